"""The attention kernels against attention written out in float64: causal attention over a
cached past (split into two blocks and merged on the CPU, one masked call elsewhere), and the
log-sum-exp merge of two disjoint key sets."""

from __future__ import annotations

import math

import pytest
import torch

from omni.compute.models import _attention
from omni.compute.models._attention import attend, causal_attention_with_past, merge_attention

SHAPES = [  # (batch, heads, kv heads, new tokens, past tokens)
    (1, 8, 4, 200, 300), (1, 4, 4, 2, 1), (2, 4, 2, 17, 33), (1, 8, 1, 70, 5), (2, 2, 1, 3, 129)]


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
              mask: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(D) where mask) v in float64; q [B, H, T, D], keys [B, Hkv, S, D]."""
    groups = q.shape[1] // keys.shape[1]
    keys = keys.double().repeat_interleave(groups, dim=1)
    values = values.double().repeat_interleave(groups, dim=1)
    scores = q.double() @ keys.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return torch.softmax(scores.masked_fill(~mask, -math.inf), dim=-1) @ values


def inputs(batch: int, heads: int, kv_heads: int, new: int, past: int,
           dtype: torch.dtype = torch.float32, seed: int = 0):
    """q, k, v of the new tokens, and the past as views into a larger buffer (as the engine's
    decode batch hands it: rows of a longer capacity, not contiguous)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, new, 16, generator=gen).to(dtype)
    k, v = (torch.randn(batch, kv_heads, new, 16, generator=gen).to(dtype) for _ in range(2))
    buffer = torch.randn(2, batch + 1, kv_heads, past + 7, 16, generator=gen).to(dtype)
    return q, k, v, (buffer[0, :batch, :, :past], buffer[1, :batch, :, :past])


def shifted_causal(new: int, past: int) -> torch.Tensor:
    return torch.ones(new, past + new, dtype=torch.bool).tril(diagonal=past)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("split", [True, False], ids=["cpu-split", "one-masked-call"])
def test_causal_attention_over_a_past_equals_the_written_out_attention(shape, split,
                                                                       monkeypatch):
    if not split:
        monkeypatch.setattr(_attention, "_flash_cpu", None)  # the path of other devices
    q, k, v, past = inputs(*shape)
    out = causal_attention_with_past(q, k, v, past)
    keys, values = torch.cat((past[0], k), 2), torch.cat((past[1], v), 2)
    expected = reference(q, keys, values, shifted_causal(shape[3], shape[4]))
    assert out.shape == q.shape and out.dtype == q.dtype
    assert (out.double() - expected).abs().max().item() < 1e-5


def test_bfloat16_stays_within_bfloat16_rounding_of_the_exact_attention():
    q, k, v, past = inputs(1, 8, 2, 50, 400, dtype=torch.bfloat16)
    out = causal_attention_with_past(q, k, v, past)
    keys, values = torch.cat((past[0], k), 2), torch.cat((past[1], v), 2)
    expected = reference(q, keys, values, shifted_causal(50, 400))
    assert out.dtype == torch.bfloat16
    assert (out.double() - expected).abs().max().item() < 2 ** -6


@pytest.mark.parametrize("shape", SHAPES[:3], ids=str)
def test_attend_routes_every_case_to_the_same_attention(shape):
    """No past (causal), a past without a mask (prefill on a cached prefix), and a past with
    an explicit mask folded for the grouped layout all equal the written-out attention."""
    _, heads, kv_heads, new, num_past = shape
    q, k, v, past = inputs(*shape, seed=1)
    mask = shifted_causal(new, num_past)
    keys, values = torch.cat((past[0], k), 2), torch.cat((past[1], v), 2)
    expected = reference(q, keys, values, mask)
    folded = mask[None, None].repeat(1, 1, heads // kv_heads, 1)  # row g*T + t = row t
    for got in (attend(q, k, v, past, None), attend(q, k, v, past, folded)):
        assert (got.double() - expected).abs().max().item() < 1e-5
    alone = reference(q, k, v, torch.ones(new, new, dtype=torch.bool).tril())
    assert (attend(q, k, v, None, None).double() - alone).abs().max().item() < 1e-5


@pytest.mark.parametrize("cut", [1, 10, 39])
def test_merging_two_key_sets_equals_attending_to_both(cut):
    gen = torch.Generator().manual_seed(cut)
    q, keys, values = (torch.randn(2, 3, n, 8, generator=gen, dtype=torch.float64)
                       for n in (5, 40, 40))
    scores = q @ keys.transpose(-1, -2)
    parts = [(torch.softmax(s, -1) @ vals, torch.logsumexp(s, -1))
             for s, vals in ((scores[..., :cut], values[..., :cut, :]),
                             (scores[..., cut:], values[..., cut:, :]))]
    merged = merge_attention(*parts[0], *parts[1])
    assert torch.allclose(merged, torch.softmax(scores, -1) @ values, atol=1e-12)
