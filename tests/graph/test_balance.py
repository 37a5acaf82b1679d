"""Balancers as pure state machines, and the `Pool` that places calls and applies backpressure."""

import random

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from omni.graph.balance import (
    Balancer,
    CallInfo,
    LeastLoaded,
    Pool,
    PowerOfTwo,
    Replica,
    RoundRobin,
    make_balancer,
)

CALL = CallInfo(node="llm", request_id="req-1", args=(), kwargs={})


def replicas_with(loads: list[int], *, concurrency: int | None = 4,
                  max_queue: int = 4) -> list[Replica]:
    """Replicas whose `load` is `loads[i]` (in flight up to `concurrency`, the rest queued)."""
    replicas = []
    for i, load in enumerate(loads):
        r = Replica(i, instance=f"inst-{i}", concurrency=concurrency, max_queue=max_queue)
        r.in_flight = load if concurrency is None else min(load, concurrency)
        r.queued = load - r.in_flight
        replicas.append(r)
    return replicas


def choices(balancer: Balancer, replicas: list[Replica], n: int) -> list[int]:
    return [balancer.choose(replicas, CALL) for _ in range(n)]


class AlwaysLast:
    """A custom balancer: every call goes to the last replica."""

    def choose(self, replicas, call):
        return len(replicas) - 1


class Fixed:
    """A custom balancer that returns whatever it was given (to test bad answers)."""

    def __init__(self, answer):
        self.answer = answer

    def choose(self, replicas, call):
        return self.answer

    def __repr__(self):
        return f"Fixed({self.answer!r})"


# -- round robin --------------------------------------------------------------------------------


def test_round_robin_cycles_through_replicas_in_order():
    assert choices(RoundRobin(), replicas_with([0, 0, 0]), 7) == [0, 1, 2, 0, 1, 2, 0]


def test_round_robin_ignores_load():
    assert choices(RoundRobin(), replicas_with([5, 0, 9]), 4) == [0, 1, 2, 0]


def test_round_robin_stays_in_range_when_the_replica_list_shrinks():
    rr = RoundRobin()
    choices(rr, replicas_with([0, 0, 0]), 2)  # next would be 2
    assert choices(rr, replicas_with([0, 0]), 3) == [0, 1, 0]


# -- least loaded -------------------------------------------------------------------------------


def test_least_loaded_picks_the_replica_with_the_minimum_load():
    assert choices(LeastLoaded(), replicas_with([3, 1, 2]), 3) == [1, 1, 1]


def test_least_loaded_counts_queued_calls_as_load():
    replicas = replicas_with([0, 0], concurrency=1)
    replicas[0].in_flight, replicas[0].queued = 1, 2  # load 3
    replicas[1].in_flight, replicas[1].queued = 1, 1  # load 2
    assert LeastLoaded().choose(replicas, CALL) == 1


def test_least_loaded_rotates_ties_round_the_ring():
    assert choices(LeastLoaded(), replicas_with([0, 0, 0]), 6) == [0, 1, 2, 0, 1, 2]


@pytest.mark.parametrize(("loads", "expected"), [
    ([1, 0, 2, 0], [1, 3, 1, 3, 1, 3]),
    ([0, 0, 5, 5], [0, 1, 0, 1, 0, 1]),
    ([4, 0, 0, 4, 0], [1, 2, 4, 1, 2, 4]),
])
def test_least_loaded_takes_tied_minimums_in_turn(loads, expected):
    assert choices(LeastLoaded(), replicas_with(loads), len(expected)) == expected


def test_least_loaded_follows_load_as_it_changes():
    ll = LeastLoaded()
    replicas = replicas_with([0, 0, 0], concurrency=None)
    for _ in range(9):  # each placed call adds one to its replica's load
        replicas[ll.choose(replicas, CALL)].in_flight += 1
    assert [r.load for r in replicas] == [3, 3, 3]


# -- power of two -------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 7, 1234])
def test_power_of_two_picks_the_less_loaded_of_its_two_samples(seed):
    loads = [4, 0, 7, 2, 2, 9, 1, 5]
    replicas = replicas_with(loads, concurrency=None)
    p2c = PowerOfTwo(seed=seed)
    twin = random.Random(seed)  # the same draws the balancer makes
    for _ in range(200):
        a, b = twin.sample(range(len(loads)), 2)
        expected = a if loads[a] <= loads[b] else b
        assert p2c.choose(replicas, CALL) == expected


@given(loads=st.lists(st.integers(0, 20), min_size=2, max_size=12), seed=st.integers(0, 2**32))
def test_power_of_two_never_picks_a_replica_more_loaded_than_both_samples(loads, seed):
    replicas = replicas_with(loads, concurrency=None)
    p2c = PowerOfTwo(seed=seed)
    twin = random.Random(seed)
    for _ in range(20):
        a, b = twin.sample(range(len(loads)), 2)
        chosen = p2c.choose(replicas, CALL)
        assert chosen in (a, b)
        assert loads[chosen] == min(loads[a], loads[b])


def test_power_of_two_never_picks_a_strictly_most_loaded_replica():
    replicas = replicas_with([1, 1, 50, 1, 1], concurrency=None)
    assert 2 not in choices(PowerOfTwo(seed=3), replicas, 500)


def test_power_of_two_with_a_seed_is_deterministic():
    replicas = replicas_with([0, 0, 0, 0, 0], concurrency=None)
    first = choices(PowerOfTwo(seed=42), replicas, 50)
    assert first == choices(PowerOfTwo(seed=42), replicas, 50)
    assert len(set(first)) > 1  # equal loads: the random samples spread the calls


def test_power_of_two_with_one_replica_picks_it():
    assert choices(PowerOfTwo(seed=0), replicas_with([3]), 3) == [0, 0, 0]


def test_power_of_two_repr_shows_its_seed():
    assert repr(PowerOfTwo(seed=5)) == "PowerOfTwo(seed=5)"
    assert repr(PowerOfTwo()) == "PowerOfTwo()"


# -- the protocol and custom balancers ----------------------------------------------------------


def test_builtin_and_custom_balancers_satisfy_the_protocol():
    for b in (RoundRobin(), LeastLoaded(), PowerOfTwo(), AlwaysLast()):
        assert isinstance(b, Balancer)
    assert not isinstance(object(), Balancer)


def test_make_balancer_builds_a_fresh_one_from_a_name_or_class_and_keeps_an_instance():
    assert isinstance(make_balancer("round_robin"), RoundRobin)
    assert isinstance(make_balancer("least_loaded"), LeastLoaded)
    assert isinstance(make_balancer("power_of_two"), PowerOfTwo)
    assert make_balancer("round_robin") is not make_balancer("round_robin")
    assert isinstance(make_balancer(AlwaysLast), AlwaysLast)
    custom = AlwaysLast()
    assert make_balancer(custom) is custom


def test_a_pool_places_calls_where_a_custom_balancer_says():
    pool = Pool("llm", ["a", "b", "c"], balancer=AlwaysLast(), concurrency=1, max_queue=2)
    assert pool._place(CALL).index == 2


@pytest.mark.parametrize("answer", [3, -1, 99])
def test_an_out_of_range_index_from_a_balancer_raises_a_clear_error(answer):
    pool = Pool("llm", ["a", "b", "c"], balancer=Fixed(answer), concurrency=1, max_queue=2)
    with pytest.raises(RuntimeError) as info:
        pool._place(CALL)
    message = str(info.value)
    assert "pool 'llm'" in message
    assert f"Fixed({answer!r}) returned {answer!r}" in message
    assert "0..2" in message


@pytest.mark.parametrize("answer", [None, "0", 1.0, True])
def test_a_non_integer_answer_from_a_balancer_raises_a_clear_error(answer):
    pool = Pool("llm", ["a", "b"], balancer=Fixed(answer), concurrency=1, max_queue=2)
    with pytest.raises(RuntimeError, match="not a replica index"):
        pool._place(CALL)


# -- replicas and placement ---------------------------------------------------------------------


def test_a_replica_is_full_at_concurrency_plus_max_queue():
    r = Replica(0, None, concurrency=2, max_queue=1)
    r.in_flight, r.queued = 2, 0
    assert not r.full
    r.queued = 1
    assert r.full


def test_a_replica_counts_a_caller_it_handed_a_slot_to_as_load():
    """A slot just released to a queued caller (still counted as queued) leaves no extra room."""
    r = Replica(0, None, concurrency=1, max_queue=1)
    r.in_flight, r.queued = 0, 2
    assert r.full


def test_a_replica_without_a_concurrency_limit_is_never_full():
    r = Replica(0, None, concurrency=None, max_queue=0)
    r.in_flight = 1000
    assert not r.full


def test_a_full_choice_falls_back_to_the_least_loaded_open_replica():
    pool = Pool("llm", ["a", "b", "c"], balancer=Fixed(0), concurrency=1, max_queue=1)
    for r, (in_flight, queued) in zip(pool.replicas, [(1, 1), (1, 0), (0, 0)], strict=True):
        r.in_flight, r.queued = in_flight, queued
    assert pool._place(CALL).index == 2


def test_placement_returns_none_when_every_replica_is_full():
    pool = Pool("llm", ["a", "b"], balancer="least_loaded", concurrency=1, max_queue=0)
    for r in pool.replicas:
        r.in_flight = 1
    assert pool._place(CALL) is None


def test_pool_repr_and_stats_summarise_load():
    pool = Pool("llm", ["a", "b"], balancer="least_loaded", concurrency=2, max_queue=3)
    pool.replicas[0].in_flight, pool.replicas[0].queued = 2, 1
    pool.replicas[1].completed, pool.replicas[1].failed = 5, 1
    assert repr(pool) == "<Pool llm replicas=2 load=[2+1 0+0]>"
    stats = pool.stats()
    assert stats.name == "llm"
    assert stats.balancer == "LeastLoaded()"
    assert stats.replicas == ((2, 1, 0, 0), (0, 0, 5, 1))
    assert stats.waiting == 0
    assert repr(pool.replicas[0]) == "<Replica 0 in_flight=2 queued=1>"


# -- the pool under trio ------------------------------------------------------------------------


async def hold(pool: Pool, release: trio.Event, seen: list[int],
               task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Take a slot, report the replica, keep it until `release` is set."""
    async with pool.acquire(CALL) as replica:
        seen.append(replica.index)
        task_status.started()
        await release.wait()


async def test_callers_beyond_capacity_wait_for_space_then_all_run():
    pool = Pool("llm", ["a", "b"], balancer="round_robin", concurrency=1, max_queue=1)
    release, seen = trio.Event(), []
    async with trio.open_nursery() as nursery:
        for _ in range(7):  # capacity is 2 replicas x (1 in flight + 1 queued) = 4
            nursery.start_soon(hold, pool, release, seen)
        await trio.testing.wait_all_tasks_blocked()
        stats = pool.stats()
        assert stats.replicas == ((1, 1, 0, 0), (1, 1, 0, 0))
        assert stats.waiting == 3
        release.set()
    assert len(seen) == 7
    stats = pool.stats()
    assert stats.waiting == 0
    assert [in_flight + queued for in_flight, queued, _, _ in stats.replicas] == [0, 0]
    assert sum(completed for _, _, completed, _ in stats.replicas) == 7


async def test_a_queued_caller_that_is_cancelled_makes_room_for_a_waiting_one():
    pool = Pool("llm", ["a"], balancer="round_robin", concurrency=1, max_queue=1)
    release, seen = trio.Event(), []
    async with trio.open_nursery() as nursery:
        await nursery.start(hold, pool, release, seen)  # in flight
        queued_scope = trio.CancelScope()

        async def queued() -> None:
            with queued_scope:
                await hold(pool, release, seen)

        nursery.start_soon(queued)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(hold, pool, release, seen)  # no room: waits for space
        await trio.testing.wait_all_tasks_blocked()
        assert pool.stats().waiting == 1
        queued_scope.cancel()
        await trio.testing.wait_all_tasks_blocked()
        # The waiting caller took the freed queue place while the first call still runs.
        assert pool.stats().waiting == 0
        assert pool.stats().replicas == ((1, 1, 0, 0),)
        release.set()
    assert pool.stats().replicas == ((0, 0, 2, 0),)


async def test_a_call_that_raises_counts_as_failed_and_frees_its_slot():
    pool = Pool("llm", ["a"], balancer="round_robin", concurrency=1, max_queue=0)
    with pytest.raises(ValueError):
        async with pool.acquire(CALL):
            raise ValueError("boom")
    async with pool.acquire(CALL) as replica:
        assert replica.in_flight == 1
    assert pool.stats().replicas == ((0, 0, 1, 1),)


async def test_in_flight_plus_queued_never_exceeds_the_bound_under_churn():
    concurrency, max_queue = 2, 1
    pool = Pool("llm", ["a", "b"], balancer="power_of_two", concurrency=concurrency,
                max_queue=max_queue)
    worst = [0]
    rng = random.Random(0)

    async def call(delay: int) -> None:
        async with pool.acquire(CALL):
            worst[0] = max(worst[0], *(r.load for r in pool.replicas))
            assert all(r.in_flight <= concurrency for r in pool.replicas)
            for _ in range(delay):
                await trio.lowlevel.checkpoint()
                worst[0] = max(worst[0], *(r.load for r in pool.replicas))

    async with trio.open_nursery() as nursery:
        for _ in range(200):
            nursery.start_soon(call, rng.randrange(4))
            if rng.random() < 0.3:
                await trio.lowlevel.checkpoint()
    assert worst[0] <= concurrency + max_queue
    assert sum(c for _, _, c, _ in pool.stats().replicas) == 200
