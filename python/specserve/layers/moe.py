"""DeepSeek-V4's mixture of experts: a shared expert plus routed ones.

Routing is either learned (a score function over the router's logits, top-k
on the scores plus a correction bias, no auxiliary loss) or, in the first
``hash_moe`` layers, a frozen token id -> experts table; either way the
selected experts are weighted by their normalised scores. Tokens are sorted
by expert and each expert runs once over its tokens: a loop over experts,
never over tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from specserve.layers.linear import Linear, PackedWeight, linear

if TYPE_CHECKING:
    from specserve.models.deepseek_v4_config import DeepseekV4Config


def score(logits: torch.Tensor, func: str) -> torch.Tensor:
    if func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if func == "softmax":
        return logits.softmax(dim=-1)
    return logits.sigmoid()


def clamped_swiglu(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(gate) * up`` with gate clamped above and up clamped both ways."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class SharedExpert(nn.Module):
    """``w2(swiglu(w1 x, w3 x))``, checkpoint names ``w1``/``w2``/``w3``."""

    def __init__(self, hidden: int, inter: int, limit: float) -> None:
        super().__init__()
        self.w1 = Linear(hidden, inter, bias=False)
        self.w2 = Linear(inter, hidden, bias=False)
        self.w3 = Linear(hidden, inter, bias=False)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = torch.cat([self.w1.forward(x), self.w3.forward(x)], dim=-1)
        return self.w2.forward(clamped_swiglu(gate_up, self.limit))


class Router(nn.Module):
    """Checkpoint ``gate.weight`` and, by kind, ``gate.bias`` (the score
    correction of learned routing) or ``gate.tid2eid`` (hash routing)."""

    def __init__(self, hidden: int, cfg: DeepseekV4Config, vocab_size: int, hashed: bool) -> None:
        super().__init__()
        e = cfg.n_routed_experts
        self.top_k, self.func, self.scaling = (
            cfg.num_experts_per_tok,
            cfg.scoring_func,
            cfg.routed_scaling_factor,
        )
        self.weight = nn.Parameter(torch.empty(e, hidden))
        self.bias = None if hashed else nn.Parameter(torch.empty(e))
        self.register_buffer(
            "tid2eid", torch.empty(vocab_size, self.top_k, dtype=torch.int64) if hashed else None
        )

    def forward(
        self, x: torch.Tensor, input_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Experts ``[T, k]`` and their weights ``[T, k]`` (float32)."""
        scores = score(F.linear(x.float(), self.weight.float()), self.func)  # [T, E]
        if self.tid2eid is not None:
            experts = self.tid2eid[input_ids]
        else:
            experts = torch.topk(
                scores + self.bias.float(), self.top_k, dim=-1, sorted=False
            ).indices
        weights = scores.gather(1, experts)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return experts, weights * self.scaling


class RoutedExperts(nn.Module):
    """Every expert's ``w1|w3`` as ``w13 [E, 2I, d]`` and ``w2 [E, d, I]``;
    the checkpoint's per-expert tensors load into their slices."""

    def __init__(self, num_experts: int, hidden: int, inter: int, limit: float) -> None:
        super().__init__()
        self.inter, self.limit = inter, limit
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, inter))
        # Each expert's packed w1|w3 and w2 (on the CPU; see PackedWeight).
        self.packed = [(PackedWeight(), PackedWeight()) for _ in range(num_experts)]

    def post_load(self) -> None:
        for e, (p13, p2) in enumerate(self.packed):
            p13.pack(self.w13[e])
            p2.pack(self.w2[e])

    def checkpoint_targets(self, prefix: str) -> dict[str, torch.Tensor]:
        out = {}
        for e in range(self.w13.shape[0]):
            out[f"{prefix}.{e}.w1.weight"] = self.w13.data[e, : self.inter]
            out[f"{prefix}.{e}.w3.weight"] = self.w13.data[e, self.inter :]
            out[f"{prefix}.{e}.w2.weight"] = self.w2.data[e]
        return out

    def forward(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """``x [T, d]``, ``experts``/``weights [T, k]`` -> ``[T, d]``."""
        k = experts.shape[1]
        flat = experts.flatten()
        order = flat.argsort(stable=True)  # (token, choice) pairs grouped by expert
        tokens = order // k
        # The slice bounds of each expert's tokens: one read per MoE layer (free
        # on the CPU; on CUDA a grouped GEMM over device offsets would avoid it).
        counts = torch.bincount(flat, minlength=self.w13.shape[0]).tolist()  # host read
        xs = x[tokens]  # [T * k, d]
        out = torch.empty_like(xs)
        start = 0
        for e, c in enumerate(counts):
            if c:
                p13, p2 = self.packed[e]
                h = clamped_swiglu(
                    linear(xs[start : start + c], self.w13[e], None, p13), self.limit
                )
                out[start : start + c] = linear(h, self.w2[e], None, p2)
                start += c
        out = out * weights.flatten()[order, None].to(out.dtype)
        return torch.zeros_like(x).index_add_(0, tokens, out)


class MoE(nn.Module):
    def __init__(self, hidden: int, cfg: DeepseekV4Config, vocab_size: int, hashed: bool) -> None:
        super().__init__()
        inter = cfg.moe_intermediate_size
        self.gate = Router(hidden, cfg, vocab_size, hashed)
        self.experts = RoutedExperts(cfg.n_routed_experts, hidden, inter, cfg.swiglu_limit)
        self.shared_experts = SharedExpert(hidden, inter * cfg.n_shared_experts, cfg.swiglu_limit)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        experts, weights = self.gate(x, input_ids)
        return self.experts(x, experts, weights) + self.shared_experts(x)
