"""DeepSeek-V4's own DSpark drafter, as its checkpoints ship it (``mtp.*``).

One stage per captured target layer (``dspark_target_layer_ids``), each a V4
decoder layer with sliding-window attention only: MQA with a sink per head,
the V4 MoE and mHC streams. The captured target states (each layer's mHC
streams averaged) are fused by stage 0's ``main_proj`` + ``main_norm`` into
one context state per position; every stage projects it through its own
``wkv`` + ``norm`` + RoPE into that stage's context key (= value). A block
``[anchor, noise x (gamma - 1)]`` at positions ``p .. p + gamma - 1``
(the target's embedding, spread over the streams) attends to the last
``sliding_window`` context positions before ``p`` and to the whole block,
without a causal mask. The last stage collapses the streams (``hc_head``);
``norm`` + the target's head give the base logits, the vanilla Markov head
corrects them slot by slot, and the confidence head reads the collapsed
state with the Markov embedding of the token before each slot.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from specserve.config import ModelConfig
from specserve.distributed import SINGLE, RankGroup
from specserve.layers.compressed_attention import sink_attention
from specserve.layers.hyper_connection import (
    HyperConnection,
    HyperHead,
    expand,
)
from specserve.layers.linear import Linear, LogitsHead, Shard
from specserve.layers.moe import MoE
from specserve.layers.norm import RMSNorm
from specserve.layers.parallel import VocabParallelEmbedding, VocabParallelHead
from specserve.models.deepseek_v4 import (
    Attention,
    DeepseekV4ForCausalLM,
    InterleavedRope,
    hc_names,
    parameter_layout,
)
from specserve.models.deepseek_v4_config import SLIDING
from specserve.speculative.block_drafter import BlockDrafter, ConfidenceHead, MarkovHead
from specserve.speculative.dspark_model import Attend


@dataclass(frozen=True)
class DSparkV4Config:
    """The ``dspark_*`` fields of a V4 config, with the names the shared
    Markov and confidence heads read."""

    block_size: int
    target_layer_ids: tuple[int, ...]
    markov_rank: int
    noise_token_id: int
    hidden_size: int
    vocab_size: int
    enable_confidence_head: bool = True
    markov_head_type: str = "vanilla"
    confidence_head_with_markov: bool = True

    @property
    def num_stages(self) -> int:
        return len(self.target_layer_ids)

    @classmethod
    def from_path(cls, path: str, target: ModelConfig) -> DSparkV4Config:
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise ValueError(f"speculative_draft_model_path: no config.json in {path!r}")
        with open(cfg_path) as f:
            return cls.from_dict(json.load(f), target, cfg_path)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], target: ModelConfig, source: str) -> DSparkV4Config:
        missing = [
            k
            for k in ("dspark_block_size", "dspark_target_layer_ids", "dspark_noise_token_id")
            if k not in cfg
        ]
        if missing:
            raise ValueError(
                f"{source}: no DeepSeek-V4 DSpark drafter here (missing {missing}; a bundled "
                "checkpoint has dspark_* fields and mtp.* weights)"
            )
        rank = int(cfg.get("dspark_markov_rank", 0) or 0)
        if rank <= 0:
            raise ValueError(f"{source}: dspark_markov_rank must be > 0, got {rank}")
        _check_v4_release(cfg, target, source)
        ids = tuple(int(i) for i in cfg["dspark_target_layer_ids"])
        n = target.num_hidden_layers
        if not ids or any(b <= a for a, b in zip(ids, ids[1:])) or ids[0] < 0 or ids[-1] >= n:
            raise ValueError(
                f"{source}: dspark_target_layer_ids {list(ids)} must be strictly increasing "
                f"target layers in [0, {n - 1}]"
            )
        return cls(
            block_size=int(cfg["dspark_block_size"]),
            target_layer_ids=ids,
            markov_rank=rank,
            noise_token_id=int(cfg["dspark_noise_token_id"]),
            hidden_size=target.hidden_size,
            vocab_size=target.vocab_size,
            enable_confidence_head=bool(cfg.get("enable_confidence_head", True)),
            confidence_head_with_markov=bool(cfg.get("confidence_head_with_markov", True)),
        )


def _check_v4_release(cfg: dict[str, Any], target: ModelConfig, source: str) -> None:
    """What the published V4 releases' drafters differ in that this one does
    not do: named errors, each with the release that needs it."""
    if cfg.get("model_type") == "deepseek_v41":
        raise ValueError(
            f"{source}: DeepSeek-V4.1 (model_type deepseek_v41: Engram layers, its drafter "
            f"reading layer id's input, not its output) is not supported"
        )
    kind = cfg.get("dspark_markov_head_type") or "vanilla"
    if kind != "vanilla":
        raise ValueError(
            f"{source}: dspark_markov_head_type {kind!r}: DeepSeek-V4's drafter has the "
            f"vanilla Markov head only"
        )
    if cfg.get("sample_from_anchor", True) is False:
        raise ValueError(f"{source}: sample_from_anchor false is not supported for DeepSeek-V4")
    stages = cfg.get("n_mtp_layers")
    if stages is not None and int(stages) != len(cfg["dspark_target_layer_ids"]):
        raise ValueError(
            f"{source}: n_mtp_layers {stages} must equal the number of "
            f"dspark_target_layer_ids ({len(cfg['dspark_target_layer_ids'])}): a stage per layer"
        )
    for key, own in (
        ("dspark_n_routed_experts", target.deepseek_v4.n_routed_experts),
        ("dspark_num_experts_per_tok", target.deepseek_v4.num_experts_per_tok),
    ):
        if cfg.get(key) is not None and int(cfg[key]) != own:
            raise ValueError(
                f"{source}: {key} {cfg[key]}: a drafter with other MoE sizes than its "
                f"target's ({own}) is not supported (DeepSeek-V4.1's)"
            )


class StageAttention(Attention):
    """V4's sliding-window MQA (checkpoint names ``attn.*``), its keys from
    the context state as well as from the block."""

    def __init__(self, cfg: ModelConfig, rope: InterleavedRope, group: RankGroup = SINGLE) -> None:
        super().__init__(cfg, SLIDING, rope, group)

    def context_key(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x [n, d]`` -> keys (= values) ``[n, D]`` at ``positions``."""
        return self.key(x, self.rope.at(positions))

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, layer: int, attend: Attend
    ) -> torch.Tensor:
        """``x [R, G, d]`` normed block at ``positions [R, G]`` -> ``[R, G, d]``."""
        r, g, _ = x.shape
        flat = x.reshape(r * g, -1)
        at = self.rope.at(positions.reshape(-1))
        q, _ = self.query(flat, at)
        k = self.key(flat, at).view(r, g, 1, -1)
        o = attend(layer, q.view(r, g, self.heads, -1), k, k)
        return self.output(o.reshape(r * g, self.heads, -1), at)


class Stage(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        rope: InterleavedRope,
        features: int,
        last: bool,
        group: RankGroup = SINGLE,
        expert_parallel: bool = False,
    ) -> None:
        """``features``: the context features stage 0 fuses (0 for later
        stages). ``group``: split as the target's V4 layers are."""
        super().__init__()
        v4 = cfg.deepseek_v4
        d = cfg.hidden_size
        self.attn = StageAttention(cfg, rope, group)
        self.ffn = MoE(d, v4, cfg.vocab_size, False, group, expert_parallel)
        self.attn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(d, cfg.rms_norm_eps)
        hc = (v4.hc_mult, d, v4.hc_sinkhorn_iters, v4.hc_eps, cfg.rms_norm_eps)
        self.hc_attn, self.hc_ffn = HyperConnection(*hc), HyperConnection(*hc)
        if features:
            self.main_proj = Linear(features, d, bias=False)
            self.main_norm = RMSNorm(d, cfg.rms_norm_eps)
        if last:
            self.norm = RMSNorm(d, cfg.rms_norm_eps)
            self.hc_head = HyperHead(v4.hc_mult, d, v4.hc_eps, cfg.rms_norm_eps)


class DSparkV4DraftModel(BlockDrafter):
    keep_fp32 = DeepseekV4ForCausalLM.keep_fp32

    def __init__(
        self,
        target: ModelConfig,
        cfg: DSparkV4Config,
        use_heads: bool = True,
        context_length: int | None = None,
        group: RankGroup = SINGLE,
        expert_parallel: bool = False,
    ) -> None:
        """``group``: the tensor-parallel group this is one rank's shard for
        (its stages split as the target's layers, the vocabulary too)."""
        super().__init__()
        self.config, self.target = cfg, target
        v4 = target.deepseek_v4
        d, n = target.hidden_size, cfg.num_stages
        self.window = v4.sliding_window
        # A block drafted at the last context position reaches block_size past it.
        positions = (context_length or target.max_position_embeddings) + cfg.block_size
        self.rope = InterleavedRope(v4.main_rope, target.head_dim, positions)
        self.stages = nn.ModuleList(
            [
                Stage(target, self.rope, n * d if i == 0 else 0, i == n - 1, group, expert_parallel)
                for i in range(n)
            ]
        )
        # The target's embedding and head, aliased by the loader.
        self.embed = VocabParallelEmbedding(target.vocab_size, d, group)
        self.head = VocabParallelHead(d, target.vocab_size, group)
        self.markov_head = MarkovHead(cfg, group)
        self.confidence_head = None
        if cfg.enable_confidence_head:
            extra = cfg.markov_rank if cfg.confidence_head_with_markov else 0
            self.confidence_head = ConfidenceHead(d + extra, bias=False)
        self.use_markov = use_heads
        self.use_confidence = use_heads and self.confidence_head is not None

    # ---- loading ----------------------------------------------------------

    def checkpoint_key(self, key: str) -> str | None:
        """Our name for a checkpoint key: ``mtp.{stage}.*`` in DeepSeek's
        names (the heads may sit under any stage); None for the target's."""
        key = key.removeprefix("model.")
        if not key.startswith("mtp."):
            return None
        _, stage, rest = key.split(".", 2)
        if rest.startswith(("markov_head.", "confidence_head.")):
            return rest
        if rest.startswith("ffn.experts."):  # another rank's expert: not ours
            expert = int(rest.split(".")[2])
            if not self.stages[int(stage)].ffn.experts.holds(expert):
                return None
        return f"stages.{stage}.{hc_names(rest)}"

    def checkpoint_name(self, ours: str) -> str:
        """The checkpoint key of one of ``checkpoint_targets``' names (the
        inverse of ``checkpoint_key``; the heads go under the last stage)."""
        if ours.startswith(("markov_head.", "confidence_head.")):
            return f"mtp.{self.config.num_stages - 1}.{ours}"
        _, stage, rest = ours.split(".", 2)
        return f"mtp.{stage}.{hc_names(rest, to_checkpoint=True)}"

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """The drafter's tensors under their checkpoint keys (``mtp.*``)."""
        return {self.checkpoint_name(k): v for k, v in self.checkpoint_targets().items()}

    def checkpoint_targets(self) -> dict[str, torch.Tensor]:
        return self.checkpoint_layout()[0]

    def checkpoint_layout(self) -> tuple[dict[str, torch.Tensor], dict[str, Shard]]:
        """Our names -> the tensors they fill (the target's embedding and
        head are not the drafter's to load), and those this rank reads a
        slice of -> that slice."""
        out, shards = parameter_layout(
            self, lambda name: name.startswith(("embed.", "head.")) or ".ffn.experts." in name
        )
        for i, stage in enumerate(self.stages):
            experts, split = stage.ffn.experts.checkpoint_layout(f"stages.{i}.ffn.experts")
            out.update(experts)
            shards.update(split)
        return out, shards

    # ---- the shared walk's hooks -------------------------------------------

    @property
    def feature_weight(self) -> torch.Tensor:
        return self.stages[0].main_proj.weight

    @property
    def vocab_head(self) -> LogitsHead:
        return self.head

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.vocab_logits(self.stages[-1].norm.forward(hidden))

    # ---- context ------------------------------------------------------------

    def context_kv(
        self, features: torch.Tensor, positions: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per stage, keys (= values) ``[n, 1, D]`` of context features ``[n, m * d]``."""
        first = self.stages[0]
        x = first.main_norm.forward(first.main_proj.forward(features))  # [n, d]
        keys = [stage.attn.context_key(x, positions)[:, None, :] for stage in self.stages]
        return [(k, k) for k in keys]

    def window_attend(self, ctx: list[torch.Tensor], ctx_bias: torch.Tensor) -> Attend:
        """Attention over each request's windowed context keys (``ctx``: per
        stage ``[R, W, D]``; ``ctx_bias [R, W]`` 0 or -inf) and its whole block."""

        def attend(layer: int, q: torch.Tensor, bk: torch.Tensor, bv: torch.Tensor) -> torch.Tensor:
            r, g, h, d = q.shape
            keys = torch.cat([ctx[layer], bk[:, :, 0]], dim=1)  # [R, W + G, D]
            bias = torch.cat([ctx_bias, ctx_bias.new_zeros(r, g)], dim=1)
            keys = keys[:, None].expand(r, g, *keys.shape[1:]).reshape(r * g, -1, d)
            bias = bias[:, None].expand(r, g, bias.shape[1]).reshape(r * g, -1)
            sinks = self.stages[layer].attn.attn_sink
            o = sink_attention(q.reshape(r * g, h, d), keys.to(q.dtype), bias, sinks, d**-0.5)
            return o.view(r, g, h, d)

        return attend

    # ---- the block ----------------------------------------------------------

    def block_hidden(
        self, anchors: torch.Tensor, starts: torch.Tensor, attend: Attend, block_size: int
    ) -> torch.Tensor:
        """The collapsed (pre-norm) streams ``[R, gamma, d]`` of the blocks."""
        r, g = anchors.shape[0], block_size
        ids = torch.full((r, g), self.config.noise_token_id, device=anchors.device)
        ids[:, 0] = anchors
        positions = starts[:, None] + torch.arange(g, device=anchors.device)  # [R, G]
        x = self.embed(ids).reshape(r * g, -1)
        streams = x[:, None, :].expand(-1, self.target.deepseek_v4.hc_mult, -1).contiguous()
        flat_ids = ids.reshape(-1)
        for i, stage in enumerate(self.stages):
            x, post, comb = stage.hc_attn(streams)
            out = stage.attn(stage.attn_norm.forward(x).view(r, g, -1), positions, i, attend)
            streams = expand(streams, out, post, comb)
            x, post, comb = stage.hc_ffn(streams)
            streams = expand(streams, stage.ffn(stage.ffn_norm.forward(x), flat_ids), post, comb)
        return self.stages[-1].hc_head(streams).view(r, g, -1)

    # ---- training -----------------------------------------------------------

    def train_hidden(
        self,
        features: torch.Tensor,  # [B, T, m * d] captured target layers of every position
        input_ids: torch.Tensor,  # [B, T]
        anchors: torch.Tensor,  # [B, A] anchor positions
        block_size: int,
    ) -> torch.Tensor:
        """Blocks at many anchors of whole sequences at once: ``[B, A, gamma, d]``.
        Block ``(b, a)`` sees the last ``window`` positions before ``anchors[b, a]``."""
        b, t = input_ids.shape
        a, w = anchors.shape[1], self.window
        positions = torch.arange(t, device=input_ids.device)
        keys = [
            k[:, 0] for k, _ in self.context_kv(features.reshape(b * t, -1), positions.repeat(b))
        ]
        window = anchors[:, :, None] - w + torch.arange(w, device=anchors.device)  # [B, A, W]
        rows = torch.arange(b, device=anchors.device)[:, None, None] * t + window.clamp(min=0)
        ctx = [k[rows.reshape(b * a, w)] for k in keys]  # per stage [B * A, W, D]
        bias = torch.zeros(window.shape, device=anchors.device).masked_fill(
            window < 0, float("-inf")
        )
        tokens = input_ids.gather(1, anchors)  # [B, A]
        attend = self.window_attend(ctx, bias.view(b * a, w))
        hidden = self.block_hidden(tokens.flatten(), anchors.flatten(), attend, block_size)
        return hidden.view(b, a, block_size, -1)
