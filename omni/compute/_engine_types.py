"""The values a `TorchEngine` hands out and keeps per request: results, stats, token streams."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from omni.compute._output import output_text, stream_due
from omni.compute.prompt import PromptTokens
from omni.compute.sampling import RequestSamplingState, SamplingParams
from omni.kv import MediaSpan

__all__ = ["EngineStats", "GenerateResult", "TokenStream"]


class _StreamSource(Protocol):
    """What a `TokenStream` needs of its engine."""

    def _stream(self, prompt: Any, params: SamplingParams | None, stream: TokenStream,
                cache_salt: str = "") -> AsyncIterator[int]: ...


@dataclass(frozen=True)
class GenerateResult:
    """One finished generation."""

    token_ids: list[int]
    text: str | None
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose KV came from the store
    finish_reason: str  # "stop", "length" or "cancelled"
    time_to_first_token: float  # seconds
    other_samples: tuple[GenerateResult, ...] = ()  # samples 2..n of an n > 1 request

    @property
    def new_tokens(self) -> int:
        """Prompt tokens computed by this request (not cached)."""
        return self.prompt_tokens - self.cached_tokens

    @property
    def samples(self) -> tuple[GenerateResult, ...]:
        """All `params.n` samples, this one first (one prefill served them all)."""
        return (self, *self.other_samples)


@dataclass(frozen=True)
class EngineStats:
    """What a `TorchEngine` computed so far."""

    num_prefills: int  # forward passes over a prompt (n samples of one prompt: one)
    num_prefill_tokens: int  # prompt tokens those passes computed (cached ones excluded)
    num_decode_steps: int  # batched one-token forward passes


@dataclass(eq=False)
class _Request:
    """One generation in flight. Invariant: `length` tokens (prompt + output[:-1]) have
    their KV in the batch row `row`; `output[-1]` is the next input."""

    tokens: PromptTokens
    params: SamplingParams
    keys: list[bytes]
    spans: list[MediaSpan]
    started: float
    cache_salt: str = ""  # its pages' keys are salted with it (see `TorchEngine.generate`)
    sampling: RequestSamplingState | None = None
    output: list[int] = field(default_factory=list)
    row: int | None = None
    length: int = 0
    position_offset: int = 0  # a decode step's RoPE position is length + this (M-RoPE media)
    cached_tokens: int = 0
    first_token_at: float | None = None
    finish_reason: str | None = None
    cancelled: bool = False
    streaming: bool = False  # its caller takes each token as it comes
    stored_pages: int = 0
    num_sent: int = 0  # tokens a stream handed over
    forks: list[_Request] = field(default_factory=list)  # samples 2..n: rows forked at prefill

    @property
    def samples(self) -> list[_Request]:
        return [self, *self.forks]

    def result(self, tokenizer: Any) -> GenerateResult:
        """What the caller gets: every sample's tokens and text (None without a tokenizer)."""
        first, *others = [sample._sample_result(tokenizer) for sample in self.samples]
        return dataclasses.replace(first, other_samples=tuple(others)) if others else first

    def _sample_result(self, tokenizer: Any) -> GenerateResult:
        tokens, text = list(self.output), None
        if tokenizer is not None:
            matched = None if self.sampling is None else self.sampling.matched_stop
            text = output_text(tokenizer, tokens, self.params, matched)
        first = (self.first_token_at or time.perf_counter()) - self.started
        return GenerateResult(tokens, text, len(self.tokens), self.cached_tokens,
                              self.finish_reason, first)

    def stream_due(self) -> bool:
        """Whether a stream hands its unsent tokens to its caller now (`stream_interval`)."""
        return stream_due(self.num_sent, len(self.output), self.params.stream_interval or 1,
                          self.finish_reason is not None)


class TokenStream:
    """`TorchEngine.stream`'s token ids, as an async iterator (``async for token in ...``).

    `prompt_tokens` is known once the prompt was read (at the first token at the latest),
    `cached_tokens` once the first token arrived (the prefix came from the store then),
    `result` (a `GenerateResult`) once the iteration ended; `aclose()` stops it early.
    """

    def __init__(self, engine: _StreamSource, prompt: Any, params: SamplingParams | None,
                 cache_salt: str = ""):
        self.result: GenerateResult | None = None
        self._request: _Request | None = None
        self._tokens = engine._stream(prompt, params, self, cache_salt)

    @property
    def prompt_tokens(self) -> int | None:
        """The prompt's tokens (None before it was read)."""
        if self.result is not None:
            return self.result.prompt_tokens
        return None if self._request is None else len(self._request.tokens)

    @property
    def cached_tokens(self) -> int | None:
        """Prompt tokens whose KV came from the store (None before the prefill)."""
        if self.result is not None:
            return self.result.cached_tokens
        request = self._request
        return request.cached_tokens if request is not None and request.output else None

    def __aiter__(self) -> TokenStream:
        return self

    async def __anext__(self) -> int:
        return await self._tokens.__anext__()

    async def aclose(self) -> None:
        await self._tokens.aclose()
