"""Reading safetensors checkpoints: which file holds which tensor, headers, and tensors.

Only safetensors are read (`safe_open`): a checkpoint never runs code or unpickles anything.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from omni.compute.models._checkpoint import IGNORED

__all__ = ["SINGLE", "open_file", "read_json", "read_named", "read_tensors", "under",
           "weight_files"]

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        raise FileNotFoundError(f"no config.json in {file.parent}")
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {file}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file} is not a JSON object")
    return data


def read_tensors(path: str | Path, prefix: str, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory whose name starts with `prefix`, by its name
    without the prefix (a part of a larger model: Qwen3-Omni's vision tower, say)."""
    files = under(weight_files(Path(path)), prefix, ("",))
    return read_named(files, dtype, torch.device(device), prefix)


def weight_files(root: Path) -> dict[Path, list[str]]:
    """Each safetensors file of the checkpoint -> the tensor names it holds."""
    if (root / SINGLE).is_file():
        file = root / SINGLE
        with open_file(file, "cpu") as f:
            return {file: list(f.keys())}
    if not (root / INDEX).is_file():
        raise FileNotFoundError(f"no {SINGLE} or {INDEX} in {root}; "
                                "only safetensors checkpoints are loaded")
    weight_map = read_json(root / INDEX).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{root / INDEX} has no 'weight_map'")
    files: dict[Path, list[str]] = defaultdict(list)
    for name, file_name in weight_map.items():
        file = root / str(file_name)
        if Path(str(file_name)).name != str(file_name) or not file.is_file():
            raise FileNotFoundError(f"{INDEX} names shard {file_name!r}, not found in {root}")
        files[file].append(name)
    return dict(files)


def under(files: dict[Path, list[str]], prefix: str,
           parts: tuple[str, ...]) -> dict[Path, list[str]]:
    """The names under `prefix` + one of `parts`, without `prefix` (all names when there is
    no prefix: a checkpoint of the decoder alone)."""
    if not prefix:
        return files
    starts = tuple(prefix + part for part in parts)
    return {file: [n[len(prefix):] for n in names if n.startswith(starts)]
            for file, names in files.items()}


def open_file(file: Path, device: str):  # type: ignore[no-untyped-def]
    try:
        return safe_open(str(file), framework="pt", device=device)
    except Exception as exc:  # safetensors raises its own SafetensorError for corrupt files
        raise ValueError(f"cannot read {file}: {exc}") from None


def read_named(files: dict[Path, list[str]], dtype: torch.dtype, device: torch.device,
                  prefix: str) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file, names in files.items():
        with open_file(file, str(device)) as f:
            for name in names:
                if not IGNORED.fullmatch(name):
                    tensors[name] = f.get_tensor(prefix + name).to(dtype)
    return tensors
