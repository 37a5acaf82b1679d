"""`TorchEngine`: the reference engine: a Llama/Qwen2/Qwen3 decoder on Omni's paged KV store.

A request's prompt is flattened to token ids (media at placeholder positions) and cut into
page keys. Prefill reads the longest cached prefix from the store under a lease, computes only
the tokens after it, and puts every new full page back; decoding puts each page back as it
fills, so the next turn of a conversation finds its whole history cached.

Requests are batched per decode step (continuous batching) without a background task: the
first waiting request drives the steps for everyone and hands over when it finishes. Each
step runs in a worker thread, so the event loop never waits on a forward pass.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch
import trio

from omni._openmp import run_in_worker
from omni.compute._batch import BatchKV
from omni.compute._default_store import StoreOption, choose_store, describe_store
from omni.compute._engine_chat import ChatMixin, load_tokenizer_and_defaults
from omni.compute._engine_types import EngineStats, GenerateResult, TokenStream, _Request
from omni.compute._output import output_text, sample_params, stream_due
from omni.compute.encoders import AudioEncoder, ImageEncoder
from omni.compute.grammar import GrammarBackend, GrammarKind, grammar_spec
from omni.compute.models import DecoderLM, load_pretrained, tiny_model
from omni.compute.prompt import Prompt, PromptTokens, Text, as_prompt, tokenize
from omni.compute.sampling import (
    RequestSamplingState,
    SamplingParams,
    TokenSampler,
    TokenSamplingState,
)
from omni.compute.tokenizer import ByteTokenizer, Tokenizer
from omni.kv import KVCapacityError, KVStore, MediaSpan, block_keys

__all__ = ["EngineStats", "GenerateResult", "TokenStream", "TorchEngine"]

log = logging.getLogger("omni.compute")

STEP_BUDGET = 0.002  # seconds of decoding one worker-thread hop may run when no one waits
PREFILL_EWMA = 0.2  # weight of the newest prefill in the estimate of a page's recompute cost
# a prompt with more characters of text than this is tokenized in a worker thread (a 64k-char
# text takes ~10 ms to tokenize: the event loop's budget for one step)
TOKENIZE_IN_THREAD_CHARS = 1 << 16


class TorchEngine(ChatMixin):
    """A decoder of the Llama / Qwen2 / Qwen3 family serving from Omni's KV store.

    Args:
        model: the `DecoderLM`; `config` its `DecoderConfig`.
        tokenizer: str <-> ids (None: prompts must give token ids).
        store: the `KVStore` to reuse and keep KV in; its layout must be the model's KV layout
            for `page_size`. "auto" (the default): a store of the engine's own, so prefix
            caching is on: one tier next to the model of a quarter of the free memory, at most
            64 GiB (on the CPU: of MemAvailable and the room in /dev/shm, reserved as pages
            arrive; on a GPU: of the device's free memory, allocated at once). None: no reuse,
            every prompt is computed in full.
        model_id: part of every page key, so that models never share pages.
        max_batch: requests decoded together at most.

    Conversations: `chat`, `chat_stream`, `chat_prompt` (the checkpoint's chat template);
    `generation_defaults` (from generation_config.json, see `from_pretrained`) gives the
    sampling of requests that pass no params (`default_params`).

    Raises:
        ValueError: a store whose layout is not the model's, or a `store` that is neither a
            `KVStore`, None nor "auto".
    """

    def __init__(self, model: DecoderLM, config: Any, *, tokenizer: Tokenizer | None = None,
                 store: StoreOption = "auto", page_size: int = 16, model_id: str = "model",
                 max_batch: int = 16, seed: int = 0):
        self.model = model.eval()
        self.config = config
        self.tokenizer = tokenizer
        self.page_size = page_size
        self.model_id = model_id
        self.max_batch = max_batch
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.kv_layout = config.kv_layout(page_size, self.dtype)
        self.store: KVStore | None = choose_store(store, self.kv_layout, self.device)
        # the built-in encoders are one small projection each: they run on the CPU in float32
        # and their embeddings move to the model's device and dtype (`embed_prompt`)
        self.image_encoder = ImageEncoder(config.hidden_size, seed=seed + 1)
        self.audio_encoder = AudioEncoder(config.hidden_size, seed=seed + 2)
        self._sampler = TokenSampler()
        self._batch_sampling: TokenSamplingState | None = None  # rebuilt when rows change
        self._batch = BatchKV(config.num_layers, config.num_kv_heads, config.head_dim,
                              max_batch, self.dtype, self.device)
        self._running: list[_Request] = []  # by batch row
        self._waiting: list[_Request] = []
        self._driving = False
        self._progress = trio.lowlevel.ParkingLot()
        # Seconds prefill takes per page of prompt (an EWMA; None until a prefill ran): what
        # the store's peer fetch must beat to be worth it.
        self._prefill_page_s: float | None = None
        self._grammars: GrammarBackend | None = None  # built by the first constrained request
        self._grammar_lock = trio.Lock()
        self._counts = {"prefills": 0, "prefill_tokens": 0, "decode_steps": 0}

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def tiny(cls, seed: int = 0, *, store: StoreOption = "auto", page_size: int = 16,
             **overrides: Any) -> TorchEngine:
        """A small random model with a byte tokenizer: demos and tests without downloads."""
        model, config = tiny_model(seed=seed, **overrides)
        return cls(model, config, tokenizer=ByteTokenizer(), store=store, page_size=page_size,
                   model_id=f"tiny-{seed}", seed=seed)

    @classmethod
    def from_pretrained(cls, path: str | Path, *, store: StoreOption = "auto",
                        page_size: int = 16, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu", **kwargs: Any) -> TorchEngine:
        """Load a Hugging Face directory (config.json + safetensors, sharded or not).

        With it come the tokenizer (tokenizer.json, its special tokens and chat template, for
        `chat`), and generation_config.json: its sampling settings become the default of
        requests without params (see `omni.compute.generation_config`) and its EOS ids end
        generation (else config.json's, else the tokenizer's `eos_token`). The weights are
        read straight onto `device` ("cuda": the model, its batch KV and its default store
        live on the GPU).

        Raises:
            ValueError: no such directory, no config.json or weights, an unsupported
                architecture, weights that do not fit the config, an unreadable
                tokenizer_config.json / generation_config.json, an invalid chat template.
        """
        model, config = load_pretrained(path, dtype=dtype, device=device)
        tokenizer, defaults = load_tokenizer_and_defaults(path, tuple(config.eos_token_ids))
        engine = cls(model, config, tokenizer=tokenizer, store=store, page_size=page_size,
                     model_id=kwargs.pop("model_id", Path(path).resolve().name), **kwargs)
        engine.generation_defaults = defaults
        return engine

    # -- requests ----------------------------------------------------------------------------

    def prepare(self, prompt: Any) -> PromptTokens:
        """Flatten a prompt to token ids and media (ValueError for what cannot be served).

        A text too long for the context is refused from its length, before it is tokenized:
        `Tokenizer.max_token_chars` bounds how much text a token covers."""
        prompt = as_prompt(prompt)
        self.check_length(prompt)
        return self._tokenize(prompt)

    def _tokenize(self, prompt: Prompt) -> PromptTokens:
        """`prepare` once the prompt's length was checked."""
        tokens = tokenize(prompt, self.tokenizer.encode if self.tokenizer else None)
        if not tokens.token_ids:
            raise ValueError("the prompt is empty")
        limit = self.config.max_position_embeddings
        if len(tokens) >= limit:
            raise ValueError(f"the prompt has {len(tokens)} tokens; this model's context is "
                             f"{limit} tokens")
        bad = [t for t in tokens.token_ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary "
                             f"(0..{self.config.vocab_size - 1})")
        return tokens

    def check_length(self, prompt: Prompt) -> int:
        """The prompt's characters of text; ValueError when they alone prove it longer than
        the context (no tokenizer runs: a hostile 30 MB prompt costs a sum of lengths)."""
        limit = self.config.max_position_embeddings
        chars = fewest = 0  # characters of text; tokens at least (ids and media: exactly)
        for segment in prompt.segments:
            if not isinstance(segment, Text):
                fewest += segment.num_positions
            elif isinstance(segment.content, str):
                chars += len(segment.content)
            else:
                fewest += len(segment.content)
        per_token = getattr(self.tokenizer, "max_token_chars", None)
        if per_token:
            fewest += -(-chars // per_token)
        if fewest >= limit:
            raise ValueError(f"the prompt has at least {fewest} tokens ({chars} characters "
                             f"of text); this model's context is {limit} tokens")
        return chars

    def page_keys(self, token_ids: Any, spans: list[MediaSpan],
                  cache_salt: str = "") -> list[bytes]:
        """The store keys of the full pages of `token_ids` (media digests included); a
        `cache_salt` gives another set of keys: requests of different salts share no page."""
        extra = (self.model_id,) if not cache_salt else (self.model_id, "salt", cache_salt)
        return block_keys(token_ids, self.page_size, extra=extra, media=spans)

    def stats(self) -> EngineStats:
        """Prefills, prompt tokens computed and decode steps since the engine was built."""
        c = self._counts
        return EngineStats(c["prefills"], c["prefill_tokens"], c["decode_steps"])

    async def generate(self, prompt: Prompt | str | list[int],
                       params: SamplingParams | None = None, *,
                       cache_salt: str = "") -> GenerateResult:
        """Generate from `prompt`; returns tokens, text and how much of the prompt was cached.

        With ``params.n > 1`` the n samples share one prefill (the prompt's KV is copied to n
        batch rows) and `GenerateResult.samples` holds all n; sample i is seeded
        ``sampling_seed + i`` when a seed is given. `cache_salt` scopes the KV cache: the
        request reuses (and leaves) pages only for requests of the same salt (a server gives
        each tenant its own, as vLLM's ``cache_salt``).

        Raises:
            ValueError: a prompt the model cannot serve, an invalid grammar or stop_regex,
                n above `max_batch`, stop strings or regexes on an engine without a
                tokenizer (as SGLang without one).
            ImportError: a grammar field is set and xgrammar is not installed.
        """
        request = await self._admit(prompt, params, cache_salt)
        try:
            while any(sample.finish_reason is None for sample in request.samples):
                await self._advance()
        finally:
            for sample in request.samples:
                self._forget(sample)
        return self._result(request)

    def stream(self, prompt: Prompt | str | list[int],
               params: SamplingParams | None = None, *, cache_salt: str = "") -> TokenStream:
        """Generate from `prompt`: an async iterator of token ids as they are sampled, whose
        `result` (cached tokens, time to first token...) is there once it is exhausted.

        With ``params.stream_interval = k`` tokens arrive as SGLang sends them: the first at
        once, then k at a time, the rest at the end (the iterator still yields single ids).
        `cache_salt` as for `generate`.

        Raises:
            ValueError: ``params.n > 1`` (a stream carries one sample; use `generate`).
        """
        if params is not None and params.n > 1:
            raise ValueError(f"a stream carries one sample, got n={params.n}: use generate()")
        return TokenStream(self, prompt, params, cache_salt)

    async def _stream(self, prompt: Any, params: SamplingParams | None, stream: TokenStream,
                      cache_salt: str = "") -> AsyncIterator[int]:
        request = await self._admit(prompt, params, cache_salt)
        request.streaming = True
        stream._request = request
        try:
            while True:
                if request.finish_reason is None:
                    await self._advance()
                if self._stream_due(request):
                    while request.num_sent < len(request.output):
                        request.num_sent += 1
                        yield request.output[request.num_sent - 1]
                if request.finish_reason is not None:
                    stream.result = self._result(request)
                    return
        finally:
            self._forget(request)

    async def _admit(self, prompt: Any, params: SamplingParams | None,
                     cache_salt: str = "") -> _Request:
        prompt = as_prompt(prompt)
        if self.check_length(prompt) > TOKENIZE_IN_THREAD_CHARS:
            tokens = await trio.to_thread.run_sync(self._tokenize, prompt)
        else:
            tokens = self._tokenize(prompt)
        params = params if params is not None else self.default_params(len(tokens))
        if params.n > self.max_batch:
            raise ValueError(f"n={params.n} samples need {params.n} batch rows; this engine "
                             f"decodes {self.max_batch} at most (max_batch)")
        if (params.stop or params.stop_regex) and self.tokenizer is None:
            raise ValueError("stop and stop_regex need a tokenizer to read the output's text; "
                             "this engine has none (stop_token_ids work without one)")
        grammar = await self._compile_grammar(params)
        spans = [MediaSpan(m.start, m.length, m.segment.digest) for m in tokens.media]
        keys, started = self.page_keys(tokens.token_ids, spans, cache_salt), time.perf_counter()
        samples = [_Request(tokens, sample_params(params, i), keys, spans, started=started,
                            cache_salt=cache_salt) for i in range(params.n)]
        for sample in samples:
            constraint = None
            if grammar is not None and self._grammars is not None:
                constraint = self._grammars.constraint(grammar[1], grammar[0])
            sample.sampling = RequestSamplingState(
                sample.params, tokens.token_ids, context_length=self.config.max_position_embeddings,
                eos_token_ids=self._eos_ids(), vocab_size=self.config.vocab_size,
                constraint=constraint,
                encode=None if self.tokenizer is None else self.tokenizer.encode)
        request, request.forks = samples[0], samples[1:]
        if self.store is not None:
            usable = request.keys[: (len(tokens) - 1) // self.page_size]
            await self.store.prefetch(usable, recompute_page_s=self._prefill_page_s)
        self._waiting.append(request)
        return request

    async def _compile_grammar(self, params: SamplingParams) -> tuple[GrammarKind, Any] | None:
        """The request's compiled grammar (kind, grammar), compiled off the event loop."""
        spec = grammar_spec(params)
        if spec is None:
            return None
        if self.tokenizer is None:
            raise ValueError(f"{spec[0]} needs a tokenizer; this engine has none")
        if self._grammars is None:  # (a cached grammar then costs no await: requests
            async with self._grammar_lock:  # arriving together still start in one step)
                if self._grammars is None:
                    self._grammars = await trio.to_thread.run_sync(
                        GrammarBackend, self.tokenizer, self.config.vocab_size,
                        self._eos_ids())
        kind, text = spec
        return kind, await self._grammars.compile_async(kind, text)

    def _eos_ids(self) -> tuple[int, ...]:
        eos = () if self.tokenizer is None else self.tokenizer.eos_token_ids
        return tuple(eos or self.config.eos_token_ids)

    @staticmethod
    def _stream_due(r: _Request) -> bool:
        """Whether a stream hands its unsent tokens to its caller now (`stream_interval`)."""
        return stream_due(r.num_sent, len(r.output), r.params.stream_interval or 1,
                          r.finish_reason is not None)

    def _forget(self, request: _Request) -> None:
        if request.finish_reason is None:
            request.finish_reason = "cancelled"
        request.cancelled = True
        if request in self._waiting:
            self._waiting.remove(request)
        if not self._driving and request.row is not None:
            self._drop(request)

    async def _advance(self) -> None:
        """Run one step (prefill the waiting, decode the running), or wait for the driver's."""
        if self._driving:
            await self._progress.park()
            return
        self._driving = True
        try:
            await trio.lowlevel.checkpoint()  # requests arriving together start in one step
            admitted, free = [], self.max_batch - len(self._running)
            for r in self._waiting:  # in order; a request of n samples needs n rows
                if len(r.samples) > free:
                    break
                admitted.append(r)
                free -= len(r.samples)
            del self._waiting[: len(admitted)]
            await run_in_worker(self._step, admitted)
        finally:
            self._driving = False
            self._progress.unpark_all()

    def _result(self, request: _Request) -> GenerateResult:
        first, *others = [self._sample_result(r) for r in request.samples]
        return dataclasses.replace(first, other_samples=tuple(others)) if others else first

    def _sample_result(self, r: _Request) -> GenerateResult:
        tokens = list(r.output)
        text = None
        if self.tokenizer is not None:
            matched = None if r.sampling is None else r.sampling.matched_stop
            text = output_text(self.tokenizer, tokens, r.params, matched)
        first = (r.first_token_at or time.perf_counter()) - r.started
        return GenerateResult(tokens, text, len(r.tokens), r.cached_tokens, r.finish_reason,
                              first)

    # -- one step, in a worker thread ---------------------------------------------------------

    @torch.inference_mode()
    def _step(self, admitted: list[_Request]) -> None:
        for r in [r for r in self._running if r.cancelled]:
            self._drop(r)
        for r in admitted:
            if not r.cancelled:
                self._prefill(r)
        # Decode on in this thread while nothing needs the event loop (no one waits to be
        # admitted, no stream wants its token now, nobody finished), for up to STEP_BUDGET:
        # a hop to the event loop and back costs as much as a small model's decode step.
        deadline = time.perf_counter() + STEP_BUDGET
        while self._running:
            size = len(self._running)
            self._decode()
            if (len(self._running) != size or self._waiting or time.perf_counter() > deadline
                    or any(r.cancelled or (r.streaming and self._stream_due(r))
                           for r in self._running)):
                return

    def _prefill(self, r: _Request) -> None:
        ids = r.tokens.token_ids
        r.row = self._batch.open_row(len(ids))
        self._running.append(r)
        self._load_cached_prefix(r)
        start = r.cached_tokens
        past = self._batch.row_kv(r.row, 0, start) if start else None
        positions = torch.arange(start, len(ids), device=self.device)[None]
        began = time.perf_counter()
        hidden, new_kv = self.model.forward(self.embed_prompt(r.tokens, start), positions, past)
        self._note_prefill(time.perf_counter() - began, len(ids) - start)
        self._counts["prefills"] += 1
        self._counts["prefill_tokens"] += len(ids) - start
        logits = self.model.logits(hidden[:, -1])
        # the lead has its row whatever happens now; a fork cancelled before it got one
        # needs none (a cancel arriving later is dropped at the next step's start)
        samples = [r, *(fork for fork in r.forks if not fork.cancelled)]
        firsts = [(sample, self._first_token(sample, logits)) for sample in samples]
        # After the first tokens, which need none of it: the row's KV, the forks' copies of
        # it, the new pages in the store
        self._batch.extend(r.row, new_kv)
        r.length = len(ids)
        r.stored_pages = start // self.page_size
        for fork in samples[1:]:
            self._fork(r, fork)
        self._store_pages(r, ids)
        for sample, token in firsts:
            if token is None:  # max_new_tokens=0: the prompt is cached only
                sample.finish_reason = sample.sampling.finish_reason
                self._drop(sample)
            else:
                self._finish_or_continue(sample, token)

    def _fork(self, lead: _Request, fork: _Request) -> None:
        """Give `fork` (another sample of `lead`'s prompt) a batch row holding a copy of the
        lead's prompt KV: n samples, one prefill."""
        fork.row = self._batch.fork(lead.row)
        self._running.append(fork)
        fork.length, fork.stored_pages = lead.length, lead.stored_pages
        fork.cached_tokens = lead.cached_tokens

    def _note_prefill(self, seconds: float, tokens: int) -> None:
        """Fold one prefill's wall time per page into the recompute-cost estimate."""
        if tokens <= 0:
            return
        per_page = seconds / tokens * self.page_size
        last = self._prefill_page_s
        self._prefill_page_s = per_page if last is None else (
            last + PREFILL_EWMA * (per_page - last))

    def _load_cached_prefix(self, r: _Request) -> None:
        """Copy the longest cached prefix's pages into the request's batch row."""
        if self.store is None:
            return
        usable = r.keys[: (len(r.tokens) - 1) // self.page_size]  # compute >= 1 token
        try:
            lease = self.store.acquire(usable[: self.store.match(usable)])
        except KVCapacityError as exc:  # the store cannot lend them now: recompute
            log.warning("KV prefix not reused: %s", exc)
            return
        with lease:
            if len(lease):
                self._batch.write_pages(r.row, lease.pages)
                r.cached_tokens = len(lease) * self.page_size

    def embed_prompt(self, tokens: PromptTokens, start: int = 0) -> torch.Tensor:
        """Input embeddings ``[1, T - start, hidden]`` of a prompt's tokens from `start` on,
        with each image's and audio clip's embeddings at its placeholder positions."""
        ids = torch.tensor(tokens.token_ids[start:], device=self.device)[None]
        hidden = self.model.embed(ids)  # [1, T - start, hidden]
        for item in tokens.media:
            lo, hi = max(item.start, start), min(item.start + item.length, len(tokens))
            if lo >= hi:
                continue
            encoder = self.image_encoder if item.kind == "image" else self.audio_encoder
            embeds = encoder.encode(item.segment).to(hidden.device, hidden.dtype)  # [n, E]
            hidden[0, lo - start: hi - start] = embeds[lo - item.start: hi - item.start]
        return hidden

    def _decode(self) -> None:
        running = self._running
        tokens = torch.tensor([[r.output[-1]] for r in running], device=self.device)
        positions = torch.tensor([[r.length] for r in running], device=self.device)
        hidden, new_kv = self.model.forward(self.model.embed(tokens), positions,
                                            self._batch.past(), self._batch.mask())
        self._counts["decode_steps"] += 1
        self._batch.append(new_kv)
        logits = self.model.logits(hidden[:, -1])
        for r in running:
            r.length += 1
        rows = tuple(r.sampling for r in running)
        if self._batch_sampling is None or self._batch_sampling.requests != rows:
            self._batch_sampling = TokenSamplingState(rows)
        sampled = self._sampler.step(logits, self._batch_sampling).tolist()
        for i, r in enumerate(list(running)):
            if r.length // self.page_size > r.stored_pages:
                self._store_pages(r, r.tokens.token_ids + tuple(r.output))
            self._finish_or_continue(r, sampled[i])

    def _first_token(self, r: _Request, logits: torch.Tensor) -> int | None:
        """The request's first token from its prompt's last logits (None when it asked for
        none); its time to first token ends here."""
        r.first_token_at = time.perf_counter()
        if r.sampling.finish_reason is not None:
            return None
        return int(self._sampler.step(logits, TokenSamplingState([r.sampling]))[0])

    def _finish_or_continue(self, r: _Request, token: int) -> None:
        r.output.append(token)
        text = None
        tail = r.sampling.stop_tail_ids()
        if tail and self.tokenizer is not None:
            # SGLang matches stop strings and regexes in the text of the output's last tokens
            # only (its tail window), decoded with special tokens kept
            text = self.tokenizer.decode(tail, skip_special_tokens=False)
        reason = r.sampling.check_stop(token, text, self._eos_ids())
        if reason is not None:
            r.finish_reason = reason
            self._drop(r)

    def _drop(self, r: _Request) -> None:
        """Take a request out of the batch; the last row's request moves into its row."""
        if r.row is None:
            return
        row, r.row = r.row, None
        moved = self._batch.remove(row)
        last = self._running.pop()
        if moved is not None:
            self._running[row] = last
            last.row = row

    def _store_pages(self, r: _Request, ids: tuple[int, ...]) -> None:
        """Put the request's newly completed full pages into the store (best effort)."""
        if self.store is None:
            return
        full = r.length // self.page_size
        if full <= r.stored_pages:
            return
        keys = self.page_keys(ids[: full * self.page_size], r.spans,
                              r.cache_salt)[r.stored_pages:]
        start = r.stored_pages * self.page_size
        kv = self._batch.row_kv(r.row, 0, full * self.page_size)
        pages = self.model.kv_to_pages(kv, start, self.page_size)
        try:
            self.store.put(keys, pages.contiguous())
        except KVCapacityError as exc:
            log.warning("KV pages not cached: %s", exc)
        r.stored_pages = full

    def __repr__(self) -> str:
        return (f"<TorchEngine {self.model_id} running={len(self._running)} "
                f"waiting={len(self._waiting)} store={describe_store(self.store)}>")
