"""Gemma 4 text models on the paged engine.

Per layer: attention with per-head RMSNorms on q and k and an unweighted
one on v, scale 1 (the norms set the logits' size), over a sliding window
(local head size, default RoPE) or over the whole prefix (the global head
size and KV head count; with ``attention_k_eq_v`` the key projection
serves as values too; partial "proportional" RoPE). Sandwich norms around
attention and the MLP, and on MoE layers (26B-A4B) a routed expert
block beside the dense MLP, each normed before the two are summed. Each
layer's output is scaled by its ``layer_scalar``; the embedding by
sqrt(hidden) rounded to the weight dtype; the logits soft-capped.

Parameter names are the checkpoint's but for the fused projections
(``qkv_proj`` or ``qk_proj``, ``gate_up_proj``); ``checkpoint_key`` reads
``Gemma4ForConditionalGeneration``'s language model and leaves its vision
and audio towers on disk.

Tensor parallelism (``group``): heads split per layer (``HeadSplit``), MLP
by intermediate features, experts whole (``ep_size`` = ``tp_size``),
embedding and head by vocabulary.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from specserve.config import ModelConfig
from specserve.distributed import SINGLE, RankGroup
from specserve.layers.activation import gated_act, get_activation
from specserve.layers.attention import AttentionBackend, AttentionMetadata, LayerAttention
from specserve.layers.linear import Linear, MergedLinear, Shard
from specserve.layers.moe import RoutedExperts
from specserve.layers.norm import RMSNorm, rms_norm
from specserve.layers.parallel import (
    HeadSplit,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelHead,
)
from specserve.layers.rotary import RotaryEmbedding
from specserve.models.decoder import DecoderMLP
from specserve.models.deepseek_v4 import pack_weights
from specserve.models.gemma4_config import Gemma4Config

# Parts of a multimodal checkpoint that are not the language model.
_TOWERS = ("vision_tower.", "embed_vision.", "audio_tower.", "embed_audio.")


class Gemma4Attention(nn.Module):
    """One layer's attention: this rank's heads of it."""

    def __init__(
        self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding, group: RankGroup
    ) -> None:
        super().__init__()
        g4 = cfg.gemma4
        assert g4 is not None
        kv_heads, d = g4.kv_heads[layer], g4.head_dims[layer]
        heads = HeadSplit.of(cfg.num_attention_heads, kv_heads, group)
        self.num_heads, self.num_kv_heads, self.head_dim = heads.q_count, heads.kv_count, d
        self.shares_kv = g4.shares_kv(layer)
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        q_rows = Shard(0, heads.q_start * d, q_size, cfg.num_attention_heads * d)
        kv_rows = Shard(0, heads.kv_start * d, kv_size, kv_heads * d)
        parts = [q_rows, kv_rows] if self.shares_kv else [q_rows, kv_rows, kv_rows]
        proj = MergedLinear(
            cfg.hidden_size,
            [p.length for p in parts],
            bias=cfg.attention_bias,
            sources=parts if group.size > 1 else None,
        )
        # Named for the checkpoint projections it holds (``packed_modules``).
        setattr(self, "qk_proj" if self.shares_kv else "qkv_proj", proj)
        self.o_proj = RowParallelLinear(
            cfg.num_attention_heads * d, cfg.hidden_size, cfg.attention_bias, group,
            "num_attention_heads x head_dim",
        )  # fmt: skip
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.eps = cfg.rms_norm_eps
        self.rotary = rotary

    @property
    def proj(self) -> MergedLinear:
        return self.qk_proj if self.shares_kv else self.qkv_proj

    def project(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Normed, rotated queries and keys and normed values ``[T, heads, D]``."""
        t, h, hkv = x.shape[0], self.num_heads, self.num_kv_heads
        heads = self.proj.forward(x).view(t, -1, self.head_dim)  # [T, H + Hkv (+ Hkv), D]
        q, k = heads[:, :h], heads[:, h : h + hkv]
        v = k if self.shares_kv else heads[:, h + hkv :]
        q = self.rotary.rotate(self.q_norm.forward(q), rope)
        k_normed = self.rotary.rotate(self.k_norm.forward(k), rope)
        return q, k_normed, rms_norm(v, None, self.eps)


class Gemma4Router(nn.Module):
    """Top-k experts of the unweighted-normed, scaled input: softmax over
    all experts, the k largest renormalised, times each expert's scale."""

    def __init__(self, cfg: ModelConfig, g4: Gemma4Config) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.proj = Linear(d, g4.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(d))
        self.per_expert_scale = nn.Parameter(torch.ones(g4.num_experts))
        self.top_k, self.eps, self.root = g4.top_k_experts, cfg.rms_norm_eps, d**-0.5

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Experts ``[T, k]`` and their weights ``[T, k]`` (float32)."""
        h = rms_norm(x, None, self.eps) * self.scale * self.root
        probs = self.proj.forward(h).float().softmax(dim=-1)  # [T, E]
        weights, experts = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights * self.per_expert_scale[experts].float()


class Gemma4Layer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layer: int,
        rotary: RotaryEmbedding,
        group: RankGroup,
        expert_parallel: bool,
    ) -> None:
        super().__init__()
        g4 = cfg.gemma4
        assert g4 is not None
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.group = group
        self.self_attn = Gemma4Attention(cfg, layer, rotary, group)
        self.mlp = DecoderMLP(cfg, group)
        self.input_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.pre_feedforward_layernorm = RMSNorm(d, eps)
        self.post_feedforward_layernorm = RMSNorm(d, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1))
        self.router: Gemma4Router | None = None
        if g4.num_experts:
            if group.size > 1 and not expert_parallel:
                raise ValueError(
                    "tp_size: Gemma 4's experts split whole over the ranks: set --ep-size "
                    "to --tp-size"
                )
            self.router = Gemma4Router(cfg, g4)
            act = partial(gated_act, act=get_activation(cfg.hidden_act))
            self.experts = RoutedExperts(
                g4.num_experts, d, g4.moe_intermediate_size, act, group, expert_parallel
            )
            self.pre_feedforward_layernorm_2 = RMSNorm(d, eps)
            self.post_feedforward_layernorm_1 = RMSNorm(d, eps)
            self.post_feedforward_layernorm_2 = RMSNorm(d, eps)

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        """The MLP (and experts) of the residual ``h``, normed, before the residual add."""
        out = self.mlp.forward(self.pre_feedforward_layernorm.forward(h))
        if self.router is not None:
            experts, weights = self.router(h)
            moe = self.experts(self.pre_feedforward_layernorm_2.forward(h), experts, weights)
            moe = self.group.all_reduce(moe)  # each rank's experts' part
            out = self.post_feedforward_layernorm_1.forward(out)
            out = out + self.post_feedforward_layernorm_2.forward(moe)
        return self.post_feedforward_layernorm.forward(out)


class Gemma4Body(nn.Module):
    def __init__(
        self, cfg: ModelConfig, max_position: int, group: RankGroup, expert_parallel: bool
    ) -> None:
        super().__init__()
        g4 = cfg.gemma4
        assert g4 is not None
        # Every sliding layer has the local head size, every global one the
        # global size; the last layer is always global.
        local = next((d for d, s in zip(g4.head_dims, g4.sliding) if s), cfg.head_dim)
        self.sliding_rotary = RotaryEmbedding(g4.sliding_rope, local, max_position)
        self.full_rotary = RotaryEmbedding(g4.full_rope, g4.head_dims[-1], max_position)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, group)
        self.layers = nn.ModuleList(
            [
                Gemma4Layer(
                    cfg,
                    i,
                    self.sliding_rotary if g4.sliding[i] else self.full_rotary,
                    group,
                    expert_parallel,
                )
                for i in range(cfg.num_hidden_layers)
            ]
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Gemma4ForCausalLM(nn.Module):
    """``model.*`` body + ``lm_head`` (tied to the embedding unless the
    config says otherwise): this rank's shard of them."""

    packed_modules = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "qk_proj": ("q_proj", "k_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }

    def __init__(
        self,
        cfg: ModelConfig,
        max_position: int | None = None,
        group: RankGroup = SINGLE,
        expert_parallel: bool = False,
    ) -> None:
        super().__init__()
        g4 = cfg.gemma4
        assert g4 is not None, "Gemma4ForCausalLM needs Gemma 4's config fields"
        self.config = cfg
        self.group = group
        self.model = Gemma4Body(
            cfg, max_position or cfg.max_position_embeddings, group, expert_parallel
        )
        self.lm_head = VocabParallelHead(cfg.hidden_size, cfg.vocab_size, group)
        self.lm_head.softcap = g4.final_logit_softcapping
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.attention_layers = tuple(
            LayerAttention(window=g4.sliding_window if s else 0, scale=1.0) for s in g4.sliding
        )

    def checkpoint_key(self, key: str) -> str | None:
        """Our name for a checkpoint key; None for a multimodal checkpoint's
        towers."""
        if key.startswith("model.language_model."):
            key = "model." + key.removeprefix("model.language_model.")
        elif key.startswith("model.") and key.removeprefix("model.").startswith(_TOWERS):
            return None
        if key.startswith("model.multi_modal_projector"):
            return None
        # All experts in one tensor per weight (``RoutedExperts.checkpoint_part``).
        if key.endswith(".experts.gate_up_proj"):
            return key.removesuffix("gate_up_proj") + "w13"
        if key.endswith(".experts.down_proj"):
            return key.removesuffix("down_proj") + "w2"
        return key

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        backend: AttentionBackend,
        capture_layer_ids: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Final-normed hidden states ``[T, d]`` and the outputs of the chosen
        layers (HF's ``hidden_states[i + 1]``; -1: the scaled embedding)."""
        body = self.model
        h = body.embed_tokens(input_ids)
        # sqrt(hidden) in the weights' dtype, as the reference rounds it.
        h = h * torch.tensor(self.config.hidden_size**0.5, dtype=h.dtype)
        captured = [h] if -1 in capture_layer_ids else []
        ropes = {
            id(r): r.at(meta.positions, h.dtype) for r in (body.sliding_rotary, body.full_rotary)
        }
        for i, layer in enumerate(body.layers):
            attn = layer.self_attn
            q, k, v = attn.project(layer.input_layernorm.forward(h), ropes[id(attn.rotary)])
            o = backend.forward(i, q, k, v, meta)  # [T, H, D]
            o = attn.o_proj.forward(o.reshape(o.shape[0], -1))
            h = h + layer.post_attention_layernorm.forward(o)
            h = (h + layer.feed_forward(h)) * layer.layer_scalar
            if i in capture_layer_ids:
                captured.append(h)
        return body.norm.forward(h), captured

    def compile_dense(self) -> None:
        raise ValueError("enable_torch_compile: not supported for Gemma 4 yet")

    def post_load(self) -> None:
        pack_weights(self)
        self.model.embed_tokens.post_load()
        self.lm_head.post_load()

    @property
    def logits_head(self) -> VocabParallelHead:
        return self.lm_head

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``[R, d]`` -> soft-capped float32 logits ``[R, V]``; under tensor
        parallelism gathered on rank 0 (None on the others)."""
        return self.lm_head.gather(self.lm_head(hidden))


class Gemma4ForConditionalGeneration(Gemma4ForCausalLM):
    """A multimodal checkpoint's language model; images and audio are not
    served (the vision and audio towers stay on disk)."""
