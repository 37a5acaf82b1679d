"""`TorchEngine`: the reference engine: a decoder (Llama, Qwen2, Qwen3, Qwen3-MoE, Qwen3-Omni's
thinker) on Omni's paged KV store.

The engine is the trio shell over two synchronous parts: the `Scheduler` plans each step
(which requests leave, which prefill, in which batch rows) and the `ModelRunner` computes it
(prefill after the cached prefix, a batched decode, pages into the store). A request's prompt
is flattened to token ids (media at placeholder positions) and cut into page keys here.

Requests are batched per decode step (continuous batching) without a background task: the
first waiting request drives the steps for everyone and hands over when it finishes. Each
step runs in a worker thread, so the event loop never waits on a forward pass.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch
import trio

from omni._openmp import run_in_worker
from omni.compute._default_store import StoreOption, choose_store, describe_store
from omni.compute._engine_chat import ChatMixin, load_tokenizer_and_defaults
from omni.compute._engine_types import EngineStats, GenerateResult, TokenStream, _Request
from omni.compute._output import sample_params
from omni.compute.encoders import MediaEncoders
from omni.compute.grammar import GrammarBackend, GrammarKind, grammar_spec
from omni.compute.models import DecoderLM, load_media, load_pretrained, tiny_model
from omni.compute.prompt import (
    Prompt,
    PromptTokens,
    as_prompt,
    check_length,
    tokenize_for_model,
)
from omni.compute.runner import ModelRunner
from omni.compute.sampling import RequestSamplingState, SamplingParams
from omni.compute.scheduler import Scheduler
from omni.compute.tokenizer import ByteTokenizer, Tokenizer
from omni.kv import KVStore

__all__ = ["EngineStats", "GenerateResult", "TokenStream", "TorchEngine"]

# a prompt with more characters of text than this is tokenized in a worker thread (a 64k-char
# text takes ~10 ms to tokenize: the event loop's budget for one step)
TOKENIZE_IN_THREAD_CHARS = 1 << 16


class TorchEngine(ChatMixin):
    """A decoder language model serving from Omni's KV store.

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
        media: the model's media encoders (None: built in; a Qwen3-Omni checkpoint's own).

    Conversations: `chat`, `chat_stream`, `chat_prompt` (the checkpoint's chat template);
    `generation_defaults` (from generation_config.json, see `from_pretrained`) gives the
    sampling of requests that pass no params (`default_params`).

    Raises:
        ValueError: a store whose layout is not the model's, or a `store` that is neither a
            `KVStore`, None nor "auto".
    """

    def __init__(self, model: DecoderLM, config: Any, *, tokenizer: Tokenizer | None = None,
                 store: StoreOption = "auto", page_size: int = 16, model_id: str = "model",
                 max_batch: int = 16, media: MediaEncoders | None = None, seed: int = 0):
        self.config = config
        self.page_size = page_size
        self.model_id = model_id
        self.max_batch = max_batch
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.kv_layout = config.kv_layout(page_size, self.dtype)
        self.store: KVStore | None = choose_store(store, self.kv_layout, self.device)
        self.scheduler: Scheduler[_Request] = Scheduler(max_batch)
        self.runner = ModelRunner(model, config, self.scheduler, tokenizer=tokenizer,
                                  store=self.store, page_size=page_size, model_id=model_id,
                                  media=media, seed=seed)
        self.model, self.media = self.runner.model, self.runner.media
        self._driving = False
        self._progress = trio.lowlevel.ParkingLot()
        self._grammars: GrammarBackend | None = None  # built by the first constrained request
        self._grammar_lock = trio.Lock()

    @property
    def tokenizer(self) -> Tokenizer | None:
        """str <-> ids (None: prompts must give token ids); the runner's, for stop strings."""
        return self.runner.tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer: Tokenizer | None) -> None:
        self.runner.tokenizer = tokenizer

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
                        device: str | torch.device = "cpu", tokenizer: str | Path | None = None,
                        layers: int | None = None, **kwargs: Any) -> TorchEngine:
        """Load a Hugging Face directory (config.json + safetensors, sharded or not).

        With it come the tokenizer (tokenizer.json, its special tokens and chat template, for
        `chat`; from the folder `tokenizer` when given: a diffusers pipeline keeps its text
        encoder's in ``tokenizer/`` beside ``text_encoder/``), and generation_config.json:
        its sampling settings become the default of requests without params (see
        `omni.compute.generation_config`) and its EOS ids end
        generation (else config.json's, else the tokenizer's `eos_token`). The weights are
        read straight onto `device` ("cuda": the model, its batch KV and its default store
        live on the GPU). `layers`: only the first that many decoder layers (a negative number:
        all but that many last ones), for a model whose output is read at an inner layer
        (`omni.compute.models.load_pretrained`).

        Raises:
            ValueError: no such directory, no config.json or weights, an unsupported
                architecture, weights that do not fit the config, an unreadable
                tokenizer_config.json / generation_config.json, an invalid chat template.
        """
        model, config = load_pretrained(path, dtype=dtype, device=device, layers=layers)
        loaded, defaults = load_tokenizer_and_defaults(path, tuple(config.eos_token_ids),
                                                       tokenizer)
        engine = cls(model, config, tokenizer=loaded, store=store, page_size=page_size,
                     model_id=kwargs.pop("model_id", Path(path).resolve().name),
                     media=load_media(path, dtype, device), **kwargs)
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
        return tokenize_for_model(prompt, self.tokenizer.encode if self.tokenizer else None,
                                  self.config.max_position_embeddings, self.config.vocab_size,
                                  self.media)

    def check_length(self, prompt: Prompt) -> int:
        """The prompt's characters of text; ValueError when they alone prove it longer than
        the context (no tokenizer runs: a hostile 30 MB prompt costs a sum of lengths)."""
        return check_length(prompt, self.config.max_position_embeddings,
                            getattr(self.tokenizer, "max_token_chars", None), self.media)

    def stats(self) -> EngineStats:
        """Prefills, prompt tokens computed and decode steps since the engine was built."""
        return EngineStats(*self.runner.counts.values())  # prefills, tokens, decode steps

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
        return request.result(self.tokenizer)

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
                if request.stream_due():
                    while request.num_sent < len(request.output):
                        request.num_sent += 1
                        yield request.output[request.num_sent - 1]
                if request.finish_reason is not None:
                    stream.result = request.result(self.tokenizer)
                    return
        finally:
            self._forget(request)

    async def _admit(self, prompt: Any, params: SamplingParams | None,
                     cache_salt: str = "") -> _Request:
        prompt = as_prompt(prompt)
        in_thread = self.check_length(prompt) > TOKENIZE_IN_THREAD_CHARS
        tokens = (await trio.to_thread.run_sync(self._tokenize, prompt) if in_thread
                  else self._tokenize(prompt))
        params = params if params is not None else self.default_params(len(tokens))
        self.scheduler.check_fits(params.n)
        if (params.stop or params.stop_regex) and self.tokenizer is None:
            raise ValueError("stop and stop_regex need a tokenizer to read the output's text; "
                             "this engine has none (stop_token_ids work without one)")
        grammar = await self._compile_grammar(params)
        spans = tokens.spans()
        keys = self.runner.page_keys(tokens.token_ids, spans, cache_salt)
        started = time.perf_counter()
        samples = [_Request(tokens, sample_params(params, i), keys, spans, started=started,
                            cache_salt=cache_salt) for i in range(params.n)]
        for sample in samples:
            constraint = (None if grammar is None or self._grammars is None
                          else self._grammars.constraint(grammar[1], grammar[0]))
            sample.sampling = RequestSamplingState(
                sample.params, tokens.token_ids, context_length=self.config.max_position_embeddings,
                eos_token_ids=self.runner.eos_ids(), vocab_size=self.config.vocab_size,
                constraint=constraint, encode=getattr(self.tokenizer, "encode", None))
        request, request.forks = samples[0], samples[1:]
        if self.store is not None:
            await self.store.prefetch(self.runner.reusable_keys(request),
                                      recompute_page_s=self.runner.prefill_page_s)
        self.scheduler.submit(request)
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
                        self.runner.eos_ids())
        kind, text = spec
        return kind, await self._grammars.compile_async(kind, text)

    def _forget(self, request: _Request) -> None:
        if request.finish_reason is None:
            request.finish_reason = "cancelled"
        request.cancelled = True
        self.scheduler.withdraw(request)
        if not self._driving and request.row is not None:
            self.runner.drop(request)

    async def _advance(self) -> None:
        """Run one step (prefill the waiting, decode the running), or wait for the driver's."""
        if self._driving:
            await self._progress.park()
            return
        self._driving = True
        try:
            await trio.lowlevel.checkpoint()  # requests arriving together start in one step
            await run_in_worker(self.runner.execute, self.scheduler.plan())
        finally:
            self._driving = False
            self._progress.unpark_all()

    def __repr__(self) -> str:
        return (f"<TorchEngine {self.model_id} running={len(self.scheduler.running)} "
                f"waiting={len(self.scheduler.waiting)} store={describe_store(self.store)}>")
