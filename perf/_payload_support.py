"""What `perf/payloads.py` needs around its measurements: peak resident memory of processes
while a call runs, a thread that runs blocking calls (Ray's) while trio keeps serving, and
the removal of shared-memory files the benchmark's processes leave behind. Linux (/proc).
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import trio

__all__ = ["BlockingThread", "PeakRss", "ShmJanitor", "descendants", "rss_fields",
           "stop_strays", "summarise_names"]

MIB = 1 << 20
SHM = Path("/dev/shm")
_FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")


def rss_fields(pid: int | str = "self") -> dict[str, int]:
    """``VmRSS``, ``VmHWM`` and the RSS parts of process `pid`, in bytes ({} if it is gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name in _FIELDS:
            out[name] = int(value.split()[0]) * 1024  # reported in kB
    return out


def _reset_peak(pid: int | str) -> bool:
    """Reset `pid`'s VmHWM to its current RSS (``echo 5 > clear_refs``); False if refused."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


class PeakRss:
    """The peak resident memory of processes while a ``with`` block runs, above what each held
    when it began (its idle RSS).

    Two readings, the larger wins: VmHWM, reset when the block begins (exact, where the kernel
    lets us reset it), and VmRSS sampled every `interval` s by a thread. Why both: sampling can
    miss a short peak, or see none at all while a C call holds the GIL in this process; a
    reset that is refused leaves VmHWM at the process's lifetime peak, so then only sampling
    counts. RSS includes shared memory a process has touched (``RssShmem``).
    """

    def __init__(self, pids: Mapping[str, int], interval: float = 0.002):
        self.pids = dict(pids)
        self.interval = interval
        self.idle: dict[str, dict[str, int]] = {}
        self.sampled: dict[str, dict[str, int]] = {}
        self.reset: dict[str, bool] = {}
        self.result: dict[str, dict[str, Any]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakRss:
        for name, pid in self.pids.items():
            self.idle[name] = rss_fields(pid)
            self.reset[name] = _reset_peak(pid)
            self.sampled[name] = dict(self.idle[name])
        self._thread = threading.Thread(target=self._sample, name="peak-rss", daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self._take()

    def _take(self) -> None:
        for name, pid in self.pids.items():
            now = rss_fields(pid)
            if now.get("VmRSS", 0) > self.sampled[name].get("VmRSS", 0):
                self.sampled[name] = now

    def __exit__(self, *exc_info: Any) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
        self._take()
        for name, pid in self.pids.items():
            idle = self.idle[name].get("VmRSS", 0)
            sampled = self.sampled[name]
            hwm = rss_fields(pid).get("VmHWM", 0) if self.reset[name] else 0
            peak = max(sampled.get("VmRSS", 0), hwm)
            self.result[name] = {
                "idle_mib": round(idle / MIB, 1), "peak_mib": round(peak / MIB, 1),
                "above_idle_mib": round((peak - idle) / MIB, 1),
                "hwm_reset": self.reset[name],
                "at_sampled_peak_mib": {k.removeprefix("Rss").lower(): round(v / MIB, 1)
                                        for k, v in sampled.items() if k.startswith("Rss")},
            }


class BlockingThread:
    """One daemon thread that runs blocking calls for trio code, one at a time, always on the
    same thread. Why: a blocking call (``ray.get``) on the trio thread would stall the Omni
    runtime's heartbeats; Ray's compiled graphs are driven from one thread; and a daemon
    thread never holds up the interpreter's exit after Ctrl-C."""

    def __init__(self, name: str = "blocking"):
        self._jobs: queue.Queue[tuple[Callable[[], Any], Callable[[Any, BaseException | None],
                                                                  None]] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, done = job
            try:
                value = fn()
            except BaseException as exc:  # handed to the awaiting trio task
                done(None, exc)
            else:
                done(value, None)

    async def run(self, fn: Callable[[], Any]) -> Any:
        """`fn()` on the thread; its value, or its exception raised here."""
        token = trio.lowlevel.current_trio_token()
        finished = trio.Event()
        box: list[Any] = []

        def done(value: Any, exc: BaseException | None) -> None:
            box.extend((value, exc))
            with contextlib.suppress(trio.RunFinishedError, OSError):
                token.run_sync_soon(finished.set)  # the run may have ended (Ctrl-C)

        self._jobs.put((fn, done))
        with trio.CancelScope(shield=True):  # the thread cannot be interrupted: wait for it
            await finished.wait()
        value, exc = box
        if exc is not None:
            raise exc
        return value

    def close(self, timeout: float = 30.0) -> bool:
        """End the thread once its current call returns; whether it ended within `timeout`
        seconds (Ray must not be shut down under a call in flight: its core worker would
        end this whole process)."""
        self._jobs.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()


def descendants(root: int) -> set[int]:
    """The pids of `root`'s living descendants (children, their children ...)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out: set[int] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def _numbers(name: str) -> set[int]:
    return {int(n) for n in re.findall(r"\d+", name)}


def stop_strays(marker: str, grace: float = 5.0) -> list[str]:
    """Stop the living processes, other than this one, whose environment holds `marker` (a
    ``NAME=value`` this run set in its own environment before starting anything, so that
    every process it started, and theirs, inherit it; such as Ray's agents, which outlive an
    interrupted ``ray.init`` and rename themselves): SIGTERM, SIGKILL after `grace` seconds.
    Their names."""
    found: dict[int, str] = {}
    needle = marker.encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            if needle not in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                continue
            name = Path(f"/proc/{entry}/comm").read_text().strip()
        except OSError:
            continue
        found[int(entry)] = name
    for pid in found:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_alive(pid) for pid in found):
        time.sleep(0.1)
    for pid in found:
        if _alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    return sorted(found.values())


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not: it is only waiting for its parent)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _in_use(*, but: int | None = None, only: int | None = None) -> set[str]:
    """Names of the files in /dev/shm that a living process (other than `but`, or only
    `only`) has open or mapped."""
    used: set[str] = set()
    prefix = f"{SHM}/"
    entries = [str(only)] if only is not None else os.listdir("/proc")
    for entry in entries:
        if not entry.isdigit() or (but is not None and int(entry) == but):
            continue
        try:
            for line in Path(f"/proc/{entry}/maps").read_text().splitlines():
                path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
                if path.startswith(prefix):
                    used.add(path[len(prefix):].removesuffix(" (deleted)"))
            for fd in os.listdir(f"/proc/{entry}/fd"):
                target = os.readlink(f"/proc/{entry}/fd/{fd}")
                if target.startswith(prefix):
                    used.add(target[len(prefix):].removesuffix(" (deleted)"))
        except OSError:
            continue  # gone meanwhile, or not ours to read
    return used


class ShmJanitor:
    """Removes the shared-memory files this benchmark's processes leave in /dev/shm (a process
    killed, or Ray's compiled-graph semaphores, which outlive ``ray.shutdown``), and only those:
    other programs on the machine may be using /dev/shm at the same time.

    A file is removed when it appeared after the janitor was made, no other living process
    has it open or mapped (this one's mappings outlive the name), and it is ours: `watch` saw
    one of our processes map or open it, or its name holds one of our processes' pids as a
    number of its own (``sem.hdr1234-...``). Call `watch` while the processes live (it
    records them and what they map).
    """

    def __init__(self) -> None:
        self.before = set(os.listdir(SHM)) if SHM.is_dir() else set()
        self.pids: set[int] = {os.getpid()}
        self.seen: set[str] = set()

    def watch(self, pids: Iterable[int] = ()) -> None:
        """Record `pids`, this process's descendants, and the shm files they map or open."""
        self.pids |= set(pids) | descendants(os.getpid())
        prefix = f"{SHM}/"
        for pid in self.pids:
            try:
                lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
                targets = [os.readlink(f"/proc/{pid}/fd/{fd}")
                           for fd in os.listdir(f"/proc/{pid}/fd")]
            except OSError:
                continue
            for path in [line.split(maxsplit=5)[-1] for line in lines] + targets:
                if path.startswith(prefix):
                    self.seen.add(path[len(prefix):].removesuffix(" (deleted)"))

    def _ours(self, name: str) -> bool:
        return name in self.seen or bool(_numbers(name) & self.pids)

    def clean(self, *, spare_own: bool = False) -> list[str]:
        """Remove our leftovers; their names. With `spare_own`, leave the files this process
        itself maps, opens or named after its pid: its libraries remove those at exit (call
        again at exit, after them, for what they leave)."""
        if not SHM.is_dir():
            return []
        new = [n for n in os.listdir(SHM) if n not in self.before and self._ours(n)]
        if not new:
            return []
        time.sleep(0.2)  # let processes that are exiting unmap their files first
        me = os.getpid()
        used = _in_use(but=me)  # our own mappings stay valid after an unlink
        if spare_own:
            used |= _in_use(only=me) | {n for n in new if me in _numbers(n)}
        removed = []
        for name in new:
            if name in used:
                continue
            try:
                (SHM / name).unlink()
                removed.append(name)
            except OSError:
                pass  # gone meanwhile
        return sorted(removed)


def summarise_names(names: list[str]) -> dict[str, Any]:
    """A long list of file names as counts by prefix (the part before the first digit)."""
    by_prefix: dict[str, int] = {}
    for name in names:
        prefix = re.split(r"\d", name, maxsplit=1)[0]
        by_prefix[prefix] = by_prefix.get(prefix, 0) + 1
    return {"files": len(names), "by_prefix": by_prefix, "first": names[:8]}
