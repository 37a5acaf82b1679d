"""KV across workers: pages fetched from another worker are byte-identical and reused with
the same tokens as recomputing; kv_aware routing sends a prefix back where its pages are."""

from __future__ import annotations

import trio

import omni
from omni.compute import SamplingParams, TorchEngine
from tests._wait import CAP_S, wait_until
from tests.cluster import kv_pipelines as kv
from tests.cluster.conftest import Cluster

SYSTEM = "You are a careful assistant. Answer briefly and precisely. " * 3  # ~10 pages


async def reference_tokens(prompt: str, max_tokens: int = 4) -> list[int]:
    result = await TorchEngine.tiny(seed=0, store=None).generate(
        prompt, SamplingParams(max_new_tokens=max_tokens, temperature=0.0))
    return result.token_ids


async def test_a_worker_fetches_pages_another_holds(cluster: Cluster) -> None:
    cluster.head()
    cluster.worker("w1")
    cluster.worker("w2")
    async with omni.Runtime(cluster=cluster.address, token_file=str(cluster.token),
                            kv=kv.KV_LAYOUT) as rt:
        first = await rt.run(kv.ChatOnW1(), prompt=SYSTEM + "Q: one?")
        assert first["worker"] == "w1" and first["cached"] == 0
        await rt.deploy(kv.ChatOnW2())  # w2's store and KV directory start
        with trio.fail_after(CAP_S):  # until w2's directory has heard of w1's pages: before
            while not await rt.run(kv.HeardOnW2(), prompt=SYSTEM):  # that, w2 would compute
                await trio.sleep(0.2)  # them itself and never need w1's
        prompt = SYSTEM + "Q: two?"
        second = await rt.run(kv.ChatOnW2(), prompt=prompt)
        assert second["fetched_pages"] > 0
        assert second["worker"] == "w2"
        assert second["cached"] >= (len(kv.prompt_keys(SYSTEM)) - 1) * 16
        assert second["tokens"] == await reference_tokens(prompt)  # cached equals recomputed
        on_w1 = await rt.run(kv.PagesOnW1(), prompt=SYSTEM)
        on_w2 = await rt.run(kv.PagesOnW2(), prompt=SYSTEM)
        assert on_w1["pages"] == on_w2["pages"] >= 5
        assert on_w1["sha256"] == on_w2["sha256"]  # the bytes arrived unchanged


async def test_kv_aware_routing_sends_a_prefix_back_to_its_pages(cluster: Cluster) -> None:
    cluster.head()
    cluster.worker("w1")
    cluster.worker("w2")
    systems = [f"{i} is the system prompt: " + "be helpful and exact. " * 4 for i in range(4)]
    async with omni.Runtime(cluster=cluster.address, token_file=str(cluster.token),
                            kv=kv.KV_LAYOUT) as rt:
        await rt.deploy(kv.Chat())
        home: dict[int, str] = {}
        for i, system in enumerate(systems):  # each prefix's first request lands somewhere
            home[i] = (await rt.run(kv.Chat(), prompt=system + "first"))["worker"]
        assert set(home.values()) == {"w1", "w2"}  # new prefixes are spread
        pool = rt.pool_for(kv.Chat())
        directory = rt.cluster.directory
        await wait_until(lambda: all(directory.prefix_len(home[i], kv.prompt_keys(s))
                                     for i, s in enumerate(systems)),
                         "the driver's directory to hear of every prefix's pages")
        for round_ in range(2):
            for i, system in enumerate(systems):
                out = await rt.run(kv.Chat(), prompt=f"{system}user {round_}")
                assert out["worker"] == home[i], (i, out)
                assert out["cached"] > 0
        assert pool.balancer.hits >= 8
