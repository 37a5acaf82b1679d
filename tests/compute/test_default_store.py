"""Prefix caching is on by default: an engine built without a store makes its own, sized from
free memory; `store=None` turns reuse off; cached turns equal recomputed ones."""

import logging

import pytest
import torch

from omni.compute import _default_store
from omni.compute._default_store import (
    DEVICE_FRACTION,
    HOST_CAP,
    HOST_FRACTION,
    default_store,
    default_store_bytes,
)
from omni.compute.engine import TorchEngine
from omni.compute.models import save_pretrained, tiny_model
from omni.compute.sampling import SamplingParams
from omni.kv import KVStore
from omni.kv.errors import KVTierError

GREEDY = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
FIRST = [(7 * i) % 250 + 3 for i in range(44)]  # with its reply's KV: three full pages
SECOND = [(11 * i) % 250 + 3 for i in range(20)]

async def two_turns(engine: TorchEngine) -> list:
    """A chat of two turns: the second prompt is the first, its reply and a new message."""
    first = await engine.generate(FIRST, GREEDY)
    second = await engine.generate(FIRST + first.token_ids + SECOND, GREEDY)
    return [first, second]


async def assert_reuses_and_equals_recompute(engine: TorchEngine,
                                             reference: TorchEngine) -> None:
    cached = await two_turns(engine)
    recomputed = await two_turns(reference)
    assert cached[0].cached_tokens == 0
    # The first turn's KV: its prompt and its reply but the last token (never an input).
    assert cached[1].cached_tokens == (len(FIRST) + GREEDY.max_new_tokens - 1) // 16 * 16 > 0
    assert [r.token_ids for r in cached] == [r.token_ids for r in recomputed]
    assert [r.cached_tokens for r in recomputed] == [0, 0]


async def test_from_pretrained_caches_the_second_turn_without_being_given_a_store(tmp_path):
    model, config = tiny_model(seed=3)
    save_pretrained(model, config, tmp_path)
    engine = TorchEngine.from_pretrained(tmp_path)
    assert isinstance(engine.store, KVStore)
    await assert_reuses_and_equals_recompute(
        engine, TorchEngine.from_pretrained(tmp_path, store=None))


async def test_the_tiny_engine_caches_by_default_and_equals_recomputing():
    engine = TorchEngine.tiny(seed=0)
    await assert_reuses_and_equals_recompute(engine, TorchEngine.tiny(seed=0, store=None))


async def test_store_none_given_on_purpose_caches_nothing():
    engine = TorchEngine.tiny(seed=0, store=None)
    assert engine.store is None
    again = [await engine.generate(FIRST, GREEDY) for _ in range(2)]
    assert [r.cached_tokens for r in again] == [0, 0]
    assert "store=none" in repr(engine)


def test_the_default_store_is_one_cpu_tier_the_engine_reports(monkeypatch):
    monkeypatch.setattr(_default_store, "free_host_bytes", lambda: 1 << 30)  # fixed for a while
    engine = TorchEngine.tiny(seed=0)
    stats = engine.store.stats()
    assert [name for name in stats if name != "leases"] == ["device"]
    capacity = stats["device"]["capacity"]
    assert capacity == default_store_bytes(torch.device("cpu")) // engine.kv_layout.page_bytes
    assert engine.store._tiers[0].device.type == "cpu"
    mib = capacity * engine.kv_layout.page_bytes / (1 << 20)
    assert f"store=device=0/{capacity}({mib:.0f}MiB)" in repr(engine)


def test_an_unknown_store_value_is_refused():
    with pytest.raises(ValueError, match="store must be a KVStore, None or 'auto'"):
        TorchEngine.tiny(seed=0, store="default")


@pytest.mark.parametrize(("host", "shm", "expected"), [
    (8 << 30, 1 << 30, int((1 << 30) * HOST_FRACTION)),  # /dev/shm smaller than memory
    (8 << 30, None, int((8 << 30) * HOST_FRACTION)),  # a filesystem without a fixed size
    (8 << 30, 64 << 30, int((8 << 30) * HOST_FRACTION)),
    (1 << 40, 1 << 40, HOST_CAP),
])
def test_the_cpu_size_is_a_fraction_of_free_memory_and_shm_room(monkeypatch, host, shm,
                                                                  expected):
    monkeypatch.setattr(_default_store, "free_host_bytes", lambda: host)
    monkeypatch.setattr(_default_store, "free_shm_bytes", lambda: shm)
    assert default_store_bytes(torch.device("cpu")) == expected


def test_no_room_for_a_page_turns_caching_off_and_says_so(monkeypatch, caplog):
    monkeypatch.setattr(_default_store, "free_host_bytes", lambda: 4096)
    layout = TorchEngine.tiny(seed=0, store=None).kv_layout
    with caplog.at_level(logging.WARNING, logger="omni.compute"):
        assert default_store(layout, torch.device("cpu")) is None
    assert "prefix caching is off" in caplog.text


def test_a_store_that_cannot_be_made_leaves_the_engine_recomputing(monkeypatch, caplog):
    def no_room(*args, **kwargs):
        raise KVTierError("device", "the device tier cannot be made: no room in /dev/shm")

    monkeypatch.setattr(_default_store, "KVStore", no_room)
    with caplog.at_level(logging.WARNING, logger="omni.compute"):
        engine = TorchEngine.tiny(seed=0)
    assert engine.store is None
    assert "prefix caching is off: the engine's KV store cannot be made" in caplog.text


@pytest.mark.gpu
def test_a_cuda_model_gets_a_device_tier_of_a_fraction_of_free_gpu_memory():
    layout = TorchEngine.tiny(seed=0, store=None).kv_layout
    free, _ = torch.cuda.mem_get_info()
    with default_store(layout, torch.device("cuda")) as store:
        tier = store._tiers[0]
        assert tier.device.type == "cuda"
        assert tier.num_slots * layout.page_bytes <= free * DEVICE_FRACTION
