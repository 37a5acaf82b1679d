"""Suite-wide cleanup: shared memory left by processes the tests killed.

Tests SIGKILL workers and store owners on purpose; a process killed that way cannot unlink its
arenas or payload segments. At the end of the session every ``omni-*`` file in the shared-memory
folder that was created during the session and that no live process maps is removed, so that
runs of the suite do not add up in /dev/shm (which is memory).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from omni._shm import shm_directory


def _mapped_names() -> set[str]:
    names: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:
            continue  # the process ended, or is not ours to read
        names.update(Path(line.split(maxsplit=5)[5]).name for line in text.splitlines()
                     if line.count(" ") >= 5 and "omni-" in line)
    return names


@pytest.fixture(scope="session", autouse=True)
def _reclaim_shared_memory_of_killed_processes() -> Iterator[None]:
    started = time.time() - 1
    yield
    folder = shm_directory()
    mapped = _mapped_names()
    for path in folder.glob("omni-*"):
        try:
            if path.stat().st_mtime >= started and path.name not in mapped:
                os.unlink(path)
        except FileNotFoundError:
            pass
