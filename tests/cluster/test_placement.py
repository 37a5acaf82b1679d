"""Placement as a plain function over member views (no processes, no sockets): replicas of one
deployment spread over the workers, pins and resources are honoured, the head's reservations
count until a beat confirms them, and the driver picks which crowded replica to move."""

from __future__ import annotations

import pytest

from omni.cluster import ClusterError, Head, MemberInfo, MemberLoad, MemberView, PlaceRequest
from omni.cluster.driver import _crowded, _silent
from omni.cluster.head import _Member, place
from omni.cluster.protocol import Beat
from omni.graph.balance import Replica


def member(name: str, hosted: dict[str, str] | None = None, *, gpus: float = 0.0,
           gpu_each: float = 0.0, state: str = "up") -> MemberView:
    """A member hosting `hosted` (``DEPLOYMENT/REPLICA`` -> node), each using `gpu_each`."""
    deployments = {key: (node, {"gpu": gpu_each} if gpu_each else {})
                   for key, node in (hosted or {}).items()}
    info = MemberInfo(name, f"tcp://127.0.0.1:{7000 + len(name)}", "host", 1,
                      {"cpu": 2.0, "gpu": gpus})
    return MemberView(info, state, 0.0, MemberLoad(deployments))


def request(replicas: int = 1, *, deployment: str = "s-1-Llm", **options) -> PlaceRequest:
    return PlaceRequest(deployment, "Llm", replicas, **options)


def test_replicas_of_one_deployment_go_one_per_worker_first():
    """w2 hosts more replicas overall, but none of this deployment: the second goes there."""
    busy = {f"s-9-Other/{i}": "Other" for i in range(3)}
    members = [member("w1"), member("w2", busy)]
    assert place(request(2), members) == ["w1", "w2"]


def test_a_replica_goes_where_its_deployment_has_fewest_then_fewest_overall_then_name():
    members = [member("w1", {"s-1-Llm/0": "Llm"}),
               member("w2", {"s-2-Other/0": "Other", "s-2-Other/1": "Other"}),
               member("w3", {"s-3-Other/0": "Other"})]
    assert place(request(deployment="s-1-Llm", first_replica=1), members) == ["w3"]
    assert place(request(3, deployment="s-4-New"), members) == ["w1", "w3", "w2"]
    # w1 already hosts one of s-1-Llm: it gets the next only once the others have one too
    assert place(request(5), members) == ["w3", "w2", "w1", "w3", "w2"]


def test_lost_members_are_never_chosen():
    members = [member("a", state="lost"), member("b", {"x/0": "X", "x/1": "X"})]
    assert place(request(2), members) == ["b", "b"]


def test_where_pins_every_replica_to_the_named_worker():
    members = [member("w1"), member("w2", {"s-1-Llm/0": "Llm"})]
    assert place(request(2, where="w2"), members) == ["w2", "w2"]
    with pytest.raises(ClusterError, match=r"asks for worker 'w9', which is not a member "
                                           r"\(members: w1, w2\)"):
        place(request(where="w9"), members)


def test_avoid_keeps_replicas_off_the_named_workers():
    members = [member("w1"), member("w2"), member("w3")]
    assert place(request(2, avoid=("w1",)), members) == ["w2", "w3"]
    with pytest.raises(ClusterError, match=r"no worker can host 1 replica\(s\) of 'Llm'.*"
                                           r"not on w1, w2, w3"):
        place(request(avoid=("w1", "w2", "w3")), members)


def test_resources_decide_where_a_replica_fits_and_each_choice_uses_them_up():
    members = [member("w1", gpus=2), member("w2", gpus=1), member("w3")]
    assert place(request(3, resources={"gpu": 1}), members) == ["w1", "w2", "w1"]
    taken = [member("w1", {"s-0-G/0": "G", "s-0-G/1": "G"}, gpus=2, gpu_each=1),
             member("w2", gpus=1)]
    with pytest.raises(ClusterError, match=r"no worker can host 2 replica\(s\) of 'Llm' "
                                           r"needing gpu=1 \(w1: gpu 0/2 free; w2: gpu 1/1"):
        place(request(2, resources={"gpu": 1}), taken)


def test_an_empty_cluster_says_it_has_no_workers():
    """The driver waits for workers while the message says "no workers"."""
    with pytest.raises(ClusterError, match="the cluster has no workers"):
        place(request(), [])
    with pytest.raises(ClusterError, match="the cluster has no workers"):
        place(request(), [member("gone", state="lost")])


def test_place_does_not_change_its_inputs():
    members = [member("w1"), member("w2")]
    before = [m.load.deployments.copy() for m in members]
    place(request(4), members)
    assert [m.load.deployments for m in members] == before


# -- the head's handler: reservations ---------------------------------------------------------


def head_with(*views: MemberView) -> Head:
    head = Head(None, "tcp://127.0.0.1:*")  # type: ignore[arg-type]  # no sockets here
    for view in views:
        head._members[view.info.name] = _Member(view.info, view.load, 0.0)
    return head


async def test_the_head_counts_a_placement_before_any_beat_confirms_it():
    """One request per replica, as the driver sends them: the reservation of the first makes
    the second go elsewhere, and a beat reporting the replica takes the reservation's place."""
    head = head_with(member("w1"), member("w2"))
    first = await head._place(request(first_replica=0))
    second = await head._place(request(first_replica=1))
    assert [m.name for m in first + second] == ["w1", "w2"]
    w1 = head._members["w1"]
    assert set(w1.reserved) == {"s-1-Llm/0"}

    hosted = MemberLoad({"s-1-Llm/0": ("Llm", {})})
    await head._beat(Beat(w1.info, hosted))
    assert w1.reserved == {}
    third = await head._place(request(first_replica=2))
    assert [m.name for m in third] == ["w1"]  # a tie at one each: by name


async def test_a_placement_that_does_not_fit_reserves_nothing():
    head = head_with(member("w1", gpus=1))
    with pytest.raises(ClusterError, match="no worker can host 2"):
        await head._place(request(2, resources={"gpu": 1}))
    assert head._members["w1"].reserved == {}


# -- the driver's choice of a replica to move ------------------------------------------------


class Proxy:
    """Stands for a `RemoteReplica`: a replica on a worker, which can die."""

    omni_remote = True

    def __init__(self, member: str, alive: bool = True):
        self.member = member
        self.alive = alive


def replicas(*members: str) -> list[Replica]:
    return [Replica(i, Proxy(m), None, 0) for i, m in enumerate(members)]


def test_a_crowded_replica_moves_only_when_a_member_hosts_none():
    assert _crowded(replicas("w1", "w1"), {"w1"}) is None
    assert _crowded(replicas("w1", "w2"), {"w1", "w2", "w3"}) is None  # one per worker
    moved = _crowded(replicas("w1", "w1"), {"w1", "w2"})
    assert moved is not None and moved.index == 1


def test_the_least_loaded_replica_of_the_most_crowded_worker_moves():
    pool = replicas("w1", "w2", "w2", "w2", "w1")
    pool[2].in_flight = 1
    pool[3].queued = 2
    moved = _crowded(pool, {"w1", "w2", "w3"})
    assert moved is not None and (moved.index, moved.member) == (1, "w2")


def test_nothing_moves_while_a_replica_is_dead():
    pool = replicas("w1", "w1")
    pool[0].instance.alive = False
    assert _crowded(pool, {"w1", "w2"}) is None


class Client:
    def __init__(self, endpoint: str, peer_alive: bool):
        self.endpoint = endpoint
        self.peer_alive = peer_alive


def test_a_replacement_avoids_workers_found_silent_at_the_endpoint_the_head_still_lists():
    members = {m.info.name: m for m in (member("w1"), member("w2"), member("w33"))}
    clients = {"w1": Client(members["w1"].info.rpc, peer_alive=False),  # dead, head lags
               "w2": Client(members["w2"].info.rpc, peer_alive=True),
               "w33": Client("tcp://127.0.0.1:1", peer_alive=False)}  # restarted elsewhere
    assert _silent(members, clients.get) == {"w1"}
    assert _silent({}, clients.get) == set()
