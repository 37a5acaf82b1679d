"""Qwen3-Omni (`Qwen3OmniMoeForConditionalGeneration` checkpoints): the thinker's media side
and multimodal positions (`thinker`; its text decoder is a `DecoderLM`, Qwen3-MoE with
M-RoPE), and speech out (`talker`: the talker, its code predictor and code2wav)."""

from omni.compute.models.qwen3_omni.talker import Qwen3OmniTalker, TalkerPrompt, TalkerSampling
from omni.compute.models.qwen3_omni.thinker import Qwen3OmniMedia, mrope_positions

__all__ = ["Qwen3OmniMedia", "Qwen3OmniTalker", "TalkerPrompt", "TalkerSampling",
           "mrope_positions"]
