"""DeepSeek-V4's mixture of experts: a shared expert plus routed ones.

Routing is either learned (a score function over the router's logits, top-k
on the scores plus a correction bias, no auxiliary loss) or, in the first
``hash_moe`` layers, a frozen token id -> experts table; either way the
selected experts are weighted by their normalised scores. Tokens are sorted
by expert and each expert runs once over its tokens: a loop over experts,
never over tokens.

Under tensor parallelism the router is replicated and each rank computes a
partial output, summed over the ranks by one all-reduce per layer: with
expert parallelism (``ep_size`` = ``tp_size``) a rank holds a contiguous
range of whole experts and computes only the (token, choice) pairs routed
to them; without it every rank holds a slice of each expert's intermediate
features. The shared expert's intermediate features are split either way.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from specserve.distributed import SINGLE, RankGroup
from specserve.layers.linear import PackedWeight, Shard, linear
from specserve.layers.parallel import ColumnParallelLinear, RowParallelLinear, split

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
    """``w2(swiglu(w1 x, w3 x))``, checkpoint names ``w1``/``w2``/``w3``: this
    rank's slice of the intermediate features, its partial output unreduced."""

    def __init__(self, hidden: int, inter: int, limit: float, group: RankGroup = SINGLE) -> None:
        super().__init__()
        what = "moe_intermediate_size x n_shared_experts"
        self.w1 = ColumnParallelLinear(hidden, inter, group, what)
        self.w2 = RowParallelLinear(inter, hidden, False, group, what, reduce=False)
        self.w3 = ColumnParallelLinear(hidden, inter, group, what)
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
    """This rank's experts' ``w1|w3`` as ``w13 [E, 2I, d]`` and ``w2 [E, d,
    I]``; the checkpoint's per-expert tensors load into their slices (or,
    where a checkpoint stores all experts as one tensor each, those tensors:
    ``checkpoint_part``). Under tensor parallelism either a contiguous range
    of whole experts (``expert_parallel``) or a slice of every expert's
    ``I``. ``act``: ``[.., 2I]`` gate|up -> ``[.., I]``."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        inter: int,
        act: Callable[[torch.Tensor], torch.Tensor],
        group: RankGroup = SINGLE,
        expert_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.group, self.full_inter, self.act = group, inter, act
        self.num_experts = num_experts
        self.first, local = 0, num_experts
        self.inter_start, self.inter = 0, inter
        if expert_parallel:
            self.first, local = split(num_experts, group, "n_routed_experts")
        else:
            self.inter_start, self.inter = split(inter, group, "moe_intermediate_size")
        self.w13 = nn.Parameter(torch.empty(local, 2 * self.inter, hidden))
        self.w2 = nn.Parameter(torch.empty(local, hidden, self.inter))
        # Each expert's packed w1|w3 and w2 (on the CPU; see PackedWeight).
        self.packed = [(PackedWeight(), PackedWeight()) for _ in range(local)]

    def post_load(self) -> None:
        for e, (p13, p2) in enumerate(self.packed):
            p13.pack(self.w13[e])
            p2.pack(self.w2[e])

    def holds(self, expert: int) -> bool:
        return self.first <= expert < self.first + self.w13.shape[0]

    def checkpoint_layout(self, prefix: str) -> tuple[dict[str, torch.Tensor], dict[str, Shard]]:
        """This rank's experts' checkpoint keys -> their tensors, and the
        slices read of them (an intermediate split)."""
        out, shards = {}, {}
        i, n, full = self.inter_start, self.inter, self.full_inter
        for local in range(self.w13.shape[0]):
            key = f"{prefix}.{self.first + local}"
            out[f"{key}.w1.weight"] = self.w13.data[local, :n]
            out[f"{key}.w3.weight"] = self.w13.data[local, n:]
            out[f"{key}.w2.weight"] = self.w2.data[local]
            if n != full:
                shards[f"{key}.w1.weight"] = shards[f"{key}.w3.weight"] = Shard(0, i, n, full)
                shards[f"{key}.w2.weight"] = Shard(1, i, n, full)
        return out, shards

    def checkpoint_targets(self, prefix: str) -> dict[str, torch.Tensor]:
        return self.checkpoint_layout(prefix)[0]

    def checkpoint_part(self, attr: str) -> tuple[torch.Tensor, Shard | None]:
        """All experts in one tensor per weight (``[E, 2I, d]`` gate|up,
        ``[E, d, I]`` down): this rank's experts of it. A slice of each
        expert's ``I`` is two ranges of gate|up, so that split is refused
        where the model is built."""
        assert self.inter == self.full_inter, "fused expert tensors split by experts only"
        param = getattr(self, attr)
        local = param.shape[0]
        if local == self.num_experts:
            return param.data, None
        return param.data, Shard(0, self.first, local, self.num_experts)

    def forward(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """``x [T, d]``, ``experts``/``weights [T, k]`` -> ``[T, d]`` (this
        rank's part of it under tensor parallelism)."""
        k, local = experts.shape[1], self.w13.shape[0]
        flat = experts.flatten() - self.first  # [T * k]: each pair's expert among this rank's
        if local < self.num_experts:  # expert parallelism: the pairs routed here only
            pairs = ((flat >= 0) & (flat < local)).nonzero().squeeze(1)
            order = pairs[flat[pairs].argsort(stable=True)]
        else:
            order = flat.argsort(stable=True)  # (token, choice) pairs grouped by expert
        tokens = order // k
        # The slice bounds of each expert's tokens: one read per MoE layer (free
        # on the CPU; on CUDA a grouped GEMM over device offsets would avoid it).
        counts = torch.bincount(flat[order], minlength=local).tolist()  # host read
        xs = x[tokens]  # [T * k, d]
        out = torch.empty_like(xs)
        start = 0
        for e, c in enumerate(counts):
            if c:
                p13, p2 = self.packed[e]
                h = self.act(linear(xs[start : start + c], self.w13[e], None, p13))
                out[start : start + c] = linear(h, self.w2[e], None, p2)
                start += c
        out = out * weights.flatten()[order, None].to(out.dtype)
        return torch.zeros_like(x).index_add_(0, tokens, out)


class MoE(nn.Module):
    def __init__(
        self,
        hidden: int,
        cfg: DeepseekV4Config,
        vocab_size: int,
        hashed: bool,
        group: RankGroup = SINGLE,
        expert_parallel: bool = False,
    ) -> None:
        super().__init__()
        inter = cfg.moe_intermediate_size
        self.group = group
        self.gate = Router(hidden, cfg, vocab_size, hashed)
        act = partial(clamped_swiglu, limit=cfg.swiglu_limit)
        self.experts = RoutedExperts(
            cfg.n_routed_experts, hidden, inter, act, group, expert_parallel
        )
        self.shared_experts = SharedExpert(
            hidden, inter * cfg.n_shared_experts, cfg.swiglu_limit, group
        )

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        experts, weights = self.gate(x, input_ids)
        # Both parts partial under tensor parallelism: one all-reduce sums them.
        return self.group.all_reduce(self.experts(x, experts, weights) + self.shared_experts(x))
