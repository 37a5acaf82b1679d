"""Chatting with a checkpoint, against transformers (the oracle): greedy answers equal
`apply_chat_template` + `generate` for Llama, Qwen2, Qwen3 and Qwen3-MoE; generation_config.json
defaults (sampling, lengths) and EOS ids. Each test builds its checkpoint (see
checkpoint_builders)."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer, GenerationConfig

from omni.compute import SamplingParams, TorchEngine
from omni.compute.generation_config import GenerationDefaults
from tests.compute.checkpoint_builders import MESSAGES, hf_chat, save_checkpoint


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe"])
async def test_chat_equals_apply_chat_template_and_greedy_generate(tmp_path: Path,
                                                                   arch: str) -> None:
    """engine.chat(messages, greedy) gives transformers' prompt ids and greedy tokens."""
    directory = save_checkpoint(tmp_path, arch)
    engine = TorchEngine.from_pretrained(directory)
    hf_tok = AutoTokenizer.from_pretrained(directory)
    expected_prompt = hf_tok.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                                 return_dict=False)
    assert engine.chat_prompt(MESSAGES) == expected_prompt
    greedy = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    result = await engine.chat(MESSAGES, greedy)
    expected = hf_chat(directory, MESSAGES, do_sample=False, max_new_tokens=24, eos_token_id=None)
    assert result.prompt_tokens == len(expected_prompt)
    assert result.token_ids == expected and len(expected) == 24
    assert result.text == hf_tok.decode(expected, skip_special_tokens=True)


async def test_chat_stream_yields_the_tokens_of_chat(tmp_path: Path) -> None:
    """chat_stream's token ids are chat's, and its result is there at the end."""
    engine = TorchEngine.from_pretrained(save_checkpoint(tmp_path, "qwen3"))
    params = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
    stream = engine.chat_stream(MESSAGES[:2], params)
    streamed = [token async for token in stream]
    assert streamed == (await engine.chat(MESSAGES[:2], params)).token_ids
    assert stream.result is not None and stream.result.token_ids == streamed


async def test_generation_config_defaults_and_eos_list_are_used(tmp_path: Path) -> None:
    """Without params, chat answers as transformers' generate() without arguments does with the
    checkpoint's generation_config.json (greedy, its max_new_tokens, its list of EOS ids)."""
    directory = save_checkpoint(tmp_path, "llama")
    engine = TorchEngine.from_pretrained(directory)
    free = (await engine.chat(MESSAGES, SamplingParams(temperature=0, max_new_tokens=20,
                                                       ignore_eos=True))).token_ids
    stop_at = next(i for i in range(3, 20) if free[i] not in free[:i])  # first stops there
    generation = {"do_sample": False, "max_new_tokens": 20, "eos_token_id": [2, free[stop_at]]}
    GenerationConfig(**generation).save_pretrained(directory)
    engine = TorchEngine.from_pretrained(directory)
    assert engine.tokenizer.eos_token_ids == (2, free[stop_at])
    assert engine.default_params().temperature == 0 and engine.default_params().max_new_tokens == 20
    result = await engine.chat(MESSAGES)
    assert result.token_ids == free[: stop_at + 1] and result.finish_reason == "stop"
    assert result.token_ids == hf_chat(directory, MESSAGES)


async def test_generation_config_max_length_counts_the_prompt(tmp_path: Path) -> None:
    """max_length in generation_config.json caps prompt + answer, as in transformers."""
    directory = save_checkpoint(tmp_path, "qwen3")
    num_prompt = len(TorchEngine.from_pretrained(directory).chat_prompt(MESSAGES))
    GenerationConfig(do_sample=False, max_length=num_prompt + 6, eos_token_id=2).save_pretrained(
        directory)
    result = await TorchEngine.from_pretrained(directory).chat(MESSAGES)
    assert len(result.token_ids) == 6 and result.finish_reason == "length"
    assert result.token_ids == hf_chat(directory, MESSAGES)


def test_generation_defaults_read_like_sglang_model_defaults() -> None:
    """do_sample: the file's knobs (top_k 0 = off); absent knobs keep SamplingParams' defaults;
    max_length counts the prompt; greedy otherwise; wrong values name the file."""
    sampled = GenerationDefaults.from_dict({"do_sample": True, "temperature": 0.7, "top_p": 0.8,
                                            "top_k": 0, "repetition_penalty": 1.1,
                                            "max_length": 50, "eos_token_id": 7})
    params = sampled.sampling_params(num_prompt_tokens=12)
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty,
            params.max_new_tokens, params.min_p) == (0.7, 0.8, -1, 1.1, 38, 0.0)
    assert sampled.sampling_params(num_prompt_tokens=80).max_new_tokens == 1
    assert sampled.eos_token_ids == (7,)
    greedy = GenerationDefaults.from_dict({"temperature": 0.6, "top_p": 0.9})  # do_sample absent
    assert greedy.sampling_params().is_greedy and greedy.sampling_params().max_new_tokens == 128
    with pytest.raises(ValueError, match=r"generation_config\.json: top_p must be in \(0, 1\]"):
        GenerationDefaults.from_dict({"do_sample": True, "top_p": 1.5}).sampling_params()
    with pytest.raises(ValueError, match=r"generation_config\.json: top_k must be an int"):
        GenerationDefaults.from_dict({"top_k": "50"})


async def test_without_generation_config_the_defaults_are_sglangs(tmp_path: Path) -> None:
    """No generation_config.json: SamplingParams() for requests without params, EOS from
    config.json."""
    directory = save_checkpoint(tmp_path, "qwen2")
    (directory / "generation_config.json").unlink()
    engine = TorchEngine.from_pretrained(directory)
    assert engine.generation_defaults is None and engine.default_params() == SamplingParams()
    assert engine.tokenizer.eos_token_ids == (2,)



async def test_engine_without_template_refuses_chat() -> None:
    """TorchEngine.tiny (byte tokenizer) has no template: chat is a ValueError saying so."""
    with pytest.raises(ValueError, match="has no chat template"):
        await TorchEngine.tiny().chat(MESSAGES)
