"""TorchEngine on a CUDA device: the model, its batch KV and its store on the GPU give
transformers' greedy tokens, and reused KV gives the recomputed tokens (float32, where the
two sides' kernels round alike). Skipped without CUDA (tests/conftest.py)."""

import numpy as np
import pytest
import torch
import trio

from omni.compute.engine import TorchEngine
from omni.compute.models import save_pretrained, tiny_model
from omni.compute.prompt import Audio, Image, Prompt, Text
from omni.compute.sampling import SamplingParams
from omni.compute.tokenizer import ByteTokenizer
from omni.kv import KVStore, TierConfig

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
SYSTEM = "You are a helpful assistant who answers in one short sentence. "


def tiny_on(device: str, store: KVStore | None = None, dtype=torch.float32) -> TorchEngine:
    model, config = tiny_model(seed=0)
    return TorchEngine(model.to(device, dtype), config, tokenizer=ByteTokenizer(), store=store,
                       model_id="tiny-0", seed=0)


@pytest.fixture
def cuda_store():
    layout = tiny_on("cpu").kv_layout
    with KVStore(layout, [TierConfig("device", 64 * layout.page_bytes),
                          TierConfig("host", 256 * layout.page_bytes)], device="cuda") as store:
        yield store


async def test_from_pretrained_on_cuda_gives_transformers_greedy_tokens_on_cuda(tmp_path):
    from transformers import AutoModelForCausalLM

    model, config = tiny_model(seed=3)
    save_pretrained(model, config, tmp_path)
    engine = TorchEngine.from_pretrained(tmp_path, device="cuda", store=None)
    assert next(engine.model.parameters()).is_cuda and engine.runner.batch.k[0].is_cuda
    prompt = [5, 17, 42, 99, 7, 3, 250, 11]
    ours = await engine.generate(prompt, SamplingParams(max_new_tokens=16, temperature=0,
                                                        ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).cuda().eval()
    out = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=16,
                      do_sample=False, eos_token_id=None, pad_token_id=0)
    assert ours.token_ids == out[0, len(prompt):].tolist()


async def test_a_second_turn_on_cuda_reuses_the_first_and_equals_recomputation(cuda_store):
    engine, reference = tiny_on("cuda", cuda_store), tiny_on("cuda")
    first = await engine.generate(SYSTEM + "What is Omni?", GREEDY)
    follow_up = SYSTEM + "What is Omni?" + first.text + " And why?"
    second = await engine.generate(follow_up, GREEDY)
    assert second.cached_tokens >= 48
    assert cuda_store._tiers[0].pool.is_cuda
    assert second.token_ids == (await reference.generate(follow_up, GREEDY)).token_ids


@pytest.mark.parametrize("media", [Image(np.random.default_rng(0).integers(
    0, 256, (24, 24, 3), dtype=np.uint8)), Audio(np.sin(np.arange(3000) / 7.0))],
    ids=["image", "audio"])
async def test_media_prompts_on_cuda_are_reused_and_equal_recomputation(cuda_store, media):
    engine, reference = tiny_on("cuda", cuda_store), tiny_on("cuda")
    prompt = Prompt([Text(SYSTEM), media, Text("Describe it.")])
    first = await engine.generate(prompt, GREEDY)
    again = await engine.generate(prompt + Text(" Briefly."), GREEDY)
    assert again.cached_tokens > first.prompt_tokens - 16
    assert again.token_ids == (await reference.generate(prompt + Text(" Briefly."),
                                                        GREEDY)).token_ids


async def test_concurrent_requests_on_cuda_are_batched_and_match_single_runs(cuda_store):
    """Rows of different lengths: the decode mask and the per-row KV writes on the GPU."""
    engine, reference = tiny_on("cuda", cuda_store), tiny_on("cuda")
    prompts = [f"request {i}: " + "tell me more " * (i + 1) for i in range(6)]
    results = {}

    async def one(i):
        results[i] = await engine.generate(prompts[i], GREEDY)

    async with trio.open_nursery() as nursery:
        for i in range(6):
            nursery.start_soon(one, i)
    assert engine.stats().num_decode_steps < 6 * GREEDY.max_new_tokens  # batched
    for i, prompt in enumerate(prompts):
        assert results[i].token_ids == (await reference.generate(prompt, GREEDY)).token_ids


async def test_a_bfloat16_engine_on_cuda_keeps_bfloat16_pages_on_the_gpu():
    layout = tiny_on("cpu", dtype=torch.bfloat16).kv_layout
    with KVStore(layout, [TierConfig("device", 64 * layout.page_bytes)],
                 device="cuda") as store:
        engine = tiny_on("cuda", store, dtype=torch.bfloat16)
        first = await engine.generate(SYSTEM * 2, GREEDY)
        again = await engine.generate(SYSTEM * 2 + "And more.", GREEDY)
        assert len(first.token_ids) == len(again.token_ids) == GREEDY.max_new_tokens
        assert again.cached_tokens > 0
        pool = store._tiers[0].pool
        assert pool.is_cuda and pool.dtype == torch.bfloat16
