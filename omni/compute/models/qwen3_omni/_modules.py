"""transformers' own modules of a Qwen3-Omni checkpoint (towers, projections, code2wav),
built from their config and given the checkpoint's tensors."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from omni.compute.models._safetensors import read_tensors

__all__ = ["load_config", "load_module"]


def load_config(root: Path) -> Any:
    """transformers' `Qwen3OmniMoeConfig` of a checkpoint directory, read without its
    warning that M-RoPE's keys (`mrope_section`, `interleaved`) are not those of a default
    RoPE: its own rotary embeddings read them."""
    from transformers import Qwen3OmniMoeConfig

    rope_log = logging.getLogger("transformers.modeling_rope_utils")
    level = rope_log.level
    rope_log.setLevel(logging.ERROR)
    try:
        return Qwen3OmniMoeConfig.from_pretrained(root)
    finally:
        rope_log.setLevel(level)


def load_module(cls: Any, config: Any, root: Path, prefix: str, dtype: torch.dtype,
                device: torch.device) -> Any:
    """transformers' module `cls(config)` with the checkpoint's tensors under `prefix`
    (a `PreTrainedModel` built without initialising weights it is about to be given)."""
    from transformers.initialization import no_init_weights

    with no_init_weights():
        module = getattr(cls, "_from_config", cls)(config)
    state = read_tensors(root, prefix, dtype, device)
    try:
        module.load_state_dict(state)  # strict: missing, unexpected and misshapen named
    except RuntimeError as exc:
        why = " ".join(str(exc).split())  # torch's message, on one line
        raise ValueError(f"{prefix.rstrip('.')} weights in {root} do not match config.json: "
                         f"{why}") from None
    return module.to(device=device, dtype=dtype).eval().requires_grad_(False)
