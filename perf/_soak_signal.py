"""The soak's signal phase: SIGTERM in the middle of the load leaves nothing behind.

A server is stopped with SIGTERM while it is busy, and whatever the stop leaves is left on the
machine for good: shared memory lives until reboot, the disk tier's file until someone deletes
it. So a child process (``perf/soak.py --signal-child``) runs the soak's own load, in one
runtime as the soak builds it, under `cli._signals.stopped_by_signals` and `cli._errors.
reporting` as ``omni run`` runs its requests, and says on stdout, one JSON object a line,
first what it could leave behind (its pid, its store's id, the shared-memory and disk-tier
folders), then its progress every `sample_s`. Once it has finished `signal_after` requests and
its disk tier holds pages (all three tiers in use, pages being demoted, requests in flight,
some cancelled on purpose), the parent sends SIGTERM, waits for the exit (at most
`EXIT_CAP_S`: a process that hangs there fails the claim rather than the soak), and counts
what is left: the arenas ``omni-<store id>-<tier>`` and the lease table ``omni-<store id>-
leases`` in the shared-memory folder, anything in the disk tier's folder, and the child's
payload segments ``omni-pay-<pid>-*`` and Unix sockets ``w-<pid>-*.sock``. The same names are
counted just before the signal, so that a zero afterwards is known to be a removal.

Claims: exit status 143; one line on stderr after the signal (``error: terminated``: no
traceback, no warning); nothing left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import trio
import typer

from cli._errors import EXIT_TERMINATED, reporting
from cli._signals import stopped_by_signals
from omni._shm import shm_directory
from omni.transport.host import ipc_directory
from perf._common import Samples, claim
from perf._procs import CliProcess

__all__ = ["EXIT_CAP_S", "claims", "measure_signalled", "run_child"]

ROOT = Path(__file__).resolve().parent.parent
EXIT_CAP_S = 120.0  # seconds from SIGTERM to exit before the child is killed
START_CAP_S = 600.0  # seconds for the child to reach the middle of its load


# -- the child --------------------------------------------------------------------------------


def _say(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


async def _serve(open_runtime: Callable[[], AbstractAsyncContextManager[Any]], soak: Any,
                 jobs: list[Any], folders: dict[str, str], sample_s: float) -> None:
    async with stopped_by_signals(), open_runtime() as rt:
        _say(pid=os.getpid(), store_id=rt.kv.store_id, **folders)

        async def progress() -> None:
            while True:
                stats = rt.kv.stats()
                _say(done=soak.done, cancelled=sum(soak.cancelled.values()),
                     in_flight=rt.stats().requests_in_flight,
                     pages={t: stats[t]["pages"] for t in ("device", "host", "disk")},
                     disk_demotions=stats["disk"]["demotions"])
                await trio.sleep(sample_s)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(progress)
            await soak.phase(rt, jobs)
            nursery.cancel_scope.cancel()
    _say(finished=True)  # the load ended before any signal came


def run_child(open_runtime: Callable[[], AbstractAsyncContextManager[Any]], soak: Any,
              jobs: list[Any], disk: Path, sample_s: float) -> int:
    """Serve `jobs` until they end or a signal comes; the exit status, as ``omni run`` gives it
    (a signal: one ``error:`` line on stderr, 130 or 143)."""
    folders = {"shm": str(shm_directory()), "disk": str(disk), "ipc": str(ipc_directory())}
    try:
        with reporting(debug=False):
            trio.run(_serve, open_runtime, soak, jobs, folders, sample_s)
    except typer.Exit as exc:
        return exc.exit_code
    return 0


# -- the parent -------------------------------------------------------------------------------


def _present(ready: dict[str, Any]) -> dict[str, list[str]]:
    """The names the child could leave behind, by kind, that exist now."""
    shm, pid, sid = Path(ready["shm"]), ready["pid"], ready["store_id"]
    ours = sorted(p.name for p in shm.glob(f"omni-{sid}-*"))
    disk = Path(ready["disk"])
    return {"arenas": [n for n in ours if n != f"omni-{sid}-leases"],
            "lease_tables": [n for n in ours if n == f"omni-{sid}-leases"],
            "disk_files": sorted(str(p.relative_to(disk)) for p in disk.rglob("*")),
            "payload_segments": sorted(p.name for p in shm.glob(f"omni-pay-{pid}-*")),
            "sockets": sorted(p.name for p in Path(ready["ipc"]).glob(f"w-{pid}-*.sock"))}


def _mid_load(child: CliProcess, signal_after: int) -> dict[str, Any]:
    """The child's progress line that says it is in the middle of the load."""
    deadline = time.monotonic() + START_CAP_S
    while True:
        line = json.loads(child.wait_line(r"^\{", max(deadline - time.monotonic(), 0.1)).string)
        if line.get("finished"):
            raise RuntimeError(f"the load ended before {signal_after} requests with disk pages")
        if (line["done"] >= signal_after and line["pages"]["disk"] > 0
                and line["in_flight"] > 0):
            return line


def measure_signalled(params: dict[str, Any], signal_after: int,
                      signum: int = signal.SIGTERM) -> dict[str, Any]:
    """Run the soak's load (`params`: a `perf.soak.Params` as a dict) in a child, send it
    `signum` once `signal_after` requests are done and the disk tier holds pages; the figures
    (`signum` SIGKILL: what a process that cannot clean up leaves, seen by the same counts)."""
    with tempfile.TemporaryDirectory(prefix="omni-soak-signal-") as tmp:
        spec = json.dumps({"folder": tmp, "params": params})
        child = CliProcess(["--signal-child", spec], ROOT,
                           program=(str(ROOT / "perf" / "soak.py"),))
        try:
            ready = json.loads(child.wait_line(r'^\{"pid"', START_CAP_S).string)
            at_signal = _mid_load(child, signal_after)
            before, said_before = _present(ready), len(child.err)
            child.signal(signum)
            sent = time.monotonic()
            try:
                status: int | None = child.popen.wait(EXIT_CAP_S)
            except subprocess.TimeoutExpired:
                status = None
            seconds = time.monotonic() - sent
        finally:
            if child.popen.poll() is None:
                child.popen.kill()
            child.wait(30)
        left = _present(ready)
        _remove(ready, left)  # a failed run leaves nothing on the machine either
    return {"pid": ready["pid"], "store_id": ready["store_id"], "signal_after": signal_after,
            "at_signal": at_signal, "present_before": before, "left": left,
            "exit_status": status, "seconds_to_exit": round(seconds, 3),
            "stderr_after": [x.rstrip("\n") for x in child.err[said_before:]],
            "stderr_before": [x.rstrip("\n") for x in child.err[:said_before]]}


def _remove(ready: dict[str, Any], left: dict[str, list[str]]) -> None:
    for kind, folder in (("arenas", "shm"), ("lease_tables", "shm"),
                         ("payload_segments", "shm"), ("sockets", "ipc")):
        for name in left[kind]:
            Path(ready[folder], name).unlink(missing_ok=True)


def claims(f: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The phase's claims from `measure_signalled`'s figures."""
    left = {k: len(v) for k, v in f["left"].items()}
    before = {k: len(v) for k, v in f["present_before"].items()}
    n_left = sum(left.values())
    seen = before["arenas"] > 0 and before["lease_tables"] > 0 and before["disk_files"] > 0
    lines = [x for x in f["stderr_after"] if x.strip()]
    at = f["at_signal"]
    where = (f"it came once {at['done']} requests were done ({at['cancelled']} cancelled on "
             f"purpose), {at['in_flight']} in flight, pages per tier {at['pages']}")

    def one(target: float, value: float, passed: bool, unit: str, note: str,
            **extra: Any) -> dict[str, Any]:
        return claim(unit=unit, target=target, measured=Samples((value,)), baseline=None,
                     ratio=None, passed=passed, note=note, digits=3, **extra)

    status = f["exit_status"]
    return {
        "sigterm_exit": one(
            EXIT_TERMINATED, -1 if status is None else status,
            status == EXIT_TERMINATED, "exit status",
            "exit status after SIGTERM mid-load (a child running the soak's load as `omni run` "
            f"runs requests); {where}; -1: it had not exited {EXIT_CAP_S:g} s after the "
            "signal and was killed", seconds_to_exit=f["seconds_to_exit"], pid=f["pid"]),
        "sigterm_stderr": one(
            1, len(lines), lines == ["error: terminated"], "lines",
            "lines on stderr after that SIGTERM: one, 'error: terminated' (no traceback, no "
            "warning)", text=f["stderr_after"], before=f["stderr_before"]),
        "sigterm_left": one(
            0, n_left, n_left == 0 and seen, "files",
            "arenas, lease tables, disk-tier files, payload segments, sockets left after that "
            f"SIGTERM; in {shm_directory()}: the arenas omni-<store id>-<tier> and the lease "
            "table omni-<store id>-leases of the child's store, its payload segments "
            "omni-pay-<pid>-*; anything in the disk tier's folder; its Unix sockets "
            "w-<pid>-*.sock; each kind counted just before the signal too (the arenas, the "
            "table and the disk files must have been there)", **left, before=before,
            names=f["left"], store_id=f["store_id"], at_signal=at),
    }
