"""A tiny language model served on cluster workers from their KV stores."""

from __future__ import annotations

import hashlib

import omni
from omni.compute import SamplingParams, TorchEngine

_KEYER = TorchEngine.tiny(seed=0, store=None)  # names a prompt's pages as the workers' engines do
KV_LAYOUT = _KEYER.kv_layout


def prompt_keys(prompt: str) -> list[bytes]:
    return _KEYER.runner.page_keys(_KEYER.prepare(prompt).token_ids, [])


class _Chat:
    def __init__(self) -> None:
        self.engine = TorchEngine.tiny(seed=0, store=omni.context().kv)

    @staticmethod
    def kv_keys(prompt: str, max_tokens: int = 4) -> list[bytes]:
        return prompt_keys(prompt)

    async def __call__(self, prompt: str, max_tokens: int = 4) -> dict:
        result = await self.engine.generate(prompt, SamplingParams(max_new_tokens=max_tokens,
                                                                   temperature=0.0))
        runtime = omni.context().runtime
        peers = runtime.peers.stats() if runtime.peers is not None else {}
        return {"tokens": result.token_ids, "cached": result.cached_tokens,
                "worker": runtime.name, "fetched_pages": peers.get("pages", 0)}


@omni.node(where="w1")
class ChatOnW1(_Chat):
    pass


@omni.node(where="w2")
class ChatOnW2(_Chat):
    pass


@omni.node(replicas=2, balance="kv_aware")
class Chat(_Chat):
    pass


@omni.node(replicas=2, balance="round_robin")
class ChatRoundRobin(_Chat):
    pass


class _Pages:
    async def __call__(self, prompt: str) -> dict:
        store = omni.context().kv
        keys = prompt_keys(prompt)
        with store.acquire(keys) as lease:
            raw = lease.pages().contiguous().view(-1).view(dtype=__import__("torch").uint8)
            return {"pages": len(lease), "sha256": hashlib.sha256(raw.numpy()).hexdigest()}


@omni.node(where="w1")
class PagesOnW1(_Pages):
    pass


@omni.node(where="w2")
class PagesOnW2(_Pages):
    pass

