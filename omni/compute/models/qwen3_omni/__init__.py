"""Qwen3-Omni (`Qwen3OmniMoeForConditionalGeneration` checkpoints): the thinker's media side
and multimodal positions (`thinker`; its text decoder is a `DecoderLM`, Qwen3-MoE with
M-RoPE), and speech out (`talker`: the talker, its code predictor and code2wav)."""

from omni.compute.models.qwen3_omni.talker import (
    CHUNK,
    LEFT_CONTEXT,
    SAMPLE_RATE,
    SUPPRESSED,
    Qwen3OmniTalker,
    TalkerPrompt,
    ThinkerContext,
)
from omni.compute.models.qwen3_omni.thinker import MediaLayout, Qwen3OmniMedia, mrope_positions

__all__ = ["CHUNK", "LEFT_CONTEXT", "SAMPLE_RATE", "SUPPRESSED", "MediaLayout", "Qwen3OmniMedia",
           "Qwen3OmniTalker", "TalkerPrompt", "ThinkerContext", "mrope_positions"]
