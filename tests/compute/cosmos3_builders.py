"""A Cosmos3 folder built in tests, in diffusers' hub layout (``model_index.json`` naming
``Cosmos3OmniPipeline`` and a folder per component, as ``save_pretrained`` writes them): a
tiny mixture-of-transformers with every parameter drawn again (diffusers zero-initialises
parts of its DiTs, and such a DiT ignores its prompt), a tiny Wan VAE, a flow UniPC
scheduler and a byte-level BPE tokenizer trained here with a Qwen3-VL-style chat template.
No safety checker: the folder's pipeline is built with ``enable_safety_checker=False``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from tests.compute.checkpoint_builders import SPECIALS, train_bpe
from tests.compute.image_builders import QWEN3_TEMPLATE, redraw

VISION_START = "<|vision_start|>"  # the pipeline ends every prompt with it
# Text the tokenizer is trained on: the pipeline's system prompt and resolution sentences
CORPUS = ["You are a helpful assistant who will generate images from a give prompt.",
          "This image is of 32x32 resolution. This image is not of 16x48 resolution.",
          "A red fox asleep in fresh snow, watercolour. A lighthouse at dusk, oil on canvas.",
          "blurry, dark, low quality, distorted"]
LATENT_CHANNELS = 4
SPATIAL_FACTOR = 4  # pixels per latent, each way: the smallest image side


def cosmos3_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with ChatML's and ``<|vision_start|>`` as special tokens and
    Qwen3's ChatML template (what the pipeline's ``apply_chat_template`` call needs)."""
    trained = train_bpe(CORPUS, [*SPECIALS, VISION_START], 384)
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(trained), chat_template=QWEN3_TEMPLATE,
        eos_token="<|im_end|>", pad_token="<|endoftext|>")


def save_cosmos3(directory: Path, seed: int = 0, num_layers: int = 2,
                 native_flow_schedule: bool = False, **transformer_options: Any) -> Path:
    """A tiny random Cosmos3 (`Cosmos3OmniPipeline`: a `num_layers`-layer transformer with
    grouped-query attention, a Wan VAE of `LATENT_CHANNELS` channels that shrinks images by
    `SPATIAL_FACTOR`, a flow-matching UniPC scheduler, the tokenizer) saved by diffusers in
    `directory`. `native_flow_schedule` is the pipeline's ``use_native_flow_schedule``;
    `transformer_options` are config fields over the tiny ones (``hidden_act="relu2"``: the
    Nemotron variant)."""
    from diffusers import (
        AutoencoderKLWan,
        Cosmos3OmniPipeline,
        Cosmos3OmniTransformer,
        UniPCMultistepScheduler,
    )

    torch.manual_seed(seed)
    transformer = Cosmos3OmniTransformer(**{
        "head_dim": 16, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
        "num_hidden_layers": num_layers, "num_key_value_heads": 1,
        "latent_channel": LATENT_CHANNELS, "latent_patch_size": 2,
        "patch_latent_dim": 4 * LATENT_CHANNELS, "vocab_size": 384, "rope_axes_dim": [4, 2, 2],
        "dtype": "float32", **transformer_options})
    vae = AutoencoderKLWan(
        base_dim=8, z_dim=LATENT_CHANNELS, dim_mult=[1, 2, 2], num_res_blocks=1,
        temperal_downsample=[False, False], latents_mean=[0.1, -0.2, 0.3, 0.0],
        latents_std=[1.5, 0.8, 1.2, 2.0], scale_factor_spatial=SPATIAL_FACTOR)
    # drawn so that the prompts move a pixel by ~0.1 on average and few pixels are clipped
    redraw(transformer, std=0.3)
    redraw(vae, std=0.1)
    with torch.no_grad():  # Wan's norms scale by `gamma`, which `redraw` draws around 0
        for name, param in vae.named_parameters():
            if name.endswith("gamma"):
                param.add_(1.0)
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        flow_shift=3.0)
    pipeline = Cosmos3OmniPipeline(transformer=transformer, text_tokenizer=cosmos3_tokenizer(),
                                   vae=vae, scheduler=scheduler, enable_safety_checker=False,
                                   use_native_flow_schedule=native_flow_schedule)
    pipeline.save_pretrained(directory)
    return directory
