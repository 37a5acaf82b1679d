"""Clusters for the tests. `local_cluster`: a head and workers in the test's own process, in
its trio nursery (`_local.LocalCluster`): every test of the cluster's logic runs on one.
`cluster`: a head and workers as real ``omni cluster`` processes (`_real.Cluster`), for the
tests marked ``proc``, whose behaviour the operating system decides (signals, a killed process,
shared memory between processes, the commands as a user starts them)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import trio

from tests.cluster._local import LocalCluster
from tests.cluster._real import HEARTBEAT, ROOT, Cluster

__all__ = ["HEARTBEAT", "ROOT", "Cluster", "LocalCluster", "cluster", "local_cluster"]


@pytest.fixture
async def local_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                        ) -> AsyncIterator[LocalCluster]:
    """A cluster in this process, its head not yet started (`LocalCluster.start`). The current
    folder is the test's own, as a worker process's would be its folder: the slow nodes of
    `pipelines` note and look for their files there."""
    monkeypatch.chdir(tmp_path)
    async with trio.open_nursery() as nursery:
        yield LocalCluster(nursery, tmp_path)
        nursery.cancel_scope.cancel()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """Real processes (only for tests marked ``proc``)."""
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.close()
