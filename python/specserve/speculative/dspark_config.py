"""The one internal config of a DSpark / DFlash drafter, in DeepSpec's
fields (``drafter_formats.py`` reads the other formats into it).

Two backbones: Qwen3's (``Qwen3DSparkModel``, also used under other
targets) and Gemma 4's (``Gemma4DSparkModel``): its layers are Gemma 4's
global layers (the global head size and KV heads, keys doubling as values
with ``attention_k_eq_v``, unweighted-normed values, attention at scale 1,
partial "proportional" RoPE), with sandwich norms and a layer scalar, the
embedding scaled by sqrt(hidden) and soft-capped logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specserve.config import ModelConfig, RopeConfig, parse_rope
from specserve.models.gemma4_config import FULL

ARCHITECTURE = "Qwen3DSparkModel"
GEMMA4_ARCHITECTURE = "Gemma4DSparkModel"
MARKOV_TYPES = ("vanilla", "gated", "rnn")


@dataclass(frozen=True)
class DSparkConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int
    max_position_embeddings: int
    rope: RopeConfig
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int | None  # the target's depth (None: the checkpoint does not say)
    markov_rank: int = 0
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = False
    attention_bias: bool = False
    # A drafter with its own reduced vocabulary: its head's and its Markov
    # head's W2's rows (draft id i is target id i + d2t[i]); None: the target's.
    draft_vocab_size: int | None = None
    # The slot layout: True, DeepSpec's (slot k predicts anchor + k + 1,
    # block_size drafts); False, the 1 + N layout (slot 0 the anchor's bonus
    # token, slot k predicts anchor + k: a block of block_size + 1 positions).
    sample_from_anchor: bool = True
    # An RMSNorm per captured layer before their concatenation (``fc_norm.{i}``).
    feature_norms: bool = False
    # Gemma 4's backbone (see the module docstring); keys as values with it.
    gemma4: bool = False
    keys_are_values: bool = False
    logit_softcap: float | None = None
    hidden_act: str = "silu"

    @property
    def drafting_vocab(self) -> int:
        """The rows of the drafter's head: the draft vocabulary, or the target's."""
        return self.draft_vocab_size or self.vocab_size

    @property
    def attention_scale(self) -> float | None:
        """Gemma 4's q/k norms set the logits' size: scale 1; else 1/sqrt(D)."""
        return 1.0 if self.gemma4 else None

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> DSparkConfig:
        """DeepSpec's config.json (the other formats' readers, in
        drafter_formats.py, write theirs in its fields)."""
        archs = cfg.get("architectures") or []
        if ARCHITECTURE not in archs and GEMMA4_ARCHITECTURE not in archs:
            raise ValueError(
                f"{source}: architectures must contain {ARCHITECTURE!r} or "
                f"{GEMMA4_ARCHITECTURE!r}, got {archs}"
            )
        for key in ("block_size", "mask_token_id", "target_layer_ids", "num_target_layers"):
            if key not in cfg:
                raise ValueError(f"{source}: missing DSpark field {key!r}")
        if GEMMA4_ARCHITECTURE in archs:
            backbone = _gemma4_backbone(cfg, source)
        else:
            base = ModelConfig.from_dict({**cfg, "architectures": ["Qwen3ForCausalLM"]}, source)
            backbone = dict(
                num_key_value_heads=base.num_key_value_heads,
                head_dim=base.head_dim,
                rope=parse_rope(cfg),
                attention_bias=base.attention_bias,
            )
        vocab = int(cfg["vocab_size"])
        rank = int(cfg.get("markov_rank", 0) or 0)
        kind = str(cfg.get("markov_head_type", "vanilla") or "vanilla")
        if rank and kind not in MARKOV_TYPES:
            raise ValueError(
                f"{source}: markov_head_type must be one of {MARKOV_TYPES}, got {kind!r}"
            )
        with_markov = bool(cfg.get("confidence_head_with_markov", False)) and rank > 0
        layers, draft_vocab = cfg["num_target_layers"], cfg.get("draft_vocab_size")
        if draft_vocab is not None and not 0 < int(draft_vocab) < vocab:
            raise ValueError(f"{source}: draft_vocab_size {draft_vocab} must be in [1, {vocab})")
        return cls(
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=int(cfg["num_attention_heads"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            vocab_size=vocab,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            block_size=int(cfg["block_size"]),
            mask_token_id=int(cfg["mask_token_id"]),
            target_layer_ids=tuple(int(i) for i in cfg["target_layer_ids"]),
            num_target_layers=None if layers is None else int(layers),
            markov_rank=rank,
            markov_head_type=kind,
            enable_confidence_head=bool(cfg.get("enable_confidence_head", False)),
            confidence_head_with_markov=with_markov,
            draft_vocab_size=None if draft_vocab is None else int(draft_vocab),
            sample_from_anchor=bool(cfg.get("sample_from_anchor", True)),
            feature_norms=bool(cfg.get("fc_norm", False)),
            **backbone,
        )


def _gemma4_backbone(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """A Gemma 4 drafter's layer shapes: every draft layer is a global one."""
    needed = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    for key in (*needed, "vocab_size", "global_head_dim"):
        if key not in cfg:
            raise ValueError(f"{source}: missing Gemma 4 DSpark field {key!r}")
    if cfg.get("enable_moe_block") or int(cfg.get("hidden_size_per_layer_input") or 0):
        raise ValueError(
            f"{source}: a Gemma 4 drafter with MoE blocks or per-layer inputs is not supported"
        )
    k_eq_v = bool(cfg.get("attention_k_eq_v", False))
    kv = cfg.get("num_global_key_value_heads") if k_eq_v else None
    rope = (cfg.get("rope_parameters") or {}).get(FULL) or {
        "rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0
    }  # fmt: skip
    softcap = cfg.get("final_logit_softcapping")
    return dict(
        num_key_value_heads=int(kv or cfg.get("num_key_value_heads") or cfg["num_attention_heads"]),
        head_dim=int(cfg["global_head_dim"]),
        rope=parse_rope({"rope_parameters": rope}),
        attention_bias=bool(cfg.get("attention_bias", False)),
        gemma4=True,
        keys_are_values=k_eq_v,
        logit_softcap=float(softcap) if softcap else None,
        hidden_act=str(cfg.get("hidden_activation") or "gelu_pytorch_tanh"),
    )
