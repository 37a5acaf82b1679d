"""The `record` fixture: every reliability test records its case (see `cases.py`); the rows
are written as JSON when the session ends (see `recorder.py`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from omni._shm import Segment
from tests.cluster.conftest import cluster  # noqa: F401  (the real cluster's fixture, shared)
from tests.reliability.recorder import Recorder, default_path


@pytest.fixture(scope="session")
def _recorder(request: pytest.FixtureRequest) -> Iterator[Recorder]:
    recorder = Recorder()
    yield recorder
    if recorder.rows:
        recorder.write(default_path(request.config))


@pytest.fixture
def record(_recorder: Recorder) -> Callable[..., None]:
    """``record(key, tries=N, outcome="...")``: call it once the case's assertions passed."""
    return _recorder.record


@pytest.fixture(autouse=True)
def _no_shared_memory_left(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No arena this process creates during a test may outlive it. Why watch `Segment.create`
    rather than list /dev/shm: other processes on the machine create arenas too."""
    created: list[Path] = []
    real = Segment.create.__func__

    def create(cls: type[Segment], name: str, size: int, **options: Any) -> Segment:
        arena = real(cls, name, size, **options)
        created.append(arena.path)
        return arena

    monkeypatch.setattr(Segment, "create", classmethod(create))
    yield
    left = [path.name for path in created if path.exists()]
    assert not left, f"shared memory left behind: {left}"
