"""Image-family folders built in tests, in diffusers' hub layout (``model_index.json`` and a
folder per component, as ``save_pretrained`` writes them): tiny random weights, every
parameter drawn again (diffusers zero-initialises parts of its DiTs, and a random DiT that
starts from zeros ignores its prompt), the tokenizer trained here."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from tests.compute.checkpoint_builders import trained_tokenizer_json

# Qwen3's chat template as far as Z-Image uses it: a conversation in ChatML, and with
# enable_thinking=False an empty thought after the generation prompt
QWEN3_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% if enable_thinking is defined and enable_thinking is "
    "false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}")


def redraw(module: torch.nn.Module, std: float = 0.15) -> None:
    """Every parameter drawn anew: norms' weights around 1, the rest around 0."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            is_norm_weight = "norm" in name and name.endswith("weight")
            param.copy_(torch.randn_like(param) * (0.1 if "norm" in name else std)
                        + (1.0 if is_norm_weight else 0.0))


def save_z_image(directory: Path, seed: int = 0, text_layers: int = 3, *,
                 text_hidden: int = 32, dit_dim: int = 32, dit_layers: int = 2) -> Path:
    """A tiny random Z-Image (`ZImagePipeline`: a Qwen3 text encoder of `text_layers`
    layers of width `text_hidden`, its tokenizer, the DiT of `dit_layers` layers of width
    `dit_dim`, a 4-channel VAE, the flow-matching scheduler) saved by diffusers in
    `directory`."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        ZImagePipeline,
        ZImageTransformer2DModel,
    )

    torch.manual_seed(seed)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(trained_tokenizer_json()),
        chat_template=QWEN3_TEMPLATE, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    text_encoder = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=384, hidden_size=text_hidden, intermediate_size=2 * text_hidden,
        num_hidden_layers=text_layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=text_hidden // 2, max_position_embeddings=1024, eos_token_id=2))
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=dit_dim,
        n_layers=dit_layers, n_refiner_layers=1, n_heads=2, n_kv_heads=2,
        cap_feat_dim=text_hidden, axes_dims=[dit_dim // 4, dit_dim // 8, dit_dim // 8],
        axes_lens=[1024, 32, 32])
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16),
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        layers_per_block=1, norm_num_groups=4, sample_size=32, shift_factor=0.1,
        scaling_factor=0.5)
    for module in (text_encoder, transformer, vae):
        redraw(module)
    pipeline = ZImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae,
                              text_encoder=text_encoder, tokenizer=tokenizer,
                              transformer=transformer)
    pipeline.save_pretrained(directory)
    return directory
