"""Cosmos3's understanding expert as a `DecoderLM`: its config and its weights, by name.

A Cosmos3 transformer (diffusers' ``Cosmos3OmniTransformer``) is two experts over one joint
sequence. The understanding expert, which reads the prompt's tokens with causal attention, is
a decoder of Qwen3 layers: an embedding, per layer an RMSNorm, q/k/v/o projections with
GQA, RMS-normed q and k heads (``qk_norm_for_text``; the Nemotron variant has none), an
RMSNorm and a SwiGLU MLP (the Nemotron variant: ``hidden_act="relu2"``, an ungated MLP),
rotated by interleaved M-RoPE (``rope_axes_dim``, transformers' Qwen3-VL layout:
`DecoderConfig.mrope_section`), then a final norm and a text head. Where they differ:

- the Nemotron variant's norms (``Cosmos3NemotronRMSNorm``) multiply by their weight in
  float32 and round once, where `RMSNorm` rounds to the input's dtype first: the same in
  float32, one rounding apart in bfloat16;
- ``use_und_k_norm_for_gen``: the generation expert reads the understanding keys through one
  more RMSNorm (``k_norm_und_for_gen``), which the understanding attention does not use.
  The decoder's KV is what its attention reads; that norm is the reader's to apply
  (`omni.compute.cosmos3`).

Here the diffusers module's tensors are renamed to transformers' names and built into a
`DecoderLM` (`build_decoder`); the generation expert's tensors stay where they are.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from torch import nn

from omni.compute.models.config import DecoderConfig
from omni.compute.models.llama import DecoderLM
from omni.compute.models.loader import build_decoder

__all__ = ["MAX_PROMPT_TOKENS", "understanding_config", "understanding_decoder"]

# RoPE puts no bound on a prompt's length; the engine refuses prompts longer than this
MAX_PROMPT_TOKENS = 1 << 18

# a diffusers name of the understanding expert (a regex on what follows "layers.N.") ->
# transformers' name of the same tensor
_LAYER_NAMES = {"input_layernorm": "input_layernorm",
                "post_attention_layernorm": "post_attention_layernorm",
                "self_attn.to_q": "self_attn.q_proj", "self_attn.to_k": "self_attn.k_proj",
                "self_attn.to_v": "self_attn.v_proj", "self_attn.to_out": "self_attn.o_proj",
                "self_attn.norm_q": "self_attn.q_norm", "self_attn.norm_k": "self_attn.k_norm",
                "mlp.gate_proj": "mlp.gate_proj", "mlp.up_proj": "mlp.up_proj",
                "mlp.down_proj": "mlp.down_proj"}
_TOP_NAMES = {"embed_tokens.weight": "model.embed_tokens.weight",
              "norm.weight": "model.norm.weight", "lm_head.weight": "lm_head.weight"}
_LAYER = re.compile(r"layers\.(\d+)\.(.+)\.(weight|bias)")


def understanding_config(transformer_config: Mapping[str, Any]) -> DecoderConfig:
    """The `DecoderConfig` of the understanding expert of a transformer of (diffusers')
    config `transformer_config`: qwen3 with q/k norms, llama (the same layer without them)
    when ``qk_norm_for_text`` is off."""
    hf = transformer_config
    return DecoderConfig(
        architecture="qwen3" if hf.get("qk_norm_for_text", True) else "llama",
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"], num_kv_heads=hf["num_key_value_heads"],
        head_dim=hf["head_dim"], rope_theta=float(hf["rope_theta"]),
        rms_norm_eps=float(hf["rms_norm_eps"]), max_position_embeddings=MAX_PROMPT_TOKENS,
        attention_bias=bool(hf["attention_bias"]),
        mrope_section=tuple(hf["rope_axes_dim"]),  # type: ignore[arg-type]
        hidden_act=hf.get("hidden_act", "silu"))


def understanding_decoder(transformer: nn.Module) -> tuple[DecoderLM, DecoderConfig]:
    """The understanding expert of a diffusers ``Cosmos3OmniTransformer`` as a `DecoderLM`
    (and its config), on the transformer's device in its dtype, holding the one copy of its
    weights: tensors the decoder keeps as they are it shares with the transformer, and the
    transformer's q/k/v and gate/up projections become views of the decoder's fused ones
    (its own modules compute as before, from the same memory).

    Raises:
        RuntimeError: a transformer whose tensors are not its config's.
    """
    config = understanding_config(transformer.config)  # type: ignore[arg-type]
    theirs = transformer.state_dict()
    tensors = {_transformers_name(name): tensor for name, tensor in theirs.items()
               if _transformers_name(name) is not None}
    device = next(transformer.parameters()).device
    model = build_decoder(config, tensors, device)  # type: ignore[arg-type]
    _view_fused(transformer, model, config)
    return model, config


def _transformers_name(name: str) -> str | None:
    """transformers' name of the understanding expert's tensor `name` (diffusers'), None for
    the generation expert's and the rest of the transformer's."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    match = _LAYER.fullmatch(name)
    if match is None or match[2] not in _LAYER_NAMES:
        return None
    return f"model.layers.{match[1]}.{_LAYER_NAMES[match[2]]}.{match[3]}"


def _view_fused(transformer: nn.Module, model: DecoderLM, config: DecoderConfig) -> None:
    """Point the transformer's q/k/v (and gate/up) weights and biases at row ranges of the
    decoder's fused projections, so that their own copies can go."""
    head_dim = int(config.head_dim or 0)
    qkv_rows = [config.num_heads * head_dim, *[config.num_kv_heads * head_dim] * 2]
    for theirs, ours in zip(transformer.layers, model.layers, strict=True):  # type: ignore[arg-type]
        attn = theirs.self_attn
        _view(ours.attn.qkv_proj, [attn.to_q, attn.to_k, attn.to_v], qkv_rows)
        if config.hidden_act == "silu":
            mlp = theirs.mlp
            _view(ours.mlp.gate_up_proj, [mlp.gate_proj, mlp.up_proj],
                  [config.intermediate_size] * 2)


def _view(fused: nn.Module, parts: list[nn.Module], rows: list[int]) -> None:
    for kind in ("weight", "bias"):
        whole = getattr(fused, kind)
        if whole is None:
            continue
        for part, view in zip(parts, whole.split(rows), strict=True):
            setattr(part, kind, nn.Parameter(view, requires_grad=False))

