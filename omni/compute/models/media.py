"""A checkpoint's own media encoders, where it has them (Qwen3-Omni)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from omni.compute.models._safetensors import read_json
from omni.compute.models.config import is_qwen3_omni
from omni.compute.models.qwen3_omni import Qwen3OmniMedia

__all__ = ["load_media"]


def load_media(path: str | Path, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu") -> Any:
    """The media encoders of a checkpoint directory that has its own (Qwen3-Omni: a
    `Qwen3OmniMedia`), else None (the engine's built-in ones serve)."""
    root = Path(path)
    if not is_qwen3_omni(read_json(root / "config.json")):
        return None
    return Qwen3OmniMedia(root, dtype, device)
