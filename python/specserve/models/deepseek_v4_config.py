"""DeepSeek-V4's architecture fields, read from ``config.json``.

Both spellings are read: transformers' (``layer_types``, ``compress_rates``,
nested ``rope_parameters``) and the legacy one of DeepSeek's own checkpoints
(``compress_ratios`` 0 / 4 / 128 per layer, ``num_hash_layers``,
``qk_rope_head_dim``, a flat rope dict for the compressed layers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specserve.config import RopeConfig

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_KINDS = (SLIDING, CSA, HCA)
MLP_KINDS = ("moe", "hash_moe")
SCORING_FUNCS = ("sqrtsoftplus", "softmax", "sigmoid")
_RATIO_KIND = {0: SLIDING, 4: CSA, 128: HCA}


@dataclass(frozen=True)
class DeepseekV4Config:
    layer_types: tuple[str, ...]  # one of LAYER_KINDS per layer
    mlp_layer_types: tuple[str, ...]  # one of MLP_KINDS per layer
    compress_rates: tuple[tuple[str, int], ...]  # (CSA, m), (HCA, m')
    sliding_window: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    rope_head_dim: int  # the trailing channels of each head that RoPE rotates
    main_rope: RopeConfig  # sliding-window layers
    compress_rope: RopeConfig  # compressed layers, their entries and the indexer
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    scoring_func: str
    routed_scaling_factor: float
    swiglu_limit: float

    def rate(self, kind: str) -> int:
        return dict(self.compress_rates)[kind]

    @property
    def compressed_kinds(self) -> tuple[str, ...]:
        """The compressed layer kinds present, CSA first."""
        return tuple(k for k in (CSA, HCA) if k in self.layer_types)

    @property
    def retain(self) -> int:
        """Positions behind a step's first new token that its layers still
        read: the window's keys and the sources of the compression windows the
        step may close (two windows for CSA's overlap, one for HCA)."""
        spans = [self.sliding_window - 1]
        if CSA in self.layer_types:
            spans.append(2 * self.rate(CSA) - 1)
        if HCA in self.layer_types:
            spans.append(self.rate(HCA) - 1)
        return max(spans)


def parse_deepseek_v4(cfg: dict[str, Any], head_dim: int, source: str) -> DeepseekV4Config:
    n = int(cfg["num_hidden_layers"])

    def bad(field: str, why: str) -> ValueError:
        return ValueError(f"{source}: {field} {why}")

    rates = {CSA: 4, HCA: 128, **(cfg.get("compress_rates") or {})}
    layer_types = cfg.get("layer_types")
    if layer_types is None and cfg.get("compress_ratios") is not None:
        ratios = cfg["compress_ratios"]
        unknown = [r for r in ratios if r not in _RATIO_KIND]
        if unknown:
            raise bad("compress_ratios", f"has {unknown}; supported: {sorted(_RATIO_KIND)}")
        layer_types = [_RATIO_KIND[r] for r in ratios]
    if layer_types is None:
        layer_types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    layer_types = list(layer_types[:n])
    mlp_types = cfg.get("mlp_layer_types")
    if mlp_types is None:
        hashed = int(cfg.get("num_hash_layers", 3))
        mlp_types = ["hash_moe"] * min(n, hashed) + ["moe"] * max(0, n - hashed)
    mlp_types = list(mlp_types[:n])
    for field, types, allowed in (
        ("layer_types", layer_types, LAYER_KINDS),
        ("mlp_layer_types", mlp_types, MLP_KINDS),
    ):
        if len(types) != n or any(t not in allowed for t in types):
            raise bad(field, f"must list one of {allowed} for each of the {n} layers; got {types}")
    if int(rates[CSA]) < 1 or int(rates[HCA]) <= int(rates[CSA]):
        raise bad("compress_rates", f"must be >= 1 with HCA's above CSA's; got {rates}")
    scoring = str(cfg.get("scoring_func", "sqrtsoftplus"))
    if scoring not in SCORING_FUNCS:
        raise bad("scoring_func", f"{scoring!r} is not supported; supported: {SCORING_FUNCS}")
    factor = cfg.get("partial_rotary_factor")
    if factor is None:
        factor = cfg.get("qk_rope_head_dim", head_dim // 8) / head_dim
    main_rope, compress_rope = _ropes(cfg, float(factor))
    heads = int(cfg["num_attention_heads"])
    groups = int(cfg.get("o_groups", 8))
    if heads % groups:
        raise bad("o_groups", f"({groups}) must divide num_attention_heads ({heads})")
    if int(cfg.get("num_key_value_heads", 1)) != 1:
        raise bad("num_key_value_heads", "must be 1 (DeepSeek-V4 attention shares one K=V head)")
    return DeepseekV4Config(
        layer_types=tuple(layer_types),
        mlp_layer_types=tuple(mlp_types),
        compress_rates=((CSA, int(rates[CSA])), (HCA, int(rates[HCA]))),
        sliding_window=int(cfg.get("sliding_window", 128)),
        q_lora_rank=int(cfg.get("q_lora_rank", 1024)),
        o_groups=groups,
        o_lora_rank=int(cfg.get("o_lora_rank", 1024)),
        rope_head_dim=int(head_dim * float(factor)),
        main_rope=main_rope,
        compress_rope=compress_rope,
        index_n_heads=int(cfg.get("index_n_heads", 64)),
        index_head_dim=int(cfg.get("index_head_dim", 128)),
        index_topk=int(cfg.get("index_topk", 512)),
        hc_mult=int(cfg.get("hc_mult", 4)),
        hc_sinkhorn_iters=int(cfg.get("hc_sinkhorn_iters", 20)),
        hc_eps=float(cfg.get("hc_eps", 1e-6)),
        n_routed_experts=int(cfg["n_routed_experts"]),
        n_shared_experts=int(cfg.get("n_shared_experts", 1)),
        num_experts_per_tok=int(cfg["num_experts_per_tok"]),
        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        scoring_func=scoring,
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        swiglu_limit=float(cfg.get("swiglu_limit") or float("inf")),
    )


def _ropes(cfg: dict[str, Any], factor: float) -> tuple[RopeConfig, RopeConfig]:
    """The plain RoPE of sliding layers and the (possibly YaRN) RoPE of the
    compressed ones. YaRN's cos/sin are not rescaled here unless the config
    says so (``attention_factor`` defaults to 1, as DeepSeek's reference does)."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        main, compress = dict(params["main"]), dict(params["compress"])
    else:
        main = {"rope_type": "default", "rope_theta": cfg.get("rope_theta", 10000.0)}
        compress = {k: v for k, v in params.items() if k not in ("main", "compress")}
        compress["rope_theta"] = cfg.get("compress_rope_theta", 160000.0)
    out = []
    for d in (main, compress):
        rope_type = d.pop("rope_type", d.pop("type", "default")) or "default"
        theta = float(d.pop("rope_theta", 10000.0))
        d.setdefault("partial_rotary_factor", factor)
        if rope_type == "yarn":
            d.setdefault("attention_factor", 1.0)
        out.append(RopeConfig(rope_type, theta, tuple(sorted(d.items()))))
    return out[0], out[1]
