"""Suite-wide isolation and cleanup: shared memory and sockets of each pytest process.

Each pytest process (each xdist worker, under `make test`) gets a folder of its own for shared
memory (``OMNI_SHM_DIR``, under /dev/shm) and for Unix sockets (``XDG_RUNTIME_DIR``), which the
processes its tests start inherit: two workers, or another run of the suite beside this one,
never see each other's arenas, payload segments or sockets. Tests SIGKILL workers and store
owners on purpose; a process killed that way cannot unlink what it made: both folders are
removed as the process ends, so nothing is left in /dev/shm.

Tests marked `gpu` need a CUDA device: where torch sees none they are skipped here, in one
place (`perf/gpu_check.py` runs them on a GPU machine).

Property tests draw the same examples on every run (`derandomize`), so a run of the suite is
repeatable; `HYPOTHESIS_PROFILE=explore` draws new ones (the way to look for new failures).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import settings

from omni._shm import shm_directory

settings.register_profile("repeatable", derandomize=True, database=None)
settings.register_profile("explore")
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))


_PRIVATE: list[Path] = []  # this process's shared-memory and socket folders


def pytest_configure(config: pytest.Config) -> None:
    shm = Path(tempfile.mkdtemp(prefix="omni-tests-", dir=shm_directory()))
    runtime = Path(tempfile.mkdtemp(prefix="omni-tests-run-"))
    os.environ["OMNI_SHM_DIR"], os.environ["XDG_RUNTIME_DIR"] = str(shm), str(runtime)
    _PRIVATE[:] = [shm, runtime]


def pytest_unconfigure(config: pytest.Config) -> None:
    for folder in _PRIVATE:
        shutil.rmtree(folder, ignore_errors=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    no_cuda = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(no_cuda)

