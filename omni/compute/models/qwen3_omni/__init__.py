"""Qwen3-Omni (`Qwen3OmniMoeForConditionalGeneration` checkpoints): the thinker's media side
and multimodal positions (`thinker`; its text decoder is a `DecoderLM`, Qwen3-MoE with
M-RoPE), and speech out (`talker`: the talker, its code predictor and code2wav)."""

from omni.compute.models.qwen3_omni.talker import (
    Code2WavStream,
    Qwen3OmniTalker,
    TalkerPrompt,
    TalkerRun,
    ThinkerContext,
    talker_params,
)
from omni.compute.models.qwen3_omni.thinker import MediaLayout, Qwen3OmniMedia, mrope_positions

__all__ = ["Code2WavStream", "MediaLayout", "Qwen3OmniMedia", "Qwen3OmniTalker", "TalkerPrompt",
           "TalkerRun", "ThinkerContext", "mrope_positions", "talker_params"]
