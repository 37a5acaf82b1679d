"""Load and save HF safetensors checkpoints; tiny random models for tests and demos.

Only safetensors are read (`safe_open`): a checkpoint never runs code or unpickles anything.
A checkpoint is checked completely against its config.json (missing, unexpected and misshapen
tensors) before any weight is read, so a bad one fails with one ValueError that names the problem.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from omni.compute.models._checkpoint import IGNORED, fuse, hf_shapes, split
from omni.compute.models._safetensors import (
    SINGLE,
    open_file,
    read_json,
    read_named,
    under,
    weight_files,
)
from omni.compute.models.config import DecoderConfig, weights_prefix
from omni.compute.models.llama import DecoderLM, rope_inv_freq

__all__ = ["build_decoder", "load_decoder", "load_pretrained", "save_pretrained",
           "tiny_config", "tiny_model"]

_MAX_NAMED = 5  # names listed per kind of problem in an error message


def load_pretrained(path: str | Path, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu", *, layers: int | None = None
                    ) -> tuple[DecoderLM, DecoderConfig]:
    """The model and config of a HF checkpoint directory (Llama, Qwen2, Qwen3, Qwen3-MoE, or
    the thinker's text decoder of a Qwen3-Omni checkpoint; safetensors only).

    Reads `config.json`, then `model.safetensors` or the shards listed by
    `model.safetensors.index.json`. The model is in eval mode, without gradients, in `dtype` on
    `device` (tensors are read straight onto the device). `layers`: only the first that many
    decoder layers are built and read (a negative number: all but that many last ones), for a
    model whose output is read at an inner layer; the config says so (its `num_layers`).

    Raises:
        FileNotFoundError: no such directory, no config.json, or no safetensors weights.
        ValueError: unreadable config.json, an unsupported architecture or option, weights that
            do not match the config (missing, unexpected or misshapen tensors, listed by name),
            `layers` keeping none of the checkpoint's layers or more than it has.
    """
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"no such directory: {root}")
    hf = read_json(root / "config.json")
    config = DecoderConfig.from_hf(hf)
    model = load_decoder(root, config, weights_prefix(hf), dtype=dtype, device=device,
                         layers=layers)
    return model, model.config


def load_decoder(path: str | Path, config: DecoderConfig, prefix: str = "",
                 parts: tuple[str, ...] = ("model.", "lm_head."),
                 renamed: Mapping[str, str] | None = None, *,
                 dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", layers: int | None = None) -> DecoderLM:
    """A `DecoderLM` of `config` from the tensors of a checkpoint directory under `prefix` +
    one of `parts` (a decoder inside a larger model: Qwen3-Omni's talker under "talker.").
    `renamed` maps a transformers decoder's tensor names to the names this one stores them
    under (the talker's "model.codec_embedding.weight" for "model.embed_tokens.weight").
    `layers`: as `load_pretrained`'s (the checkpoint is checked whole all the same).

    Raises: as `load_pretrained`.
    """
    root = Path(path)
    stored = {name: standard for standard, name in (renamed or {}).items()}
    files = under(weight_files(root), prefix, parts)
    _check_tensors(root, config, files, prefix, stored)
    if layers is not None:
        config, files = _first_layers(config, files, layers)
    tensors = read_named(files, dtype, torch.device(device), prefix)
    return build_decoder(config, {stored.get(n, n): t for n, t in tensors.items()},
                         torch.device(device))


def save_pretrained(model: DecoderLM, config: DecoderConfig, path: str | Path) -> None:
    """Write `config.json` and `model.safetensors` in HF format (transformers loads them)."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    dtype = str(model.embed_tokens.weight.dtype).removeprefix("torch.")
    (root / "config.json").write_text(json.dumps({**config.to_hf(), "dtype": dtype}, indent=2))
    save_file(split(config, model.state_dict()), str(root / SINGLE), metadata={"format": "pt"})


def tiny_config(**overrides: Any) -> DecoderConfig:
    """A small config (vocab 512, hidden 64, 2 layers, 4 heads, 2 KV heads, 4096 positions).

    Any `DecoderConfig` field can be overridden; qwen2 gets its q/k/v biases by default.
    """
    known = {f.name for f in fields(DecoderConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown DecoderConfig fields: {', '.join(unknown)}")
    values: dict[str, Any] = dict(
        architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, max_position_embeddings=4096, bos_token_id=1,
        eos_token_ids=(2,))
    values.update(overrides)
    values.setdefault("attention_bias", values["architecture"] == "qwen2")
    return DecoderConfig(**values)


def tiny_model(seed: int = 0, **overrides: Any) -> tuple[DecoderLM, DecoderConfig]:
    """A random `tiny_config(**overrides)` model, float32 on the CPU, the same for the same seed.

    Initialised like transformers: weights normal(0, 0.02), biases zero, norm weights one.
    """
    config = tiny_config(**overrides)
    generator = torch.Generator().manual_seed(seed)
    model = DecoderLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():  # the tied lm_head is listed once
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.normal_(0.0, 0.02, generator=generator)
    return model.eval().requires_grad_(False), config


def _check_tensors(root: Path, config: DecoderConfig, files: dict[Path, list[str]],
                   prefix: str, stored: Mapping[str, str]) -> None:
    """ValueError naming missing, unexpected and misshapen tensors; reads headers only."""
    expected = hf_shapes(config)
    found: dict[str, tuple[int, ...]] = {}
    for file, names in files.items():
        with open_file(file, "cpu") as f:
            present = set(f.keys())
            for name in names:
                if prefix + name in present:
                    found[stored.get(name, name)] = tuple(f.get_slice(prefix + name).get_shape())
    tied_head = config.tie_word_embeddings and "lm_head.weight" in found
    missing = [n for n in expected if n not in found]
    unexpected = [n for n in found if n not in expected and not IGNORED.fullmatch(n)
                  and not (tied_head and n == "lm_head.weight")]
    misshapen = [f"{n} {list(found[n])} (config.json says {list(expected[n])})"
                 for n in expected if n in found and found[n] != expected[n]]
    if tied_head and found["lm_head.weight"] != expected["model.embed_tokens.weight"]:
        misshapen.append(f"lm_head.weight {list(found['lm_head.weight'])}")
    problems = [f"{kind}: {_some(items)}" for kind, items in
                (("missing", missing), ("unexpected", unexpected), ("wrong shape", misshapen))
                if items]
    if problems:
        raise ValueError(f"weights in {root} do not match config.json ({config.architecture}, "
                         f"{config.num_layers} layers): " + "; ".join(problems))


def _first_layers(config: DecoderConfig, files: dict[Path, list[str]], layers: int
                  ) -> tuple[DecoderConfig, dict[Path, list[str]]]:
    """The config of the first `layers` layers (negative: all but that many last ones) and
    the tensor names of `files` that model reads (no later layer's)."""
    keep = layers if layers >= 0 else config.num_layers + layers
    if not 1 <= keep <= config.num_layers:
        raise ValueError(f"layers={layers} keeps {keep} of the checkpoint's "
                         f"{config.num_layers} decoder layers (1 to {config.num_layers} can)")
    later = re.compile(r"(?:.*\.)?layers\.(\d+)\.")

    def read(name: str) -> bool:
        match = later.match(name)
        return match is None or int(match[1]) < keep

    return (replace(config, num_layers=keep),
            {file: [name for name in names if read(name)] for file, names in files.items()})


def _some(items: list[str]) -> str:
    listed = ", ".join(items[:_MAX_NAMED])
    more = len(items) - _MAX_NAMED
    return listed + (f" and {more} more" if more > 0 else "")


def build_decoder(config: DecoderConfig, tensors: dict[str, torch.Tensor],
                  device: torch.device) -> DecoderLM:
    """The model of `config` with `tensors` (transformers' names, all of `hf_shapes`, on
    `device`) as its parameters: no random init (built on the meta device), no copy but
    the fused projections'. Consumes `tensors`.

    Raises:
        RuntimeError: tensors missing, unexpected or misshapen (`load_state_dict`).
    """
    state = fuse(config, tensors)
    if config.tie_word_embeddings:  # a tied checkpoint may still carry lm_head.weight: unused
        state["lm_head.weight"] = state["embed_tokens.weight"]
    with torch.device("meta"):
        model = DecoderLM(config)
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary.inv_freq = rope_inv_freq(config, device)
    return model.eval().requires_grad_(False)
