"""The batched stages `TokenSampler` runs on logits, each equal to SGLang 0.5.23's.

In SGLang's order (sglang/srt/sampling/sampling_batch_info.py `apply_logits_bias`, then
sglang/srt/layers/sampler.py `Sampler.forward`): additive penalties (frequency, presence,
min_new_tokens), the repetition penalty's scaling, the grammar bitmask, logit_bias, custom
logit processors, temperature, softmax, then top-k / top-p / min-p
(`top_k_top_p_min_p_sampling_from_probs_torch`). Every stage works on [B, V] float32 tensors
in place; rows that do not use a stage hold neutral entries, which leave their values
bit-for-bit unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from omni.compute.sampling import RequestSamplingState
    from omni.compute.sampling_params import SamplingParams

_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)


@dataclass(frozen=True, slots=True)
class Columns:
    """Per-row parameters as [B, 1] tensors; greedy rows get neutral ones (they take argmax)."""

    rows: torch.Tensor  # [B] int64
    greedy: torch.Tensor  # [B] bool
    temperature: torch.Tensor  # float32; 1 for greedy rows
    top_k: torch.Tensor  # int64 in [1, V] (V where off)
    top_k_on: torch.Tensor
    top_p: torch.Tensor
    top_p_on: torch.Tensor
    min_p: torch.Tensor

    @classmethod
    def build(cls, rows: list[tuple[SamplingParams, bool]], vocab_size: int,
              device: torch.device) -> Columns:
        def column(values: list[Any], dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device).view(-1, 1)

        top_k_on = [p.top_k != -1 and not g for p, g in rows]
        return cls(
            rows=torch.arange(len(rows), device=device),
            greedy=torch.tensor([g for _, g in rows], dtype=torch.bool, device=device),
            temperature=column([1.0 if g else p.temperature for p, g in rows]),
            top_k=column([min(p.top_k, vocab_size) if on else vocab_size
                          for (p, _), on in zip(rows, top_k_on, strict=True)], torch.int64),
            top_k_on=column(top_k_on, torch.bool),
            top_p=column([p.top_p for p, _ in rows]),
            # SGLang's torch sampler applies top-p to every row it filters, even at 1.0,
            # where float rounding of the cumulative sum can drop the least likely tail
            top_p_on=column([p.filters and not g for p, g in rows], torch.bool),
            min_p=column([0.0 if g else p.min_p for p, g in rows]),
        )


def _valid_ids(ids: Any, vocab_size: int) -> torch.Tensor:
    ids = torch.as_tensor(list(ids), dtype=torch.int64)
    return ids[(ids >= 0) & (ids < vocab_size)]


class PenaltyTables:
    """SGLang's cumulated penalties per row and token: [B, V] tables over OUTPUT tokens.

    Why: penalties depend on each row's whole output. Tables updated by one write per row per
    step turn them into a few branch-free in-place passes. As SGLang's penalizers
    (sglang/srt/sampling/penaltylib/): the frequency table grows by repeated float32 addition,
    presence and repetition are set once a token occurs, the additive part is applied before
    the repetition scaling (`SamplingBatchInfo.update_penalties`), and the scaling divides
    positive and multiplies negative logits (`apply_scaling_penalties`). Prompt tokens are not
    penalised.
    """

    def __init__(self, requests: Sequence[RequestSamplingState], vocab_size: int,
                 device: torch.device) -> None:
        shape = (len(requests), vocab_size)
        params = [r.params for r in requests]
        self._frequency = torch.tensor([p.frequency_penalty for p in params], device=device)
        self._presence = torch.tensor([p.presence_penalty for p in params], device=device)
        self._repetition = torch.tensor([p.repetition_penalty for p in params], device=device)
        self.cum_frequency = torch.zeros(shape, device=device)
        self.cum_presence = torch.zeros(shape, device=device)
        self.scale = torch.ones(shape, device=device)  # repetition: 1 where unseen
        for row, request in enumerate(requests):
            ids = _valid_ids(request.output_token_ids, vocab_size).to(device)
            self.cum_frequency[row].index_add_(0, ids, self._frequency[row].expand(len(ids)))
            self.cum_presence[row, ids] = self._presence[row]
            self.scale[row, ids] = self._repetition[row]
        self.offset = self.cum_frequency + self.cum_presence  # subtracted: 0 - f - p in SGLang
        self.any_additive = bool((self._frequency != 0).any() or (self._presence != 0).any())
        self.any_repetition = bool((self._repetition != 1).any())

    def apply_(self, scores: torch.Tensor, spare: torch.Tensor) -> None:
        """In place on `scores`: frequency and presence, then the repetition scaling."""
        if self.any_additive:
            scores.sub_(self.offset)
        if self.any_repetition:
            negative = torch.mul(scores, self.scale, out=spare)
            torch.where(scores < 0, negative, scores.div_(self.scale), out=scores)

    def record(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count each row's new token (one per row, so the scattered writes never collide)."""
        self.cum_frequency[rows, tokens] += self._frequency
        self.cum_presence[rows, tokens] = self._presence
        self.offset[rows, tokens] = self.cum_frequency[rows, tokens] + self._presence
        self.scale[rows, tokens] = self._repetition


def bias_table(params: Sequence[SamplingParams], vocab_size: int,
               device: torch.device) -> torch.Tensor | None:
    """SGLang's logit_bias tensor [B, V] (zeros for rows without one), or None if no row has one.

    Raises ValueError for a token id outside the vocabulary (SGLang's `verify(vocab_size)`).
    """
    if all(p.logit_bias is None for p in params):
        return None
    table = torch.zeros((len(params), vocab_size), device=device)
    for row, p in enumerate(params):
        for key, value in (p.logit_bias or {}).items():
            if int(key) >= vocab_size:
                raise ValueError(f"logit_bias keys must be in [0, {vocab_size - 1}], got {key}")
            table[row, int(key)] = value
    return table


def apply_bitmask_(scores: torch.Tensor, bitmask: torch.Tensor,
                   rows: torch.Tensor | Sequence[int],
                   fallback_ids: Callable[[int], torch.Tensor] | None = None) -> None:
    """Disallowed tokens of `rows` -> -inf, from xgrammar's int32 bitmask [B, ceil(V / 32)].

    Bit j of word w allows token 32 * w + j. Given `fallback_ids`, a row whose mask allows
    no token at all keeps only its `fallback_ids(row)` (EOS) instead, so it never turns into
    NaN (with no fallback ids it is left unmasked); without, such a row becomes all -inf and
    the caller rescues it. On the CPU, xgrammar's own kernel does the masking where it is
    installed (numpy otherwise).
    """
    row_ids = rows.tolist() if isinstance(rows, torch.Tensor) else list(rows)
    if scores.is_cpu and bitmask.is_cpu:
        kernel = _xgrammar_cpu_kernel()
        if kernel is not None and fallback_ids is None:
            kernel(scores, bitmask, scores.shape[1], row_ids)
        elif kernel is not None:
            _apply_bitmask_kernel_(kernel, scores, bitmask, row_ids, fallback_ids)
        else:
            _apply_bitmask_numpy_(scores, bitmask, row_ids, fallback_ids)
        return
    rows = torch.tensor(row_ids, device=scores.device)
    vocab_size = scores.shape[1]
    words = bitmask.index_select(0, rows)  # [C, W]
    bits = (words.unsqueeze(-1) >> _BIT_SHIFTS.to(words.device)) & 1  # [C, W, 32]
    allowed = bits.view(len(rows), -1)[:, :vocab_size].bool()
    empty = ~allowed.any(dim=-1)
    if fallback_ids is not None and bool(empty.any()):
        for i in torch.nonzero(empty).flatten().tolist():
            ids = fallback_ids(row_ids[i]).to(allowed.device)
            allowed[i] = True if len(ids) == 0 else False
            allowed[i, ids] = True
    selected = scores.index_select(0, rows).masked_fill_(~allowed, -torch.inf)
    scores.index_copy_(0, rows, selected)


@functools.cache
def _xgrammar_cpu_kernel() -> Callable[..., None] | None:
    """xgrammar's C++ bitmask kernel for CPU tensors, or None without xgrammar installed."""
    try:
        from xgrammar.kernels.apply_token_bitmask_inplace_cpu import (
            apply_token_bitmask_inplace_cpu,
        )
    except ImportError:
        return None
    return apply_token_bitmask_inplace_cpu


def bound_bitmask_kernel(scores: torch.Tensor,
                         bitmask: torch.Tensor) -> Callable[[list[int]], None] | None:
    """`apply_bitmask_(scores, bitmask, rows)` as a function of `rows` alone, for two buffers
    that stay put (a batch composition's scratch scores and bitmask): one call into xgrammar's
    C++ kernel with the buffers' addresses, shapes and strides worked out once; None where
    that kernel is not available (then use `apply_bitmask_`).

    Why: a decode step masks right after the forward pass has pushed the sampler's code out
    of the CPU caches, where the public wrapper's dozen checks and tensor queries cost more
    than the masking (measured in a tiny model's decode: ~34 us a call through the wrapper,
    ~22 us bound).
    """
    kernel = _xgrammar_core_kernel()
    if (kernel is None or not (scores.is_cpu and bitmask.is_cpu) or scores.dim() != 2
            or scores.dtype != torch.float32 or bitmask.dtype != torch.int32
            or bitmask.shape != (scores.shape[0], (scores.shape[1] + 31) // 32)
            or not (scores.is_contiguous() and bitmask.is_contiguous())):
        return None
    args = (scores.data_ptr(), tuple(scores.shape), tuple(scores.stride()), bitmask.data_ptr(),
            tuple(bitmask.shape), tuple(bitmask.stride()), scores.shape[1])

    def apply(rows: list[int]) -> None:
        kernel(*args, rows, "float32")
    return apply


@functools.cache
def _xgrammar_core_kernel() -> Callable[..., None] | None:
    """The C++ function behind xgrammar's CPU bitmask wrapper, if this xgrammar has it with
    the arguments its wrapper passes (checked once against the wrapper); else None."""
    public = _xgrammar_cpu_kernel()
    try:
        from xgrammar.base import _core
        kernel = _core.kernels.apply_token_bitmask_inplace_cpu
        expected, scores = torch.zeros(2, 40), torch.zeros(2, 40)
        bitmask = torch.tensor([[0x0F0F0F0F, 0xFF], [-1, 1]], dtype=torch.int32)
        public(expected, bitmask, 40, [0])  # type: ignore[misc]
        kernel(scores.data_ptr(), (2, 40), (40, 1), bitmask.data_ptr(), (2, 2), (2, 1), 40,
               [0], "float32")
    except Exception:  # any mismatch: the public wrapper it is
        return None
    return kernel if torch.equal(scores, expected) else None


def _apply_bitmask_kernel_(kernel: Callable[..., None], scores: torch.Tensor,
                           bitmask: torch.Tensor, rows: list[int],
                           fallback_ids: Callable[[int], torch.Tensor] | None) -> None:
    """`apply_bitmask_` through xgrammar's CPU kernel; the rows whose mask allows nothing
    (rare: one numpy pass finds them, given `fallback_ids`) are masked here."""
    empty = [] if fallback_ids is None else np.flatnonzero(
        ~bitmask.numpy().any(axis=1)).tolist()
    if empty:
        empty = [row for row in empty if row in rows]
        rows = [row for row in rows if row not in empty]
    if rows:
        kernel(scores, bitmask, scores.shape[1], rows)
    for row in empty:
        ids = fallback_ids(row)  # type: ignore[misc]
        if len(ids):
            values = scores[row]
            kept = values[ids].clone()
            values.fill_(-torch.inf)
            values[ids] = kept


def _apply_bitmask_numpy_(scores: torch.Tensor, bitmask: torch.Tensor, rows: list[int],
                          fallback_ids: Callable[[int], torch.Tensor] | None) -> None:
    """`apply_bitmask_` on the CPU in numpy (without xgrammar's kernel): it runs every decode
    step on a few rows, where each torch op's dispatch costs more than the work."""
    vocab_size, values = scores.shape[1], scores.numpy()  # values shares the tensor's memory
    every_row = rows == list(range(values.shape[0])) and bitmask.shape[0] == len(rows)
    words = bitmask.numpy() if every_row else bitmask.numpy()[rows]  # [C, W]
    allowed = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
    if fallback_ids is not None and not words.any(axis=1).all():
        for i in np.flatnonzero(~allowed.any(axis=1)):
            ids = fallback_ids(rows[i]).numpy()
            allowed[i] = 0 if len(ids) else 1
            allowed[i, ids] = 1
    if every_row:
        np.copyto(values, -np.inf, where=allowed == 0)
    else:
        selected = values[rows]
        np.copyto(selected, -np.inf, where=allowed == 0)
        values[rows] = selected


def filter_probs_(probs: torch.Tensor, cols: Columns, flags: Any,
                  keep: torch.Tensor) -> torch.Tensor:
    """Zero what top-k, top-p and min-p drop, in place on softmax `probs` [B, V].

    As `top_k_top_p_min_p_sampling_from_probs_torch`: in a descending sort, position i is
    kept when i < top_k and the mass before it (cumsum - p) is <= top_p; then a token less
    likely than min_p x the most likely goes. Ties at the cut go to the lower token id, the
    order of a stable descending sort. (SGLang calls `torch.sort` without `stable=True`, which
    promises no order among ties; on CPU it keeps id order for rows of up to 16 tokens, which
    is where the conformance table's tie rows were checked against it.)
    """
    if flags.any_top_k or flags.any_top_p or flags.any_min_p:
        num_kept, cut = _cut(probs, cols, flags)
        torch.ge(probs, cut, out=keep)
        num_ge = keep.sum(dim=-1, keepdim=True)
        if bool(((num_ge > num_kept) & (cut > 0)).any()):  # ties at the cut: lower ids first
            ties = torch.eq(probs, cut)
            room = num_kept - (num_ge - ties.sum(dim=-1, keepdim=True))
            keep = torch.gt(probs, cut, out=keep) | (ties & (ties.cumsum(dim=-1) <= room))
        probs.mul_(keep)
    if flags.any_min_p:
        floor = probs.amax(dim=-1, keepdim=True).mul_(cols.min_p)
        probs.mul_(torch.ge(probs, floor, out=keep))
    return probs


def _cut(probs: torch.Tensor, cols: Columns, flags: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(how many tokens top-k and top-p keep, the probability of the last one), each [B, 1].

    Reads the `flags.sort_width` largest probabilities of each row, widening that prefix (x8)
    while a row without top-k keeps all of it and (top-p below 1, or its last value at least
    min_p x the top) tokens beyond it may be kept. The prefix of a sort holds the same
    values as the full sort and CPU cumsum is sequential, so a row's cut does not depend on
    the width the other rows ask for.
    """
    vocab_size = probs.shape[-1]
    open_rows = cols.top_p_on & ~cols.top_k_on
    while True:
        width = min(flags.sort_width, vocab_size)
        ranked = (probs.sort(dim=-1, descending=True).values if width == vocab_size
                  else probs.topk(width, dim=-1).values)  # [B, width], descending
        num_kept = torch.minimum(cols.top_k, torch.tensor(width, device=probs.device))
        mass_before = ranked.cumsum(dim=-1) - ranked
        within = (mass_before <= cols.top_p) | ~cols.top_p_on
        num_kept = torch.minimum(num_kept, within.sum(dim=-1, keepdim=True))
        more = (cols.top_p < 1.0) | (ranked[:, -1:] >= ranked[:, :1] * cols.min_p)
        if width == vocab_size or not bool((open_rows & more & (num_kept == width)).any()):
            on = cols.top_k_on | cols.top_p_on  # rows with neither keep everything
            cut = torch.where(on, ranked.gather(1, num_kept - 1), 0.0)
            return torch.where(on, num_kept, vocab_size), cut
        flags.sort_width = min(width * 8, vocab_size)


def inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor,
                out: torch.Tensor) -> torch.Tensor:
    """One index per row of unnormalised `weights` [B, V] for draws `uniforms` [B] in [0, 1)."""
    cdf = torch.cumsum(weights, dim=-1, out=out)  # [B, V], non-decreasing
    total = cdf[:, -1:]
    target = torch.minimum(uniforms[:, None] * total, torch.nextafter(total, total.new_zeros(())))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)  # first cdf > target
