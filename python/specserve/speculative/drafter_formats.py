"""One reader per DSpark drafter checkpoint format, each producing the one
internal ``DSparkConfig`` (DeepSpec's fields and slot layout) and the names
of the checkpoint's tensors in the internal model:

- ``deepspec``: DeepSpec's own (``Qwen3DSparkModel``, ``Gemma4DSparkModel``),
  the internal layout.
- ``torchspec``: TorchSpec's exports. Its module names before its converter
  renames them (``context_proj``, ``context_norm``, ``final_norm``); no
  ``lm_head`` (the target's is shared) and no ``block_size`` (a training
  argument); ``num_target_layers`` counts the captured layers, the
  target's depth is ``target_num_hidden_layers``; older exports call the
  vanilla Markov head "classical"; the DFlash-style variant nests
  ``mask_token_id`` and ``target_layer_ids`` in ``dflash_config``; an
  RMSNorm per captured layer before the concatenation (``fc_norm.{i}``,
  with ``fc_norm: true``, or found among the tensors) is read.
- ``speculators``: ``speculators_model_type: "dspark"``. The backbone in
  ``transformer_layer_config``; ``aux_hidden_state_layer_ids`` number the
  hidden states with the embeddings as 0 (DeepSpec's id + 1); a reduced
  draft vocabulary (``draft_vocab_size``) maps draft id i to target id
  ``i + d2t[i]``; ``sample_from_anchor`` names the slot layout.

Each reader writes down the settings its checkpoint leaves open, as taken
(``DrafterCheckpoint.choices``): the loader logs them, ``check-drafter``
prints them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from safetensors import safe_open

from specserve.models.loader import checkpoint_files
from specserve.speculative.dspark_config import ARCHITECTURE, GEMMA4_ARCHITECTURE, DSparkConfig

FORMATS = ("deepspec", "torchspec", "speculators")
# TorchSpec's module names -> DeepSpec's (its converter applies the same).
TORCHSPEC_RENAMES = (
    ("midlayer.", "layers.0."),
    ("context_proj.", "fc."),
    ("context_norm.", "hidden_norm."),
    ("final_norm.", "norm."),
)
# The block TorchSpec's DSpark recipes train, when nothing else says.
TORCHSPEC_DEFAULT_BLOCK = 7
# DSpark fields a speculators config keeps beside the backbone's.
_SPECULATORS_FIELDS = (
    "markov_rank",
    "markov_head_type",
    "enable_confidence_head",
    "confidence_head_with_markov",
    "mask_token_id",
    "block_size",
)


@dataclass(frozen=True)
class DrafterCheckpoint:
    """A drafter checkpoint read into the internal config."""

    format: str  # one of FORMATS
    config: DSparkConfig
    renames: tuple[tuple[str, str], ...] = ()  # checkpoint name prefix -> ours
    ignored: tuple[str, ...] = ()  # checkpoint tensors nothing reads
    choices: tuple[str, ...] = ()  # what the checkpoint left open, as taken

    def checkpoint_key(self, key: str) -> str | None:
        """The internal name of checkpoint tensor ``key`` (None: not read)."""
        return None if key in self.ignored else renamed(key, self.renames)


def renamed(key: str, renames: Sequence[tuple[str, str]]) -> str:
    """``key`` with its first matching prefix of ``renames`` (old, new) replaced."""
    for old, new in renames:
        if key.startswith(old):
            return new + key[len(old) :]
    return key


def read_drafter(path: str, block_hint: int | None = None) -> DrafterCheckpoint:
    """The drafter at ``path`` in whichever format it is. ``block_hint``:
    the block the flags ask for, taken as the trained block by a format
    that does not record one (TorchSpec)."""
    source = os.path.join(path, "config.json")
    if not os.path.isfile(source):
        raise ValueError(f"speculative_draft_model_path: no config.json in {path!r}")
    with open(source) as f:
        cfg = json.load(f)
    fmt = detect_format(cfg)
    if fmt == "speculators":
        return _read_speculators(cfg, source)
    if fmt == "torchspec":
        return _read_torchspec(cfg, source, block_hint)
    return DrafterCheckpoint("deepspec", DSparkConfig.from_dict(cfg, source))


def detect_format(cfg: dict[str, Any]) -> str:
    """The format a drafter's config.json is written in."""
    if cfg.get("speculators_model_type") is not None:
        return "speculators"
    archs = cfg.get("architectures") or []
    torchspec = (
        "_torchspec_version" in cfg
        or "target_num_hidden_layers" in cfg
        or "dflash_config" in cfg
        or cfg.get("model_type") in ("qwen3_dspark", "dflash")
        or any(a in ("DFlashDraftModel", "DSparkDraftModel") for a in archs)
    )
    return "torchspec" if torchspec else "deepspec"


def _read_torchspec(cfg: dict[str, Any], source: str, block_hint: int | None) -> DrafterCheckpoint:
    choices = []
    if not cfg.get("fc_norm") and _has_tensor(os.path.dirname(source), "fc_norm.0.weight"):
        cfg = {**cfg, "fc_norm": True}
        choices.append("an RMSNorm per captured layer (fc_norm.*, found among the tensors)")
    nested = cfg.get("dflash_config") or {}
    norm = {**cfg, **{k: nested[k] for k in ("mask_token_id", "target_layer_ids") if k in nested}}
    norm["architectures"] = [ARCHITECTURE]
    for key in ("mask_token_id", "target_layer_ids"):
        if key not in norm:
            raise ValueError(f"{source}: missing TorchSpec DSpark field {key!r}")
    if "block_size" not in cfg:
        norm["block_size"] = block_hint or TORCHSPEC_DEFAULT_BLOCK
        said = "from the flags" if block_hint else f"TorchSpec's default {TORCHSPEC_DEFAULT_BLOCK}"
        choices.append(
            f"block size {norm['block_size']} ({said}: the checkpoint does not record it)"
        )
    draft_vocab = norm.pop("draft_vocab_size", None)
    if draft_vocab is not None and int(draft_vocab) != int(cfg.get("vocab_size", draft_vocab)):
        raise ValueError(
            f"{source}: draft_vocab_size {draft_vocab}: a TorchSpec export with a pruned "
            f"vocabulary is not supported (its DSpark exports draft over the target's)"
        )
    # TorchSpec's num_target_layers is the number of captured layers.
    norm["num_target_layers"] = cfg.get("target_num_hidden_layers")
    if norm.get("markov_head_type") == "classical":
        norm["markov_head_type"] = "vanilla"
        choices.append('Markov head "classical" read as vanilla (the older name of the same head)')
    if int(cfg.get("markov_rank", 0) or 0) and "markov_head_type" not in cfg:
        norm["markov_head_type"] = "vanilla"
    return DrafterCheckpoint(
        "torchspec",
        DSparkConfig.from_dict(norm, source),
        renames=TORCHSPEC_RENAMES,
        ignored=("t2d", "d2t"),
        choices=tuple(choices),
    )


def _read_speculators(cfg: dict[str, Any], source: str) -> DrafterCheckpoint:
    kind = cfg.get("speculators_model_type")
    if kind != "dspark":
        raise ValueError(
            f"{source}: speculators_model_type {kind!r} is not a DSpark drafter "
            f"(speculative_algorithm DSPARK / DFLASH load speculators' 'dspark' models)"
        )
    backbone = cfg.get("transformer_layer_config")
    if not isinstance(backbone, dict):
        raise ValueError(f"{source}: missing speculators field 'transformer_layer_config'")
    for key in ("aux_hidden_state_layer_ids", "block_size", "mask_token_id"):
        if key not in cfg:
            raise ValueError(f"{source}: missing speculators DSpark field {key!r}")
    if cfg.get("sliding_window_non_causal"):
        raise ValueError(
            f"{source}: sliding_window_non_causal true (draft layers attending to a window of "
            f"the context) is not supported; the drafter's layers see the whole context"
        )
    choices = []
    anchor = cfg.get("sample_from_anchor")
    if anchor is None:
        # Exports older than the field reserve slot 0 for the anchor; the
        # proposal's speculative_tokens says which when it is there.
        block, tokens = int(cfg["block_size"]), _speculative_tokens(cfg)
        anchor = tokens is not None and tokens == block
        how = f"speculative_tokens {tokens}" if tokens is not None else "the field's absence"
        choices.append(f"sample_from_anchor {str(anchor).lower()} (from {how})")
    vocab = int(backbone.get("vocab_size") or cfg.get("vocab_size") or 0)
    draft_vocab = int(cfg.get("draft_vocab_size") or vocab)
    gemma4 = str(backbone.get("model_type", "")).startswith("gemma4")
    norm = {
        **backbone,
        **{k: cfg[k] for k in _SPECULATORS_FIELDS if k in cfg},
        # A Gemma 4 backbone is Gemma 4's drafter layers (DeepSpec's Gemma4DSparkModel).
        "architectures": [GEMMA4_ARCHITECTURE if gemma4 else ARCHITECTURE],
        "vocab_size": vocab,
        # Hidden state a is the output of layer a - 1 (0: the embeddings).
        "target_layer_ids": [int(a) - 1 for a in cfg["aux_hidden_state_layer_ids"]],
        "num_target_layers": None,  # the verifier's depth is not recorded
        "draft_vocab_size": draft_vocab if draft_vocab != vocab else None,
        "sample_from_anchor": bool(anchor),
    }
    if not anchor:  # slot 0 the bonus token: a block of B positions drafts B - 1
        norm["block_size"] = int(cfg["block_size"]) - 1
    if "markov_head_type" not in norm and int(norm.get("markov_rank", 0) or 0):
        norm["markov_head_type"] = "vanilla"
    dcfg = DSparkConfig.from_dict(norm, source)
    renames: tuple[tuple[str, str], ...] = ()
    ignored = ("t2d", "d2t")  # (a whole vocabulary's identity map, if written)
    if dcfg.draft_vocab_size is not None:
        # The drafter's own reduced head; the target's full one stays shared.
        renames, ignored = (("lm_head.", "draft_head."),), ("t2d",)
    return DrafterCheckpoint(
        "speculators", dcfg, renames=renames, ignored=ignored, choices=tuple(choices)
    )


def _has_tensor(path: str, key: str) -> bool:
    """Whether the checkpoint at ``path`` holds tensor ``key``."""
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt") as f:
            if key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                return True
    return False


def _speculative_tokens(cfg: dict[str, Any]) -> int | None:
    """The drafts per round a speculators config proposes, if it says."""
    methods = (cfg.get("speculators_config") or {}).get("proposal_methods") or []
    for m in methods:
        if isinstance(m, dict) and m.get("speculative_tokens") is not None:
            return int(m["speculative_tokens"])
    return None
