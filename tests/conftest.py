"""Suite-wide cleanup: shared memory and sockets left by processes the tests killed.

Tests SIGKILL workers and store owners on purpose; a process killed that way cannot unlink its
arenas or payload segments, or remove its Unix socket. At the end of the session those whose
owner process is gone are removed: KV stores by the owner record in their lease table, payload
segments by the pid in their name, sockets because nobody listens on them. Only what belongs to
dead processes goes, so that another run of the suite beside this one keeps its files.

Tests marked `gpu` need a CUDA device: where torch sees none they are skipped here, in one
place (`perf/gpu_check.py` runs them on a GPU machine).

Property tests draw the same examples on every run (`derandomize`), so a run of the suite is
repeatable; `HYPOTHESIS_PROFILE=explore` draws new ones (the way to look for new failures).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from hypothesis import settings

from omni.kv.leases import reclaim_dead_stores
from omni.transport._host import ipc_directory
from omni.transport._unix import remove_stale
from omni.transport.payloads import reclaim_dead_segments

settings.register_profile("repeatable", derandomize=True, database=None)
settings.register_profile("explore")
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    no_cuda = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(no_cuda)


@pytest.fixture(scope="session", autouse=True)
def _reclaim_what_killed_processes_left() -> Iterator[None]:
    yield
    reclaim_dead_stores()
    reclaim_dead_segments()
    remove_stale(ipc_directory(), "w-*.sock")
