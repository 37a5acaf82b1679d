"""Speech for the replies of a Qwen3-Omni thinker: `thinker_context` on the thinker's side,
`Talker` (the talker, its code predictor and code2wav) on the speaker's.

The thinker (a `TorchEngine` on a Qwen3-Omni checkpoint) writes a reply; what the talker reads
of it crosses as stage values, so the two may run in different processes: once per reply a
`ThinkerContext` (the prompt's ids and media layout, its thinker input embeddings and media
hidden states), then each reply token with its thinker input embedding (`reply_embeddings`).
The talker reads them as transformers' `generate(return_audio=True)` does (see
`omni.compute.models.qwen3_omni.talker`) and speaks as they come: codec frames, then code2wav's
24 kHz samples in chunks. Its computation runs in worker threads.

    engine = TorchEngine.from_pretrained(folder)
    talker = Talker.from_pretrained(folder)
    prompt = engine.chat_prompt(messages)
    speech = talker.session(thinker_context(engine, engine.prepare(prompt)), voice="Chelsie")
    async for token in engine.stream(prompt, params):
        chunks = await speech.feed(token, reply_embeddings(engine, [token])[0])
    chunks = await speech.finish()

(`Talker.speak` and `Talker.stream` do this in one call when both run in one process.)
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from omni._openmp import run_in_worker
from omni.compute.engine import TorchEngine
from omni.compute.models.qwen3_omni import (
    Code2WavStream,
    Qwen3OmniMedia,
    Qwen3OmniTalker,
    TalkerRun,
    ThinkerContext,
    talker_params,
)
from omni.compute.models.qwen3_omni.talker import SAMPLE_RATE
from omni.compute.prompt import PromptTokens
from omni.compute.sampling import SamplingParams

__all__ = ["SAMPLE_RATE", "Speech", "SpeechSession", "Talker", "ThinkerContext",
           "reply_embeddings", "talker_params", "thinker_context"]


def _omni_media(engine: TorchEngine) -> Qwen3OmniMedia:
    if not isinstance(engine.media, Qwen3OmniMedia):
        raise ValueError(f"{engine.model_id} is not a Qwen3-Omni thinker: only a Qwen3-Omni "
                         "checkpoint's talker speaks")
    return engine.media


@torch.inference_mode()
def thinker_context(engine: TorchEngine, tokens: PromptTokens) -> ThinkerContext:
    """What the talker reads of a prompt the thinker `engine` answers (run it in a worker
    thread: with media it computes the prompt's first layers again, see
    `ModelRunner.hidden_at`)."""
    media = _omni_media(engine)
    runner = engine.runner
    ids = torch.tensor(tokens.token_ids, device=engine.device)
    inputs = runner.model.embed(ids)
    if tokens.media:
        hidden = runner.hidden_at(tokens, media.accept_hidden_layer)
        for item in tokens.media:
            span = slice(item.start, item.start + item.length)
            inputs[span] = hidden[span]
    specials = runner.model.embed(torch.tensor(media.tts_token_ids, device=engine.device))
    return ThinkerContext(tokens.token_ids, media.layout(tokens), inputs.cpu(), specials.cpu())


@torch.inference_mode()
def reply_embeddings(engine: TorchEngine, token_ids: list[int]) -> torch.Tensor:
    """The thinker's input embeddings [n, E] of reply tokens (what the talker adds per step)."""
    return engine.runner.model.embed(torch.tensor(token_ids, device=engine.device)).cpu()


@dataclass(frozen=True)
class Speech:
    """A spoken reply: its codec frames [codebooks, frames] and waveform (float32 samples in
    [-1, 1] at `sample_rate`)."""

    codes: np.ndarray
    waveform: np.ndarray
    sample_rate: int


class SpeechSession:
    """One reply being spoken: `feed` its tokens as the thinker writes them, then `finish`;
    each returns the audio chunks (float32, 24 kHz) that became ready. Talker step k needs
    reply token k + 2 (or the reply's end), so speech follows the text two tokens behind."""

    def __init__(self, talker: Talker, context: ThinkerContext, voice: str | None,
                 sampling: SamplingParams):
        talker.model.speaker_id(voice)  # an unknown voice fails before any work
        self.talker, self.context = talker, context
        self.voice, self.sampling = voice, sampling
        self.run: TalkerRun | None = None
        self.wav = Code2WavStream(talker.model.code2wav)
        self.frames: list[list[int]] = []

    async def feed(self, token: int, embed: torch.Tensor) -> list[np.ndarray]:
        """The reply's next token and its thinker embedding [E] (`reply_embeddings`)."""
        if self.run is None:
            self.run = await run_in_worker(self._start, token, embed)
        else:
            self.run.feed(token, embed)
        return await self._steps()

    async def finish(self) -> list[np.ndarray]:
        """The reply is complete: the rest of the speech."""
        if self.run is None:
            return []  # an empty reply says nothing
        self.run.end()
        chunks = await self._steps()
        tail = await run_in_worker(self.wav.finish)
        return [*chunks, tail] if tail.size else chunks

    def _start(self, token: int, embed: torch.Tensor) -> TalkerRun:
        model = self.talker.model
        prompt = model.prompt(self.context, token, embed, self.voice)
        return model.start(prompt, self.talker.eos_ids, self.sampling)

    async def _steps(self) -> list[np.ndarray]:
        """Run every talker step the reply so far allows (in a worker thread)."""
        assert self.run is not None
        if not self.run.ready:
            return []
        return await run_in_worker(self._run_steps)

    def _run_steps(self) -> list[np.ndarray]:
        assert self.run is not None
        chunks = []
        while self.run.ready:
            frame = self.run.step()
            self.frames.append(frame)
            samples = self.wav.push(frame)
            if samples.size:
                chunks.append(samples)
        return chunks


class Talker:
    """A Qwen3-Omni checkpoint's talker, code predictor and code2wav.

    Args:
        model: the loaded `Qwen3OmniTalker`.
        eos_ids: the thinker's end-of-sequence ids (a reply's first such token is where its
            text ends for the talker).
    """

    def __init__(self, model: Qwen3OmniTalker, eos_ids: tuple[int, ...]):
        self.model, self.eos_ids = model, tuple(eos_ids)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu",
                        eos_ids: tuple[int, ...] | None = None) -> Talker:
        """The talker of a Qwen3-Omni checkpoint directory (the thinker's EOS: its
        tokenizer's, unless given)."""
        model = Qwen3OmniTalker(path, dtype, device)
        if eos_ids is None:
            from omni.compute.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(path)
            eos_ids = tuple(getattr(tokenizer, "eos_token_ids", ()) or ())
        return cls(model, eos_ids)

    def session(self, context: ThinkerContext, *, voice: str | None = None,
                sampling: SamplingParams | None = None) -> SpeechSession:
        """A reply to speak for the thinker's prompt `context`, the talker sampling as
        `sampling` says (None: `talker_params()`, transformers' defaults). ValueError: an
        unknown voice."""
        return SpeechSession(self, context, voice, sampling or talker_params())

    async def speak(self, engine: TorchEngine, prompt: object, reply: list[int], *,
                    voice: str | None = None,
                    sampling: SamplingParams | None = None) -> Speech:
        """Speak a whole `reply`: the tokens `engine` (the thinker) gave for `prompt` (what
        `engine.chat_prompt` gives)."""
        tokens = engine.prepare(prompt)
        context = await run_in_worker(thinker_context, engine, tokens)
        session = self.session(context, voice=voice, sampling=sampling)
        embeds = reply_embeddings(engine, list(reply)) if reply else None
        chunks: list[np.ndarray] = []
        for i, token in enumerate(reply):
            chunks += await session.feed(token, embeds[i])  # type: ignore[index]
        chunks += await session.finish()
        codes = np.array(session.frames, dtype=np.int64).T.reshape(
            self.model.talker_hf.num_code_groups, -1)
        waveform = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
        return Speech(codes, waveform, SAMPLE_RATE)

    async def stream(self, engine: TorchEngine, prompt: object,
                     reply: AsyncIterator[int], *, voice: str | None = None,
                     sampling: SamplingParams | None = None) -> AsyncIterator[np.ndarray]:
        """Speak a reply as the thinker writes it (`reply`: its tokens, say from
        `engine.stream(prompt, ...)`): audio chunks as soon as they decode."""
        tokens = engine.prepare(prompt)
        context = await run_in_worker(thinker_context, engine, tokens)
        session = self.session(context, voice=voice, sampling=sampling)
        async for token in reply:
            for chunk in await session.feed(token, reply_embeddings(engine, [token])[0]):
                yield chunk
        for chunk in await session.finish():
            yield chunk
