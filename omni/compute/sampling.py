"""Sampling: SGLang's `SamplingParams`, and samplers that turn a forward pass into the next input.

`TokenSampler` turns logits into next token ids (per-request history in `RequestSamplingState`,
one batch composition's tensors in `TokenSamplingState`); a diffusion sampler is another `Sampler`.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

import numpy as np
import torch

from omni.compute.sampling_params import GREEDY_TEMPERATURE, FinishReason, SamplingParams

__all__ = ["GREEDY_TEMPERATURE", "FinishReason", "RequestSamplingState", "Sampler",
           "SamplingParams", "TokenSampler", "TokenSamplingState", "truncate_at_stop"]

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


def truncate_at_stop(text: str, stop: Iterable[str]) -> str:
    """`text` cut before the earliest occurrence of any stop string (SGLang's output rule)."""
    cuts = [i for i in (text.find(s) for s in stop if s) if i >= 0]
    return text[:min(cuts)] if cuts else text


class RequestSamplingState:
    """One request's sampling history, kept for the request's lifetime.

    Why: penalties need the prompt and the tokens sampled so far; reproducible sampling needs a
    generator only this request draws from, so its tokens do not depend on the rest of the batch;
    stop checks need the parameters. Batches come and go around it (`TokenSamplingState`).
    """

    def __init__(self, params: SamplingParams, prompt_token_ids: Iterable[int] = (), *,
                 eos_token_ids: Collection[int] = (), constraint: Any = None,
                 logit_processor: Any = None, context_length: int | None = None) -> None:
        self.params = params
        self.eos_token_ids = tuple(eos_token_ids)
        self.constraint = constraint
        self.context_length = context_length
        self.prompt_token_ids: tuple[int, ...] = tuple(int(t) for t in prompt_token_ids)
        self.output_token_ids: list[int] = []  # appended by TokenSampler.step
        self.finish_reason: FinishReason | None = "length" if params.max_new_tokens == 0 else None
        self.matched_stop: int | str | None = None  # the stop token id or string that matched
        self.generator = torch.Generator()
        seed = params.sampling_seed if params.sampling_seed is not None else params.seed
        if seed is None:
            self.generator.seed()  # a non-deterministic seed from the OS
        else:
            self.generator.manual_seed(seed % 2**64)
        self._uniforms: list[float] = []

    def __repr__(self) -> str:
        return (f"<RequestSamplingState prompt={len(self.prompt_token_ids)} "
                f"output={len(self.output_token_ids)} finish={self.finish_reason}>")

    def next_uniform(self) -> float:
        """The next draw in [0, 1) from this request's generator (drawn 64 at a time)."""
        if not self._uniforms:
            draws = torch.rand(64, generator=self.generator, dtype=torch.float64)
            self._uniforms = draws.tolist()[::-1]
        return self._uniforms.pop()

    def output_token_counts(self, vocab_size: int) -> torch.Tensor:
        """How often each token id occurs in the output so far: int64 [vocab_size]."""
        ids = torch.tensor(self.output_token_ids, dtype=torch.int64)
        return torch.bincount(ids[(ids >= 0) & (ids < vocab_size)], minlength=vocab_size)

    def check_stop(self, new_token: int, text_so_far: str | None = None,
                   eos_token_ids: Collection[int] = ()) -> FinishReason | None:
        """Whether the request ends after `new_token` (already recorded by `TokenSampler.step`).

        In SGLang's order: "length" once max_new_tokens tokens were generated; "stop" for a stop
        token id, an eos id (unless ignore_eos) or a stop string in `text_so_far` (cut the text
        with `truncate_at_stop`); else None. Also sets `finish_reason` and `matched_stop`.
        """
        params, reason, matched = self.params, None, None
        if len(self.output_token_ids) >= params.max_new_tokens or (
                self.context_length is not None and len(self.prompt_token_ids)
                + len(self.output_token_ids) >= self.context_length):
            reason = "length"
        elif new_token in params.stop_token_ids or (
                not params.ignore_eos and new_token in eos_token_ids):
            reason, matched = "stop", new_token
        elif text_so_far is not None:
            stop: tuple[str, ...] = params.stop  # type: ignore[assignment]
            hits = [(text_so_far.find(s), s) for s in stop if s in text_so_far]
            reason, matched = ("stop", min(hits)[1]) if hits else (None, None)
            for pattern in params.stop_regex if reason is None else ():  # type: ignore[union-attr]
                if re.search(pattern, text_so_far):
                    reason, matched = "stop", pattern
                    break
        if reason is None and self.constraint is not None and self.constraint.is_terminated():
            reason, matched = "stop", new_token
        self.finish_reason, self.matched_stop = reason, matched
        return reason


@dataclass(frozen=True, slots=True)
class _Columns:
    """Per-row parameters as [B, 1] tensors; greedy rows get neutral ones (they take argmax)."""

    rows: torch.Tensor  # [B] int64
    greedy: torch.Tensor  # [B] bool
    inv_temperature: torch.Tensor
    top_k: torch.Tensor  # int64; 1 where off (masked by top_k_on)
    top_k_on: torch.Tensor
    top_p: torch.Tensor
    top_p_on: torch.Tensor
    min_p: torch.Tensor
    repetition: torch.Tensor
    frequency: torch.Tensor
    presence: torch.Tensor

    @classmethod
    def build(cls, rows: list[tuple[SamplingParams, bool]], vocab_size: int,
              device: torch.device) -> _Columns:
        def column(values: list[Any], dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device).view(-1, 1)

        return cls(
            rows=torch.arange(len(rows), device=device),
            greedy=torch.tensor([g for _, g in rows], dtype=torch.bool, device=device),
            inv_temperature=column([1.0 if g else 1.0 / p.temperature for p, g in rows]),
            top_k=column([min(max(p.top_k, 1), vocab_size) for p, _ in rows], torch.int64),
            top_k_on=column([p.top_k != -1 and not g for p, g in rows], torch.bool),
            top_p=column([p.top_p for p, _ in rows]),
            top_p_on=column([p.top_p < 1.0 and not g for p, g in rows], torch.bool),
            min_p=column([0.0 if g else p.min_p for p, g in rows]),
            repetition=column([p.repetition_penalty for p, _ in rows]),
            frequency=column([p.frequency_penalty for p, _ in rows]),
            presence=column([p.presence_penalty for p, _ in rows]),
        )


class _PenaltyTables:
    """The multipliers and offsets the penalties apply, per row and token: [B, V] tables.

    Why: penalties depend on each row's whole history. Tables updated by one write per row per
    step turn them into a few branch-free in-place passes, with no per-step rebuild; rows without
    penalties hold neutral entries (1 and 0), which leave their logits bit-for-bit unchanged.
    """

    def __init__(self, requests: Sequence[RequestSamplingState], cols: _Columns,
                 vocab_size: int, device: torch.device) -> None:
        shape, self._cols = (len(requests), vocab_size), cols
        self.counts = torch.zeros(shape, device=device)  # occurrences in the output
        seen = torch.zeros(shape, dtype=torch.bool, device=device)  # in prompt or output
        for row, request in enumerate(requests):
            if request.params.has_penalties:
                self.counts[row] = request.output_token_counts(vocab_size).to(device)
                prompt = torch.tensor(request.prompt_token_ids, dtype=torch.int64)
                seen[row, prompt[(prompt >= 0) & (prompt < vocab_size)].to(device)] = True
        seen |= self.counts > 0
        self.positive = torch.where(seen, 1.0 / cols.repetition, 1.0)  # x > 0: x * positive
        self.negative = torch.where(seen, cols.repetition, 1.0)  # x < 0: x * negative
        self.offset = cols.frequency * self.counts + cols.presence * (self.counts > 0)
        self.any_repetition = any(r.params.repetition_penalty != 1.0 for r in requests)

    def apply_(self, scores: torch.Tensor, spare: torch.Tensor) -> None:
        """In place on `scores`: repetition, then frequency and presence penalties."""
        if self.any_repetition:
            negative = torch.clamp(scores, max=0, out=spare).mul_(self.negative)
            scores.clamp_(min=0).mul_(self.positive).add_(negative)
        scores.sub_(self.offset)

    def record(self, tokens: torch.Tensor) -> None:
        """Count each row's new token (one per row, so the scattered writes never collide)."""
        rows, cols = self._cols.rows, self._cols
        count = self.counts[rows, tokens] + 1.0
        self.counts[rows, tokens] = count
        self.offset[rows, tokens] = cols.frequency[:, 0] * count + cols.presence[:, 0]
        self.positive[rows, tokens] = 1.0 / cols.repetition[:, 0]
        self.negative[rows, tokens] = cols.repetition[:, 0]


class TokenSamplingState:
    """The rows of one decode batch, with their parameters as per-row tensors.

    Why: the decode loop samples every step, but the batch changes only when a request joins or
    leaves. Columns, penalty tables and [B, V] scratch buffers are made once per composition (at
    the first step, when V and the device are known), so a step allocates no large tensor; flags
    skip the stages no row needs (all-greedy without penalties is one argmax). Build a new state
    when rows join or leave (penalty tables are rebuilt from the requests' histories).
    """

    def __init__(self, requests: Sequence[RequestSamplingState]) -> None:
        self.requests = tuple(requests)
        params = [r.params for r in self.requests]
        self._rows = [(p, p.is_greedy) for p in params]
        sampled = [p for p, greedy in self._rows if not greedy]
        self.all_greedy, self.any_greedy = not sampled, len(sampled) < len(params)
        self.any_penalty = any(p.has_penalties for p in params)
        self.any_temperature = any(p.temperature != 1.0 for p in sampled)
        self.any_top_k = any(p.top_k != -1 for p in sampled)
        self.any_top_p = any(p.top_p < 1.0 for p in sampled)
        self.any_min_p = any(p.min_p > 0.0 for p in sampled)
        # top-k / top-p read each row's `sort_width` largest probabilities; a top-p row without
        # top-k may need more and widens it, for later steps too (distributions change slowly)
        open_top_p = any(p.top_p < 1.0 and p.top_k == -1 for p in sampled)
        self.sort_width = max([256 if open_top_p else 1] + [p.top_k for p in sampled])
        self.constrained = [i for i, r in enumerate(self.requests) if r.constraint is not None]
        self._vocab_size: int | None = None
        self._columns: _Columns | None = None
        self._penalties: _PenaltyTables | None = None
        self._scratch: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self.requests)

    def __repr__(self) -> str:
        return (f"<TokenSamplingState rows={len(self)} greedy={sum(g for _, g in self._rows)} "
                f"penalised={sum(p.has_penalties for p, _ in self._rows)}>")

    def columns(self, logits: torch.Tensor) -> _Columns:
        """The per-row tensors for `logits` [B, V]; ValueError if B or V does not fit."""
        if logits.dim() != 2 or logits.shape[0] != len(self):
            raise ValueError(f"expected logits [{len(self)}, V], got {list(logits.shape)}")
        vocab_size, device = logits.shape[1], logits.device
        if self._columns is None:
            self._vocab_size = vocab_size
            self._columns = _Columns.build(self._rows, vocab_size, device)
            if self.any_penalty:
                self._penalties = _PenaltyTables(self.requests, self._columns, vocab_size, device)
        elif vocab_size != self._vocab_size:
            raise ValueError(f"vocab size changed from {self._vocab_size} to {vocab_size}")
        return self._columns

    def scratch(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Reused buffers: two float32 [B, V] and one bool [B, V] (after `columns`)."""
        if self._scratch is None:
            assert self._columns is not None and self._vocab_size is not None, "after columns()"
            shape, device = (len(self), self._vocab_size), self._columns.rows.device
            self._scratch = (torch.empty(shape, device=device), torch.empty(shape, device=device),
                             torch.empty(shape, dtype=torch.bool, device=device))
        return self._scratch

    def penalised(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` as float32 after each row's penalties, in the first scratch buffer."""
        scores, spare, _ = self.scratch()
        scores.copy_(logits)
        if self._penalties is not None:
            self._penalties.apply_(scores, spare)
        return scores

    def uniforms(self, device: torch.device) -> torch.Tensor:
        """One draw per row from each request's own generator (0 for greedy rows): [B]."""
        draws = [0.0 if greedy else r.next_uniform()
                 for r, (_, greedy) in zip(self.requests, self._rows, strict=True)]
        return torch.tensor(draws, dtype=torch.float32, device=device)

    def record(self, tokens: torch.Tensor) -> list[int]:
        """Append each row's sampled token to its request and to the penalty tables."""
        token_ids = tokens.tolist()
        for request, token_id in zip(self.requests, token_ids, strict=True):
            request.output_token_ids.append(token_id)
            if request.constraint is not None:
                request.constraint.accept(token_id)
        if self._penalties is not None:
            self._penalties.record(tokens)
        return token_ids


class TokenSampler:
    """Samples next token ids from logits, each row with its own `SamplingParams`.

    Order as SGLang and vLLM: penalties (repetition on prompt + output tokens; frequency and
    presence from output counts), temperature, top-k / top-p / min-p, softmax, then one draw per
    row from that request's generator (inverse CDF in vocabulary order), so on CPU a seeded row
    gives the same tokens whatever else is in the batch. Greedy rows take the argmax of the
    penalised logits. Implements `Sampler[TokenSamplingState]`.
    """

    def __init__(self) -> None:
        self.num_steps = 0
        self.num_fast_steps = 0  # steps served by a plain argmax

    def __repr__(self) -> str:
        return f"<TokenSampler steps={self.num_steps} fast={self.num_fast_steps}>"

    def step(self, output: torch.Tensor, state: TokenSamplingState) -> torch.Tensor:
        """Next token ids [B] (int64) for logits `output` [B, V], recorded in `state`.

        Raises ValueError when `output` is not [len(state), V] or V changed since the last step.
        """
        cols = state.columns(output)
        self.num_steps += 1
        if state.all_greedy and not state.any_penalty and not state.constrained:
            self.num_fast_steps += 1
            tokens = output.argmax(dim=-1)
        else:
            scores = state.penalised(output)
            if state.constrained:
                _apply_constraints(scores, state)
            greedy = scores.argmax(dim=-1) if state.any_greedy else None
            if greedy is not None and state.all_greedy:
                tokens = greedy
            else:
                weights = _weights(scores, state, cols)
                tokens = _inverse_cdf(weights, state.uniforms(weights.device), state.scratch()[1])
                if greedy is not None:
                    tokens = torch.where(cols.greedy, greedy, tokens)
        state.record(tokens)
        return tokens

    def probs(self, logits: torch.Tensor, state: TokenSamplingState) -> torch.Tensor:
        """The distribution `step` would draw from: [B, V] float32, greedy rows one-hot.

        Does not advance `state` (no draw, nothing recorded); useful for logprobs and tests.
        """
        cols = state.columns(logits)
        scores = state.penalised(logits)
        one_hot = torch.nn.functional.one_hot(scores.argmax(dim=-1), scores.shape[-1])
        weights = _weights(scores, state, cols)
        probs = weights / weights.sum(dim=-1, keepdim=True)
        return torch.where(cols.greedy[:, None], one_hot.to(probs.dtype), probs)


def _weights(scores: torch.Tensor, state: TokenSamplingState, cols: _Columns) -> torch.Tensor:
    """In place on `scores`: temperature, exp(x - max), then top-k / top-p / min-p.

    Returns unnormalised probabilities (each row's largest is exactly 1). As in SGLang, every
    filter is measured on the same temperature-scaled distribution and the kept sets intersect,
    so each is a per-row probability threshold (ties at it are kept).
    """
    if state.any_temperature:
        scores.mul_(cols.inv_temperature)
    # exp of anything under -87 underflows, which is ~10x slower on CPU: clamp, then zero what
    # is below 1e-37 of the top weight (so -inf logits still get exactly 0)
    weights = scores.sub_(scores.amax(dim=-1, keepdim=True)).clamp_(min=-87.0).exp_()
    torch.nn.functional.threshold_(weights, 1e-37, 0.0)
    if not (state.any_min_p or state.any_top_k or state.any_top_p):
        return weights
    threshold = cols.min_p  # min_p x the largest weight, which is 1
    if state.any_top_k or state.any_top_p:
        threshold = torch.maximum(threshold, _top_threshold(weights, state, cols))
    keep = torch.ge(weights, threshold, out=state.scratch()[2])
    return weights.mul_(keep)  # branch-free: faster than masked_fill on CPU


def _top_threshold(weights: torch.Tensor, state: TokenSamplingState,
                   cols: _Columns) -> torch.Tensor:
    """The smallest weight top-k and top-p keep, per row ([B, 1]; 0 where both are off).

    Reads the `state.sort_width` largest weights of each row, widening that prefix (x8) while
    a top-p row without top-k has its cut-off beyond it. A prefix holds the same values as a
    full sort and CPU cumsum is sequential, so a row's threshold does not depend on the width
    that the other rows ask for.
    """
    vocab_size = weights.shape[-1]
    open_top_p = cols.top_p_on & ~cols.top_k_on
    mass = weights.sum(dim=-1, keepdim=True) * cols.top_p if state.any_top_p else None
    while True:
        width = min(state.sort_width, vocab_size)
        ranked = (weights.sort(dim=-1, descending=True).values if width == vocab_size
                  else weights.topk(width, dim=-1).values)  # [B, width], descending
        kth = ranked.gather(1, cols.top_k.clamp(max=width) - 1)
        threshold = torch.where(cols.top_k_on, kth, 0.0)
        if mass is None:
            return threshold
        mass_before = ranked.cumsum(dim=-1) - ranked  # mass of the more likely tokens
        num_kept = (mass_before < mass).sum(dim=-1, keepdim=True)  # >= 1
        if width == vocab_size or not bool((open_top_p & (num_kept == width)).any()):
            last = ranked.gather(1, num_kept - 1)
            return torch.maximum(threshold, torch.where(cols.top_p_on, last, 0.0))
        state.sort_width = min(width * 8, vocab_size)


def _apply_constraints(scores: torch.Tensor, state: TokenSamplingState) -> None:
    """In place: tokens a row's constraint forbids get -inf; a row allowed none gets EOS.

    On the CPU the bitmask is unpacked and applied with numpy: on a few rows its ops cost a
    fraction of torch's dispatch.
    """
    rows, (b, v) = state.constrained, scores.shape
    bitmask = np.full((len(rows), (v + 31) // 32), -1, dtype=np.int32)
    view = torch.from_numpy(bitmask)
    for i, row in enumerate(rows):
        state.requests[row].constraint.fill_bitmask(view, i)
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :v]
    if not bitmask.any(axis=1).all():  # a row allowed nothing: it takes EOS
        for i in np.flatnonzero(~allowed.any(axis=1)):
            allowed[i, list(state.requests[rows[i]].eos_token_ids)] = 1
    blocked = allowed == 0
    if scores.device.type == "cpu" and len(rows) == b:
        scores.numpy()[blocked] = -np.inf
    else:
        index = torch.tensor(rows, device=scores.device)
        mask = torch.from_numpy(blocked).to(scores.device)
        scores[index] = scores[index].masked_fill(mask, float("-inf"))


def _inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor,
                 out: torch.Tensor) -> torch.Tensor:
    """One index per row of unnormalised `weights` [B, V] for draws `uniforms` [B] in [0, 1)."""
    cdf = torch.cumsum(weights, dim=-1, out=out)  # [B, V], non-decreasing
    total = cdf[:, -1:]
    target = torch.minimum(uniforms[:, None] * total, torch.nextafter(total, total.new_zeros(())))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)  # first cdf > target
