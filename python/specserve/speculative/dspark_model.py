"""The DSpark draft network (DeepSpec's checkpoint format; ``markov_rank`` 0 is DFlash).

Context features (the captured target layers of committed positions) are
fused by ``fc`` + ``hidden_norm`` into ``H_ctx``; every draft layer projects
``H_ctx`` to context keys/values (``k_norm`` on keys, RoPE at the context
positions). A block ``[anchor, mask x (gamma - 1)]`` at positions
``p .. p + gamma - 1`` attends, without a causal mask, to all context
positions ``< p`` and to the whole block. Slot ``k`` predicts the token at
``p + k + 1``; the Markov head adds a correction that depends on the token
before it, which makes drafting left to right; the confidence head scores
each draft. Gemma 4's drafter (``DSparkConfig.gemma4``) differs in its
layers as ``dspark_config.py`` says.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specserve.distributed import SINGLE, RankGroup
from specserve.layers.activation import gated_act, get_activation
from specserve.layers.attention import LayerAttention
from specserve.layers.linear import FusedLinears, Linear, LogitsHead, k_major_
from specserve.layers.norm import RMSNorm, rms_norm
from specserve.layers.parallel import (
    ColumnParallelLinear,
    HeadSplit,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelHead,
)
from specserve.layers.rotary import RotaryEmbedding
from specserve.speculative.block_drafter import BlockDrafter, ConfidenceHead, MarkovHead
from specserve.speculative.dspark_config import DSparkConfig


class DraftAttention(nn.Module):
    """This rank's heads of a draft layer (all of them at one rank)."""

    def __init__(self, cfg: DSparkConfig, group: RankGroup = SINGLE) -> None:
        super().__init__()
        heads = HeadSplit.of(cfg.num_attention_heads, cfg.num_key_value_heads, group)
        h, kv, dim = heads.q_count, heads.kv_count, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, kv, dim
        self.eps = cfg.rms_norm_eps
        bias, d = cfg.attention_bias, cfg.hidden_size
        q_full, kv_full = cfg.num_attention_heads * dim, cfg.num_key_value_heads * dim
        q_rows, kv_rows = (heads.q_start * dim, h * dim), (heads.kv_start * dim, kv * dim)
        self.q_proj = ColumnParallelLinear(d, q_full, group, "heads", q_rows, bias)
        self.k_proj = ColumnParallelLinear(d, kv_full, group, "KV heads", kv_rows, bias)
        projections = [self.q_proj, self.k_proj]
        # Gemma 4: values normed without a weight, and with ``keys_are_values``
        # taken from the key projection (before its norm and RoPE).
        self.keys_are_values, self.norm_values = cfg.keys_are_values, cfg.gemma4
        if not self.keys_are_values:
            self.v_proj = ColumnParallelLinear(d, kv_full, group, "KV heads", kv_rows, bias)
            projections.append(self.v_proj)
        self.o_proj = RowParallelLinear(
            q_full, d, bias, group, "the drafter's num_attention_heads x head_dim"
        )
        self.q_norm = RMSNorm(dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(dim, cfg.rms_norm_eps)
        # One matmul for q|k|v of the block (k|v of the context: its last rows).
        self.qkv = FusedLinears(*projections)
        self._qk_norm: torch.Tensor | None = None  # [H + Hkv, D], set by post_load

    def post_load(self) -> None:
        self.qkv.fuse_()
        self.o_proj.post_load()
        self._qk_norm = self._qk_norm_weight()

    def _qk_norm_weight(self) -> torch.Tensor:
        """q_norm's weight for each q head, then k_norm's for each k head: both
        norms as one op over the q|k heads."""
        if self._qk_norm is not None:
            return self._qk_norm
        q = self.q_norm.weight.expand(self.num_heads, -1)
        return torch.cat([q, self.k_norm.weight.expand(self.num_kv_heads, -1)])

    def values(self, kv: torch.Tensor) -> torch.Tensor:
        """The values ``[N, Hkv, D]`` of projected key (and value) heads
        ``[N, Hkv (+ Hkv), D]``."""
        hkv = self.num_kv_heads
        v = kv[:, :hkv] if self.keys_are_values else kv[:, hkv:]
        return rms_norm(v, None, self.eps) if self.norm_values else v

    def kv(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], rotary: RotaryEmbedding
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, rotated) and values ``[n, Hkv, D]`` of ``x [n, d]``."""
        q_size = self.num_heads * self.head_dim
        kv_heads = self.num_kv_heads * (1 if self.keys_are_values else 2)
        kv = self.qkv(x, slice(q_size, None)).view(x.shape[0], kv_heads, self.head_dim)
        k = rms_norm(kv[:, : self.num_kv_heads], self._qk_norm_weight()[self.num_heads :], self.eps)
        return rotary.rotate(k, rope), self.values(kv)

    def forward(
        self,
        x: torch.Tensor,  # [R, G, d] block
        rope: tuple[torch.Tensor, torch.Tensor],  # RoPE at the context rows', then the block's
        layer: int,
        attend: Attend,
        rotary: RotaryEmbedding,
        context: ContextRows | None = None,
    ) -> torch.Tensor:
        r, g, d = x.shape
        rows = x.reshape(r * g, d)
        n = 0
        if context is not None:  # their K/V from the same matmul as the block's q|k|v
            n = context.hidden.shape[0]
            rows = torch.cat([context.hidden, rows])
        n_qk = self.num_heads + self.num_kv_heads
        heads = self.qkv(rows).view(n + r * g, -1, self.head_dim)  # [N, H + 2 * Hkv, D]
        qk = rotary.rotate(rms_norm(heads[:, :n_qk], self._qk_norm_weight(), self.eps), rope)
        v = self.values(heads[:, self.num_heads :])
        if context is not None:
            context.store(layer, qk[:n, self.num_heads :], v[:n])
        q, k = (
            qk[n:]
            .view(r, g, n_qk, self.head_dim)
            .split([self.num_heads, self.num_kv_heads], dim=-2)
        )
        o = attend(layer, q, k, v[n:].view(r, g, self.num_kv_heads, self.head_dim))  # [R, G, H, D]
        return self.o_proj.forward(o.reshape(r, g, -1))


@dataclass
class ContextRows:
    """Context positions whose K/V a block forward computes on its way (serving:
    the few features a round committed): ``hidden_norm(fc(features))``
    rows join each layer's q|k|v matmul, and ``store`` puts their K/V in the
    draft pool before the block attends to it."""

    hidden: torch.Tensor  # [n, d]
    positions: torch.Tensor  # [n]
    store: Callable[[int, torch.Tensor, torch.Tensor], None]  # (layer, k, v [n, Hkv, D])


# (layer, q [R, G, H, D], the block's k / v [R, G, Hkv, D]) -> [R, G, H, D]:
# each block sees its context and the whole block, without a causal mask.
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def dense_attend(
    ctx: list[tuple[torch.Tensor, torch.Tensor]],  # per layer [R, L, Hkv, D]
    ctx_bias: torch.Tensor,  # [R, L]: 0 for a real context position, -inf for padding
    scale: float | None = None,  # None: 1 / sqrt(D)
) -> Attend:
    """Attention over dense context K/V (training, and the test oracle; serving
    reads the draft pool through the paged attention backends)."""

    def attend(layer: int, q: torch.Tensor, bk: torch.Tensor, bv: torch.Tensor) -> torch.Tensor:
        ck, cv = ctx[layer]
        r, g = q.shape[:2]
        k = torch.cat([ck, bk], dim=1).transpose(1, 2)  # [R, Hkv, L + G, D]
        v = torch.cat([cv, bv], dim=1).transpose(1, 2)
        bias = torch.cat([ctx_bias, ctx_bias.new_zeros(r, g)], dim=1)[:, None, None, :]
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k,
            v,
            attn_mask=bias.to(q.dtype),
            enable_gqa=q.shape[2] != k.shape[1],
            scale=scale,
        )  # [R, H, G, D]
        return o.transpose(1, 2)

    return attend


class DraftLayer(nn.Module):
    def __init__(self, cfg: DSparkConfig, group: RankGroup = SINGLE) -> None:
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = DraftAttention(cfg, group)
        self.mlp = DraftMLP(cfg, group)
        self.input_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.sandwich = cfg.gemma4
        if self.sandwich:  # Gemma 4: norms on each sublayer's output too, and a scalar
            self.pre_feedforward_layernorm = RMSNorm(d, eps)
            self.post_feedforward_layernorm = RMSNorm(d, eps)
            self.layer_scalar = nn.Parameter(torch.ones(1))

    def after_attention(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The residual stream after attention's output ``attn`` and the MLP."""
        if not self.sandwich:  # (post_attention_layernorm: the MLP's input norm)
            x = x + attn
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + self.post_attention_layernorm(attn)
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x * self.layer_scalar


class DraftMLP(nn.Module):
    def __init__(self, cfg: DSparkConfig, group: RankGroup = SINGLE) -> None:
        super().__init__()
        d, inter, what = cfg.hidden_size, cfg.intermediate_size, "the drafter's intermediate_size"
        self.gate_proj = ColumnParallelLinear(d, inter, group, what)
        self.up_proj = ColumnParallelLinear(d, inter, group, what)
        self.down_proj = RowParallelLinear(inter, d, False, group, what)
        self.gate_up = FusedLinears(self.gate_proj, self.up_proj)
        self.act = get_activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(gated_act(self.gate_up(x), self.act))


class DSparkDraftModel(BlockDrafter):
    def __init__(
        self,
        cfg: DSparkConfig,
        use_markov: bool = True,
        use_confidence: bool = True,
        context_length: int | None = None,  # the serving context, if longer than the config's
        group: RankGroup = SINGLE,
    ) -> None:
        """``group``: the tensor-parallel group this is one rank's shard for
        (heads, MLP features and vocabulary split as the target's)."""
        super().__init__()
        self.config = cfg
        self.group = group
        d = cfg.hidden_size
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, d, group)
        self.lm_head = VocabParallelHead(d, cfg.vocab_size, group)
        self.lm_head.softcap = cfg.logit_softcap
        self.fc = Linear(len(cfg.target_layer_ids) * d, d, bias=False)
        self.fc_norm = None
        if cfg.feature_norms:  # each captured layer normed before they are joined
            eps = cfg.rms_norm_eps
            self.fc_norm = nn.ModuleList([RMSNorm(d, eps) for _ in cfg.target_layer_ids])
        self.hidden_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([DraftLayer(cfg, group) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.markov_head = None
        if cfg.markov_rank > 0:
            self.markov_head = MarkovHead(cfg, group, cfg.drafting_vocab)
        self.draft_head: LogitsHead | None = None
        if cfg.draft_vocab_size is not None:  # its own head over its reduced vocabulary
            assert group.size == 1, "a reduced-vocabulary drafter drafts on one rank"
            self.draft_head = LogitsHead(d, cfg.draft_vocab_size)
            self.draft_head.softcap = cfg.logit_softcap
            # Draft id i is target id i + d2t[i] (the speculators format's offsets).
            self.d2t = nn.Parameter(
                torch.empty(cfg.draft_vocab_size, dtype=torch.long), requires_grad=False
            )
        self.confidence_head = None
        if cfg.enable_confidence_head:
            extra = cfg.markov_rank if cfg.confidence_head_with_markov else 0
            self.confidence_head = ConfidenceHead(d + extra)
        self.lead = 0 if cfg.sample_from_anchor else 1
        # DFlash runs a DSpark checkpoint without its Markov and confidence heads.
        self.use_markov = use_markov and self.markov_head is not None
        self.use_confidence = use_confidence and self.confidence_head is not None
        # A block drafted at the last context position reaches block_size past it.
        longer = max(0, (context_length or 0) - cfg.max_position_embeddings)
        self.rotary = RotaryEmbedding(
            cfg.rope,
            cfg.head_dim,
            cfg.max_position_embeddings,
            extra_positions=longer + cfg.block_size + self.lead,
        )

    @property
    def feature_weight(self) -> torch.Tensor:
        return self.fc.weight

    @property
    def attention_layers(self) -> tuple[LayerAttention, ...]:
        """Each draft layer's attention, for the backends that read its pool."""
        return (LayerAttention(scale=self.config.attention_scale),) * len(self.layers)

    @property
    def vocab_head(self) -> LogitsHead:
        return self.lm_head

    @property
    def drafting_head(self) -> LogitsHead:
        return self.lm_head if self.draft_head is None else self.draft_head

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.vocab_logits(hidden)

    def post_load(self) -> None:
        """After the weights are in: the fused projections, the packed weights
        of the CPU's matmuls (``PackedWeight``), and the Markov head's weight
        K-major (see ``k_major_``)."""
        self.embed_tokens.post_load()
        self.lm_head.post_load()
        self.fc.post_load()
        for layer in self.layers:
            layer.self_attn.post_load()
            layer.mlp.gate_up.fuse_()
            layer.mlp.down_proj.post_load()
        if self.markov_head is not None:
            self.markov_head.markov_w2.post_load()
            k_major_(self.markov_head.markov_w2.weight)
        if self.draft_head is not None:
            self._map_draft_vocab()

    def _map_draft_vocab(self) -> None:
        """A reduced vocabulary drafts as a token map does (``restrict_vocab``),
        its rows in the order of their target ids."""
        cfg = self.config
        ids = torch.arange(cfg.draft_vocab_size, device=self.d2t.device) + self.d2t
        if (
            int(ids.min()) < 0
            or int(ids.max()) >= cfg.vocab_size
            or ids.unique().numel() < ids.numel()
        ):
            raise ValueError(
                f"speculative_draft_model_path: d2t must map the {cfg.draft_vocab_size} draft ids "
                f"to distinct target ids in [0, {cfg.vocab_size})"
            )
        ids, rows = ids.sort()
        self.restrict_vocab(ids, rows)

    # ---- context ------------------------------------------------------------

    def context_kv(
        self, features: torch.Tensor, positions: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, keys/values ``[n, Hkv, D]`` of context features ``[n, m * d]``."""
        h_ctx = self.context_hidden(features)  # [n, d], the same for every layer
        rope = self.rotary.at(positions, h_ctx.dtype)
        return [layer.self_attn.kv(h_ctx, rope, self.rotary) for layer in self.layers]

    def context_hidden(self, features: torch.Tensor) -> torch.Tensor:
        """``[n, m * d]`` captured target layers -> the fused context state ``[n, d]``."""
        if self.fc_norm is not None:
            layers = features.view(features.shape[0], len(self.fc_norm), -1)  # [n, m, d]
            weight = torch.stack([norm.weight for norm in self.fc_norm])  # [m, d]
            features = rms_norm(layers, weight, self.config.rms_norm_eps).flatten(1)
        return self.hidden_norm(self.fc.forward(features))

    # ---- the block ----------------------------------------------------------

    def block_hidden(
        self,
        anchors: torch.Tensor,  # [R]
        starts: torch.Tensor,  # [R]: each anchor's position p
        attend: Attend,
        block_size: int,
        context: ContextRows | None = None,
    ) -> torch.Tensor:
        """Final-normed outputs ``[R, gamma, d]`` of the blocks ``[anchor, mask...]``
        (and, on the way, the K/V of ``context``'s rows)."""
        r = anchors.shape[0]
        ids = torch.full((r, block_size), self.config.mask_token_id, device=anchors.device)
        ids[:, 0] = anchors
        positions = starts[:, None] + torch.arange(block_size, device=anchors.device)  # [R, G]
        x = self.embed_tokens(ids)
        if self.config.gemma4:  # sqrt(hidden) in the weights' dtype, as Gemma rounds it
            x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        flat = positions.reshape(-1)
        if context is not None:
            flat = torch.cat([context.positions, flat])
        rope = self.rotary.at(flat, x.dtype)  # one lookup for every layer
        for i, layer in enumerate(self.layers):
            h = layer.input_layernorm(x)
            x = layer.after_attention(x, layer.self_attn(h, rope, i, attend, self.rotary, context))
        return self.norm(x)

    # ---- training -----------------------------------------------------------

    def train_hidden(
        self,
        features: torch.Tensor,  # [B, T, m * d] captured target layers of every position
        input_ids: torch.Tensor,  # [B, T]
        anchors: torch.Tensor,  # [B, A] anchor positions
        block_size: int,
    ) -> torch.Tensor:
        """Blocks at many anchors of whole sequences at once: ``[B, A, gamma, d]``.
        Block ``(b, a)`` sees the context positions ``< anchors[b, a]``."""
        b, t = input_ids.shape
        a = anchors.shape[1]
        positions = torch.arange(t, device=input_ids.device).expand(b, t)
        h_ctx = self.context_hidden(features).reshape(b * t, -1)  # [B * T, d]
        rope = self.rotary.at(positions.reshape(-1), h_ctx.dtype)
        ctx = []
        for layer in self.layers:
            k, v = (
                x.view(b, t, *x.shape[1:]) for x in layer.self_attn.kv(h_ctx, rope, self.rotary)
            )  # [B, T, Hkv, D]
            ctx.append(
                tuple(
                    x[:, None].expand(b, a, *x.shape[1:]).reshape(b * a, *x.shape[1:])
                    for x in (k, v)
                )
            )
        past = positions[:, None, :] >= anchors[:, :, None]  # [B, A, T]
        bias = torch.zeros(past.shape, device=past.device).masked_fill(past, float("-inf"))
        tokens = input_ids.gather(1, anchors)  # [B, A]
        hidden = self.block_hidden(
            tokens.flatten(),
            anchors.flatten(),
            dense_attend(ctx, bias.view(b * a, t), self.config.attention_scale),
            block_size,
        )
        return hidden.view(b, a, block_size, -1)

    # ---- reference ----------------------------------------------------------

    def naive_block(self, features: torch.Tensor, anchor: int, block_size: int) -> torch.Tensor:
        """One block from scratch (no cache) over context features ``[p, m * d]``
        of positions ``0..p-1``: the oracle for the cached path, and the shape
        of a training forward."""
        p = features.shape[0]
        positions = torch.arange(p, device=features.device)
        ctx = [(k[None], v[None]) for k, v in self.context_kv(features, positions)]
        bias = features.new_zeros(1, p)
        anchors = torch.tensor([anchor], device=features.device)
        starts = torch.tensor([p], device=features.device)
        return self.block_hidden(
            anchors, starts, dense_attend(ctx, bias, self.config.attention_scale), block_size
        )[0]
