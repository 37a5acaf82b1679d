"""Decoder language models (Llama, Qwen2, Qwen3, Qwen3-MoE, Qwen3-Omni's thinker) keeping their
KV cache outside, in `omni.kv` pages.

`DecoderLM.forward` takes embeddings, explicit positions, the past KV and an optional mask, and
returns the new tokens' KV; `load_pretrained` reads HF safetensors checkpoints; `tiny_model` makes
a small random model for tests and demos. On the CPU, float32 linears run on MKL with packed
weights or on oneDNN, whichever is the faster for the CPU's vendor (`set_cpu_linear_backend`
overrides the choice).
"""

from omni.compute.models._linear import (
    cpu_linear_backend,
    default_cpu_linear_backend,
    set_cpu_linear_backend,
)
from omni.compute.models.config import SUPPORTED_ARCHITECTURES, DecoderConfig, RopeScaling
from omni.compute.models.llama import DecoderLM, KVList
from omni.compute.models.loader import (
    load_pretrained,
    save_pretrained,
    tiny_config,
    tiny_model,
)
from omni.compute.models.media import load_media

__all__ = [
    "SUPPORTED_ARCHITECTURES", "DecoderConfig", "DecoderLM", "KVList", "RopeScaling",
    "cpu_linear_backend", "default_cpu_linear_backend", "load_media", "load_pretrained",
    "save_pretrained", "set_cpu_linear_backend", "tiny_config", "tiny_model",
]
