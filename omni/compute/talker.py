"""`Talker`: speech for the replies of a Qwen3-Omni thinker served by a `TorchEngine`.

The engine runs the thinker (a conversation in, reply tokens out); the talker reads that
conversation and reply as transformers' `generate(return_audio=True)` does (see
`omni.compute.models.qwen3_omni.talker`) and speaks it: codec frames from the talker and its
code predictor, then code2wav's 24 kHz waveform. Its computation runs in a worker thread.

    engine = TorchEngine.from_pretrained(folder)
    talker = Talker.from_pretrained(folder, engine)
    reply = await engine.chat(messages, params)
    speech = await talker.speak(engine.chat_prompt(messages), reply.token_ids)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from omni._openmp import run_in_worker
from omni.compute.engine import TorchEngine
from omni.compute.models.qwen3_omni import Qwen3OmniMedia, Qwen3OmniTalker, TalkerSampling
from omni.compute.models.qwen3_omni.talker import SAMPLE_RATE
from omni.compute.prompt import Prompt, PromptTokens

__all__ = ["Speech", "Talker", "TalkerSampling"]


@dataclass(frozen=True)
class Speech:
    """A spoken reply: its codec frames [codebooks, frames] and waveform (float32 samples in
    [-1, 1] at `sample_rate`)."""

    codes: np.ndarray
    waveform: np.ndarray
    sample_rate: int


class Talker:
    """A Qwen3-Omni checkpoint's talker and code2wav, speaking for `engine`'s thinker (the
    same checkpoint's: its embeddings, media encoders and EOS ids are read).

    Raises:
        ValueError: an engine that is not a Qwen3-Omni thinker.
    """

    def __init__(self, model: Qwen3OmniTalker, engine: TorchEngine):
        if not isinstance(engine.media, Qwen3OmniMedia):
            raise ValueError("a Talker speaks for a Qwen3-Omni thinker: load the engine with "
                             "TorchEngine.from_pretrained on the same checkpoint")
        self.model, self.engine = model, engine

    @classmethod
    def from_pretrained(cls, path: str | Path, engine: TorchEngine) -> Talker:
        """The talker of the checkpoint directory `engine` was loaded from, in its dtype and
        on its device."""
        return cls(Qwen3OmniTalker(path, engine.dtype, engine.device), engine)

    async def speak(self, prompt: Prompt | list[int], reply: list[int], *,
                    voice: str | None = None,
                    sampling: TalkerSampling | None = None) -> Speech:
        """Speak `reply` (the thinker's tokens for `prompt`, a conversation's prompt as
        `engine.chat_prompt` gives it) in `voice` (the checkpoint's speaker names; None:
        transformers' default).

        Raises:
            ValueError: an empty reply, a prompt without an assistant turn, an unknown voice.
        """
        if not reply:
            raise ValueError("there is no reply to speak")
        tokens = self.engine.prepare(prompt)
        self.model.speaker_id(voice)  # an unknown voice fails before any work
        return await run_in_worker(self._speak, tokens, list(reply), voice,
                                   sampling or TalkerSampling())

    def _speak(self, tokens: PromptTokens, reply: list[int], voice: str | None,
               sampling: TalkerSampling) -> Speech:
        runner = self.engine.runner
        media_hidden: dict[int, torch.Tensor] = {}
        if tokens.media:
            hidden = runner.hidden_at(tokens, int(self.model.talker_hf.accept_hidden_layer))
            media_hidden = {p: hidden[p] for item in tokens.media
                            for p in range(item.start, item.start + item.length)}
        prompt = self.model.prompt(tokens, reply, runner.model.embed, media_hidden,
                                   self.engine.media, voice, runner.eos_ids())
        codes = self.model.codes(prompt, sampling)
        waveform = self.model.waveform(codes)
        return Speech(codes.numpy(), waveform.numpy(), SAMPLE_RATE)
