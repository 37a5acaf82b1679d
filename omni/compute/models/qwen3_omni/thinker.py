"""Qwen3-Omni's thinker inputs: images and audio through the checkpoint's own processor parts
and encoders, and the multimodal rotary positions of a prompt.

The thinker's text decoder is a `DecoderLM` (Qwen3-MoE with M-RoPE, `config.mrope_section`);
what surrounds it here is transformers' own code, run as it is: the image processor and the
feature extractor of `preprocessor_config.json`, or of `processor_config.json` where
transformers 5 saves them nested (built one by one: transformers builds the
whole `Qwen3OmniMoeProcessor` only with torchvision installed, for its video processor, which
images and audio do not need), the vision tower (`thinker.visual.*`, with its deepstack
features) and the audio encoder (`thinker.audio_tower.*`). Positions follow transformers'
`get_rope_index`: text advances all three axes by one; an image's positions are its merged
patch grid (temporal, row, column) offset by the position where it starts; audio advances like
text; after an item, text resumes one past the largest position used.

Video is not served (a `Video` segment does not exist yet); neither is audio inside video.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omni.compute.encoders import Encoded
from omni.compute.models.qwen3_omni._modules import load_config, load_module
from omni.compute.prompt import Audio, Image, PromptTokens

__all__ = ["MediaLayout", "Qwen3OmniMedia", "mrope_positions"]

SAMPLE_RATE = 16_000  # the feature extractor's (Whisper's) rate


class Qwen3OmniMedia:
    """The processor parts and encoders of a Qwen3-Omni checkpoint directory, on `device` in
    `dtype` (see the module docstring).

    Raises:
        FileNotFoundError: neither preprocessor_config.json nor a processor_config.json that
            holds the image processor and the feature extractor.
        ValueError: weights of the towers missing or misshapen.
    """

    def __init__(self, root: str | Path, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu"):
        from transformers import (
            Qwen2VLImageProcessorPil,
            WhisperFeatureExtractor,
        )
        from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as hf

        root = Path(root)
        _check_processor_files(root)
        whole = load_config(root)
        config = self.config = whole.thinker_config
        # what the talker reads of the thinker (`omni.compute.talker.thinker_context`): the
        # hidden states after this layer at media positions (kept by the runner's prefill)
        self.tap_layer = int(whole.talker_config.accept_hidden_layer)
        self.tts_token_ids = (int(whole.tts_bos_token_id), int(whole.tts_eos_token_id),
                              int(whole.tts_pad_token_id))
        self.image_processor = Qwen2VLImageProcessorPil.from_pretrained(root)
        self.feature_extractor = WhisperFeatureExtractor.from_pretrained(root)
        self.merge = int(config.vision_config.spatial_merge_size)
        self.n_window = int(config.audio_config.n_window)
        self.dtype, self.device = dtype, torch.device(device)
        self.visual = load_module(hf.Qwen3OmniMoeVisionEncoder, config.vision_config, root,
                                  "thinker.visual.", dtype, self.device)
        self.audio_tower = load_module(hf.Qwen3OmniMoeAudioEncoder, config.audio_config, root,
                                       "thinker.audio_tower.", dtype, self.device)
        self._output_lengths = hf._get_feat_extract_output_lengths

    # -- how a segment is laid out ----------------------------------------------------------

    def placeholder(self, segment: Image | Audio) -> int:
        """The token id at a segment's positions (what transformers' processor writes)."""
        return int(self.config.image_token_id if isinstance(segment, Image)
                   else self.config.audio_token_id)

    def grid(self, image: Image) -> tuple[int, int, int]:
        """An image's patch grid (temporal, rows, columns) before merging, as the image
        processor will resize it (computed from its size alone)."""
        height, width = image.pixels.shape[:2]
        resized_h, resized_w = _smart_resize(self.image_processor, height, width)
        patch = int(self.image_processor.patch_size)
        return 1, resized_h // patch, resized_w // patch

    def num_positions(self, segment: Image | Audio) -> int:
        """How many positions the thinker gives a segment: an image's merged patches, an
        audio clip's encoder frames."""
        if isinstance(segment, Image):
            t, h, w = self.grid(segment)
            return t * h * w // self.merge ** 2
        frames = _check_rate(segment).samples.size // int(self.feature_extractor.hop_length)
        return int(self._output_lengths(torch.tensor(frames), self.n_window))

    # -- encoding ---------------------------------------------------------------------------

    @torch.inference_mode()
    def encode(self, segment: Image | Audio) -> Encoded:
        """A segment's embeddings (and an image's deepstack features) from the towers,
        computed each time: the runner keeps them, per cache salt (`ModelRunner.encode`)."""
        return (self._encode_image(segment) if isinstance(segment, Image)
                else self._encode_audio(segment))

    def _encode_image(self, image: Image) -> Encoded:
        inputs = self.image_processor(images=[np.asarray(image.pixels)], return_tensors="pt")
        out = self.visual(inputs["pixel_values"].to(self.device, self.dtype),
                          grid_thw=inputs["image_grid_thw"].to(self.device))
        deepstack = torch.stack(list(out.deepstack_features)) if out.deepstack_features else None
        return Encoded(out.pooler_output, deepstack)

    def _encode_audio(self, audio: Audio) -> Encoded:
        inputs = self.feature_extractor(
            np.asarray(_check_rate(audio).samples), sampling_rate=SAMPLE_RATE, padding=True,
            truncation=False, return_attention_mask=True, return_tensors="pt")
        mask = inputs["attention_mask"][0].bool()
        features = inputs["input_features"][0][:, mask]  # [mel bins, frames]
        out = self.audio_tower(features.to(self.device, self.dtype),
                               feature_lens=mask.sum()[None].to(self.device))
        return Encoded(out.last_hidden_state)

    # -- positions --------------------------------------------------------------------------

    def layout(self, tokens: PromptTokens) -> tuple[MediaLayout, ...]:
        """Where the prompt's media are, and each image's patch grid."""
        return tuple(MediaLayout(item.start, item.length,
                                 self.grid(item.segment) if isinstance(item.segment, Image)
                                 else None) for item in tokens.media)

    def positions(self, tokens: PromptTokens) -> torch.Tensor:
        """The prompt's M-RoPE positions [3, T] (see `mrope_positions`)."""
        return mrope_positions(len(tokens), self.layout(tokens), self.merge,
                               float(self.config.position_id_per_seconds))


@dataclass(frozen=True)
class MediaLayout:
    """A media item's positions in a prompt, and an image's patch grid (temporal, rows,
    columns, before merging; None for audio)."""

    start: int
    length: int
    grid: tuple[int, int, int] | None = None


def _check_processor_files(root: Path) -> None:
    """Refuse a folder without the processor parts' configs: `preprocessor_config.json` (as
    Qwen's checkpoints ship it) or `processor_config.json` holding ``image_processor`` and
    ``feature_extractor`` (as transformers 5 saves a processor); transformers reads either."""
    if (root / "preprocessor_config.json").is_file():
        return
    nested = root / "processor_config.json"
    try:
        parts = json.loads(nested.read_text()) if nested.is_file() else {}
    except (OSError, ValueError) as exc:
        raise FileNotFoundError(f"cannot read {nested}: {exc}") from None
    missing = [p for p in ("image_processor", "feature_extractor")
               if not isinstance(parts.get(p), dict)]
    if missing:
        raise FileNotFoundError(
            f"no preprocessor_config.json in {root}, and no processor_config.json holding "
            f"the {' and the '.join(m.replace('_', ' ') for m in missing)}: a Qwen3-Omni "
            "checkpoint needs its image processor and feature extractor")


def mrope_positions(length: int, media: Sequence[MediaLayout], merge: int,
                    per_second: float) -> torch.Tensor:
    """[3, length] temporal / height / width positions of a prompt with `media` (in order),
    as transformers' `get_rope_index` gives them for text, images and audio."""
    out = torch.empty(3, length, dtype=torch.long)
    next_pos = cursor = 0
    for item in media:
        n_text = item.start - cursor
        out[:, cursor:item.start] = torch.arange(next_pos, next_pos + n_text)
        next_pos += n_text
        span = slice(item.start, item.start + item.length)
        if item.grid is not None:
            t, h, w = item.grid
            h, w = h // merge, w // merge
            out[0, span] = (torch.arange(t) * per_second).long().repeat_interleave(h * w)
            out[1, span] = torch.arange(h).repeat_interleave(w).repeat(t)
            out[2, span] = torch.arange(w).repeat(t * h)
            out[:, span] += next_pos
            next_pos = int(out[:, span].max()) + 1
        else:
            out[:, span] = torch.arange(next_pos, next_pos + item.length)
            next_pos += item.length
        cursor = item.start + item.length
    out[:, cursor:] = torch.arange(next_pos, next_pos + length - cursor)
    return out


def _check_rate(audio: Audio) -> Audio:
    if audio.sample_rate != SAMPLE_RATE:
        raise ValueError(f"Qwen3-Omni hears audio at {SAMPLE_RATE} Hz; this clip is "
                         f"{audio.sample_rate} Hz (resample it first)")
    return audio


def _smart_resize(processor: Any, height: int, width: int) -> tuple[int, int]:
    """The size the image processor resizes an image to (its own `smart_resize`)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    kwargs = processor._merge_and_standardize_kwargs()
    return smart_resize(height, width, int(kwargs["patch_size"]) * int(kwargs["merge_size"]),
                        min_pixels=kwargs["size"].shortest_edge,
                        max_pixels=kwargs["size"].longest_edge)
