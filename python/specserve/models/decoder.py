"""The decoder-only transformer shared by Llama and Qwen3.

Parameter names follow the HF checkpoints except the fused projections
(``qkv_proj``, ``gate_up_proj``), which the loader fills shard by shard.
"""

from __future__ import annotations

import torch
from torch import nn

from specserve.config import ModelConfig
from specserve.distributed import SINGLE, RankGroup
from specserve.layers.activation import gated_act, get_activation
from specserve.layers.attention import AttentionBackend, AttentionMetadata
from specserve.layers.linear import MergedLinear, Shard
from specserve.layers.norm import RMSNorm, rms_norm
from specserve.layers.parallel import (
    HeadSplit,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelHead,
    split,
)
from specserve.layers.rotary import RotaryEmbedding


class DecoderAttention(nn.Module):
    """This rank's attention heads (all of them at one rank)."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, group: RankGroup) -> None:
        super().__init__()
        heads = HeadSplit.of(cfg.num_attention_heads, cfg.num_key_value_heads, group)
        self.num_heads, self.num_kv_heads = heads.q_count, heads.kv_count
        d = self.head_dim = cfg.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        q_full, kv_full = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
        q_rows = Shard(0, heads.q_start * d, q_size, q_full)
        kv_rows = Shard(0, heads.kv_start * d, kv_size, kv_full)
        self.qkv_proj = MergedLinear(
            cfg.hidden_size,
            [q_size, kv_size, kv_size],
            bias=cfg.attention_bias,
            sources=[q_rows, kv_rows, kv_rows] if group.size > 1 else None,
        )
        self.o_proj = RowParallelLinear(
            q_full, cfg.hidden_size, cfg.attention_bias, group, "num_attention_heads x head_dim"
        )
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.eps = cfg.rms_norm_eps
        self.rotary = rotary
        # q_norm and k_norm weights side by side, one row per q then k head, so
        # both norms (and then RoPE) run as one op over the q|k heads. Derived
        # from the loaded weights by ``post_load``.
        self.register_buffer(
            "qk_norm_weight",
            torch.empty(self.num_heads + self.num_kv_heads, self.head_dim) if cfg.qk_norm else None,
            persistent=False,
        )

    def post_load(self) -> None:
        if self.q_norm is not None:
            w = torch.cat(
                [
                    self.q_norm.weight.expand(self.num_heads, -1),
                    self.k_norm.weight.expand(self.num_kv_heads, -1),
                ]
            )
            self.qk_norm_weight = w.contiguous()

    def project(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Normed, rotated queries and keys and the values ``[T, heads, D]``
        (``rope``: ``RotaryEmbedding.at`` the batch's positions)."""
        t = x.shape[0]
        heads = self.qkv_proj.forward(x).view(t, -1, self.head_dim)  # [T, H + 2 * Hkv, D]
        n_qk = self.num_heads + self.num_kv_heads
        qk, v = heads[:, :n_qk], heads[:, n_qk:]
        if self.qk_norm_weight is not None:
            qk = rms_norm(qk, self.qk_norm_weight, self.eps)
        qk = self.rotary.rotate(qk, rope)
        return qk[:, : self.num_heads], qk[:, self.num_heads :], v


class DecoderMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, group: RankGroup) -> None:
        super().__init__()
        full = cfg.intermediate_size
        start, inter = split(full, group, "intermediate_size")
        rows = Shard(0, start, inter, full)
        self.gate_up_proj = MergedLinear(
            cfg.hidden_size,
            [inter, inter],
            bias=cfg.mlp_bias,
            sources=[rows, rows] if group.size > 1 else None,
        )
        self.down_proj = RowParallelLinear(
            full, cfg.hidden_size, cfg.mlp_bias, group, "intermediate_size"
        )
        self.act = get_activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(gated_act(self.gate_up_proj.forward(x), self.act))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, group: RankGroup) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(cfg, rotary, group)
        self.mlp = DecoderMLP(cfg, group)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def before_attention(
    layer: DecoderLayer, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's dense part before attention: input norm, q|k|v, q/k norms, RoPE."""
    return layer.self_attn.project(layer.input_layernorm.forward(h), rope)


def after_attention(layer: DecoderLayer, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """A layer's dense part after attention (``o [T, H, D]``): the output
    projection and residual, the post-attention norm, the MLP and residual."""
    attn = layer.self_attn
    h = h + attn.o_proj.forward(o.reshape(o.shape[0], -1))
    return h + layer.mlp.forward(layer.post_attention_layernorm.forward(h))


class DecoderBody(nn.Module):
    def __init__(self, cfg: ModelConfig, max_position: int, group: RankGroup) -> None:
        super().__init__()
        self.rotary = rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, max_position)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, group)
        self.layers = nn.ModuleList(
            [DecoderLayer(cfg, rotary, group) for _ in range(cfg.num_hidden_layers)]
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DecoderForCausalLM(nn.Module):
    """``model.*`` body + ``lm_head`` (tied to the embedding when the config
    says so): this rank's shard of them (``group``; the whole at one rank)."""

    # Fused parameter -> the checkpoint projections stored in it, in order.
    packed_modules = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }

    def __init__(
        self, cfg: ModelConfig, max_position: int | None = None, group: RankGroup = SINGLE
    ) -> None:
        super().__init__()
        self.config = cfg
        self.group = group
        self.model = DecoderBody(cfg, max_position or cfg.max_position_embeddings, group)
        self.lm_head = VocabParallelHead(cfg.hidden_size, cfg.vocab_size, group)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # The layers' dense parts, eager unless ``compile_dense`` replaces them.
        self._before = before_attention
        self._after = after_attention

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        backend: AttentionBackend,
        capture_layer_ids: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Final-normed hidden states ``[T, d]`` and the outputs of the chosen
        layers (``[T, d]`` each, HF's ``hidden_states[i + 1]``; -1 is the
        embedding output)."""
        h = self.model.embed_tokens(input_ids)
        captured = [h] if -1 in capture_layer_ids else []
        rope = self.model.rotary.at(meta.positions, h.dtype)  # one lookup for every layer
        for i, layer in enumerate(self.model.layers):
            q, k, v = self._before(layer, h, rope)
            o = backend.forward(i, q, k, v, meta)  # [T, H, D]
            h = self._after(layer, h, o)
            if i in capture_layer_ids:
                captured.append(h)
        return self.model.norm.forward(h), captured

    def compile_dense(self) -> None:
        """``torch.compile`` the layers' dense parts (everything but the paged
        attention), shared by every layer: one graph per shape class, fused
        element-wise ops (on CUDA, far fewer kernel launches)."""
        self._before = torch.compile(before_attention, dynamic=True)
        self._after = torch.compile(after_attention, dynamic=True)

    def post_load(self) -> None:
        """Rebuilds state derived from the weights; the loader calls it: the
        q/k norm weights side by side, and on the CPU every projection's
        packed weight (``PackedWeight``)."""
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.post_load()
            for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                lin.post_load()
        self.model.embed_tokens.post_load()
        self.lm_head.post_load()

    @property
    def logits_head(self) -> VocabParallelHead:
        return self.lm_head

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``[R, d]`` -> float32 logits ``[R, V]`` (accumulated in float32);
        under tensor parallelism gathered on rank 0 (None on the others)."""
        return self.lm_head.gather(self.lm_head(hidden))
