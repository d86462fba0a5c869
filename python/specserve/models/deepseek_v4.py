"""DeepSeek-V4 on the paged engine.

Per layer: MQA with one shared K=V head, per-head sinks, a low-rank query,
partial interleaved RoPE (rotated back on the output) and a grouped low-rank
output projection; attention over a sliding window plus, by layer kind,
compressed entries (CSA: an indexer's top-k of 4-position entries; HCA: all
128-position entries; see ``layers/compressed_attention.py``). mHC residual
streams around attention and the MoE of every layer.

Parameter names are DeepSeek's checkpoint names (``attn.wq_a``,
``ffn.experts.0.w1``, ``hc_attn_fn``, ...); ``checkpoint_key`` also reads the
names transformers writes (``model.`` prefix, ``embed_tokens``, ``lm_head``).

Tensor parallelism (``group``): the query heads and their sinks split over
the ranks with the output groups they feed (``wq_b``, ``wo_a`` column,
``wo_b`` row), the one K=V head, the compressors, the indexer and mHC
replicated (every rank keeps the whole cache); the MoE as ``layers/moe.py``
says; embedding and head split by vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from specserve.config import ModelConfig, RopeConfig
from specserve.distributed import SINGLE, RankGroup
from specserve.layers.attention import AttentionMetadata
from specserve.layers.compressed_attention import CompressedAttentionBackend
from specserve.layers.hyper_connection import (
    HyperConnection,
    HyperHead,
    expand,
    unweighted_rms_norm,
)
from specserve.layers.linear import Linear, Shard
from specserve.layers.moe import MoE, RoutedExperts
from specserve.layers.norm import RMSNorm
from specserve.layers.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelHead,
    split,
)
from specserve.layers.rotary import rope_inv_freq
from specserve.models.deepseek_v4_config import CSA, SLIDING


class InterleavedRope:
    """RoPE on the trailing ``rot_dim`` channels, rotating channel pairs
    ``(2i, 2i + 1)``; ``inverse`` rotates back."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_position: int) -> None:
        inv_freq, scale = rope_inv_freq(rope, head_dim, max_position)
        self.rot_dim = 2 * inv_freq.numel()
        freqs = (
            torch.arange(max_position, dtype=torch.float32, device="cpu")[:, None]
            * inv_freq[None, :]
        )
        self._cos, self._sin = freqs.cos() * scale, freqs.sin() * scale  # [P, rot_dim // 2]

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[T, 1, rot_dim // 2]`` at ``positions [T]``: looked up
        once per forward, shared by every layer of this RoPE."""
        if self._cos.device != positions.device:
            self._cos, self._sin = self._cos.to(positions.device), self._sin.to(positions.device)
        return self._cos[positions][:, None, :], self._sin[positions][:, None, :]

    def rotate(
        self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], inverse: bool = False
    ) -> torch.Tensor:
        """``x [T, heads, D]`` rotated by ``at(positions)``."""
        cos, sin = cos_sin
        if inverse:
            sin = -sin
        nope, rot = x[..., : -self.rot_dim], x[..., -self.rot_dim :].float()
        even, odd = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1)
        return torch.cat([nope, rotated.flatten(-2).to(x.dtype)], dim=-1)


_HC_PARAMS = [(f"hc_{site}_{part}", f"hc_{site}.{part}")
              for site in ("attn", "ffn", "head") for part in ("fn", "base", "scale")]  # fmt: skip


def hc_names(key: str, to_checkpoint: bool = False) -> str:
    """DeepSeek's flat mHC parameter names (``hc_attn_fn``, ``hc_head_scale``)
    as our modules' dotted ones (``hc_attn.fn``), or back."""
    for flat, dotted in _HC_PARAMS:
        key = key.replace(dotted, flat) if to_checkpoint else key.replace(flat, dotted)
    return key


class Compressor(nn.Module):
    """Per-position K/V and gate projections (``wkv``, ``wgate``), a gate bias
    per window offset (``ape``) and the entries' norm."""

    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool, eps: float) -> None:
        super().__init__()
        width = 2 * dim if overlap else dim
        self.wkv = nn.Linear(hidden, width, bias=False)
        self.wgate = nn.Linear(hidden, width, bias=False)
        self.ape = nn.Parameter(torch.empty(rate, width))
        self.norm = RMSNorm(dim, eps)
        self.rate = rate

    def forward(
        self,
        x: torch.Tensor,
        layer: int,
        rope: InterleavedRope,
        backend: CompressedAttentionBackend,
        meta: AttentionMetadata,
        index: bool = False,
    ) -> None:
        xf = x.float()
        kv = F.linear(xf, self.wkv.weight.float())
        gate = F.linear(xf, self.wgate.weight.float())
        closed = backend.emit(layer, kv, gate, self.ape, self.rate, meta, index)
        if closed is not None:
            entries, positions = closed
            entries = self.norm.forward(entries)  # [E, d] float32
            entries = rope.rotate(entries[:, None, :], rope.at(positions))[:, 0]
            backend.store_entries(layer, entries, self.rate, meta, index)


class Indexer(nn.Module):
    """CSA's Lightning indexer: its own compressor for keys, queries from the
    low-rank query, per-head weights from the layer input."""

    def __init__(self, cfg: ModelConfig, rate: int) -> None:
        super().__init__()
        v4 = cfg.deepseek_v4
        self.heads, self.dim, self.top_k = v4.index_n_heads, v4.index_head_dim, v4.index_topk
        self.wq_b = Linear(v4.q_lora_rank, self.heads * self.dim, bias=False)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.heads, bias=False)
        self.compressor = Compressor(cfg.hidden_size, self.dim, rate, True, cfg.rms_norm_eps)


class Attention(nn.Module):
    """This rank's query heads (all of them at one rank) over the shared K=V."""

    def __init__(
        self, cfg: ModelConfig, kind: str, rope: InterleavedRope, group: RankGroup = SINGLE
    ) -> None:
        super().__init__()
        v4 = cfg.deepseek_v4
        h, d, g, r = cfg.num_attention_heads, cfg.head_dim, v4.o_groups, v4.o_lora_rank
        # A rank's heads are whole output groups: split the groups.
        g_start, groups = split(g, group, "o_groups")
        heads = groups * (h // g)
        self.heads, self.head_dim, self.rope = heads, d, rope
        self.groups, self.eps = groups, cfg.rms_norm_eps
        self.group = group
        self.wq_a = Linear(cfg.hidden_size, v4.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(v4.q_lora_rank, cfg.rms_norm_eps)
        h_start = g_start * (h // g)
        what = "num_attention_heads"
        self.wq_b = ColumnParallelLinear(
            v4.q_lora_rank, h * d, group, what, (h_start * d, heads * d)
        )
        self.wkv = Linear(cfg.hidden_size, d, bias=False)
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.wo_a = ColumnParallelLinear(
            h * d // g, g * r, group, "o_groups", (g_start * r, groups * r)
        )
        self.wo_b = RowParallelLinear(
            g * r, cfg.hidden_size, False, group, "o_groups x o_lora_rank"
        )
        self.attn_sink = nn.Parameter(torch.empty(heads))
        self.sink_shard = Shard(0, h_start, heads, h)
        self.rate = v4.rate(kind) if kind != SLIDING else 0
        self.compressor = (
            Compressor(cfg.hidden_size, d, self.rate, kind == CSA, cfg.rms_norm_eps)
            if kind != SLIDING
            else None
        )
        self.indexer = Indexer(cfg, self.rate) if kind == CSA else None

    def checkpoint_part(self, attr: str) -> tuple[torch.Tensor, Shard | None]:
        """``attn_sink``: this rank's heads' sinks."""
        return self.attn_sink.data, self.sink_shard if self.group.size > 1 else None

    def forward(
        self,
        layer: int,
        x: torch.Tensor,  # [T, d_model], normed
        meta: AttentionMetadata,
        backend: CompressedAttentionBackend,
        compress_rope: InterleavedRope,
        at: dict[InterleavedRope, tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """``at``: each RoPE's cos/sin at this forward's positions."""
        t, rope = x.shape[0], self.rope
        q, q_res = self.query(x, at[rope])
        backend.store_window(layer, self.key(x, at[rope]), meta)
        entries = None
        if self.compressor is not None:
            self.compressor(x, layer, compress_rope, backend, meta)
            entries = meta.plan.visible[self.rate]  # HCA: every visible entry
            if self.indexer is not None:
                ix = self.indexer
                ix.compressor(x, layer, compress_rope, backend, meta, index=True)
                qi = ix.wq_b.forward(q_res).view(t, ix.heads, ix.dim)
                qi = compress_rope.rotate(qi, at[compress_rope])
                w = F.linear(x.float(), ix.weights_proj.weight.float()) * ix.heads**-0.5
                entries = backend.select(layer, qi, w, self.rate, ix.top_k, meta)
        o = backend.attend(layer, q, self.attn_sink, self.head_dim**-0.5, meta, entries)
        return self.output(o, at[rope])

    def query(
        self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated queries ``[T, H, D]`` and the low-rank query ``[T, q_lora]``."""
        q_res = self.q_norm.forward(self.wq_a.forward(x))
        q = self.wq_b.forward(q_res).view(x.shape[0], self.heads, self.head_dim)
        return self.rope.rotate(unweighted_rms_norm(q, self.eps), cos_sin), q_res

    def key(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The shared key (= value) ``[T, D]``, normed and rotated."""
        kv = self.norm.forward(self.wkv.forward(x))
        return self.rope.rotate(kv[:, None, :], cos_sin)[:, 0]

    def output(self, o: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Attention output ``[T, H, D]`` rotated back, through the grouped
        low-rank projection -> ``[T, d_model]``."""
        t = o.shape[0]
        o = self.rope.rotate(o, cos_sin, inverse=True).reshape(t, self.groups, -1)
        wa = self.wo_a.weight.view(self.groups, -1, o.shape[-1])  # [G, r, H * D / G]
        grouped = torch.einsum("tgi,gri->tgr", o, wa).reshape(t, -1)
        return self.wo_b.forward(grouped)


def parameter_layout(
    model: nn.Module, skip: Callable[[str], bool]
) -> tuple[dict[str, torch.Tensor], dict[str, Shard]]:
    """``model``'s parameters but those ``skip`` names -> the tensors they
    fill (a split module's ``checkpoint_part``), and the names read as a
    slice -> that slice. (Routed experts lay themselves out.)"""
    out: dict[str, torch.Tensor] = {}
    shards: dict[str, Shard] = {}
    modules = dict(model.named_modules())
    for name, param in model.named_parameters():
        if skip(name):
            continue
        module_name, _, attr = name.rpartition(".")
        part_of = getattr(modules[module_name], "checkpoint_part", None)
        out[name], shard = part_of(attr) if part_of else (param.data, None)
        if shard is not None:
            shards[name] = shard
    return out, shards


def pack_weights(module: nn.Module) -> None:
    """After the weights are in: on the CPU, the packed weights
    (``PackedWeight``) of every projection and expert under ``module``."""
    for m in module.modules():
        if isinstance(m, (Linear, RoutedExperts)):
            m.post_load()


class Block(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layer: int,
        ropes: dict[str, InterleavedRope],
        group: RankGroup,
        expert_parallel: bool,
    ) -> None:
        super().__init__()
        v4 = cfg.deepseek_v4
        kind = v4.layer_types[layer]
        d, n = cfg.hidden_size, v4.hc_mult
        self.attn = Attention(cfg, kind, ropes["main" if kind == SLIDING else "compress"], group)
        hashed = v4.mlp_layer_types[layer] == "hash_moe"
        self.ffn = MoE(d, v4, cfg.vocab_size, hashed, group, expert_parallel)
        self.attn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(d, cfg.rms_norm_eps)
        hc = (n, d, v4.hc_sinkhorn_iters, v4.hc_eps, cfg.rms_norm_eps)
        self.hc_attn, self.hc_ffn = HyperConnection(*hc), HyperConnection(*hc)


class DeepseekV4ForCausalLM(nn.Module):
    # Kept in float32 whatever the serving dtype, as the reference keeps them.
    keep_fp32 = ("hc_", "attn_sink", "ape", "compressor.", "weights_proj", "gate.bias")

    def __init__(
        self,
        cfg: ModelConfig,
        max_position: int | None = None,
        group: RankGroup = SINGLE,
        expert_parallel: bool = False,
    ) -> None:
        """``group``: the tensor-parallel group this is one rank's shard of;
        ``expert_parallel``: its routed experts split whole over the ranks
        (else each expert's intermediate features)."""
        super().__init__()
        v4 = cfg.deepseek_v4
        assert v4 is not None
        self.config = cfg
        self.group = group
        max_position = max_position or cfg.max_position_embeddings
        self.ropes = {
            "main": InterleavedRope(v4.main_rope, cfg.head_dim, max_position),
            "compress": InterleavedRope(v4.compress_rope, cfg.head_dim, max_position),
        }
        self.embed = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, group)
        self.layers = nn.ModuleList(
            [
                Block(cfg, i, self.ropes, group, expert_parallel)
                for i in range(cfg.num_hidden_layers)
            ]
        )
        self.hc_head = HyperHead(v4.hc_mult, cfg.hidden_size, v4.hc_eps, cfg.rms_norm_eps)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = VocabParallelHead(cfg.hidden_size, cfg.vocab_size, group)
        if cfg.tie_word_embeddings:
            self.head.weight = self.embed.weight

    # ---- loading ----------------------------------------------------------

    def checkpoint_key(self, key: str) -> str | None:
        """Our name for a checkpoint key (DeepSeek's or transformers'); None
        for what is not part of this rank's target (the MTP / DSpark layers,
        other ranks' experts)."""
        key = key.removeprefix("model.")
        if key.startswith("mtp."):
            return None
        if ".ffn.experts." in key:
            layer, expert = key.split(".")[1], key.split(".ffn.experts.")[1].split(".")[0]
            if not self.layers[int(layer)].ffn.experts.holds(int(expert)):
                return None
        renames = {
            "embed_tokens.weight": "embed.weight",
            "lm_head.weight": "head.weight",
            "hc_head.hc_fn": "hc_head.fn",
            "hc_head.hc_base": "hc_head.base",
            "hc_head.hc_scale": "hc_head.scale",
        }
        return renames.get(key) or hc_names(key)

    def checkpoint_targets(self) -> dict[str, torch.Tensor]:
        return self.checkpoint_layout()[0]

    def checkpoint_layout(self) -> tuple[dict[str, torch.Tensor], dict[str, Shard]]:
        """Our names -> the tensors they fill, and the names this rank reads
        a slice of -> that slice."""
        out, shards = parameter_layout(self, lambda name: ".ffn.experts." in name)
        for name, buf in self.named_buffers():
            out[name] = buf
        for i, block in enumerate(self.layers):
            experts, split_keys = block.ffn.experts.checkpoint_layout(f"layers.{i}.ffn.experts")
            out.update(experts)
            shards.update(split_keys)
        if self.config.tie_word_embeddings:
            out.pop("head.weight", None)
        return out, shards

    def post_load(self) -> None:
        pack_weights(self)
        self.embed.post_load()
        self.head.post_load()

    # ---- the forward --------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        backend: CompressedAttentionBackend,
        capture_layer_ids: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Final-normed hidden states ``[T, d]`` and, for ``capture_layer_ids``,
        each chosen layer's output streams averaged ``[T, d]``."""
        h = self.embed(input_ids)
        streams = h[:, None, :].expand(-1, self.config.deepseek_v4.hc_mult, -1).contiguous()
        captured = [h] if -1 in capture_layer_ids else []
        compress_rope = self.ropes["compress"]
        at = {rope: rope.at(meta.positions) for rope in self.ropes.values()}
        for i, block in enumerate(self.layers):
            x, post, comb = block.hc_attn(streams)
            out = block.attn(i, block.attn_norm.forward(x), meta, backend, compress_rope, at)
            streams = expand(streams, out, post, comb)
            x, post, comb = block.hc_ffn(streams)
            out = block.ffn(block.ffn_norm.forward(x), input_ids)
            streams = expand(streams, out, post, comb)
            if i in capture_layer_ids:
                # A layer's state, for a drafter: its output streams averaged.
                captured.append(streams.mean(dim=1))
        return self.norm.forward(self.hc_head(streams)), captured

    def compile_dense(self) -> None:
        raise ValueError("enable_torch_compile: not supported for DeepseekV4ForCausalLM yet")

    @property
    def logits_head(self) -> VocabParallelHead:
        return self.head

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits ``[R, V]``; under tensor parallelism gathered on
        rank 0 (None on the others)."""
        return self.head.gather(self.head(hidden))
