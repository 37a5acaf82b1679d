"""`balance="kv_aware"`: prefix overlap against load, with a fallback to least-loaded."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

import omni
from omni.graph.balance import CallInfo, make_balancer
from omni.graph.kv_aware import KVAware


class Index:
    """A stand-in KV directory: the keys each member holds."""

    def __init__(self, held: dict[str, set[bytes]]):
        self.held = held

    def prefix_len(self, member: str, keys: Sequence[bytes]) -> int:
        n = 0
        for key in keys:
            if key not in self.held.get(member, set()):
                break
            n += 1
        return n


class FakeReplica:
    def __init__(self, member: str, load: int = 0):
        self.member = member
        self.load = load


def keys(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}{i}".encode().ljust(16, b".") for i in range(n)]


def call(prompt_keys: list[bytes]) -> CallInfo:
    return CallInfo("Llm", "req-1", (prompt_keys,), {})


def balancer(held: dict[str, set[bytes]], **options) -> KVAware:
    b = KVAware(**options)
    b.bind(Index(held), lambda c: c.args[0])
    return b


def test_the_replica_holding_the_prefix_wins() -> None:
    a, b = keys("a", 8), keys("b", 8)
    kv = balancer({"w1": set(a), "w2": set(b)})
    replicas = [FakeReplica("w1"), FakeReplica("w2")]
    assert kv.choose(replicas, call(a)) == 0
    assert kv.choose(replicas, call(b)) == 1
    assert kv.choose(replicas, call(a[:4] + keys("x", 4))) == 0  # a partial prefix counts
    assert (kv.hits, kv.misses) == (3, 0)


def test_a_busy_holder_loses_to_an_idle_replica() -> None:
    a = keys("a", 8)
    kv = balancer({"w1": set(a)}, load_weight=0.5)
    # w1 saves 8 pages of prefill; each call it holds costs 0.5 * 8 pages.
    assert kv.choose([FakeReplica("w1", load=1), FakeReplica("w2")], call(a)) == 0
    assert kv.choose([FakeReplica("w1", load=3), FakeReplica("w2")], call(a)) == 1


def test_uneven_load_falls_back_to_least_loaded() -> None:
    a = keys("a", 8)
    kv = balancer({"w1": set(a)}, max_imbalance=2, load_weight=0.0)
    assert kv.choose([FakeReplica("w1", load=3), FakeReplica("w2")], call(a)) == 1
    assert kv.fallbacks == 1


def test_ties_go_round_the_ring() -> None:
    kv = balancer({})
    replicas = [FakeReplica("w1"), FakeReplica("w2")]
    chosen = [kv.choose(replicas, call(keys(p, 4))) for p in "abcd"]
    assert chosen == [0, 1, 0, 1]


def test_without_an_index_it_is_least_loaded() -> None:
    kv = make_balancer("kv_aware")
    assert isinstance(kv, KVAware)
    replicas = [FakeReplica("w1", load=2), FakeReplica("w2", load=0)]
    assert kv.choose(replicas, call(keys("a", 4))) == 1


async def test_kv_aware_is_a_valid_balance_option_locally() -> None:
    @omni.node(replicas=2, balance="kv_aware")
    class Echo:
        async def __call__(self, x: int) -> int:
            return x

    async with omni.Runtime() as rt:
        assert [await rt.run(Echo(), x=i) for i in range(4)] == [0, 1, 2, 3]


def test_resources_and_where_belong_to_class_nodes() -> None:
    with pytest.raises(ValueError, match="function nodes run in the driver"):
        omni.node(resources={"gpu": 1})(lambda x: x)
    with pytest.raises(ValueError, match="resources must map names to amounts"):
        @omni.node(resources={"gpu": -1})
        class Bad:
            def __call__(self, x: int) -> int:
                return x


def test_a_prefix_just_sent_somewhere_follows_it_before_the_directory_hears() -> None:
    a = keys("a", 8)
    kv = balancer({})  # the directory knows nothing yet
    replicas = [FakeReplica("w1"), FakeReplica("w2")]
    first = kv.choose(replicas, call(a))
    assert [kv.choose(replicas, call(a)) for _ in range(3)] == [first] * 3
    kv.memory_s = 0.0  # once the memory lapses, only the directory counts
    assert kv.choose(replicas, call(a)) != first


def test_replicas_that_all_hold_a_prefix_are_chosen_stably() -> None:
    a = keys("a", 8)
    kv = balancer({"w1": set(a), "w2": set(a)})
    replicas = [FakeReplica("w1"), FakeReplica("w2")]
    assert len({kv.choose(replicas, call(a)) for _ in range(6)}) == 1
