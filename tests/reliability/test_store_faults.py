"""Faults of a running store: every page pinned under memory pressure, and its shared memory
deleted under it. Requests that cannot be served get a clear error, or recompute; the others,
and the requests after, are served their own pages."""

from __future__ import annotations

import os

import pytest
import torch
import trio

import omni
from omni._shm import shm_directory
from omni.compute import SamplingParams, TorchEngine
from omni.kv import KVCapacityError, KVLeaseError, KVStore, TierConfig, open_descriptor
from tests.reliability._support import (
    Tally,
    check_pages,
    keys_for,
    make_store,
    page_of,
    pages_of,
)

GREEDY = SamplingParams(max_new_tokens=6, temperature=0)
PROMPTS = [f"user {i}: tell me about pages" for i in range(4)]  # a full page each


async def test_every_page_pinned_engines_recompute_and_puts_fail_their_request(record):
    tally = Tally()
    reference = TorchEngine.tiny(seed=0, store=None)  # what recomputation gives
    expected = [(await reference.generate(p, GREEDY)).token_ids for p in PROMPTS]
    layout = reference.kv_layout
    filler_keys = [bytes([i]) * 16 for i in range(4)]
    filler = torch.zeros((4, *layout.page_shape), dtype=layout.dtype)
    with KVStore(layout, [TierConfig("device", 4 * layout.page_bytes),
                          TierConfig("host", 16 * layout.page_bytes)]) as store:
        engine = TorchEngine.tiny(seed=0, store=store)
        for prompt, tokens in zip(PROMPTS, expected, strict=True):  # warm: pages cached
            assert (await engine.generate(prompt, GREEDY)).token_ids == tokens
        store.put(filler_keys, filler)
        with store.acquire(filler_keys) as hold:  # the device tier: every page pinned
            assert store.stats()["leases"]["pinned_pages"] == 4
            for _ in range(2):
                for prompt, tokens in zip(PROMPTS, expected, strict=True):
                    result = await engine.generate(prompt, GREEDY)
                    assert result.token_ids == tokens and result.cached_tokens == 0
                    tally("recomputed")
            with pytest.raises(KVCapacityError, match="every page in it is pinned"):
                store.put([b"\xee" * 16], filler[:1])
            assert len(hold) == 4 and torch.equal(hold.pages(), filler)  # untouched
        for prompt, tokens in zip(PROMPTS, expected, strict=True):  # pressure gone: reuse
            result = await engine.generate(prompt, GREEDY)
            assert result.token_ids == tokens and result.cached_tokens > 0
            tally("reused")
        assert store.stats()["leases"] == {"open": 0, "exported": 0, "pinned_pages": 0}
    await _nodes_under_pressure(tally)
    record("kv.all_pinned", tries=tally["recomputed"] + tally["failed"],
           outcome=f"{tally['recomputed']} generations recomputed with the same tokens; "
                   f"{tally['failed']} node puts failed their request with KVCapacityError "
                   f"(naming the pins) while {tally['served']} readers were served; all "
                   "served again once released")


async def _nodes_under_pressure(tally: Tally) -> None:
    """Nodes that must cache a new page fail their own request; readers of the pinned pages
    and every request after the pressure are served."""
    held = keys_for(4, extra="held")
    fresh = keys_for(8, start=50, extra="fresh")

    @omni.node
    async def cache_page(i: int) -> bool:
        store = omni.context().kv
        store.put([fresh[i]], page_of(fresh[i]).unsqueeze(0))
        with store.acquire([fresh[i]]) as lease:
            check_pages([fresh[i]], lease.pages())
        return True

    @omni.node
    async def read_page(i: int) -> bool:
        with omni.context().kv.acquire([held[i % 4]]) as lease:
            check_pages([held[i % 4]], lease.pages())
        return True

    @omni.graph
    def cache(i: int):
        return cache_page(i)

    @omni.graph
    def read(i: int):
        return read_page(i)

    with make_store(device=4, host=4) as store:
        store.put(held, pages_of(held))
        async with omni.Runtime(kv=store) as rt:
            errors: list[omni.NodeError] = []

            async def one(graph, i: int) -> None:
                try:
                    assert await rt.run(graph, i=i)
                    tally("served")
                except omni.NodeError as exc:
                    errors.append(exc)

            with store.acquire(held):
                async with trio.open_nursery() as nursery:
                    for i in range(8):
                        nursery.start_soon(one, cache, i)
                        nursery.start_soon(one, read, i)
            assert len(errors) == 8 and tally["served"] == 8
            for exc in errors:
                assert exc.node == "cache_page" and isinstance(exc.cause, KVCapacityError)
                assert "pinned" in str(exc)
                tally("failed")
            for i in range(8):  # released: the same requests succeed
                assert await rt.run(cache, i=i)
        assert store.stats()["leases"] == {"open": 0, "exported": 0, "pinned_pages": 0}


def test_shared_memory_deleted_under_a_running_store(record):
    tally = Tally()
    shm = shm_directory()
    keys = keys_for(6, extra="shm")
    more = keys_for(6, start=10, extra="shm-more")
    for round_ in range(5):
        for victim in ("device", "host", "leases", "all"):
            with make_store(device=4, host=4) as store:
                store.put(keys, pages_of(keys))
                with store.acquire(keys[:2]) as lease:
                    descriptor = lease.descriptor(ttl=60)
                names = ["device", "host", "leases"] if victim == "all" else [victim]
                for name in names:
                    os.unlink(shm / f"omni-{store.store_id}-{name}")
                # The descriptor names the device arena and the lease table: without either,
                # another process cannot map the pages (a miss), never other memory.
                if victim == "host":
                    with open_descriptor(descriptor) as opened:
                        check_pages(keys[:2], torch.stack(list(opened)))
                else:
                    with pytest.raises(KVLeaseError, match="does not exist"):
                        open_descriptor(descriptor)
                    tally("refused")
                # This process keeps serving from its mappings, old pages and new.
                store.put(more[: round_ + 1], pages_of(more[: round_ + 1]))
                for key in keys + more[: round_ + 1]:
                    if store.match([key]):
                        with store.acquire([key]) as lease:
                            check_pages([key], lease.pages())
                            tally("served")
                tally("round")
            # close() did not fail on the missing files
    record("shm.deleted", tries=tally["round"],
           outcome=f"{tally['refused']} descriptors naming a deleted file refused "
                   "(KVLeaseError), others still mapped intact; the store kept serving "
                   f"{tally['served']} pages from its mappings and closed cleanly")
