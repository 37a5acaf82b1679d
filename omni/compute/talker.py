"""`Talker`: speech for the replies of a Qwen3-Omni thinker served by a `TorchEngine`.

The engine runs the thinker (a conversation in, reply tokens out); the talker reads that
conversation and reply as transformers' `generate(return_audio=True)` does (see
`omni.compute.models.qwen3_omni.talker`) and speaks it: codec frames from the talker and its
code predictor, then code2wav's 24 kHz waveform. Its computation runs in a worker thread.

    engine = TorchEngine.from_pretrained(folder)
    talker = Talker.from_pretrained(folder, engine)
    reply = await engine.chat(messages, params)
    speech = await talker.speak(engine.chat_prompt(messages), reply.token_ids)

or, speaking while the thinker writes, `talker.stream(prompt, engine.stream(prompt, params))`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from omni._openmp import run_in_worker
from omni.compute.engine import TorchEngine
from omni.compute.models.qwen3_omni import Qwen3OmniMedia, Qwen3OmniTalker, TalkerSampling
from omni.compute.models.qwen3_omni.talker import SAMPLE_RATE, Code2WavStream, TalkerRun
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
        """Speak a whole `reply` (the thinker's tokens for `prompt`, a conversation's prompt as
        `engine.chat_prompt` gives it) in `voice` (the checkpoint's speaker names; None:
        transformers' default). As `stream`, collected.

        Raises:
            ValueError: as `stream`.
        """
        async def tokens() -> AsyncIterator[int]:
            for token in reply:
                yield token

        frames: list[list[int]] = []
        chunks = [chunk async for chunk in self.stream(prompt, tokens(), voice=voice,
                                                       sampling=sampling, frames=frames)]
        codes = np.array(frames, dtype=np.int64).T.reshape(
            self.model.talker_hf.num_code_groups, -1)
        waveform = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
        return Speech(codes, waveform, SAMPLE_RATE)

    async def stream(self, prompt: Prompt | list[int], reply: AsyncIterator[int], *,
                     voice: str | None = None, sampling: TalkerSampling | None = None,
                     frames: list[list[int]] | None = None) -> AsyncIterator[np.ndarray]:
        """Speak a reply as the thinker writes it: `reply` yields its tokens (say, from
        `engine.stream`); the waveform comes in chunks (float32, 24 kHz) as soon as frames
        decode, while the reply goes on. Talker step k needs reply token k + 2 (or the
        reply's end): the talker runs a step whenever it can and otherwise takes the reply's
        next token. Each frame is appended to `frames` when given.

        Raises:
            ValueError: a prompt without an assistant turn, an unknown voice.
        """
        tokens = self.engine.prepare(prompt)
        self.model.speaker_id(voice)  # an unknown voice fails before any work
        source = aiter(reply)
        first = await anext(source, None)
        if first is None:
            return
        run = await run_in_worker(self._start, tokens, first, voice,
                                  sampling or TalkerSampling())
        wav = Code2WavStream(self.model.code2wav)
        while not run.done:
            if not run.ready:
                token = await anext(source, None)
                if token is None:
                    run.end()
                else:
                    run.feed(token)
                continue
            frame = await run_in_worker(run.step)
            if frames is not None:
                frames.append(frame)
            samples = await run_in_worker(wav.push, frame)
            if samples.size:
                yield samples
        tail = await run_in_worker(wav.finish)
        if tail.size:
            yield tail

    def _start(self, tokens: PromptTokens, first: int, voice: str | None,
               sampling: TalkerSampling) -> TalkerRun:
        """The talker prefilled for `tokens` and the reply's first token (worker thread)."""
        runner = self.engine.runner
        media_hidden: dict[int, torch.Tensor] = {}
        if tokens.media:
            hidden = runner.hidden_at(tokens, int(self.model.talker_hf.accept_hidden_layer))
            media_hidden = {p: hidden[p] for item in tokens.media
                            for p in range(item.start, item.start + item.length)}
        prompt = self.model.prompt(tokens, first, runner.model.embed, media_hidden,
                                   self.engine.media, voice)
        return self.model.start(prompt, runner.eos_ids(), sampling)
