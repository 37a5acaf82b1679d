"""Load and save HF safetensors checkpoints; tiny random models for tests and demos.

Only safetensors are read (`safe_open`): a checkpoint never runs code or unpickles anything.
A checkpoint is checked completely against its config.json (missing, unexpected and misshapen
tensors) before any weight is read, so a bad one fails with one ValueError that names the problem.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from omni.compute.models._checkpoint import IGNORED, fuse, hf_shapes, split
from omni.compute.models.config import DecoderConfig
from omni.compute.models.llama import DecoderLM, rope_inv_freq

__all__ = ["load_pretrained", "save_pretrained", "tiny_config", "tiny_model"]

_SINGLE = "model.safetensors"
_INDEX = "model.safetensors.index.json"
_MAX_NAMED = 5  # names listed per kind of problem in an error message


def load_pretrained(path: str | Path, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu") -> tuple[DecoderLM, DecoderConfig]:
    """The model and config of a HF checkpoint directory (Llama, Qwen2 or Qwen3; safetensors
    only).

    Reads `config.json`, then `model.safetensors` or the shards listed by
    `model.safetensors.index.json`. The model is in eval mode, without gradients, in `dtype` on
    `device` (tensors are read straight onto the device).

    Raises:
        FileNotFoundError: no such directory, no config.json, or no safetensors weights.
        ValueError: unreadable config.json, an unsupported architecture or option, or weights that
            do not match the config (missing, unexpected or misshapen tensors, listed by name).
    """
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"no such directory: {root}")
    config = DecoderConfig.from_hf(_read_json(root / "config.json"))
    files = _weight_files(root)
    _check_tensors(root, config, files)
    tensors = _read_tensors(files, dtype, torch.device(device))
    return _build(config, tensors, torch.device(device)), config


def save_pretrained(model: DecoderLM, config: DecoderConfig, path: str | Path) -> None:
    """Write `config.json` and `model.safetensors` in HF format (transformers loads them)."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    dtype = str(model.embed_tokens.weight.dtype).removeprefix("torch.")
    (root / "config.json").write_text(json.dumps({**config.to_hf(), "dtype": dtype}, indent=2))
    save_file(split(config, model.state_dict()), str(root / _SINGLE), metadata={"format": "pt"})


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


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        raise FileNotFoundError(f"no config.json in {file.parent}")
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {file}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file} is not a JSON object")
    return data


def _weight_files(root: Path) -> dict[Path, list[str]]:
    """Each safetensors file of the checkpoint -> the tensor names it holds."""
    if (root / _SINGLE).is_file():
        file = root / _SINGLE
        with _open(file, "cpu") as f:
            return {file: list(f.keys())}
    if not (root / _INDEX).is_file():
        raise FileNotFoundError(f"no {_SINGLE} or {_INDEX} in {root}; "
                                "only safetensors checkpoints are loaded")
    weight_map = _read_json(root / _INDEX).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{root / _INDEX} has no 'weight_map'")
    files: dict[Path, list[str]] = defaultdict(list)
    for name, file_name in weight_map.items():
        file = root / str(file_name)
        if Path(str(file_name)).name != str(file_name) or not file.is_file():
            raise FileNotFoundError(f"{_INDEX} names shard {file_name!r}, not found in {root}")
        files[file].append(name)
    return dict(files)


def _open(file: Path, device: str):  # type: ignore[no-untyped-def]
    try:
        return safe_open(str(file), framework="pt", device=device)
    except Exception as exc:  # safetensors raises its own SafetensorError for corrupt files
        raise ValueError(f"cannot read {file}: {exc}") from None


def _check_tensors(root: Path, config: DecoderConfig, files: dict[Path, list[str]]) -> None:
    """ValueError naming missing, unexpected and misshapen tensors; reads headers only."""
    expected = hf_shapes(config)
    found: dict[str, tuple[int, ...]] = {}
    for file, names in files.items():
        with _open(file, "cpu") as f:
            present = set(f.keys())
            for name in names:
                if name in present:
                    found[name] = tuple(f.get_slice(name).get_shape())
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


def _some(items: list[str]) -> str:
    listed = ", ".join(items[:_MAX_NAMED])
    more = len(items) - _MAX_NAMED
    return listed + (f" and {more} more" if more > 0 else "")


def _read_tensors(files: dict[Path, list[str]], dtype: torch.dtype,
                  device: torch.device) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file, names in files.items():
        with _open(file, str(device)) as f:
            for name in names:
                if not IGNORED.fullmatch(name):
                    tensors[name] = f.get_tensor(name).to(dtype)
    return tensors


def _build(config: DecoderConfig, tensors: dict[str, torch.Tensor],
           device: torch.device) -> DecoderLM:
    """The model with `tensors` as its parameters (no random init: built on the meta device)."""
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
