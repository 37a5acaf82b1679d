"""Decoder language models (Llama, Qwen2, Qwen3) keeping their KV cache outside, in `omni.kv` pages.

`DecoderLM.forward` takes embeddings, explicit positions, the past KV and an optional mask, and
returns the new tokens' KV; `load_pretrained` reads HF safetensors checkpoints; `tiny_model` makes
a small random model for tests and demos. On the CPU, float32 linears run through oneDNN or MKL,
whichever is the faster for the CPU's vendor (`prefer_onednn` overrides the choice).
"""

from omni.compute.models._linear import onednn_by_default, prefer_onednn
from omni.compute.models.config import SUPPORTED_ARCHITECTURES, DecoderConfig, RopeScaling
from omni.compute.models.llama import DecoderLM, KVList
from omni.compute.models.loader import load_pretrained, save_pretrained, tiny_config, tiny_model

__all__ = [
    "SUPPORTED_ARCHITECTURES", "DecoderConfig", "DecoderLM", "KVList", "RopeScaling",
    "load_pretrained", "onednn_by_default", "prefer_onednn", "save_pretrained", "tiny_config",
    "tiny_model",
]
