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
from typing import Any

import numpy as np
import torch
from torch import Tensor

from omni._openmp import run_in_worker
from omni.compute._batch import BatchKV
from omni.compute.engine import TorchEngine
from omni.compute.models.qwen3_omni import (
    CHUNK,
    LEFT_CONTEXT,
    SAMPLE_RATE,
    SUPPRESSED,
    Qwen3OmniMedia,
    Qwen3OmniTalker,
    TalkerPrompt,
    ThinkerContext,
)
from omni.compute.prompt import PromptTokens
from omni.compute.sampling import (
    RequestSamplingState,
    SamplingParams,
    TokenSampler,
    TokenSamplingState,
)

__all__ = ["SAMPLE_RATE", "Code2WavStream", "Speech", "SpeechSession", "Talker", "TalkerRun",
           "ThinkerContext", "reply_embeddings", "talker_params", "thinker_context"]


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


def talker_params(**fields: Any) -> SamplingParams:
    """The talker's sampling: transformers' defaults of `generate(return_audio=True)`
    (temperature 0.9, top-k 50, repetition penalty 1.05 over the codec tokens so far, at
    most 4,096 codec tokens) with `fields` (SGLang's `SamplingParams` names) over them."""
    defaults = {"temperature": 0.9, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.05,
                "max_new_tokens": 4096}
    return SamplingParams(**{**defaults, **fields})


class _SuppressControls:
    """transformers suppresses the talker's top 1,024 ids (its control codes) but codec EOS
    (a logit processor, in SGLang's terms)."""

    def __init__(self, eos: int):
        self.eos = eos

    def __call__(self, logits: Tensor, custom_param_list: list[Any]) -> Tensor:
        keep = logits[:, self.eos].clone()
        logits[:, max(0, logits.shape[-1] - SUPPRESSED):] = float("-inf")
        logits[:, self.eos] = keep
        return logits



class TalkerRun:
    """One reply being spoken, step by step: each step turns the current codec token into a
    frame (its residual codes from the code predictor) and feeds the frame, plus the reply's
    next projected token, back to the talker for the next codec token.

    Step k adds reply token k + 1 (`<tts_text_eod>` in place of the reply's last token,
    `<tts_pad>` after it), so it can run once the thinker has given token k + 2 or ended:
    `feed` the reply's tokens after the first as they come, `end` when it is complete, and
    call `step` while `ready`.
    """

    def __init__(self, talker: Qwen3OmniTalker, prompt: TalkerPrompt, eos_ids: tuple[int, ...],
                 sampling: SamplingParams):
        self.talker, self.prompt, self.sampling = talker, prompt, sampling
        self.eos_ids = frozenset(eos_ids)
        codec_eos = int(talker.talker_hf.codec_eos_token_id)
        self.max_new_tokens = (sampling.max_new_tokens
                               or talker.decoder_config.max_position_embeddings)
        self._sampler = TokenSampler()
        self._state = TokenSamplingState([RequestSamplingState(
            sampling, eos_token_ids=(codec_eos,), logit_processor=_SuppressControls(codec_eos),
            vocab_size=talker.decoder_config.vocab_size)])
        # the code predictor samples when the talker does, as transformers lets it (top-k 50,
        # top-p 0.8), from a generator of its own
        predictor = (SamplingParams(temperature=0) if sampling.is_greedy else SamplingParams(
            top_k=50, top_p=0.8, sampling_seed=None if sampling.sampling_seed is None
            else sampling.sampling_seed + 1))
        self._predictor_state = RequestSamplingState(predictor)
        self.reply: list[int] = [prompt.first]  # its projection is in the prompt already
        self.embeds: list[Tensor | None] = [None]  # the reply tokens' thinker embeddings
        self.ended = False
        self.generated: list[int] = []  # the talker's codec tokens
        config = talker.decoder_config
        # the run's KV: one row of a batch buffer, grown by doubling (not a copy per step)
        self.kv = BatchKV(config.num_layers, config.num_kv_heads, int(config.head_dim or 0), 1,
                          talker.dtype, talker.device, capacity=len(prompt.embeds) + 64)
        self.kv.open_row(len(prompt.embeds))
        with torch.inference_mode():
            hidden, new_kv = talker.decoder.forward(prompt.embeds[None],
                                                    prompt.positions[:, None])
        self.kv.extend(0, new_kv)
        self.length = len(prompt.embeds)
        self.offset = int(prompt.positions.max()) + 1 - self.length
        self.hidden = hidden[:, -1:]
        self._sample()

    def feed(self, token: int, embed: Tensor) -> None:
        """The reply's next token (the second on: the first is in the prompt) and its thinker
        input embedding [E]."""
        if self.ended:
            raise RuntimeError("the reply has ended")
        self.reply.append(int(token))
        self.embeds.append(embed)

    def end(self) -> None:
        """The reply is complete."""
        self.ended = True

    @property
    def done(self) -> bool:
        """Whether the talker has stopped (codec EOS, or `max_new_tokens`)."""
        return (self.generated[-1] == self.talker.talker_hf.codec_eos_token_id
                or len(self.generated) >= self.max_new_tokens)

    @property
    def ready(self) -> bool:
        """Whether `step` can run now (not done, and the reply's text it adds is known)."""
        return not self.done and self._text(len(self.generated) - 1) is not None

    @torch.inference_mode()
    def step(self) -> list[int]:
        """The current codec token's frame [Q codes]; the talker then reads it and picks the
        next codec token. RuntimeError unless `ready`."""
        k = len(self.generated) - 1
        text = self._text(k)
        if self.done or text is None:
            raise RuntimeError("the talker cannot step now (see TalkerRun.ready)")
        frame, frame_embed = self.talker.frame(self.hidden, self.generated[-1],
                                                self._pick_residual)
        position = torch.full((1, 1), self.length + k + self.offset,
                              device=self.talker.device)
        self.hidden, new_kv = self.talker.decoder.forward((frame_embed + text)[None, None],
                                                          position, self.kv.past())
        self.kv.append(new_kv)
        self._sample()
        return frame

    def _sample(self) -> None:
        logits = self.talker.decoder.logits(self.hidden[:, -1])  # [1, V]
        self.generated.append(int(self._sampler.step(logits, self._state)[0]))

    def _pick_residual(self, logits: Tensor) -> int:
        """A residual code from the code predictor's logits [V] (a fresh one-row batch each
        time: its penalties, none, need no history)."""
        state = TokenSamplingState([self._predictor_state])
        return int(self._sampler.step(logits[None], state)[0])

    def _text(self, j: int) -> Tensor | None:
        """What step j adds, as transformers lays out `trailing_text_hidden`: the projected
        reply token j + 1, `<tts_text_eod>` in place of the reply's last token (and at its
        first end-of-sequence token, should one come earlier), `<tts_pad>` past either; None
        while unknown (reply token j + 1, and whether it is the last, are not known yet)."""
        known = len(self.reply)
        if not self.ended and known < j + 3:
            return None
        if self.ended and j >= known - 1:
            return self.prompt.pad
        eos_at = next((i for i, t in enumerate(self.reply) if t in self.eos_ids), None)
        if eos_at is not None and j >= eos_at:
            return self.prompt.eos if j == eos_at else self.prompt.pad
        if self.ended and j == known - 2:
            return self.prompt.eos
        return self.prompt.project(self.embeds[j + 1])


class Code2WavStream:
    """code2wav as frames arrive: the samples transformers' `chunked_decode` gives (chunks of
    300 frames, 25 frames of left context), sent early. code2wav is causal, so decoding a
    chunk's first n frames gives the first samples of decoding all of them; a chunk is
    decoded again at 1, 2, 4, ... of its frames (and at its end), and each time the samples
    not sent yet go out (up to float rounding, ~1e-6, the same samples)."""

    def __init__(self, code2wav: Any, first: int = 1):
        self.code2wav, self.first = code2wav, first
        self.upsample = int(code2wav.total_upsample)
        self.device = next(code2wav.parameters()).device
        self.frames: list[list[int]] = []
        self.chunk_start = 0  # the first frame of the current chunk
        self.sent = 0  # samples of the current chunk sent
        self.next_at = first  # frames of the chunk at which it is decoded next

    def push(self, frame: list[int]) -> np.ndarray:
        """Take a frame; the samples it makes ready (often none)."""
        self.frames.append(frame)
        in_chunk = len(self.frames) - self.chunk_start
        if in_chunk < self.next_at and in_chunk < CHUNK:
            return np.zeros(0, np.float32)
        out = self._decode()
        self.next_at = min(2 * in_chunk, CHUNK)
        if in_chunk == CHUNK:  # the next chunk starts, with its left context
            self.chunk_start, self.sent, self.next_at = len(self.frames), 0, self.first
        return out

    def finish(self) -> np.ndarray:
        """The remaining samples (the last frames' tail)."""
        if len(self.frames) == self.chunk_start:
            return np.zeros(0, np.float32)
        return self._decode()

    @torch.inference_mode()
    def _decode(self) -> np.ndarray:
        context = min(LEFT_CONTEXT, self.chunk_start)
        codes = torch.tensor(self.frames[self.chunk_start - context:],
                             device=self.device).T[None]
        wav = self.code2wav(codes)[0, 0, context * self.upsample:].float().cpu().numpy()
        out, self.sent = wav[self.sent:], len(wav)
        return out


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
        return TalkerRun(model, prompt, self.talker.eos_ids, self.sampling)

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
