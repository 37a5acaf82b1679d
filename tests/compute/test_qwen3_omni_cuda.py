"""Qwen3-Omni on a CUDA device: the thinker (its towers and decoder), the talker and code2wav
on the GPU give transformers' tokens and waveform on the same GPU (float32, where both sides'
kernels round alike), and in bfloat16 (the weights' dtype on a GPU) a reply is spoken.
Skipped without CUDA (tests/conftest.py)."""

from pathlib import Path

import numpy as np
import pytest
import torch

from omni.compute import SamplingParams, TorchEngine
from omni.compute.talker import Talker, talker_params
from tests.compute.omni_builders import hf_processor, save_omni_checkpoint

pytestmark = pytest.mark.gpu

IMAGE = (np.random.default_rng(0).random((40, 72, 3)) * 255).astype(np.uint8)
AUDIO = (np.random.default_rng(1).standard_normal(16_000) * 0.1).astype(np.float32)
MESSAGES = [{"role": "user", "content": [{"type": "image", "image": IMAGE},
                                         {"type": "audio", "audio": AUDIO},
                                         {"type": "text", "text": "What do you hear?"}]}]
TALKER = talker_params(temperature=0, max_new_tokens=20, min_new_tokens=5)


async def test_qwen3_omni_on_cuda_speaks_as_transformers_on_cuda(tmp_path: Path) -> None:
    from transformers import Qwen3OmniMoeForConditionalGeneration

    directory = save_omni_checkpoint(tmp_path)
    engine = TorchEngine.from_pretrained(directory, device="cuda")
    talker = Talker.from_pretrained(directory, device="cuda")
    reply = await engine.chat(MESSAGES, SamplingParams(temperature=0, max_new_tokens=8))
    speech = await talker.speak(engine, engine.chat_prompt(MESSAGES), reply.token_ids,
                                sampling=TALKER)
    hf = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        directory, dtype=torch.float32).to("cuda").eval()
    hf.talker.config.audio_config = hf.config.thinker_config.audio_config
    processor = hf_processor(directory)
    rendered = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "audio"},
                                      {"type": "text", "text": "What do you hear?"}]}],
        add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[rendered], images=[IMAGE], audio=[AUDIO],
                       return_tensors="pt").to("cuda")
    with torch.inference_mode():
        sequences, wav = hf.generate(
            **inputs, return_audio=True, thinker_do_sample=False, thinker_max_new_tokens=8,
            thinker_eos_token_id=engine.tokenizer.eos_token_ids[0], talker_do_sample=False,
            talker_max_new_tokens=20, talker_min_new_tokens=5)
    assert reply.token_ids == sequences[0, inputs["input_ids"].shape[1]:].tolist()
    expected = wav.reshape(-1).float().cpu().numpy()
    assert speech.waveform.shape == expected.shape
    assert np.abs(speech.waveform - expected).max() <= 1e-3


async def test_qwen3_omni_in_bfloat16_on_cuda_speaks(tmp_path: Path) -> None:
    directory = save_omni_checkpoint(tmp_path)
    engine = TorchEngine.from_pretrained(directory, device="cuda", dtype=torch.bfloat16)
    talker = Talker.from_pretrained(directory, dtype=torch.bfloat16, device="cuda")
    assert next(engine.model.parameters()).dtype == torch.bfloat16
    reply = await engine.chat(MESSAGES, SamplingParams(temperature=0, max_new_tokens=8))
    speech = await talker.speak(engine, engine.chat_prompt(MESSAGES), reply.token_ids,
                                sampling=TALKER)
    assert speech.codes.shape == (4, 19) and np.isfinite(speech.waveform).all()
    assert speech.waveform.size > 0 and np.abs(speech.waveform).max() <= 1.0
