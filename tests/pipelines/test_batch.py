"""`Batcher`: calls that arrive while a batch runs are run together by key, at most
`max_batch` at once; a failing batch gives each call its own result or error; a call
cancelled while it waits leaves the others alone. Under trio's autojump clock: a batch's
work is a sleep, so the order is the clock's, not the machine's."""

from __future__ import annotations

import pytest
import trio

from omni.pipelines._batch import Batcher


class Work:
    """A batch's work: it records each batch's items and sleeps 1 s; an item "bad" fails
    the batch it is in."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []

    async def __call__(self, items: list[str]) -> list[str]:
        self.batches.append(list(items))
        await trio.sleep(1)
        if "bad" in items:
            raise ValueError("bad item")
        return [item.upper() for item in items]


async def calls(batcher: Batcher[str, str], keyed: list[tuple[str, str]]
                ) -> dict[str, str | Exception]:
    """Each (key, item) called in this order, 0.1 s apart; each item's result or error."""
    out: dict[str, str | Exception] = {}

    async def one(key: str, item: str) -> None:
        try:
            out[item] = await batcher(key, item)
        except ValueError as exc:
            out[item] = exc

    async with trio.open_nursery() as nursery:
        for key, item in keyed:
            nursery.start_soon(one, key, item)
            await trio.sleep(0.1)
    return out


async def test_calls_arriving_during_a_batch_run_together_by_key(autojump_clock) -> None:
    work = Work()
    batcher: Batcher[str, str] = Batcher(work, max_batch=3)
    out = await calls(batcher, [("a", "a1"), ("a", "a2"), ("b", "b1"), ("a", "a3"),
                                ("a", "a4"), ("a", "a5"), ("b", "b2")])
    assert out == {item: item.upper() for item in out}
    # a1 alone (nothing waited); then the first waiter's key, three at most; then the rest
    assert work.batches == [["a1"], ["a2", "a3", "a4"], ["b1", "b2"], ["a5"]]
    assert batcher.batches == 4


async def test_a_failing_batch_gives_each_call_its_own_result_or_error(autojump_clock) -> None:
    work = Work()
    batcher: Batcher[str, str] = Batcher(work, max_batch=4)
    out = await calls(batcher, [("a", "a1"), ("a", "a2"), ("a", "bad"), ("a", "a3")])
    assert out["a1"] == "A1" and out["a2"] == "A2" and out["a3"] == "A3"
    assert isinstance(out["bad"], ValueError)
    assert work.batches == [["a1"], ["a2", "bad", "a3"], ["a2"], ["bad"], ["a3"]]


async def test_a_call_cancelled_while_it_waits_leaves_the_others_alone(autojump_clock) -> None:
    work = Work()
    batcher: Batcher[str, str] = Batcher(work, max_batch=4)
    out: dict[str, str] = {}

    async def one(item: str, scope: trio.CancelScope | None = None) -> None:
        with scope or trio.CancelScope():
            out[item] = await batcher("a", item)

    leaving = trio.CancelScope()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(one, "a1")
        await trio.sleep(0.1)
        nursery.start_soon(one, "a2", leaving)
        nursery.start_soon(one, "a3")
        await trio.sleep(0.1)
        leaving.cancel()  # a2 waits for a1's batch: it leaves
    assert out == {"a1": "A1", "a3": "A3"}
    assert work.batches == [["a1"], ["a3"]]


def test_a_batch_holds_at_least_one_call() -> None:
    with pytest.raises(ValueError, match="max_batch must be >= 1"):
        Batcher(Work(), max_batch=0)
