"""Gemma 4's architecture fields, read from ``config.json``.

Gemma 4 text models interleave sliding-window layers (a local head size,
the default RoPE) with global layers (their own head size and KV head
count, and with ``attention_k_eq_v`` keys that double as values, under a
"proportional" partial RoPE). Both spellings of the global layers' shape
are read: the published one (``global_head_dim``,
``num_global_key_value_heads``) and the ``per_layer_config`` overrides
transformers writes. ``Gemma4ForConditionalGeneration`` nests the text
model's fields in ``text_config``; its vision and audio towers are not
served. What the E2B / E4B releases add (per-layer embeddings, layers that
reuse another's KV) stops start-up, named.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specserve.config import RopeConfig

SLIDING = "sliding_attention"
FULL = "full_attention"
ARCHITECTURES = (
    "Gemma4ForCausalLM",
    "Gemma4ForConditionalGeneration",
    "Gemma4UnifiedForConditionalGeneration",
)
MODEL_TYPES = ("gemma4", "gemma4_text", "gemma4_unified")


@dataclass(frozen=True)
class Gemma4Config:
    sliding: tuple[bool, ...]  # per layer: a sliding-window layer
    sliding_window: int  # keys a sliding layer's query sees, its own included
    kv_heads: tuple[int, ...]  # per layer
    head_dims: tuple[int, ...]  # per layer
    k_eq_v: bool  # global layers: V = v_norm(k_proj(x)), no v_proj
    sliding_rope: RopeConfig
    full_rope: RopeConfig
    final_logit_softcapping: float | None
    num_experts: int  # 0: dense MLPs only
    top_k_experts: int
    moe_intermediate_size: int

    def shares_kv(self, layer: int) -> bool:
        """Whether ``layer`` takes its values from its key projection."""
        return self.k_eq_v and not self.sliding[layer]


def is_gemma4(cfg: dict[str, Any]) -> bool:
    archs = cfg.get("architectures") or []
    return bool(set(archs) & set(ARCHITECTURES)) or cfg.get("model_type") in MODEL_TYPES


def text_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The text model's fields: ``text_config`` of a multimodal checkpoint,
    with the outer ``architectures`` and token ids where it lacks them."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        return cfg
    outer = {k: cfg[k] for k in ("architectures", "eos_token_id", "bos_token_id") if k in cfg}
    tie = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", True))
    return {**outer, **text, "architectures": cfg.get("architectures"), "tie_word_embeddings": tie}


def parse_gemma4(cfg: dict[str, Any], source: str) -> Gemma4Config:
    """``cfg``: the text model's fields (``text_fields``)."""
    n = int(cfg["num_hidden_layers"])
    if int(cfg.get("hidden_size_per_layer_input") or 0):
        raise ValueError(
            f"{source}: per-layer input embeddings (hidden_size_per_layer_input, the "
            "gemma-4-E2B / E4B releases) are not supported"
        )
    if int(cfg.get("num_kv_shared_layers") or 0):
        raise ValueError(
            f"{source}: layers that reuse another layer's KV (num_kv_shared_layers, the "
            "gemma-4-E2B / E4B releases) are not supported"
        )
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(f"{source}: use_bidirectional_attention is not supported")
    types = list(cfg.get("layer_types") or [])
    if not types:  # transformers' default: five sliding layers, then a global one
        types = [SLIDING if (i + 1) % 6 else FULL for i in range(n)]
    if len(types) != n or set(types) - {SLIDING, FULL}:
        raise ValueError(
            f"{source}: layer_types must give {SLIDING!r} or {FULL!r} for each of {n} layers"
        )
    types[-1] = FULL  # as transformers forces it
    sliding = tuple(t == SLIDING for t in types)
    k_eq_v = bool(cfg.get("attention_k_eq_v", False))
    heads = int(cfg["num_attention_heads"])
    local_kv = int(cfg.get("num_key_value_heads") or heads)
    local_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    overrides = cfg.get("per_layer_config")
    if isinstance(overrides, dict):
        shapes = []
        for i in range(n):
            o = overrides.get(str(i)) or overrides.get(i) or {}
            shapes.append(
                (int(o.get("num_key_value_heads", local_kv)), int(o.get("head_dim", local_dim)))
            )
    else:
        global_kv = cfg.get("num_global_key_value_heads")
        full_kv = int(global_kv) if k_eq_v and global_kv is not None else local_kv
        full_dim = int(cfg.get("global_head_dim", 512))
        shapes = [(local_kv, local_dim) if s else (full_kv, full_dim) for s in sliding]
    for kv, _ in shapes:
        if heads % kv:
            raise ValueError(f"{source}: {heads} attention heads cannot share {kv} KV heads")
    ropes = cfg.get("rope_parameters") or {}
    sliding_rope = _rope(ropes.get(SLIDING), {"rope_type": "default", "rope_theta": 10_000.0})
    full_rope = _rope(
        ropes.get(FULL),
        {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
    )
    moe = bool(cfg.get("enable_moe_block", False))
    softcap = cfg.get("final_logit_softcapping")
    return Gemma4Config(
        sliding=sliding,
        sliding_window=int(cfg.get("sliding_window", 512)),
        kv_heads=tuple(kv for kv, _ in shapes),
        head_dims=tuple(d for _, d in shapes),
        k_eq_v=k_eq_v,
        sliding_rope=sliding_rope,
        full_rope=full_rope,
        final_logit_softcapping=float(softcap) if softcap else None,
        num_experts=int(cfg["num_experts"]) if moe else 0,
        top_k_experts=int(cfg["top_k_experts"]) if moe else 0,
        moe_intermediate_size=int(cfg["moe_intermediate_size"]) if moe else 0,
    )


def _rope(params: dict[str, Any] | None, default: dict[str, Any]) -> RopeConfig:
    params = dict(params or default)
    theta = float(params.pop("rope_theta", default["rope_theta"]))
    rope_type = params.pop("rope_type", "default") or "default"
    return RopeConfig(rope_type=rope_type, theta=theta, params=tuple(sorted(params.items())))
