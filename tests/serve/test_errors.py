"""How a failed request reads over HTTP: the client's mistake a 400, a node with nowhere to
run a 503 to retry, anything else the server's 500."""

from __future__ import annotations

from omni.graph.balance import NoLiveReplica
from omni.graph.errors import NodeError, ReplicaLost, RouteError
from omni.serve._requests import graph_error


def test_a_node_without_a_live_replica_is_a_503_to_retry_later() -> None:
    error = graph_error(NodeError("Dialogue", "r1", NoLiveReplica("Dialogue", [], 30.0)))
    assert error.status == 503 and error.code == "no_live_replica"
    assert error.headers == {"retry-after": "5"}
    assert "within the replace timeout of 30 s" in error.message


def test_a_refused_input_is_a_400_and_a_broken_node_a_500() -> None:
    assert graph_error(NodeError("n", "r", ValueError("no"))).status == 400
    assert graph_error(RouteError("n", "r", KeyError("k"))).status == 400
    assert graph_error(NodeError("n", "r", RuntimeError("broke"))).status == 500


def test_a_node_lost_with_its_worker_where_it_could_not_run_again_is_a_503_to_retry() -> None:
    lost = ReplicaLost("worker 'w1' stopped answering")
    lost.items_passed = 3
    error = graph_error(NodeError("Talk", "r1", lost))
    assert (error.status, error.code, error.headers) == (503, "worker_lost",
                                                         {"retry-after": "5"})
