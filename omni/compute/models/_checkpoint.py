"""How HF checkpoint tensor names map onto `DecoderLM` parameters (both directions).

Why a table: the loader must check a checkpoint completely (missing, unexpected, wrong shape)
before reading any bytes, and the saver must write exactly what transformers expects. Both use
`hf_shapes`, and `fuse` / `split` are each other's inverse.

A mixture-of-experts layer is stored one tensor per expert and projection
(`mlp.experts.N.gate_proj.weight`), as transformers saves it; the model holds each projection
of all experts in one tensor (`mlp.gate_up_proj` [X, 2I, E], `mlp.down_proj` [X, E, I]).
"""

from __future__ import annotations

import re

import torch
from torch import Tensor

from omni.compute.models.config import DecoderConfig

__all__ = ["IGNORED", "fuse", "hf_shapes", "split"]

# Tensors some checkpoints carry that the model recomputes (old Llama RoPE buffers).
IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")

# Our fused parameter -> the HF tensors concatenated along dim 0, in order.
_FUSED = {"attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
# (an ungated MLP, ``hidden_act="relu2"``, has no gate_proj: its up_proj keeps its name)
_RENAMED = {"attn.o_proj": "self_attn.o_proj", "mlp.down_proj": "mlp.down_proj",
            "mlp.up_proj": "mlp.up_proj",
            "attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
            "attn.q_norm": "self_attn.q_norm", "attn.k_norm": "self_attn.k_norm"}


def hf_shapes(config: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a HF checkpoint of this config holds, with its shape (lm_head only untied)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_rows = config.num_heads * int(config.head_dim or 0)
    kv_rows = config.num_kv_heads * int(config.head_dim or 0)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, hidden),
                                          "model.norm.weight": (hidden,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    per_layer = {"self_attn.q_proj": ((q_rows, hidden), config.attention_bias),
                 "self_attn.k_proj": ((kv_rows, hidden), config.attention_bias),
                 "self_attn.v_proj": ((kv_rows, hidden), config.attention_bias),
                 "self_attn.o_proj": ((hidden, q_rows), config.o_proj_bias),
                 "mlp.gate_proj": ((inter, hidden), config.mlp_bias),
                 "mlp.up_proj": ((inter, hidden), config.mlp_bias),
                 "mlp.down_proj": ((hidden, inter), config.mlp_bias)}
    if config.hidden_act == "relu2":
        del per_layer["mlp.gate_proj"]
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}."
        for name, (shape, has_bias) in per_layer.items():
            if name.startswith("mlp.") and config.is_sparse_layer(i):
                continue
            shapes[f"{prefix}{name}.weight"] = shape
            if has_bias:
                shapes[f"{prefix}{name}.bias"] = shape[:1]
        if config.is_sparse_layer(i):
            shapes.update(_expert_shapes(config, prefix))
        shapes[prefix + "input_layernorm.weight"] = (hidden,)
        shapes[prefix + "post_attention_layernorm.weight"] = (hidden,)
        if config.qk_norm:
            shapes[prefix + "self_attn.q_norm.weight"] = (int(config.head_dim or 0),)
            shapes[prefix + "self_attn.k_norm.weight"] = (int(config.head_dim or 0),)
    return shapes


def _expert_shapes(config: DecoderConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    hidden, inter = config.hidden_size, config.moe_intermediate_size
    shapes: dict[str, tuple[int, ...]] = {f"{prefix}mlp.gate.weight": (config.num_experts,
                                                                        hidden)}
    for e in range(config.num_experts):
        expert = f"{prefix}mlp.experts.{e}."
        shapes[expert + "gate_proj.weight"] = (inter, hidden)
        shapes[expert + "up_proj.weight"] = (inter, hidden)
        shapes[expert + "down_proj.weight"] = (hidden, inter)
    shared = config.shared_expert_intermediate_size
    if shared:
        shapes[f"{prefix}mlp.shared_expert.gate_proj.weight"] = (shared, hidden)
        shapes[f"{prefix}mlp.shared_expert.up_proj.weight"] = (shared, hidden)
        shapes[f"{prefix}mlp.shared_expert.down_proj.weight"] = (hidden, shared)
        shapes[f"{prefix}mlp.shared_expert_gate.weight"] = (1, hidden)
    return shapes


def _fuse_experts(config: DecoderConfig, hf: dict[str, Tensor], src: str, dst: str,
                  state: dict[str, Tensor]) -> None:
    state[f"{dst}mlp.gate.weight"] = hf.pop(f"{src}mlp.gate.weight")
    experts = [f"{src}mlp.experts.{e}." for e in range(config.num_experts)]
    state[f"{dst}mlp.gate_up_proj"] = torch.stack([torch.cat(
        [hf.pop(e + "gate_proj.weight"), hf.pop(e + "up_proj.weight")]) for e in experts])
    state[f"{dst}mlp.down_proj"] = torch.stack([hf.pop(e + "down_proj.weight")
                                                for e in experts])
    if config.shared_expert_intermediate_size:
        shared = f"{src}mlp.shared_expert."
        state[f"{dst}mlp.shared_expert.gate_up_proj.weight"] = torch.cat(
            [hf.pop(shared + "gate_proj.weight"), hf.pop(shared + "up_proj.weight")])
        state[f"{dst}mlp.shared_expert.down_proj.weight"] = hf.pop(shared + "down_proj.weight")
        state[f"{dst}mlp.shared_expert_gate.weight"] = hf.pop(f"{src}mlp.shared_expert_gate.weight")


def _split_experts(config: DecoderConfig, state: dict[str, Tensor], src: str, dst: str,
                   hf: dict[str, Tensor]) -> None:
    hf[f"{dst}mlp.gate.weight"] = state[f"{src}mlp.gate.weight"]
    inter = config.moe_intermediate_size
    for e in range(config.num_experts):
        gate, up = state[f"{src}mlp.gate_up_proj"][e].split([inter, inter])
        expert = f"{dst}mlp.experts.{e}."
        hf.update({expert + "gate_proj.weight": gate, expert + "up_proj.weight": up,
                   expert + "down_proj.weight": state[f"{src}mlp.down_proj"][e]})
    shared = config.shared_expert_intermediate_size
    if shared:
        gate, up = state[f"{src}mlp.shared_expert.gate_up_proj.weight"].split([shared, shared])
        hf.update({f"{dst}mlp.shared_expert.gate_proj.weight": gate,
                   f"{dst}mlp.shared_expert.up_proj.weight": up,
                   f"{dst}mlp.shared_expert.down_proj.weight":
                       state[f"{src}mlp.shared_expert.down_proj.weight"],
                   f"{dst}mlp.shared_expert_gate.weight":
                       state[f"{src}mlp.shared_expert_gate.weight"]})


def fuse(config: DecoderConfig, hf: dict[str, Tensor]) -> dict[str, Tensor]:
    """HF tensors (all of `hf_shapes`) -> a `DecoderLM` state dict (without tied lm_head).

    Consumes `hf` (each tensor is dropped as soon as it is used, to keep peak memory low).
    """
    state = {"embed_tokens.weight": hf.pop("model.embed_tokens.weight"),
             "norm.weight": hf.pop("model.norm.weight")}
    if not config.tie_word_embeddings:
        state["lm_head.weight"] = hf.pop("lm_head.weight")
    for i in range(config.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        if config.is_sparse_layer(i):
            _fuse_experts(config, hf, src, dst, state)
        for ours, parts in _FUSED.items():
            for kind in ("weight", "bias"):
                if f"{src}{parts[0]}.{kind}" in hf:
                    state[f"{dst}{ours}.{kind}"] = torch.cat(
                        [hf.pop(f"{src}{part}.{kind}") for part in parts])
        for ours, theirs in _RENAMED.items():
            for kind in ("weight", "bias"):
                if f"{src}{theirs}.{kind}" in hf:
                    state[f"{dst}{ours}.{kind}"] = hf.pop(f"{src}{theirs}.{kind}")
    return state


def split(config: DecoderConfig, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """A `DecoderLM` state dict -> HF tensors named as in `hf_shapes` (fresh, unshared memory)."""
    shapes = hf_shapes(config)
    hf = {"model.embed_tokens.weight": state["embed_tokens.weight"],
          "model.norm.weight": state["norm.weight"]}
    if not config.tie_word_embeddings:
        hf["lm_head.weight"] = state["lm_head.weight"]
    for i in range(config.num_layers):
        src, dst = f"layers.{i}.", f"model.layers.{i}."
        if config.is_sparse_layer(i):
            _split_experts(config, state, src, dst, hf)
        for ours, parts in _FUSED.items():
            for kind in ("weight", "bias"):
                if f"{src}{ours}.{kind}" not in state:
                    continue
                sizes = [shapes[f"{dst}{part}.weight"][0] for part in parts]
                chunks = state[f"{src}{ours}.{kind}"].split(sizes)
                hf.update({f"{dst}{part}.{kind}": t for part, t in zip(parts, chunks, strict=True)})
        for ours, theirs in _RENAMED.items():
            for kind in ("weight", "bias"):
                if f"{src}{ours}.{kind}" in state:
                    hf[f"{dst}{theirs}.{kind}"] = state[f"{src}{ours}.{kind}"]
    return {name: t.detach().to("cpu").clone().contiguous() for name, t in hf.items()}
