"""Torch work off the event loop (`run_in_worker`) without libgomp's throttled workers.

Why: the engines run torch in a worker thread, off the event loop (as the KV store does its
moves and disk reads). torch's CPU kernels run
on OpenMP, and libgomp gives every thread that starts a parallel region its own pool of
worker threads, kept for the thread's life. The event loop's thread has one as soon as it
ran any parallel op, e.g. while the model was built or loaded. When the pools' threads
together outnumber the CPUs, libgomp *throttles*: a worker spins ~100 times instead of
~300,000 before it sleeps on a futex, so every parallel region (a forward has hundreds) first
waits for its workers to be woken. Measured on 2 CPUs, a 208-token prefill over 1,728 cached
tokens kept 1.45-1.68 cores busy and took 8-40% longer with the event loop's pool alive than
without it (1.97-1.99 cores); short steps suffer most, as their regions are short.

So `run_in_worker`, which the engines use to hand a step to a worker thread, first
releases the calling thread's pool (`release_openmp_pool`: OpenMP 5's
``omp_pause_resource_all``, which libgomp implements as freeing that thread's pool). It
costs nothing when there is none, and the thread gets a new one if it runs a parallel op
again. Other OpenMP runtimes (LLVM's libomp, Intel's libiomp) are left
alone: they do not throttle this way.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
import trio

__all__ = ["release_openmp_pool", "run_in_worker"]

T = TypeVar("T")

_OMP_PAUSE_SOFT = 1


@functools.cache
def _pause_all() -> Callable[[int], int] | None:
    """libgomp's ``omp_pause_resource_all`` as loaded in this process (by torch), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for path in sorted({line.split()[-1] for line in maps.splitlines() if "/libgomp" in line}):
        try:
            function = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):  # not loadable, or a libgomp older than GCC 9
            continue
        function.argtypes, function.restype = [ctypes.c_int], ctypes.c_int
        return function  # type: ignore[no-any-return]
    return None


def release_openmp_pool() -> bool:
    """Free the calling thread's libgomp worker threads, if it has any; True if libgomp is
    loaded (torch imported) and accepted the call. Never call it inside a parallel region."""
    pause = _pause_all()
    return pause is not None and pause(_OMP_PAUSE_SOFT) == 0


async def run_in_worker(fn: Callable[..., T], *args: object, keep_pool: bool = True) -> T:
    """`trio.to_thread.run_sync(fn, *args)`, the calling thread's OpenMP pool released first,
    and `fn` run with the calling thread's torch thread count.

    Why the thread count: torch applies `torch.set_num_threads` to the calling thread and to
    threads that have not run a parallel op yet; a cached worker thread kept the count it
    started with. Here the count set on the event loop's thread always holds for its work.

    `keep_pool=False` also releases the worker's own pool when `fn` returns: for occasional
    work (a prefetch), so that an idle cached worker thread holds no pool while another
    runs the steps. Like `trio.to_thread.run_sync`, a cancel waits for `fn` to return.
    """
    threads = torch.get_num_threads()
    release_openmp_pool()

    def run() -> T:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        try:
            return fn(*args)
        finally:
            if not keep_pool:
                release_openmp_pool()
    return await trio.to_thread.run_sync(run)
