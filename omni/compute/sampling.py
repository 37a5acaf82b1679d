"""Sampling: SGLang's `SamplingParams`, and samplers that turn a forward pass into the next input.

`TokenSampler` turns logits into next token ids (per-request history in `RequestSamplingState`,
one batch composition's tensors in `TokenSamplingState`); a diffusion sampler is another `Sampler`.
A request's output can be constrained (`TokenConstraint`, a grammar's token bitmask) and its
logits rewritten by a `LogitProcessor` that receives the request's `custom_params`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch

from omni.compute._stop import stop_tail_len, stop_window
from omni.compute._token_batch import TokenSampler, TokenSamplingState
from omni.compute.sampling_params import GREEDY_TEMPERATURE, FinishReason, SamplingParams

__all__ = ["GREEDY_TEMPERATURE", "FinishReason", "LogitProcessor", "RequestSamplingState",
           "Sampler", "SamplingParams", "TokenConstraint", "TokenSampler", "TokenSamplingState",
           "truncate_at_stop"]

StateT = TypeVar("StateT", contravariant=True)


@runtime_checkable
class Sampler(Protocol[StateT]):
    """Turns a forward pass into the next input.

    `TokenSampler` maps logits [B, V] to next token ids [B]; a diffusion sampler maps the model's
    output for image tokens to the next latents. `state` carries what it needs across steps
    (token history and generators; a noise schedule and timestep), and `step` advances it.
    """

    def step(self, output: torch.Tensor, state: StateT) -> torch.Tensor:
        """Return the next input for the batch and advance `state`."""
        ...


@runtime_checkable
class TokenConstraint(Protocol):
    """What a request's output must match, as xgrammar's token bitmask (a grammar matcher).

    The batched sampler calls `fill_bitmask` for each constrained row before every step
    (skipping terminated ones), masks the disallowed tokens to -inf after the penalties and
    before logit_bias, temperature and greedy (SGLang's order), and calls `accept` with the
    token it records. `RequestSamplingState.check_stop` ends the request ("stop") once the
    constraint `is_terminated`.
    """

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool | None:
        """Write row `row` of `bitmask`, int32 [B, ceil(V / 32)]: bit j of word w set allows
        token 32 * w + j (all bits set: no constraint). May return False to say the row
        allows every token (nothing to mask; xgrammar's ``need_apply``); None counts as
        True."""
        ...

    def accept(self, token_id: int) -> None:
        """Advance past the sampled token."""
        ...

    def is_terminated(self) -> bool:
        """True once the grammar is complete (only EOS can follow)."""
        ...


@runtime_checkable
class LogitProcessor(Protocol):
    """Rewrites logits, designed after SGLang's `CustomLogitProcessor` (a processor written for
    SGLang's `__call__` works unchanged).

    Called once per step for all rows that share this processor (by identity), after the
    penalties, the grammar mask and logit_bias, before temperature and greedy, with those rows'
    logits `logits` [n, V] float32 and one entry per row in `custom_param_list`: the request's
    `custom_params` dict plus ``"__req__"`` (its `RequestSamplingState`, whose
    `origin_input_ids` and `output_ids` read like SGLang's `Req`), or None when the request has
    no `custom_params`. Returns logits of the same shape (it may modify `logits` in place).
    """

    def __call__(self, logits: torch.Tensor,
                 custom_param_list: list[dict[str, Any] | None]) -> torch.Tensor: ...


def truncate_at_stop(text: str, stop: Iterable[str]) -> str:
    """`text` cut before the earliest occurrence of any stop string (SGLang's output rule)."""
    cuts = [i for i in (text.find(s) for s in stop if s) if i >= 0]
    return text[:min(cuts)] if cuts else text


class RequestSamplingState:
    """One request's sampling history, kept for the request's lifetime.

    Why: penalties need the tokens sampled so far; reproducible sampling needs a generator only
    this request draws from, so its tokens do not depend on the rest of the batch; stop checks
    need the parameters, the EOS ids, the constraint and the size of the tail window in which
    stop strings and regexes are looked for. Batches come and go around it
    (`TokenSamplingState`).

    Args:
        params: the request's sampling parameters.
        prompt_token_ids: the prompt (for `context_length` and custom logit processors).
        eos_token_ids: the model's EOS ids: they stop the request (unless `ignore_eos`) and
            `min_new_tokens` masks them, with `stop_token_ids`, until reached.
        constraint: the output constraint (a grammar), or None.
        logit_processor: a custom logit processor, or None.
        context_length: the model's context: the request ends with "length" once prompt and
            output fill it (SGLang's bound, which also gives `max_new_tokens=None` its end).
        vocab_size: the model's vocabulary, for SGLang's `verify(vocab_size)` checks.
        encode: the tokenizer's text -> ids: a stop string's length in tokens sizes the tail
            window (`stop_tail_ids`); None: its length in characters, as SGLang without one.

    Raises:
        ValueError: `params` fails `params.verify(vocab_size)` (a logit_bias token id outside
            the vocabulary), so a bad request fails before it joins a batch.
    """

    def __init__(self, params: SamplingParams, prompt_token_ids: Iterable[int] = (), *,
                 eos_token_ids: Iterable[int] = (), constraint: TokenConstraint | None = None,
                 logit_processor: LogitProcessor | None = None,
                 context_length: int | None = None, vocab_size: int | None = None,
                 encode: Callable[[str], Sequence[int]] | None = None) -> None:
        if vocab_size is not None:
            params.verify(vocab_size)
        # the most output tokens a stop check decodes (0: the request has no stop text)
        self.stop_window = stop_window(params.stop, params.stop_regex,  # type: ignore[arg-type]
                                       encode)
        self.params = params
        self.prompt_token_ids: tuple[int, ...] = tuple(int(t) for t in prompt_token_ids)
        self.eos_token_ids: frozenset[int] = frozenset(int(t) for t in eos_token_ids)
        self.constraint = constraint
        self.logit_processor = logit_processor
        self.context_length = context_length
        self.output_token_ids: list[int] = []  # appended by TokenSampler.step
        self.finish_reason: FinishReason | None = "length" if params.max_new_tokens == 0 else None
        self.matched_stop: int | str | None = None  # the stop token id, string or regex
        self.generator = torch.Generator()
        if params.sampling_seed is None:
            self.generator.seed()  # a non-deterministic seed from the OS
        else:
            self.generator.manual_seed(params.sampling_seed % 2**64)
        self._uniforms: list[float] = []

    def __repr__(self) -> str:
        return (f"<RequestSamplingState prompt={len(self.prompt_token_ids)} "
                f"output={len(self.output_token_ids)} finish={self.finish_reason}>")

    @property
    def origin_input_ids(self) -> list[int]:
        """The prompt's token ids (SGLang's `Req.origin_input_ids`, for logit processors)."""
        return list(self.prompt_token_ids)

    @property
    def output_ids(self) -> list[int]:
        """The tokens sampled so far (SGLang's `Req.output_ids`, for logit processors)."""
        return self.output_token_ids

    @property
    def min_new_tokens_pending(self) -> bool:
        """True while `min_new_tokens` still masks EOS and the stop token ids."""
        return len(self.output_token_ids) < self.params.min_new_tokens

    def next_uniform(self) -> float:
        """The next draw in [0, 1) from this request's generator (drawn 64 at a time)."""
        if not self._uniforms:
            draws = torch.rand(64, generator=self.generator, dtype=torch.float64)
            self._uniforms = draws.tolist()[::-1]
        return self._uniforms.pop()

    def stop_tail_ids(self) -> list[int]:
        """The output ids whose text a stop check searches (SGLang's `Req.tail_str`): the
        last ``max(stop_str_max_len, stop_regex_max_len) + 1``, or all while the output is
        shorter; none when the request has no stop strings or regexes. Decoding only these
        keeps a step's cost independent of the output's length (unless a regex is unbounded,
        which makes the window the whole output, as in SGLang)."""
        if not self.stop_window:
            return []
        return self.output_token_ids[-stop_tail_len(self.stop_window,
                                                    len(self.output_token_ids)):]

    def check_stop(self, new_token: int, tail_text: str | None = None,
                   eos_token_ids: Collection[int] = ()) -> FinishReason | None:
        """Whether the request ends after `new_token` (already recorded by `TokenSampler.step`).

        In SGLang's order (`Req.update_finish_state`): "stop" for a stop string, then a stop
        regex (`re.search`), found in `tail_text`, the text of `stop_tail_ids()` with special
        tokens kept (each list in its order; `min_new_tokens` does not hold them back);
        "stop" for a stop token id or an EOS id (the constructor's and `eos_token_ids`), both
        ignored with `ignore_eos`; "length" once max_new_tokens tokens were generated or
        prompt and output fill `context_length`; "stop" once the constraint is terminated;
        else None. Sets `finish_reason` and `matched_stop` (the string, the regex or the
        token id). `tail_text` None: no text to search (no tokenizer).
        """
        reason, matched = self._check_text(tail_text)
        if reason is None:
            reason, matched = self._check_token(new_token, eos_token_ids)
        self.finish_reason, self.matched_stop = reason, matched
        return reason

    def _check_token(self, new_token: int, eos_token_ids: Collection[int],
                     ) -> tuple[FinishReason | None, int | None]:
        """`check_stop` after the text: stop and EOS ids, then the lengths, then the grammar."""
        params = self.params
        eos = self.eos_token_ids.union(eos_token_ids)
        if not params.ignore_eos and (new_token in params.stop_token_ids or new_token in eos):
            return "stop", new_token
        num_tokens = len(self.prompt_token_ids) + len(self.output_token_ids)
        if (params.max_new_tokens is not None
                and len(self.output_token_ids) >= params.max_new_tokens) or (
                self.context_length is not None and num_tokens >= self.context_length):
            return "length", None
        if self.constraint is not None and self.constraint.is_terminated():
            return "stop", new_token
        return None, None

    def _check_text(self, text: str | None) -> tuple[FinishReason | None, str | None]:
        """SGLang's `Req._check_str_based_finish` for one new token: every stop string,
        then every regex, in the tail's text."""
        if text is None:
            return None, None
        stop: tuple[str, ...] = self.params.stop  # type: ignore[assignment]
        for s in stop:
            if s in text:
                return "stop", s
        stop_regex: tuple[str, ...] = self.params.stop_regex  # type: ignore[assignment]
        for pattern in stop_regex:
            if re.search(pattern, text):
                return "stop", pattern
        return None, None
