"""The attention kernels of `Attention`: scaled dot-product attention of the new tokens over
the past KV and themselves, in the three shapes a decoder needs.

- no past: plain causal attention (SDPA's `is_causal`, grouped-query via `enable_gqa`);
- a past and no mask, several new tokens (a prefill that reuses a cached prefix): causal
  with the diagonal shifted by the past's length. On the CPU this runs as two blocks, the
  past without any mask and the new tokens causal among themselves, each through torch's
  CPU flash kernel (``aten::_scaled_dot_product_flash_attention_for_cpu``, which also
  returns the log-sum-exp of each row's scores), merged by `merge_attention`: one softmax
  over all the keys, to float rounding (~1e-6 in float32). Why: it never concatenates the
  past with the new KV (a copy of the whole past per layer) nor builds, converts and reads a
  [G*T, S] mask. With 1.7k cached tokens and 208 new ones (one thread, head_dim 64) it takes
  ~10% less time than the one masked call, a few % of the whole prefill. On CUDA it is one
  SDPA call with torch's lower-right causal bias (`causal_attention_with_past`);
- anything else (decode, explicit masks): one SDPA call over the concatenated KV, the G
  query heads of each KV head folded into the query axis (the KV is read once, never
  repeated).

Shapes as in `omni.compute.models.llama`: q [B, H, T, D], k / v [B, Hkv, T, D], past k / v
[B, Hkv, T_past, D], G = H / Hkv.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["attend", "causal_attention_with_past", "merge_attention"]


@functools.cache
def _causal_lower_right() -> Any:
    """torch's lower-right causal bias, imported at first use: its module loads
    torch._dynamo (~0.9 s of importing omni.compute), which the CPU path never needs."""
    from torch.nn.attention.bias import causal_lower_right

    return causal_lower_right


_flash_cpu = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def attend(q: Tensor, k: Tensor, v: Tensor, past: tuple[Tensor, Tensor] | None,
           mask: Tensor | None) -> Tensor:
    """Attention of the new tokens' queries over the past and the new keys: out [B, H, T, D].

    `mask` is None (causal over past + new) or a boolean [B or 1, 1, G*T, S] already folded
    for the grouped layout (row g*T + t is query head g of each KV head at token t).
    """
    batch, num_heads, num_new, head_dim = q.shape
    num_kv_heads = k.shape[1]
    num_past = 0 if past is None else past[0].shape[2]
    if mask is None and num_past == 0 and num_new > 1:  # plain causal prefill
        return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                              enable_gqa=num_heads != num_kv_heads)
    if mask is None and num_new > 1:
        return causal_attention_with_past(q, k, v, past)
    keys, values = (k, v) if past is None or num_past == 0 else (
        torch.cat((past[0], k), dim=2), torch.cat((past[1], v), dim=2))
    grouped = q.reshape(batch, num_kv_heads, -1, head_dim)  # [B, Hkv, G*T, D]
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask)
    return out.reshape(batch, num_heads, num_new, head_dim)


def causal_attention_with_past(q: Tensor, k: Tensor, v: Tensor,
                               past: tuple[Tensor, Tensor]) -> Tensor:
    """Causal attention of T new tokens that follow T_past cached ones: query t sees every
    past key and the new keys 0..t. Returns [B, H, T, D].

    On the CPU: the past block and the new block separately, merged by their log-sum-exps;
    elsewhere (CUDA) one SDPA call with torch's lower-right causal bias, which runs in the
    fused (flash / memory-efficient) kernels rather than the unfused math path that a
    boolean mask with grouped heads may fall back to; those kernels take as many KV heads as
    query heads, so the KV is repeated.
    """
    batch, num_heads, num_new, head_dim = q.shape
    num_kv_heads, num_past = k.shape[1], past[0].shape[2]
    groups = num_heads // num_kv_heads
    if _flash_cpu is None or q.device.type != "cpu":
        keys = torch.cat((past[0], k), dim=2)
        values = torch.cat((past[1], v), dim=2)
        if groups != 1:
            keys = keys.repeat_interleave(groups, dim=1)  # [B, H, S, D]
            values = values.repeat_interleave(groups, dim=1)
        return F.scaled_dot_product_attention(
            q, keys, values, attn_mask=_causal_lower_right()(num_new, num_past + num_new))
    grouped = q.reshape(batch, num_kv_heads, groups * num_new, head_dim)
    out_past, lse_past = _flash_cpu(grouped, past[0], past[1])  # [B, Hkv, G*T, (D)]
    # the kernel maps query head h to KV head h // G itself (grouped-query attention)
    out_new, lse_new = _flash_cpu(q, k, v, is_causal=True)  # [B, H, T, (D)]
    return merge_attention(out_past.reshape(batch, num_heads, num_new, head_dim),
                           lse_past.reshape(batch, num_heads, num_new), out_new, lse_new)


def merge_attention(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> Tensor:
    """Attention over the union of two disjoint key sets from each set's output [..., D] and
    the log-sum-exp [...] of its scores: the softmax weights of set a sum to
    exp(lse_a) / (exp(lse_a) + exp(lse_b)) = sigmoid(lse_a - lse_b). Computed in float32 at
    least, returned in the outputs' dtype."""
    dtype = torch.promote_types(out_a.dtype, torch.float32)
    weight_a = torch.sigmoid(lse_a.to(dtype) - lse_b.to(dtype))[..., None]
    return torch.lerp(out_b.to(dtype), out_a.to(dtype), weight_a).to(out_a.dtype)
