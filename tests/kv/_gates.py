"""A disk that is slow exactly when a test says: an `os` call parked on an Event, and a thread
that hands its result or exception back to the test."""

from __future__ import annotations

import os
import threading
from unittest import mock

from omni.kv.tiers import disk as disk_module

__all__ = ["CAP", "Gate", "Worker"]

CAP = 60.0  # seconds: only a hang gets near it


class Gate:
    """An `os` disk call whose first call parks until `go` is set (then runs, or fails with
    `fail`); later calls pass straight through. Counts the calls, and whether the parked one
    has returned."""

    def __init__(self, name: str, *, fail: int | None = None) -> None:
        self.name = name
        self.real = getattr(os, name)
        self.fail = fail
        self.parked = threading.Event()
        self.go = threading.Event()
        self.calls = 0
        self.returned = False  # the parked call
        self._lock = threading.Lock()

    def __call__(self, *args):
        with self._lock:
            self.calls += 1
            first = self.calls == 1
        try:
            if first:
                self.parked.set()
                assert self.go.wait(CAP), "the test never let the parked disk call go"
                if self.fail is not None:
                    raise OSError(self.fail, os.strerror(self.fail))
            return self.real(*args)
        finally:
            if first:
                self.returned = True

    def patch(self):
        return mock.patch.object(disk_module.os, self.name, self)


class Worker(threading.Thread):
    """Runs `fn` in a thread and keeps its result or its exception."""

    def __init__(self, fn, *, done: threading.Event | None = None) -> None:
        super().__init__(daemon=True)
        self.fn = fn
        self.done = done  # set when `fn` returns or raises
        self.result = self.error = None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as exc:  # handed to the test thread
            self.error = exc
        finally:
            if self.done is not None:
                self.done.set()

    def finish(self):
        """The result of `fn`; raises what it raised."""
        self.join(CAP)
        assert not self.is_alive(), "a store operation is stuck"
        if self.error is not None:
            raise self.error
        return self.result
