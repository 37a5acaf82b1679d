"""`omni._openmp`: an engine's step runs in a worker thread, and the event loop's
thread gives its OpenMP worker threads back first (libgomp would otherwise throttle every
pool's workers to sleep between parallel regions once they outnumber the CPUs)."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch
import trio

from omni import _openmp
from omni.compute.engine import TorchEngine
from omni.compute.models import tiny_model
from omni.compute.sampling import SamplingParams
from tests._cli import ROOT

# A joined thread can stay listed in /proc/self/task for a moment after pthread_join returns
# (the kernel reaps it just after waking the joiner), so counts are read once they settle.
_THREADS = """
import os
from tests._wait import wait_until_sync
def count():
    return len(os.listdir("/proc/self/task"))
def threads(expected=None):
    if expected is not None:
        try:
            wait_until_sync(lambda: count() == expected, cap=30)
        except AssertionError:
            pass  # the count, whatever it is, is what the test asserts on
    return count()
"""

_POOL_PROBE = _THREADS + """
import torch
from omni._openmp import release_openmp_pool
torch.set_num_threads(2)
base = threads()
torch.ones(1 << 22).mul_(2)  # a parallel region on this thread: its pool starts
with_pool = threads()
released = release_openmp_pool()
after = threads(expected=base)
print(base, with_pool, released, after, release_openmp_pool(), threads(expected=base))
"""


@pytest.mark.proc  # a fresh process: its threads, counted in /proc
def test_release_frees_the_calling_threads_openmp_workers_and_nothing_else() -> None:
    """In a fresh process (2 torch threads): the main thread's parallel op starts one worker
    thread; releasing frees it; releasing again, with no pool, changes nothing."""
    proc = subprocess.run([sys.executable, "-c", _POOL_PROBE], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    base, with_pool, released, after, again, after_again = proc.stdout.split()
    assert int(with_pool) == int(base) + 1
    assert (released, again) == ("True", "True")
    assert int(after) == int(after_again) == int(base)


_WORKER_PROBE = _THREADS + """
import torch, trio
from omni._openmp import run_in_worker
torch.set_num_threads(2)
def work():
    torch.ones(1 << 22).mul_(2)
async def main():
    base = threads()
    await run_in_worker(work, keep_pool=False)
    released = threads(expected=base + 1)
    await run_in_worker(work)
    print(base, released, threads())
trio.run(main)
"""


@pytest.mark.proc  # a fresh process: its threads, counted in /proc
def test_a_worker_gives_its_own_pool_back_only_when_asked() -> None:
    """keep_pool=False (the KV store's prefetch): the idle worker thread keeps no OpenMP
    workers; the default (an engine's steps): it keeps them for the next step."""
    proc = subprocess.run([sys.executable, "-c", _WORKER_PROBE], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    base, released, kept = map(int, proc.stdout.split())
    assert released == base + 1  # trio's cached worker thread, without a pool
    assert kept == released + 1  # the same thread, with its pool's one worker


def test_the_worker_runs_with_the_calling_threads_torch_thread_count() -> None:
    """torch.set_num_threads on the event loop's thread holds for the work it hands off,
    also on a cached worker thread that started with another count."""
    before = torch.get_num_threads()

    async def main() -> list[int]:
        seen = []
        for count in (2, 1, 2):
            torch.set_num_threads(count)
            seen.append(await _openmp.run_in_worker(torch.get_num_threads))
        return seen

    try:
        assert trio.run(main) == [2, 1, 2]
    finally:
        torch.set_num_threads(before)


def test_every_engine_step_releases_the_event_loops_pool_first(monkeypatch) -> None:
    """The release runs on the event loop's thread, before each step's worker thread starts
    (so no step runs while that pool is alive)."""
    events: list[tuple[str, int]] = []
    release = _openmp.release_openmp_pool

    def spy() -> bool:
        events.append(("release", threading.get_ident()))
        return release()

    monkeypatch.setattr(_openmp, "release_openmp_pool", spy)
    model, config = tiny_model(seed=0)
    engine = TorchEngine(model, config, store=None)
    step = engine.runner.execute

    def spied_step(plan):  # type: ignore[no-untyped-def]
        events.append(("step", threading.get_ident()))
        return step(plan)

    monkeypatch.setattr(engine.runner, "execute", spied_step)

    async def main() -> int:
        result = await engine.generate([5, 6, 7], SamplingParams(max_new_tokens=3,
                                                                 temperature=0))
        assert len(result.token_ids) == 3
        return threading.get_ident()

    loop_thread = trio.run(main)
    kinds = [kind for kind, _ in events]
    assert kinds and kinds[0] == "release" and "step" in kinds
    assert all(kinds[i - 1] == "release" for i, kind in enumerate(kinds) if kind == "step")
    assert {ident for kind, ident in events if kind == "release"} == {loop_thread}
    assert all(ident != loop_thread for kind, ident in events if kind == "step")
