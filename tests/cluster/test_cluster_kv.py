"""KV across workers: pages fetched from another worker are byte-identical and reused with
the same tokens as recomputing; kv_aware routing sends a prefix back where its pages are."""

from __future__ import annotations

from omni.compute import SamplingParams, TorchEngine
from tests._wait import wait_until
from tests.cluster import kv_pipelines as kv
from tests.cluster.conftest import LocalCluster

SYSTEM = "You are a careful assistant. Answer briefly and precisely. " * 3  # ~10 pages


async def reference_tokens(prompt: str, max_tokens: int = 4) -> list[int]:
    result = await TorchEngine.tiny(seed=0, store=None).generate(
        prompt, SamplingParams(max_new_tokens=max_tokens, temperature=0.0))
    return result.token_ids


async def test_a_worker_fetches_pages_another_holds(local_cluster: LocalCluster) -> None:
    await local_cluster.start()
    await local_cluster.worker("w1")
    await local_cluster.worker("w2")
    async with local_cluster.driver(kv=kv.KV_LAYOUT) as rt:
        first = await rt.run(kv.ChatOnW1(), prompt=SYSTEM + "Q: one?")
        assert first["worker"] == "w1" and first["cached"] == 0
        await rt.deploy(kv.ChatOnW2())  # w2's store and KV directory start
        # Until w2's directory has heard of w1's pages: before that, w2 would compute them
        # itself and never need w1's.
        await wait_until(lambda: local_cluster.worker_named("w2").directory is not None
                         and local_cluster.worker_named("w2").directory.prefix_len(
                             "w1", kv.prompt_keys(SYSTEM)),
                         "w2's KV directory to hear of w1's pages")
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


async def test_kv_aware_routing_sends_a_prefix_back_to_its_pages(
        local_cluster: LocalCluster) -> None:
    await local_cluster.start()
    await local_cluster.worker("w1")
    await local_cluster.worker("w2")
    systems = [f"{i} is the system prompt: " + "be helpful and exact. " * 4 for i in range(4)]
    async with local_cluster.driver(kv=kv.KV_LAYOUT) as rt:
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
