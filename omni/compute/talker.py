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
import trio
from torch import Tensor

from omni._openmp import run_in_worker
from omni.compute._batch import BatchKV
from omni.compute._default_store import StoreOption, choose_store
from omni.compute._prefix import load_prefix, store_pages
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
from omni.kv import KVStore, MediaSpan, block_keys, media_digest

__all__ = ["SAMPLE_RATE", "Code2WavStream", "Speech", "SpeechSession", "Talker", "TalkerBatch",
           "TalkerRun", "ThinkerContext", "reply_embeddings", "talker_params", "thinker_context"]

TALKER_KEY = "qwen3-omni-talker"  # the model, in the talker's page keys


def _omni_media(engine: TorchEngine) -> Qwen3OmniMedia:
    if not isinstance(engine.media, Qwen3OmniMedia):
        raise ValueError(f"{engine.model_id} is not a Qwen3-Omni thinker: only a Qwen3-Omni "
                         "checkpoint's talker speaks")
    return engine.media


@torch.inference_mode()
def thinker_context(engine: TorchEngine, tokens: PromptTokens,
                    cache_salt: str = "") -> ThinkerContext:
    """What the talker reads of a prompt the thinker `engine` answers. Its media hidden
    states come from the thinker's prefill of the prompt (call this after it: after the
    reply's first token; `cache_salt` the request's, which the context carries to the
    talker's page keys); should they be gone, the prompt's first layers are computed again
    (`ModelRunner.hidden_at`: run this in a worker thread)."""
    media = _omni_media(engine)
    runner = engine.runner
    ids = torch.tensor(tokens.token_ids, device=engine.device)
    inputs = runner.model.embed(ids)
    if tokens.media:
        kept = runner.media_hidden(tokens, cache_salt)
        if kept is None:
            hidden = runner.hidden_at(tokens, media.tap_layer, cache_salt)
            kept = {item.start: hidden[item.start:item.start + item.length]
                    for item in tokens.media}
        for item in tokens.media:
            inputs[item.start:item.start + item.length] = kept[item.start]
    specials = runner.model.embed(torch.tensor(media.tts_token_ids, device=engine.device))
    return ThinkerContext(tokens.token_ids, media.layout(tokens), inputs.cpu(), specials.cpu(),
                          cache_salt)


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
    """One reply being spoken: what the talker has read of it, its codec tokens, and its
    frames not yet taken. A `TalkerBatch` steps it (with every other run in flight): each
    step turns the current codec token into a frame (its residual codes from the code
    predictor) and feeds the frame, plus the reply's next projected token, back to the talker
    for the next codec token.

    Step k adds reply token k + 1 (`<tts_text_eod>` in place of the reply's last token,
    `<tts_pad>` after it), so it can run once the thinker has given token k + 2 or ended:
    `feed` the reply's tokens after the first as they come and `end` when it is complete.
    """

    def __init__(self, talker: Qwen3OmniTalker, prompt: TalkerPrompt, eos_ids: tuple[int, ...],
                 sampling: SamplingParams, cache_salt: str = ""):
        self.talker, self.prompt, self.sampling = talker, prompt, sampling
        self.cache_salt = cache_salt  # the request's: its prompt pages are keyed by it
        self.eos_ids = frozenset(eos_ids)
        codec_eos = int(talker.talker_hf.codec_eos_token_id)
        self.max_new_tokens = (sampling.max_new_tokens
                               or talker.decoder_config.max_position_embeddings)
        self.state = RequestSamplingState(
            sampling, eos_token_ids=(codec_eos,), logit_processor=_SuppressControls(codec_eos),
            vocab_size=talker.decoder_config.vocab_size)
        # the code predictor samples when the talker does, as transformers lets it (top-k 50,
        # top-p 0.8), from a generator of its own
        predictor = (SamplingParams(temperature=0) if sampling.is_greedy else SamplingParams(
            top_k=50, top_p=0.8, sampling_seed=None if sampling.sampling_seed is None
            else sampling.sampling_seed + 1))
        self.predictor_state = RequestSamplingState(predictor)
        self.reply: list[int] = [prompt.first]  # its projection is in the prompt already
        # the reply's first end-of-sequence token, where its text ends for the talker
        self.eos_at: int | None = 0 if prompt.first in self.eos_ids else None
        self.embeds: list[Tensor | None] = [None]  # the reply tokens' thinker embeddings
        self.ended = self.cancelled = False
        self.generated: list[int] = []  # the talker's codec tokens
        self.frames: list[list[int]] = []  # made, not taken yet
        self.length = len(prompt.embeds)  # KV positions of the prompt
        self.offset = int(prompt.positions.max()) + 1 - self.length  # M-RoPE's
        self.hidden: Tensor | None = None  # the talker's last hidden state [E]
        self.row: int | None = None  # in the batch

    def feed(self, token: int, embed: Tensor) -> None:
        """The reply's next token (the second on: the first is in the prompt) and its thinker
        input embedding [E]."""
        if self.ended:
            raise RuntimeError("the reply has ended")
        if self.eos_at is None and token in self.eos_ids:
            self.eos_at = len(self.reply)
        self.reply.append(int(token))
        self.embeds.append(embed)

    def end(self) -> None:
        """The reply is complete."""
        self.ended = True

    def take_frames(self) -> list[list[int]]:
        frames, self.frames = self.frames, []
        return frames

    @property
    def done(self) -> bool:
        """Whether the talker has stopped (codec EOS, or `max_new_tokens`)."""
        return bool(self.generated) and (
            self.generated[-1] == self.talker.talker_hf.codec_eos_token_id
            or len(self.generated) >= self.max_new_tokens)

    @property
    def ready(self) -> bool:
        """Whether a step can take it now (prefilled, not done, its next text known)."""
        return (self.row is not None and not self.done and not self.cancelled
                and self._text_known(len(self.generated) - 1))

    def _text_known(self, j: int) -> bool:
        """Whether what step j adds is known: reply token j + 1, and whether it is the
        last, are (token j + 2 is there, or the reply ended)."""
        return self.ended or len(self.reply) >= j + 3

    def _text(self, j: int) -> Tensor | None:
        """What step j adds, as transformers lays out `trailing_text_hidden`: the projected
        reply token j + 1, `<tts_text_eod>` in place of the reply's last token (and at its
        first end-of-sequence token, should one come earlier), `<tts_pad>` past either; None
        while unknown (reply token j + 1, and whether it is the last, are not known yet)."""
        known = len(self.reply)
        if not self._text_known(j):
            return None
        if self.ended and j >= known - 1:
            return self.prompt.pad
        if self.eos_at is not None and j >= self.eos_at:
            return self.prompt.eos if j == self.eos_at else self.prompt.pad
        if self.ended and j == known - 2:
            return self.prompt.eos
        return self.prompt.project(self.embeds[j + 1])


class TalkerBatch:
    """Every reply being spoken, stepped together (continuous batching): one row each of a
    batch KV buffer; a step takes every run that can go on (`TalkerRun.ready`: a run waiting
    for the thinker's next token sits it out, its rows moved behind the others') through the
    code predictor and the talker at once. Synchronous: call it from one thread at a time."""

    def __init__(self, model: Qwen3OmniTalker, max_batch: int = 16,
                 store: KVStore | None = None, page_size: int = 16):
        config = model.decoder_config
        self.model, self.max_batch = model, max_batch
        self.store, self.page_size = store, page_size
        self.kv = BatchKV(config.num_layers, config.num_kv_heads, int(config.head_dim or 0),
                          max_batch, model.dtype, model.device)
        self.cached_tokens = 0  # of the prompts added, read from the store
        self.runs: list[TalkerRun] = []  # by row
        self.sampler = TokenSampler()
        self.peak = 0  # the most runs one step took

    @torch.inference_mode()
    def add(self, run: TalkerRun) -> None:
        """Prefill `run`'s prompt into a new row (after the longest prefix the store holds:
        a conversation's later turns find its earlier user turns there) and pick its first
        codec token; the prompt's new full pages go to the store."""
        self.drop_finished()
        prompt = run.prompt
        length = len(prompt.embeds)
        row = self.kv.open_row(length)
        keys = self._keys(prompt, run.cache_salt)
        start = load_prefix(self.store, self.kv, row, keys[: (length - 1) // self.page_size],
                            self.page_size)
        past = self.kv.row_kv(row, 0, start) if start else None
        hidden, new_kv = self.model.decoder.forward(
            prompt.embeds[None, start:], prompt.positions[:, None, start:], past)
        self.kv.extend(row, new_kv)
        self.cached_tokens += start
        run.row, run.hidden = row, hidden[0, -1]
        self.runs.append(run)
        store_pages(self.store, self.kv, row, keys, start // self.page_size, self.page_size)
        self._sample([run], self.model.decoder.logits(hidden[:, -1]))

    def _keys(self, prompt: TalkerPrompt, cache_salt: str) -> list[bytes]:
        """The store keys of the prompt's full pages: its ids, and the digests of the rows
        the ids do not determine; a `cache_salt` gives another set of keys (as the
        thinker's `ModelRunner.page_keys`): requests of different salts share no page."""
        if self.store is None:
            return []
        spans = [MediaSpan(start, n, media_digest(prompt.embeds[start:start + n].float()))
                 for start, n in prompt.content_spans if n]
        extra = (TALKER_KEY,) if not cache_salt else (TALKER_KEY, "salt", cache_salt)
        return block_keys(prompt.ids, self.page_size, extra=extra, media=spans)

    @torch.inference_mode()
    def step(self) -> int:
        """One step of every ready run; how many."""
        self.drop_finished()
        ready = [run for run in self.runs if run.ready]
        if not ready:
            return 0
        for front, run in enumerate(ready):  # the ready rows first: a step reads rows [:B]
            self._swap(front, int(run.row))  # type: ignore[arg-type]
        steps = [len(run.generated) - 1 for run in ready]
        hidden = torch.stack([run.hidden for run in ready])  # type: ignore[misc]
        frames, frame_embeds = self.model.frames(
            hidden, [run.generated[-1] for run in ready], self._picker(ready))
        texts = torch.stack([run._text(k) for run, k in zip(ready, steps, strict=True)])
        positions = torch.tensor([[run.length + k + run.offset]
                                  for run, k in zip(ready, steps, strict=True)],
                                 device=self.model.device)
        b = len(ready)
        out, new_kv = self.model.decoder.forward((frame_embeds + texts)[:, None], positions,
                                                 self.kv.past(b), self.kv.mask(b))
        self.kv.append(new_kv, b)
        for run, frame, h in zip(ready, frames, out[:, -1], strict=True):
            run.frames.append(frame)
            run.hidden = h
        self._sample(ready, self.model.decoder.logits(out[:, -1]))
        self.peak = max(self.peak, b)
        return b

    def _picker(self, ready: list[TalkerRun]) -> Any:
        """Residual codes from the code predictor's logits [B, V], each row with its run's
        predictor sampling (no history: a fresh state over the same rows each time)."""
        states = TokenSamplingState([run.predictor_state for run in ready])
        return lambda logits: self.sampler.step(logits, states).tolist()

    def _sample(self, runs: list[TalkerRun], logits: Tensor) -> None:
        tokens = self.sampler.step(logits, TokenSamplingState([run.state for run in runs]))
        for run, token in zip(runs, tokens.tolist(), strict=True):
            run.generated.append(int(token))

    def _swap(self, a: int, b: int) -> None:
        if a == b:
            return
        self.kv.swap(a, b)
        self.runs[a], self.runs[b] = self.runs[b], self.runs[a]
        self.runs[a].row, self.runs[b].row = a, b

    def drop_finished(self) -> None:
        """Free the rows of runs that are done or abandoned (the last row moves in)."""
        for run in [r for r in self.runs if r.done or r.cancelled]:
            row = int(run.row)  # type: ignore[arg-type]
            moved = self.kv.remove(row)
            last = self.runs.pop()
            if moved is not None:
                self.runs[row] = last
                last.row = row
            run.row = None


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
    reply token k + 2 (or the reply's end), so speech follows the text two tokens behind.
    Its talker steps are shared with every other reply in flight (`TalkerBatch`). `close`
    (also done by `finish`) gives its batch row back: call it when abandoning a reply."""

    def __init__(self, talker: Talker, context: ThinkerContext, voice: str | None,
                 sampling: SamplingParams):
        talker.model.speaker_id(voice)  # an unknown voice fails before any work
        self.talker, self.context = talker, context
        self.voice, self.sampling = voice, sampling
        self.run: TalkerRun | None = None
        self.wav = Code2WavStream(talker.model.code2wav)
        self.frames: list[list[int]] = []
        self._slot = False  # holds one of the batch's rows

    async def feed(self, token: int, embed: torch.Tensor) -> list[np.ndarray]:
        """The reply's next token and its thinker embedding [E] (`reply_embeddings`)."""
        if self.run is None:
            await self.talker.rows.acquire()
            self._slot = True
            self.run = await self.talker.start(self, token, embed)
        else:
            self.run.feed(token, embed)
        return await self._audio()

    async def finish(self) -> list[np.ndarray]:
        """The reply is complete: the rest of the speech."""
        if self.run is None:
            return []  # an empty reply says nothing
        self.run.end()
        try:
            chunks = await self._audio()
            tail = await run_in_worker(self.wav.finish)
            await self.talker.release()
        finally:
            self.close()
        return [*chunks, tail] if tail.size else chunks

    def close(self) -> None:
        """Stop speaking this reply (its batch row is freed at the next step)."""
        if self.run is not None:
            self.run.cancelled = self.run.cancelled or not self.run.done
        if self._slot:
            self._slot = False
            self.talker.rows.release()

    async def _audio(self) -> list[np.ndarray]:
        """Step the batch while this reply can go on; its new frames through code2wav."""
        assert self.run is not None
        await self.talker.advance(self.run)
        frames = self.run.take_frames()
        if not frames:
            return []
        self.frames += frames
        return await run_in_worker(self._decode, frames)

    def _decode(self, frames: list[list[int]]) -> list[np.ndarray]:
        chunks = [self.wav.push(frame) for frame in frames]
        return [chunk for chunk in chunks if chunk.size]


class Talker:
    """A Qwen3-Omni checkpoint's talker, code predictor and code2wav.

    Args:
        model: the loaded `Qwen3OmniTalker`.
        eos_ids: the thinker's end-of-sequence ids (a reply's first such token is where its
            text ends for the talker).
        max_batch: replies decoded in one batch (more wait for a row).
        store: where the talker's prompt pages are kept and found (a `KVStore` of the
            talker's layout, None: none, "auto": a store of its own, as `TorchEngine`'s).
    """

    def __init__(self, model: Qwen3OmniTalker, eos_ids: tuple[int, ...], max_batch: int = 16,
                 store: StoreOption = "auto", page_size: int = 16):
        self.model, self.eos_ids = model, tuple(eos_ids)
        layout = model.decoder_config.kv_layout(page_size, model.dtype)
        self.store = choose_store(store, layout, model.device)
        self.batch = TalkerBatch(model, max_batch, self.store, page_size)
        self.rows = trio.Semaphore(max_batch)  # a reply past max_batch waits for a row
        self._lock = trio.Lock()  # one thread at a time in the batch

    async def start(self, session: SpeechSession, token: int,
                    embed: torch.Tensor) -> TalkerRun:
        """A session's run, its prompt prefilled into the batch (its first reply token)."""
        def prefill() -> TalkerRun:
            prompt = self.model.prompt(session.context, token, embed, session.voice)
            run = TalkerRun(self.model, prompt, self.eos_ids, session.sampling,
                            session.context.cache_salt)
            self.batch.add(run)
            return run

        async with self._lock:
            return await run_in_worker(prefill)

    async def release(self) -> None:
        """Free the batch rows of replies that are done or abandoned."""
        async with self._lock:
            await run_in_worker(self.batch.drop_finished)

    async def advance(self, run: TalkerRun) -> None:
        """Step the batch (every reply that can go on: the other sessions' frames wait in
        their runs) until `run` cannot go on, in one worker thread hop."""
        def steps() -> None:
            while run.ready:
                self.batch.step()

        async with self._lock:
            if run.ready:
                await run_in_worker(steps)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu",
                        eos_ids: tuple[int, ...] | None = None, **kwargs: Any) -> Talker:
        """The talker of a Qwen3-Omni checkpoint directory (the thinker's EOS: its
        tokenizer's, unless given), decoding up to 16 replies in one batch."""
        model = Qwen3OmniTalker(path, dtype, device)
        if eos_ids is None:
            from omni.compute.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(path)
            eos_ids = tuple(getattr(tokenizer, "eos_token_ids", ()) or ())
        return cls(model, eos_ids, **kwargs)

    def session(self, context: ThinkerContext, *, voice: str | None = None,
                sampling: SamplingParams | None = None) -> SpeechSession:
        """A reply to speak for the thinker's prompt `context`, the talker sampling as
        `sampling` says (None: `talker_params()`, transformers' defaults). ValueError: an
        unknown voice."""
        return SpeechSession(self, context, voice, sampling or talker_params())

    async def speak(self, engine: TorchEngine, prompt: object, reply: list[int], *,
                    voice: str | None = None, sampling: SamplingParams | None = None,
                    cache_salt: str = "") -> Speech:
        """Speak a whole `reply`: the tokens `engine` (the thinker) gave for `prompt` (what
        `engine.chat_prompt` gives) under `cache_salt`. `stream`, collected."""
        async def tokens() -> AsyncIterator[int]:
            for token in reply:
                yield token

        frames: list[list[int]] = []
        chunks = [chunk async for chunk in self.stream(engine, prompt, tokens(), voice=voice,
                                                       sampling=sampling, frames=frames,
                                                       cache_salt=cache_salt)]
        codes = np.array(frames, dtype=np.int64).T.reshape(
            self.model.talker_hf.num_code_groups, -1)
        waveform = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
        return Speech(codes, waveform, SAMPLE_RATE)

    async def stream(self, engine: TorchEngine, prompt: object,
                     reply: AsyncIterator[int], *, voice: str | None = None,
                     sampling: SamplingParams | None = None,
                     frames: list[list[int]] | None = None,
                     cache_salt: str = "") -> AsyncIterator[np.ndarray]:
        """Speak a reply as the thinker writes it (`reply`: its tokens, say from
        `engine.stream(prompt, ..., cache_salt=cache_salt)`): audio chunks as soon as they
        decode; the codec frames go to `frames` when given. The talker's pages are keyed by
        `cache_salt` as the thinker's are."""
        tokens = engine.prepare(prompt)
        self.model.speaker_id(voice)  # an unknown voice fails before any work
        source = aiter(reply)
        first = await anext(source, None)
        if first is None:
            return  # an empty reply says nothing
        # after the reply's first token: the thinker's prefill kept what the talker reads
        context = await run_in_worker(thinker_context, engine, tokens, cache_salt)
        session = self.session(context, voice=voice, sampling=sampling)
        try:
            for chunk in await session.feed(first, reply_embeddings(engine, [first])[0]):
                yield chunk
            async for token in source:
                for chunk in await session.feed(token, reply_embeddings(engine, [token])[0]):
                    yield chunk
            for chunk in await session.finish():
                yield chunk
        finally:
            session.close()
            if frames is not None:
                frames += session.frames
