"""The runtime serves nodes with the process's KV store; cancelled requests leave no lease."""

import functools
import os

import pytest
import torch
import trio

import omni
from omni._shm import shm_directory
from omni.kv import KVConfig, KVLayout, KVStore, TierConfig, block_keys

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, page_size=4, dtype=torch.float32)
TIERS = (TierConfig("device", 8 * LAYOUT.page_bytes), TierConfig("host", 8 * LAYOUT.page_bytes))


@omni.node
async def store_of(x: int) -> object:
    return omni.context().kv


@omni.graph
def which_store(x: int):
    return store_of(x)


async def test_runtime_builds_serves_and_closes_a_configured_store():
    async with omni.Runtime(kv=KVConfig(LAYOUT, TIERS)) as rt:
        store = await rt.run(which_store, x=1)
        assert isinstance(store, KVStore) and store is rt.kv
        arena = f"omni-{store.store_id}-host"
        assert arena in os.listdir(shm_directory())
    assert arena not in os.listdir(shm_directory())  # the runtime built it, the runtime closed it


async def test_a_store_passed_in_stays_open_after_the_runtime():
    with KVStore(LAYOUT, TIERS) as store:
        async with omni.Runtime(kv=store) as rt:
            assert await rt.run(which_store, x=1) is store
        assert store.match([]) == 0  # still open


async def test_a_layout_alone_gives_a_store_with_default_tiers():
    async with omni.Runtime(kv=LAYOUT) as rt:
        assert set(rt.kv.stats()) == {"device", "host", "leases"}


async def test_a_bad_kv_option_is_a_clear_error():
    with pytest.raises(TypeError, match="kv must be a KVStore, a KVConfig or a KVLayout"):
        async with omni.Runtime(kv="8GiB"):
            pass


async def test_cancelling_a_request_releases_the_leases_its_nodes_held():
    keys = block_keys(range(8), LAYOUT.page_size)
    holding = trio.Event()

    @omni.node
    async def hold_pages(n: int) -> int:
        store = omni.context().kv
        with store.acquire(keys) as lease:
            holding.set()
            await trio.sleep_forever()
        return len(lease)

    @omni.graph
    def g(n: int):
        return hold_pages(n)

    async with omni.Runtime(kv=KVConfig(LAYOUT, TIERS)) as rt:
        rt.kv.put(keys, torch.zeros((2, *LAYOUT.page_shape)))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(rt.run, g, n=0))
            await holding.wait()
            assert rt.kv.stats()["leases"]["pinned_pages"] == 2
            nursery.cancel_scope.cancel()
        assert rt.kv.stats()["leases"] == {"open": 0, "exported": 0, "pinned_pages": 0}
