"""`TokenSamplingState` (one batch composition) and `TokenSampler` (logits -> token ids)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from omni.compute._logits import (
    Columns,
    PenaltyTables,
    apply_bitmask_,
    bias_table,
    bound_bitmask_kernel,
    filter_probs_,
    inverse_cdf,
)

if TYPE_CHECKING:
    from omni.compute.sampling import RequestSamplingState, TokenConstraint

MASK_FIRST_STEPS = 16  # after a forbidden argmax, steps that mask at once


class _Groups:
    """The rows that share each custom logit processor, and their `custom_params` entries.

    Why: SGLang calls a processor once per step for all of its rows; the row indices and the
    parameter list (with ``"__req__"``) depend only on the batch composition.
    """

    def __init__(self, requests: Sequence[RequestSamplingState], device: torch.device):
        by_processor: dict[int, tuple[Any, list[int]]] = {}
        for row, r in enumerate(requests):
            processor = r.logit_processor
            if processor is not None:
                by_processor.setdefault(id(processor), (processor, []))[1].append(row)
        self.groups = [(proc, torch.tensor(rows, device=device),
                        [_custom_params(requests[i]) for i in rows])
                       for proc, rows in by_processor.values()]

    def apply_(self, scores: torch.Tensor) -> None:
        for processor, rows, params in self.groups:
            result = processor(scores.index_select(0, rows), params)
            if tuple(result.shape) != (len(rows), scores.shape[1]):
                raise ValueError(f"logit processor {processor!r} returned shape "
                                 f"{list(result.shape)}, expected {[len(rows), scores.shape[1]]}")
            scores.index_copy_(0, rows, result.to(scores.dtype))


def _custom_params(request: RequestSamplingState) -> dict[str, Any] | None:
    params = request.params.custom_params
    return None if params is None else {**params, "__req__": request}


class TokenSamplingState:
    """The rows of one decode batch, with their parameters as per-row tensors.

    Why: the decode loop samples every step, but the batch changes only when a request joins or
    leaves. Columns, penalty and bias tables, the constraint bitmask and [B, V] scratch buffers
    are made once per composition (at the first step, when V and the device are known), so a
    step allocates no large tensor; flags skip the stages no row needs (all-greedy without
    any logit transform is one argmax). Build a new state when rows join or leave (penalty
    tables are rebuilt from the requests' histories).
    """

    def __init__(self, requests: Sequence[RequestSamplingState]) -> None:
        self.requests = tuple(requests)
        params = [r.params for r in self.requests]
        self._rows = [(p, p.is_greedy) for p in params]
        sampled = [p for p, greedy in self._rows if not greedy]
        self.all_greedy, self.any_greedy = not sampled, len(sampled) < len(params)
        self.any_penalty = any(p.has_penalties for p in params)
        self.any_top_k = any(p.top_k != -1 for p in sampled)
        self.any_top_p = any(p.top_p < 1.0 for p in sampled)
        self.any_min_p = any(p.min_p > 0.0 for p in sampled)
        self.any_min_new = any(p.min_new_tokens > 0 for p in params)
        self.any_bias = any(p.logit_bias is not None for p in params)
        self.any_constraint = any(r.constraint is not None for r in self.requests)
        self.any_processor = any(r.logit_processor is not None for r in self.requests)
        # the stages that can take every token from a row
        self.any_masking = (self.any_min_new or self.any_bias or self.any_constraint
                            or self.any_processor)
        self.any_transform = (self.any_penalty or self.any_min_new or self.any_bias
                              or self.any_constraint or self.any_processor)
        self.only_constraints = self.any_constraint and not (
            self.any_penalty or self.any_min_new or self.any_bias or self.any_processor)
        # the filters read each row's `sort_width` largest probabilities; a row without top-k
        # may need more and widens it, for later steps too (distributions change slowly)
        open_rows = any(p.filters and p.top_k == -1 for p in sampled)
        self.sort_width = max([256 if open_rows else 1] + [p.top_k for p in sampled])
        self._vocab_size: int | None = None
        self._columns: Columns | None = None
        self._penalties: PenaltyTables | None = None
        self._bias: torch.Tensor | None = None
        self._processors: _Groups | None = None
        self._bitmask: torch.Tensor | None = None
        self._bitmask_words: Any = None  # numpy view of _bitmask
        self._constrained: list[tuple[int, TokenConstraint]] = []
        self._next_rows: list[int] | None = None  # filled by `record` for the next step
        self._mask_first = 0  # steps `constrained_argmax` masks before trying the argmax
        self._masker: Any = False  # `bound_bitmask_kernel` on scratch()[0] (False: not yet)
        self._scratch: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._stop_id_cache: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.requests)

    def __repr__(self) -> str:
        return (f"<TokenSamplingState rows={len(self)} greedy={sum(g for _, g in self._rows)} "
                f"penalised={sum(p.has_penalties for p, _ in self._rows)}>")

    def columns(self, logits: torch.Tensor) -> Columns:
        """The per-row tensors for `logits` [B, V]; ValueError if B or V does not fit.

        Also raises ValueError for a logit_bias token id outside the vocabulary.
        """
        if logits.dim() != 2 or logits.shape[0] != len(self):
            raise ValueError(f"expected logits [{len(self)}, V], got {list(logits.shape)}")
        vocab_size, device = logits.shape[1], logits.device
        if self._columns is None:
            params = [p for p, _ in self._rows]
            self._bias = bias_table(params, vocab_size, device)
            self._vocab_size = vocab_size
            self._columns = Columns.build(self._rows, vocab_size, device)
            if self.any_penalty:
                self._penalties = PenaltyTables(self.requests, vocab_size, device)
            if self.any_processor:
                self._processors = _Groups(self.requests, device)
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

    def transformed(self, logits: torch.Tensor, *, rescue: bool = True) -> torch.Tensor:
        """`logits` as float32 after SGLang's logit stages, in the first scratch buffer.

        Penalties (additive, min_new_tokens, repetition), the constraint bitmask, logit_bias,
        then custom logit processors. A row those stages leave with no token at all takes its
        EOS instead (`rescue=False` leaves that to the caller: `greedy_tokens` does it).
        """
        scores, spare, _ = self.scratch()
        scores.copy_(logits)
        if self._penalties is not None:
            self._penalties.apply_(scores, spare)
        if self.any_min_new:
            self._mask_stop_tokens(scores)
        if self.any_constraint:
            self._apply_constraints(scores)
        if self._bias is not None:
            scores.add_(self._bias)
        if self._processors is not None:
            self._processors.apply_(scores)
        if rescue and self.any_masking:
            self._rescue_dead_rows(scores)
        return scores

    def greedy_tokens(self, scores: torch.Tensor) -> torch.Tensor:
        """The argmax of each row of `transformed(..., rescue=False)` scores [B], a row left
        with no token taking its EOS (found from the maxima, at no extra pass)."""
        values, tokens = scores.max(dim=-1)
        if self.any_masking and -math.inf in values.tolist():
            self._rescue_dead_rows(scores)
            tokens = scores.argmax(dim=-1)
        return tokens

    def _rescue_dead_rows(self, scores: torch.Tensor) -> None:
        """A row whose every logit is -inf (say a grammar that allows only EOS while
        min_new_tokens masks it) takes its EOS / stop ids instead of turning into NaN
        (with none, any token)."""
        dead = torch.nonzero(scores.amax(dim=-1) == -math.inf).flatten().tolist()
        for row in dead:
            ids = self._stop_ids(row).to(scores.device)
            scores[row] = -math.inf if len(ids) else 0.0
            scores[row, ids] = 0.0

    def _stop_ids(self, row: int) -> torch.Tensor:
        """The row's EOS and stop token ids inside the vocabulary (cached per composition)."""
        if row not in self._stop_id_cache:
            request = self.requests[row]
            ids = request.eos_token_ids | request.params.stop_token_ids  # type: ignore[operator]
            vocab_size = self._vocab_size or 0
            self._stop_id_cache[row] = torch.tensor(
                sorted(t for t in ids if 0 <= t < vocab_size), dtype=torch.int64)
        return self._stop_id_cache[row]

    def _mask_stop_tokens(self, scores: torch.Tensor) -> None:
        """min_new_tokens: EOS and stop token ids -> -inf while a row is below its minimum."""
        for row, request in enumerate(self.requests):
            if request.min_new_tokens_pending:
                scores[row, self._stop_ids(row).to(scores.device)] = -math.inf

    def constrained_argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy tokens [B] when the constraints are the only logit stage: each row's argmax,
        unless its grammar forbids that token; only those rows are masked and taken again.

        Equal to masking every row first (masking lowers only other tokens, so an allowed
        argmax stays the first maximum), at a bit test per row in the usual case. After a
        step that had to mask, the next `MASK_FIRST_STEPS` mask at once.
        """
        bitmask = self._bitmask_for(logits.shape[1])
        masked = self._take_filled_rows(bitmask)
        if self._mask_first > 0:
            self._mask_first -= 1
        else:
            tokens = logits.argmax(dim=-1)
            masked = self._forbidding(masked, tokens.tolist())
            if not masked:
                return tokens
            # a model that disagrees with its grammar once likely does again: the next
            # steps mask first, skipping the argmax they would throw away
            self._mask_first = MASK_FIRST_STEPS
        if not masked:
            return logits.argmax(dim=-1)
        scores = self.scratch()[0]
        scores.copy_(logits)
        if self._masker is False:
            self._masker = bound_bitmask_kernel(scores, bitmask)
        if self._masker is not None:
            self._masker(masked)
        else:
            apply_bitmask_(scores, bitmask.to(scores.device), masked)
        values, tokens = scores.max(dim=-1)
        if -math.inf in values.tolist():  # a row allowed nothing: it takes its EOS
            self._rescue_dead_rows(scores)
            tokens = scores.argmax(dim=-1)
        return tokens

    def _forbidding(self, rows: list[int], ids: list[int]) -> list[int]:
        """The `rows` whose filled mask forbids their token in `ids`."""
        words = self._bitmask_words
        return [row for row in rows if not int(words[row, ids[row] >> 5]) >> (ids[row] & 31) & 1]

    def _bitmask_for(self, vocab_size: int) -> torch.Tensor:
        """The composition's int32 bitmask [B, ceil(V / 32)] (all allowed at first)."""
        if self._bitmask is None:
            self._bitmask = torch.full((len(self), (vocab_size + 31) // 32), -1,
                                       dtype=torch.int32)
            self._bitmask_words = self._bitmask.numpy()  # the same memory, for bit tests
            self._constrained = [(row, r.constraint) for row, r in enumerate(self.requests)
                                 if r.constraint is not None]
        return self._bitmask

    def _take_filled_rows(self, bitmask: torch.Tensor) -> list[int]:
        """The rows `record` filled for this step, or `_filled_rows` now."""
        rows, self._next_rows = self._next_rows, None
        return self._filled_rows(bitmask) if rows is None else rows

    def _filled_rows(self, bitmask: torch.Tensor) -> list[int]:
        """Fill each live constrained row's mask; the rows that forbid some token."""
        return [row for row, constraint in self._constrained
                if not constraint.is_terminated()
                and constraint.fill_bitmask(bitmask, row) is not False]

    def _apply_constraints(self, scores: torch.Tensor) -> None:
        """Each live constrained row's bitmask, filled and applied (rows whose grammar allows
        every token now are left alone)."""
        bitmask = self._bitmask_for(scores.shape[1])
        rows = self._take_filled_rows(bitmask)
        if rows:
            apply_bitmask_(scores, bitmask.to(scores.device), rows)

    def uniforms(self, device: torch.device) -> torch.Tensor:
        """One draw per row from each request's own generator (0 for greedy rows): [B]."""
        draws = [0.0 if greedy else r.next_uniform()
                 for r, (_, greedy) in zip(self.requests, self._rows, strict=True)]
        return torch.tensor(draws, dtype=torch.float32, device=device)

    def record(self, tokens: torch.Tensor) -> list[int]:
        """Append each row's token to its request, its constraint and the penalty tables."""
        token_ids = tokens.tolist()
        for request, token_id in zip(self.requests, token_ids, strict=True):
            request.output_token_ids.append(token_id)
            constraint = request.constraint
            if constraint is not None and not constraint.is_terminated():
                constraint.accept(token_id)
        if self._bitmask is not None:
            # the next step's masks, filled now while the matchers' code and state are warm
            # in the cache (on a small model this halves their cost); valid until the next
            # accept, which only this method does
            self._next_rows = self._filled_rows(self._bitmask)
        if self._penalties is not None and self._columns is not None:
            self._penalties.record(self._columns.rows, tokens)
        return token_ids


class TokenSampler:
    """Samples next token ids from logits, each row with its own `SamplingParams`.

    SGLang's order: penalties on output tokens (frequency and presence subtracted, then
    repetition), min_new_tokens masking, the constraint bitmask, logit_bias, custom logit
    processors; greedy rows take the argmax of that; the others are divided by temperature,
    softmaxed, filtered by top-k / top-p / min-p as SGLang's torch sampler does, and draw once
    from their request's generator (inverse CDF in vocabulary order), so on CPU a seeded row
    gives the same tokens whatever else is in the batch. Implements
    `Sampler[TokenSamplingState]`.
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
        if state.all_greedy and not state.any_transform:
            self.num_fast_steps += 1
            tokens = output.argmax(dim=-1)
        elif state.all_greedy and state.only_constraints:
            tokens = state.constrained_argmax(output)
        elif state.all_greedy:
            tokens = state.greedy_tokens(state.transformed(output, rescue=False))
        else:
            scores = state.transformed(output)
            greedy = scores.argmax(dim=-1) if state.any_greedy else None
            probs = _probs(scores, state, cols)
            tokens = inverse_cdf(probs, state.uniforms(probs.device), state.scratch()[0])
            if greedy is not None:
                tokens = torch.where(cols.greedy, greedy, tokens)
        state.record(tokens)
        return tokens

    def probs(self, logits: torch.Tensor, state: TokenSamplingState) -> torch.Tensor:
        """The distribution `step` would draw from: [B, V] float32, greedy rows one-hot.

        Does not advance `state` (no draw, nothing recorded); useful for logprobs and tests.
        """
        cols = state.columns(logits)
        scores = state.transformed(logits)
        one_hot = torch.nn.functional.one_hot(scores.argmax(dim=-1), scores.shape[-1])
        probs = _probs(scores, state, cols)
        probs = probs / probs.sum(dim=-1, keepdim=True)
        return torch.where(cols.greedy[:, None], one_hot.to(probs.dtype), probs)


def _probs(scores: torch.Tensor, state: TokenSamplingState, cols: Columns) -> torch.Tensor:
    """Temperature, softmax and the filters: the kept probabilities (not renormalised), in the
    second scratch buffer; `scores` is overwritten."""
    _, probs, keep = state.scratch()
    torch.softmax(scores.div_(cols.temperature), dim=-1, out=probs)
    return filter_probs_(probs, cols, state, keep)
