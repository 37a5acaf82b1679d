"""Suite-wide isolation and cleanup: shared memory and sockets of each pytest process.

Each pytest process (each xdist worker, under `make test`) gets a folder of its own for shared
memory (``OMNI_SHM_DIR``, under /dev/shm) and for Unix sockets (``XDG_RUNTIME_DIR``), which the
processes its tests start inherit (an xdist worker also runs torch on one thread: the workers
already share the cores): two workers, or another run of the suite beside this one,
never see each other's arenas, payload segments or sockets. Tests SIGKILL workers and store
owners on purpose; a process killed that way cannot unlink what it made: both folders are
removed as the process ends, so nothing is left in /dev/shm.

A test that starts a process (a subprocess, a multiprocessing child, a fork) is marked `proc`:
it is one whose behaviour the operating system decides (signals, exit codes, a SIGKILLed
worker, shared memory between processes, a real server for a real client). Everything else
runs in this process, and a test that is not marked and starts one fails, naming what it
started: `pytest -m proc --collect-only -q` is the whole list.

Tests marked `gpu` need a CUDA device: where torch sees none they are skipped here, in one
place (`perf/gpu_check.py` runs them on a GPU machine).

Property tests draw the same examples on every run (`derandomize`), so a run of the suite is
repeatable; `HYPOTHESIS_PROFILE=explore` draws new ones (the way to look for new failures).
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing.util
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn
from unittest import mock

import pytest
import torch
from hypothesis import settings

from omni._shm import shm_directory
from omni.kv import leases

settings.register_profile("repeatable", derandomize=True, database=None)
settings.register_profile("explore")
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))


_PRIVATE: list[Path] = []  # this process's shared-memory and socket folders


def pytest_configure(config: pytest.Config) -> None:
    shm = Path(tempfile.mkdtemp(prefix="omni-tests-", dir=shm_directory()))
    runtime = Path(tempfile.mkdtemp(prefix="omni-tests-run-"))
    os.environ["OMNI_SHM_DIR"], os.environ["XDG_RUNTIME_DIR"] = str(shm), str(runtime)
    _PRIVATE[:] = [shm, runtime]
    # the graph files the tests' processes load wait through tests/_wait.py
    root = str(Path(__file__).resolve().parent.parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])
    # At exit, after what the tests' processes registered later (a payload mover's cleanup
    # still needs the folder): atexit runs handlers last-registered first.
    atexit.register(_remove_private_folders)
    if os.environ.get("PYTEST_XDIST_WORKER"):  # workers share the cores: one torch thread each
        os.environ["OMP_NUM_THREADS"] = "1"  # (and in the processes its tests start)
        torch.set_num_threads(1)
    else:
        _build_font_cache()


def _build_font_cache() -> None:
    """Matplotlib builds its font cache on its first import on a machine, by running
    `fc-list`: built here, once for the run, so that a benchmark's plot in a test that starts
    no process does not start one on a fresh machine."""
    import matplotlib.font_manager  # noqa: F401


def _remove_private_folders() -> None:
    for folder in _PRIVATE:
        shutil.rmtree(folder, ignore_errors=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    no_cuda = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(no_cuda)



class ProcessStarted(AssertionError):
    """A test not marked `proc` started a process."""


@contextlib.contextmanager
def _processes_refused(item: pytest.Item) -> Iterator[None]:
    """While `item` sets up, runs and tears down (its fixtures of any scope included), starting
    a process fails unless it is marked `proc`."""
    if item.get_closest_marker("proc") is not None:
        yield
        return

    def refuse(what: str) -> Callable[..., NoReturn]:
        def starting(*args: object, **kwargs: object) -> NoReturn:
            raise ProcessStarted(f"{item.nodeid} starts a process ({what}) but is not marked "
                                 "proc")
        return starting

    with (mock.patch.object(subprocess.Popen, "_execute_child", refuse("subprocess")),
          mock.patch.object(multiprocessing.util, "spawnv_passfds", refuse("multiprocessing")),
          mock.patch.object(os, "fork", refuse("fork")),
          mock.patch.object(os, "posix_spawn", refuse("posix_spawn"))):
        yield


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    with _processes_refused(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    with _processes_refused(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    with _processes_refused(item):
        return (yield)


class LeaseClock:
    """The KV leases' clock (`omni.kv.leases.clock`) as a test moves it: real time plus the
    seconds `advance` added, so that a lease expires without the test waiting for it."""

    def __init__(self) -> None:
        self.offset_ns = 0

    def __call__(self) -> int:
        return time.monotonic_ns() + self.offset_ns

    def advance(self, seconds: float) -> None:
        self.offset_ns += int(seconds * 1e9)


@pytest.fixture
def lease_clock(monkeypatch: pytest.MonkeyPatch) -> LeaseClock:
    clock = LeaseClock()
    monkeypatch.setattr(leases, "clock", clock)
    return clock
