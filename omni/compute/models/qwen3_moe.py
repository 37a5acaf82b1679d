"""`SparseMoE`: a mixture-of-experts MLP (Qwen3-MoE), computed as transformers computes it.

A router scores every expert per token (softmax in float32), the token goes to its top-k
experts (their weights renormalised to sum to 1 with `norm_topk_prob`), and each expert that
got tokens runs its SwiGLU on just those tokens; their outputs, scaled by the routing weights,
are summed per token in expert order (transformers' order, so the sums round alike).

Shapes: N tokens, E hidden, X experts, K experts per token, I an expert's intermediate size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omni.compute.models._linear import Linear
from omni.compute.models.config import DecoderConfig

__all__ = ["SparseMoE"]


class SparseMoE(nn.Module):
    """`num_experts` SwiGLU experts behind a top-k router.

    Parameters: `gate` (the router, [X, E]); per expert `gate_up_proj` [X, 2I, E] (gate rows
    first) and `down_proj` [X, E, I]; with a `shared_expert` (an MLP every token goes through,
    Qwen3-Omni's talker), its `shared_expert_gate` [1, E], a sigmoid scaling its output.
    """

    def __init__(self, config: DecoderConfig, shared_expert: nn.Module | None = None) -> None:
        super().__init__()
        experts, inter, hidden = (config.num_experts, config.moe_intermediate_size,
                                  config.hidden_size)
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.gate = Linear(hidden, experts, bias=False)
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, inter))
        # Qwen3-Omni's talker: every token also through one shared expert, scaled by a gate
        self.shared_expert = shared_expert
        self.shared_expert_gate = (Linear(hidden, 1, bias=False) if shared_expert is not None
                                   else None)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [N, E] -> (weights [N, K] in x's dtype, experts [N, K])."""
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: Tensor) -> Tensor:  # [B, T, E] -> [B, T, E]
        flat = x.reshape(-1, x.shape[-1])
        weights, experts = self.route(flat)
        out = torch.zeros_like(flat)
        # tokens per expert: one sort instead of a mask per expert
        order = experts.flatten().argsort(stable=True)
        counts = torch.bincount(experts.flatten(), minlength=self.gate_up_proj.shape[0]).tolist()
        slots = order.split(counts)  # per expert: indices into the [N * K] assignments
        for expert, slot in enumerate(slots):
            if not len(slot):
                continue
            tokens = slot // self.top_k
            gate, up = F.linear(flat[tokens], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[expert])
            out.index_add_(0, tokens, y * weights.flatten()[slot, None])
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.view_as(x)
