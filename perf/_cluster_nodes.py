"""The nodes `perf/cluster.py` serves on its cluster workers (they load this file's source).

One random Llama (`MODEL`, float32) per replica, on its worker's KV store, keyed with
`MODEL_ID`: prompts are token ids, so the driver computes a request's page keys
(`prompt_keys`, the node classes' ``kv_keys``) exactly as the workers' engines do, without a
model or a tokenizer. The two node classes differ only in their balancer.
"""

from __future__ import annotations

from typing import Any

import torch

import omni
from omni.compute import SamplingParams, TorchEngine
from omni.compute.models import tiny_config, tiny_model
from omni.kv import KVLayout, block_keys

__all__ = ["MODEL", "MODEL_ID", "PAGE_SIZE", "ChatKVAware", "ChatRoundRobin", "kv_layout",
           "prompt_keys"]

PAGE_SIZE = 16
MODEL_ID = "perf-cluster"
# ~4 M parameters: a 512-token prefill takes ~0.1 s on one core, a cached one a few ms.
MODEL: dict[str, Any] = {"hidden_size": 256, "intermediate_size": 768, "num_layers": 4,
                         "num_heads": 4, "num_kv_heads": 2, "vocab_size": 512}


def kv_layout() -> KVLayout:
    """The page layout of the workers' stores (the driver's ``kv=``)."""
    return tiny_config(**MODEL).kv_layout(PAGE_SIZE, torch.float32)


def prompt_keys(prompt: list[int]) -> list[bytes]:
    """The store keys of a prompt's full pages, as `ModelRunner.page_keys` names them."""
    return block_keys(prompt, PAGE_SIZE, extra=(MODEL_ID,))


class _Chat:
    """Generates greedily from a token-id prompt on this worker's KV store."""

    def __init__(self, seed: int = 0) -> None:
        model, config = tiny_model(seed=seed, **MODEL)
        self.engine = TorchEngine(model, config, store=omni.context().kv, page_size=PAGE_SIZE,
                                  model_id=MODEL_ID, seed=seed)

    @staticmethod
    def kv_keys(prompt: list[int], max_tokens: int = 4) -> list[bytes]:
        return prompt_keys(prompt)

    async def __call__(self, prompt: list[int], max_tokens: int = 4) -> dict[str, Any]:
        result = await self.engine.generate(prompt, SamplingParams(
            max_new_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        return {"worker": omni.context().runtime.name, "prompt_tokens": result.prompt_tokens,
                "cached_tokens": result.cached_tokens, "tokens": result.token_ids,
                "ttft_s": result.time_to_first_token}


@omni.node(replicas=2, balance="kv_aware")
class ChatKVAware(_Chat):
    pass


@omni.node(replicas=2, balance="round_robin")
class ChatRoundRobin(_Chat):
    pass
