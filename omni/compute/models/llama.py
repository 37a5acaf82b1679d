"""`DecoderLM`: a Llama / Qwen2 / Qwen3 / Qwen3-MoE decoder (and Qwen3-Omni's thinker: Qwen3-MoE
with M-RoPE) whose KV cache lives outside the model.

The model keeps no cache. `forward` takes the past KV of each layer and returns the KV of the new
tokens only; the engine owns the cache (contiguous per-layer tensors, paged in the `omni.kv`
store). Built gpt-fast style from small modules; numerics follow transformers (RMSNorm and RoPE
angles in float32, `rotate_half`) so the logits match `LlamaForCausalLM`, `Qwen2ForCausalLM` and
`Qwen3ForCausalLM` (and `Qwen3MoeForCausalLM`, its experts in `omni.compute.models.qwen3_moe`).

Shapes: B batch, T new tokens, S = T_past + T keys, E hidden, H query heads, Hkv KV heads,
G = H / Hkv query heads per KV head, D head dim, L layers, P page size.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omni.compute.models._attention import attend
from omni.compute.models._linear import Linear
from omni.compute.models.config import DecoderConfig
from omni.compute.models.qwen3_moe import SparseMoE

__all__ = ["MLP", "Attention", "DecoderLM", "DecoderLayer", "KVList", "RMSNorm",
           "RotaryEmbedding", "SquaredReLUMLP", "apply_rotary", "rms_normalize",
           "rope_inv_freq"]

KVList = list[tuple[Tensor, Tensor]]  # per layer (k, v), each [B, Hkv, T, D]


def rms_normalize(x: Tensor, eps: float) -> Tensor:
    """x / rms(x) over the last axis, the statistics in float32, rounded to x's dtype: what
    transformers' RMSNorm computes before its weight. F.rms_norm computes
    x * rsqrt(mean(x^2) + eps) as one op (one kernel where torch has a fused one) where the
    spelled-out form takes five: on a GPU a small model's decode step costs what its kernel
    launches cost."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), eps=eps)
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, the statistics in float32, rounded to x's dtype before the weight
    (as transformers does)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:  # [..., E] -> [..., E]
        if x.dtype == torch.float32:  # the weight fused in too: the same arithmetic as below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * rms_normalize(x, self.eps)


def rope_inv_freq(config: DecoderConfig, device: torch.device | str | None = None) -> Tensor:
    """The float32 inverse frequencies [D / 2] of RoPE, with the config's scaling (as HF)."""
    dim = int(config.head_dim or 0)
    inv_freq = 1.0 / (config.rope_theta ** (
        torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # llama3: keep high frequencies, divide low ones by factor, interpolate between.
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = ((old_len / wavelen - scaling.low_freq_factor)
              / (scaling.high_freq_factor - scaling.low_freq_factor))
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos / sin of the rotary angles at explicit positions, computed in float32.

    With M-RoPE (`config.mrope_section`) a position is a (temporal, height, width) triple and
    each frequency turns with one of them, interleaved as transformers' Qwen3-Omni does.

    Why `_apply` is overridden: `model.to(torch.bfloat16)` would otherwise round `inv_freq`, and
    RoPE angles at large positions would drift from the reference implementation.
    """

    inv_freq: Tensor

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        self.mrope_section = config.mrope_section

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        inv_freq = self.inv_freq
        super()._apply(fn, recurse)
        if inv_freq.device.type != "meta":
            self.inv_freq = inv_freq.to(device=self.inv_freq.device)  # stays float32
        return self

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions [B, T] (or [3, B, T] with M-RoPE) -> (cos, sin), each [B, 1, T, D] in
        `dtype`."""
        freqs = positions[..., None].float() * self.inv_freq  # [(3,) B, T, D/2]
        if positions.dim() == 3:
            freqs = self._interleave(freqs)
        angles = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, T, D]
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def _interleave(self, freqs: Tensor) -> Tensor:
        """[3, B, T, D/2] -> [B, T, D/2]: frequency i from the temporal angles, but from the
        height ones at i = 1, 4, ... < 3 * section[1] and the width ones at i = 2, 5, ...
        < 3 * section[2]."""
        out = freqs[0].clone()
        section = self.mrope_section or (0, 0, 0)
        for axis in (1, 2):
            picked = slice(axis, 3 * section[axis], 3)
            out[..., picked] = freqs[axis, ..., picked]
        return out


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, heads, T, D] rotated by the angles (cos, sin) [B, 1, T, D] (rotate_half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Grouped-query self-attention over the past KV and the new tokens.

    q, k and v come from one fused projection (`qkv_proj`: rows q then k then v), which saves two
    matmul launches per layer in decode. Qwen3 RMS-normalises each q and k head before RoPE
    (`q_norm`, `k_norm`; None for the others).
    """

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = int(config.head_dim or 0)
        qkv_rows = (config.num_heads + 2 * config.num_kv_heads) * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, qkv_rows, bias=config.attention_bias)
        self.o_proj = Linear(config.num_heads * self.head_dim, config.hidden_size,
                                bias=config.o_proj_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, past: tuple[Tensor, Tensor] | None,
                mask: Tensor | None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """x [B, T, E] -> (out [B, T, E], the new tokens' (k, v) [B, Hkv, T, D]).

        `mask` is None (causal; no mask at all when T == 1) or a boolean [B, 1, G*T, S] already
        folded by `DecoderLM.forward` for the grouped layout (see `attend`).
        """
        batch, num_new, _ = x.shape
        qkv = self.qkv_proj(x).view(batch, num_new, -1, self.head_dim).transpose(1, 2)
        num_qk = self.num_heads + self.num_kv_heads
        qk = qkv[:, :num_qk]  # [B, H + Hkv, T, D]
        if self.q_norm is not None and self.k_norm is not None:
            # every q and k head normalised at once, then each group times its own weight
            # (a new tensor: scaling it in place changes nothing else)
            qk = rms_normalize(qk, self.q_norm.eps)
            qk[:, :self.num_heads] *= self.q_norm.weight
            qk[:, self.num_heads:] *= self.k_norm.weight
        qk = apply_rotary(qk, cos, sin)
        q, k, v = qk[:, :self.num_heads], qk[:, self.num_heads:], qkv[:, num_qk:]
        out = attend(q, k, v, past, mask).transpose(1, 2)  # [B, T, H, D]
        # Contiguous, so that a kept (k, v) holds no reference to the larger q/k/v buffers.
        return self.o_proj(out.reshape(batch, num_new, -1)), (k.contiguous(), v.contiguous())


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused (`gate_up_proj`: gate rows first)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: Tensor) -> Tensor:  # [B, T, E] -> [B, T, E]
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [B, T, I] each
        return self.down_proj(F.silu(gate) * up)


class SquaredReLUMLP(nn.Module):
    """Nemotron's ungated MLP (``hidden_act="relu2"``): down(relu(up(x))^2)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: Tensor) -> Tensor:  # [B, T, E] -> [B, T, E]
        return self.down_proj(F.relu(self.up_proj(x)).square())


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(x)) (a mixture of experts on a
    sparse layer of a MoE model)."""

    def __init__(self, config: DecoderConfig, layer: int = 0) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: nn.Module
        if config.is_sparse_layer(layer):
            shared = config.shared_expert_intermediate_size
            self.mlp = SparseMoE(config, MLP(config.hidden_size, shared) if shared else None)
        else:
            dense = SquaredReLUMLP if config.hidden_act == "relu2" else MLP
            self.mlp = dense(config.hidden_size, config.intermediate_size, config.mlp_bias)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, past: tuple[Tensor, Tensor] | None,
                mask: Tensor | None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """x [B, T, E] -> (x [B, T, E], new (k, v) [B, Hkv, T, D])."""
        attn_out, kv = self.attn(self.attn_norm(x), cos, sin, past, mask)
        x = x + attn_out
        return x + self.mlp(self.mlp_norm(x)), kv


class DecoderLM(nn.Module):
    """A decoder-only language model (Llama, Qwen2, Qwen3) that keeps no KV cache of its own.

    Use `embed` (or your own input embeddings, e.g. image latents), then `forward` with explicit
    positions and the past KV, then `logits` on the positions you sample from.
    """

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(config)

    def embed(self, token_ids: Tensor) -> Tensor:
        """token_ids LongTensor [B, T] -> input embeddings [B, T, E]."""
        return self.embed_tokens(token_ids)

    def forward(self, hidden: Tensor, positions: Tensor, past: KVList | None = None,
                mask: Tensor | None = None, deepstack: Tensor | None = None,
                taps: dict[int, Tensor | None] | None = None) -> tuple[Tensor, KVList]:
        """Run the new tokens through every layer.

        Args:
            hidden: input embeddings [B, T, E] of the new tokens (from `embed`, or custom).
            positions: LongTensor [B, T], the RoPE position of each new token (per row, so padded
                rows get their own positions); with M-RoPE also [3, B, T], the temporal, height
                and width positions of each token ([B, T] means all three equal).
            past: per layer (k, v) [B, Hkv, T_past, D] of the earlier tokens (rotary applied), or
                None when there are none.
            mask: BoolTensor [B, 1, T, T_past + T], True where a new token may attend to a key
                (past keys first). None means causal over past + new. A query row with no True at
                all attends to itself only (its output is meaningless, but never NaN).
            deepstack: [k, B, T, E] added to the hidden states after each of the first k
                layers (Qwen3-Omni's deepstack visual features; zero away from image positions),
                or None.
            taps: layers whose hidden states to keep, as `hidden_at` defines them: each key
                `layer` gets its value set to transformers' ``output_hidden_states[layer]`` of
                the new tokens [B, T, E] (what Qwen3-Omni's talker reads of the thinker).

        Returns:
            (hidden [B, T, E] after the final norm, per layer the new tokens' (k, v) [B, Hkv, T, D]
            with rotary applied to k). They are contiguous and may be kept as they are.

        Raises:
            ValueError: shapes that do not fit together.
        """
        x, new_kv = self._run_layers(hidden, positions, past, mask, deepstack, taps,
                                     self.config.num_layers)
        out = self.norm(x)
        if taps is not None and self.config.num_layers in taps:
            taps[self.config.num_layers] = out
        return out, new_kv

    def _run_layers(self, hidden: Tensor, positions: Tensor, past: KVList | None,
                    mask: Tensor | None, deepstack: Tensor | None,
                    taps: dict[int, Tensor | None] | None, num_layers: int
                    ) -> tuple[Tensor, KVList]:
        """The first `num_layers` layers over the new tokens (arguments as `forward`'s): the
        last one's output, before the final norm, and their new (k, v)."""
        num_past = self._check_inputs(hidden, positions, past, mask)
        cos, sin = self.rotary(positions, hidden.dtype)
        mask = self._attention_mask(mask, hidden.shape[1], num_past, hidden.device)
        new_kv: KVList = []
        x = hidden
        if taps is not None and 0 in taps:
            taps[0] = x
        for i, layer in enumerate(self.layers[:num_layers]):
            x, kv = layer(x, cos, sin, None if past is None else past[i], mask)
            if taps is not None and i + 1 in taps:
                taps[i + 1] = x  # before deepstack, as transformers records it
            if deepstack is not None and i < len(deepstack):
                x = x + deepstack[i]
            new_kv.append(kv)
        return x, new_kv

    def hidden_at(self, layer: int, hidden: Tensor, positions: Tensor,
                  deepstack: Tensor | None = None) -> Tensor:
        """What transformers' ``output_hidden_states[layer]`` holds for a prompt computed
        alone (causal, no past): the input embeddings at 0, what layer ``layer - 1`` outputs
        (before deepstack features are added to it) in between, the final norm's output at
        `num_layers`. Shapes as `forward`'s. Only the layers before it run."""
        if not 0 <= layer <= self.config.num_layers:
            raise ValueError(f"layer must be in 0..{self.config.num_layers}, got {layer}")
        taps: dict[int, Tensor | None] = {layer: None}
        if layer == self.config.num_layers:
            self.forward(hidden, positions, deepstack=deepstack, taps=taps)
        else:
            self._run_layers(hidden, positions, None, None, deepstack, taps, layer)
        return taps[layer]  # type: ignore[return-value]

    def logits(self, hidden: Tensor) -> Tensor:
        """hidden [..., E] -> float32 logits [..., vocab] (computed in the model's dtype)."""
        return self.lm_head(hidden).float()

    def _check_inputs(self, hidden: Tensor, positions: Tensor, past: KVList | None,
                      mask: Tensor | None) -> int:
        """The number of past tokens; ValueError when the shapes do not fit together."""
        if hidden.dim() != 3 or hidden.shape[2] != self.config.hidden_size:
            raise ValueError(f"hidden must be [B, T, {self.config.hidden_size}], "
                             f"got {list(hidden.shape)}")
        batch, num_new = hidden.shape[0], hidden.shape[1]
        if positions.shape != (batch, num_new) and not (
                self.config.mrope_section is not None and positions.shape == (3, batch, num_new)):
            wanted = "[B, T] or [3, B, T]" if self.config.mrope_section else "[B, T]"
            raise ValueError(f"positions must be {wanted} with B, T = {batch}, {num_new}, "
                             f"got {list(positions.shape)}")
        num_past = 0
        if past is not None:
            if len(past) != self.config.num_layers:
                raise ValueError(f"past has {len(past)} layers, the model {self.config.num_layers}")
            num_past = past[0][0].shape[2]
            expected = (batch, self.config.num_kv_heads, num_past, self.config.head_dim)
            if past[0][0].shape != expected:
                raise ValueError(f"past k must be [B, Hkv, T_past, D] = {list(expected)}, "
                                 f"got {list(past[0][0].shape)}")
        if mask is not None and (mask.dtype != torch.bool
                                 or mask.shape != (batch, 1, num_new, num_past + num_new)):
            raise ValueError(f"mask must be a bool tensor [B, 1, T, T_past + T] = "
                             f"{[batch, 1, num_new, num_past + num_new]}, "
                             f"got {mask.dtype} {list(mask.shape)}")
        return num_past

    def _attention_mask(self, mask: Tensor | None, num_new: int, num_past: int,
                        device: torch.device) -> Tensor | None:
        """The mask every layer uses, built once per forward: [B or 1, 1, G*T, S] or None.

        None stands for "causal over past + new" (`attend` needs no mask for it), which is
        "everything" when a single new token attends to its past (decode).
        """
        if mask is None:
            return None
        # A row that may attend to nothing would make softmax NaN on some backends; NaN in a
        # padding token's V would then leak into real rows (0 * NaN). Let it see itself.
        own = torch.arange(num_new, device=device)[:, None] + num_past == torch.arange(
            num_past + num_new, device=device)  # [T, S]
        mask = mask | (own & ~mask.any(dim=-1, keepdim=True))
        groups = self.config.num_groups
        return mask if groups == 1 else mask.repeat(1, 1, groups, 1)  # row g*T + t = row t

    @staticmethod
    def kv_from_pages(pages: Tensor) -> KVList:
        """Pages [n, L, 2, P, Hkv, D] -> per layer (k, v) [1, Hkv, n*P, D] (one copy in all).

        The k/v of all layers are views into one contiguous buffer, each itself contiguous.
        """
        if pages.dim() != 6 or pages.shape[2] != 2:
            raise ValueError(f"pages must be [n, L, 2, P, Hkv, D], got {list(pages.shape)}")
        n, num_layers, _, page_size, num_kv_heads, head_dim = pages.shape
        kv = pages.permute(1, 2, 4, 0, 3, 5).reshape(  # [L, 2, Hkv, n*P, D]
            num_layers, 2, num_kv_heads, n * page_size, head_dim)
        return [(kv[layer, 0, None], kv[layer, 1, None]) for layer in range(num_layers)]

    @staticmethod
    def kv_to_pages(kv: KVList, start: int, page_size: int,
                    dtype: torch.dtype | None = None) -> Tensor:
        """Per layer (k, v) [1, Hkv, T, D] -> full pages of tokens [start, T): [n, L, 2, P, Hkv, D].

        `start` is a token index, normally the number of tokens whose pages the store already has
        (a multiple of `page_size`); n = (T - start) // page_size, and a partial last page is left
        out (only full pages are cached). `dtype` converts (default: the KV's dtype).
        """
        k0 = kv[0][0]
        if k0.dim() != 4 or k0.shape[0] != 1:
            raise ValueError(f"kv must be per layer (k, v) [1, Hkv, T, D], got {list(k0.shape)}")
        _, num_kv_heads, num_tokens, head_dim = k0.shape
        if not 0 <= start <= num_tokens or page_size < 1:
            raise ValueError(f"need 0 <= start <= T and page_size >= 1, got start={start}, "
                             f"T={num_tokens}, page_size={page_size}")
        n = (num_tokens - start) // page_size
        end = start + n * page_size
        pages = torch.empty(n, len(kv), 2, page_size, num_kv_heads, head_dim,
                            dtype=dtype or k0.dtype, device=k0.device)
        for layer, (k, v) in enumerate(kv):  # one strided copy per layer and K / V
            for which, x in enumerate((k, v)):
                pages[:, layer, which] = x[0, :, start:end].unflatten(
                    1, (n, page_size)).permute(1, 2, 0, 3)  # [Hkv, n*P, D] -> [n, P, Hkv, D]
        return pages
