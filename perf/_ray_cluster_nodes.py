"""The nodes `perf/ray_cluster.py` runs on both clusters' workers (they load this file's source).

None is pinned: on two workers the head places a node's replica on the one hosting fewer
replicas, so both clusters place them alike (``Tiny`` and ``Size`` on one worker, the three
stages of ``chain`` alternating between the two). The bodies do as little as possible, so that
a call's time is the cost of moving its arguments and result.
"""

from __future__ import annotations

from typing import Any

import omni

__all__ = ["Size", "Tiny", "chain"]


class _Pass:
    async def __call__(self, value: Any) -> Any:
        return value


@omni.node
class Tiny(_Pass):
    pass


@omni.node
class Size:
    async def __call__(self, value: Any) -> int:
        return int(value.nbytes)


@omni.node
class Hop1(_Pass):
    pass


@omni.node
class Hop2(_Pass):
    pass


@omni.node
class Hop3(_Pass):
    pass


@omni.graph
def tiny(value: Any):
    return Tiny()(value)


@omni.graph
def size(value: Any):
    return Size()(value)


@omni.graph
def chain(value: Any):
    """Three stages: the value goes driver -> worker -> worker -> worker -> driver."""
    return Hop3()(Hop2()(Hop1()(value)))
