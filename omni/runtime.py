"""`omni.Runtime`: the graph runtime, with its class nodes placed on a cluster when asked.

Why a layer of its own: the graph runtime (`omni.graph.runtime`) knows nothing of clusters; it
takes a *placement* for class nodes' replicas. This module is the one place that plugs the
cluster's (`omni.cluster.ClusterLink`) into it, so `graph` never imports `cluster`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from omni.graph import embed
from omni.graph import runtime as graph_runtime
from omni.graph.balance import REPLACE_TIMEOUT_S

if TYPE_CHECKING:
    from omni.cluster.membership import Membership

__all__ = ["AsyncioRuntime", "Runtime"]


class Runtime(graph_runtime.Runtime):
    """Runs graphs. ``async with omni.Runtime() as rt: await rt.run(graph, **inputs)``.

    Takes every argument of `omni.graph.runtime.Runtime` (`graphs`, `kv`, `metrics_port`,
    `metrics_host`, `metrics`), and:

    Args:
        cluster: where class nodes' replicas run (function nodes still run here): the
            address of a cluster head (``omni cluster start``), or ``"ray"`` /
            ``"ray://HOST:PORT"`` for a Ray cluster (`omni.cluster.ray`: an `OmniWorker`
            actor per Ray node, connecting as ``ray.init`` does: ``$RAY_ADDRESS``, else the
            cluster this machine is in), or a `omni.cluster.membership.Membership` (such as
            a `RayCluster` with options of its own). The workers build their own KV stores
            of `kv`'s layout.
        token_file: a head's token file (default: ``$OMNI_TOKEN_FILE`` or
            ``~/.config/omni/cluster.token``); not used with Ray (each run makes its own).
        min_workers: with `cluster`, wait until that many workers are members before placing
            the first replica (at most 10 s), so that replicas spread over all of them.
        replace_timeout: with `cluster`, how long (seconds) a request waits for a class
            node's replicas to be placed again when the workers hosting all of them are gone
            (a call in flight there is retried once on the replacement); past it, the request
            fails with a `NodeError` whose cause (`NoLiveReplica`) names the node and the
            timeout.
    """

    def __init__(self, *, cluster: str | Membership | None = None, token_file: str | None = None,
                 min_workers: int = 0, replace_timeout: float = REPLACE_TIMEOUT_S,
                 kv: Any = None, **options: Any):
        placement = None
        if cluster is not None:
            from omni.cluster.driver import ClusterLink
            from omni.cluster.errors import ClusterError
            from omni.cluster.ray import RayCluster, is_ray_address

            if isinstance(cluster, str) and is_ray_address(cluster):
                if token_file is not None:
                    raise ClusterError("a token file is not used with a Ray cluster: each run "
                                     "makes its own token and hands it to its workers")
                cluster = RayCluster(cluster)
            placement = ClusterLink(cluster, token_file=token_file,
                                    kv_layout=getattr(kv, "layout", kv),
                                    min_workers=min_workers, replace_timeout=replace_timeout)
        super().__init__(kv=kv, placement=placement, **options)


class AsyncioRuntime(embed.AsyncioRuntime):
    """`Runtime`'s interface for asyncio applications (see `omni.graph.embed`), with the same
    options as `Runtime`, `cluster` included."""

    runtime_class = Runtime
