"""Writes a DeepSpec-format DSpark drafter (``make_tiny_dspark``) in the
other published layouts, with the config keys their published releases
carry: the same weights in another format, for the loader's tests and for
trying ``specserve check-drafter``."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import torch
from safetensors.torch import load_file, save_file

from specserve.speculative.drafter_formats import TORCHSPEC_RENAMES, renamed

# The backbone fields a DeepSpec config shares with its Qwen3 target.
_BACKBONE = (
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "vocab_size",
    "max_position_embeddings",
    "rope_theta",
    # Gemma 4's drafter layers.
    "global_head_dim",
    "num_global_key_value_heads",
    "attention_k_eq_v",
    "hidden_activation",
    "final_logit_softcapping",
    "hidden_size_per_layer_input",
    "rope_parameters",
)
_HEADS = (
    "markov_rank",
    "markov_head_type",
    "enable_confidence_head",
    "confidence_head_with_markov",
)


def _read(src: str) -> tuple[dict, dict[str, torch.Tensor]]:
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    return cfg, load_file(os.path.join(src, "model.safetensors"))


def _write(
    dst: str, cfg: dict, state: dict[str, torch.Tensor], dtype: torch.dtype | None = None
) -> str:
    """``dtype``: the floating tensors' (a bf16 release's), else as they are."""
    os.makedirs(dst, exist_ok=True)
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
        name = str(dtype).removeprefix("torch.")
        for key in ("dtype", "torch_dtype"):
            if key in cfg:
                cfg[key] = name
    state = {k: v.contiguous() for k, v in state.items()}
    save_file(state, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return dst


def write_deepspec(src: str, dst: str, *, dtype: torch.dtype | None = None) -> str:
    """The drafter at ``src`` again in DeepSpec's layout, its weights in ``dtype``."""
    cfg, state = _read(src)
    return _write(dst, cfg, state, dtype)


def write_torchspec(
    src: str,
    dst: str,
    *,
    trained_names: bool = True,
    variant: str = "qwen3_dspark",
    dtype: torch.dtype | None = None,
    fc_norm: torch.Tensor | None = None,
) -> str:
    """TorchSpec's export of the drafter at ``src``: no ``lm_head`` and no
    ``block_size``; ``num_target_layers`` the captured layers' count.
    ``trained_names``: its training modules' names (``context_proj``,
    ``context_norm``, ``final_norm``), as before its converter's renames.
    ``variant``: "qwen3_dspark" (current), "classical" (the older export,
    Markov head so named), "dflash" (``DFlashDraftModel`` with the ids in
    ``dflash_config``). ``fc_norm``: ``[m, d]`` weights of an RMSNorm per
    captured layer before the concatenation (``fc_norm.{i}.weight``, with
    ``fc_norm: true`` in the config)."""
    cfg, state = _read(src)
    out = {k: cfg[k] for k in _BACKBONE if k in cfg}
    out.update(
        architectures=["Qwen3DSparkModel"],
        model_type="qwen3",
        num_target_layers=len(cfg["target_layer_ids"]),
        target_hidden_size=cfg["hidden_size"],
        target_num_hidden_layers=cfg["num_target_layers"],
        target_layer_ids=cfg["target_layer_ids"],
        mask_token_id=cfg["mask_token_id"],
        tie_word_embeddings=False,
        draft_vocab_size=cfg["vocab_size"],
        torch_dtype=cfg.get("dtype", "float32"),
        _torchspec_version="0.1.0",
        **{k: cfg[k] for k in _HEADS if k in cfg},
    )
    if variant == "classical":
        out["markov_head_type"] = "classical"
    elif variant == "dflash":
        out.update(architectures=["DFlashDraftModel"], model_type="dflash")
        out["dflash_config"] = {
            "mask_token_id": out.pop("mask_token_id"),
            "target_layer_ids": out.pop("target_layer_ids"),
        }
    state.pop("lm_head.weight", None)
    if fc_norm is not None:
        out["fc_norm"] = True
        state.update({f"fc_norm.{i}.weight": w.clone() for i, w in enumerate(fc_norm)})
    if trained_names:
        # The readers' renames the other way (a DSpark export has no midlayer).
        back = [(new, old) for old, new in TORCHSPEC_RENAMES if old != "midlayer."]
        state = {renamed(k, back): v for k, v in state.items()}
    return _write(dst, out, state, dtype)


def write_speculators(
    src: str,
    dst: str,
    *,
    draft_ids: Sequence[int] | None = None,
    sample_from_anchor: bool | None = True,
    verifier: str = "Qwen/Qwen3-8B",
    dtype: torch.dtype | None = None,
) -> str:
    """The speculators format's export of the drafter at ``src`` (``DSparkSpeculator``):
    the backbone in ``transformer_layer_config``, hidden-state ids counting
    the embeddings as 0, no ``embed_tokens``. ``draft_ids``: a reduced draft
    vocabulary, these target ids (its head's and W2's rows, ``d2t`` /
    ``t2d``). ``sample_from_anchor`` None leaves the field out, as exports
    older than it did. ``dtype``: the weights' (bf16, as the releases)."""
    cfg, state = _read(src)
    backbone = {k: cfg[k] for k in _BACKBONE if k in cfg}
    target = "Gemma4ForCausalLM" if cfg.get("model_type") == "gemma4_text" else "Qwen3ForCausalLM"
    backbone.update(architectures=[target], model_type=cfg.get("model_type", "qwen3"))
    block = cfg["block_size"]
    vocab = cfg["vocab_size"]
    out = {
        "architectures": ["DSparkSpeculator"],
        "speculators_model_type": "dspark",
        "speculators_version": "0.4.0",
        "transformer_layer_config": backbone,
        "draft_vocab_size": vocab if draft_ids is None else len(draft_ids),
        "block_size": block,
        "target_hidden_size": cfg["hidden_size"],
        "aux_hidden_state_layer_ids": [i + 1 for i in cfg["target_layer_ids"]],
        "mask_token_id": cfg["mask_token_id"],
        "sliding_window_non_causal": False,
        **{k: cfg[k] for k in _HEADS if k in cfg},
        "speculators_config": {
            "algorithm": "dspark",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": block if sample_from_anchor is not False else block - 1,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": [target]},
        },
        "torch_dtype": cfg.get("dtype", "float32"),
    }
    if sample_from_anchor is not None:
        out["sample_from_anchor"] = sample_from_anchor
    state.pop("embed_tokens.weight", None)
    if draft_ids is not None:
        if "lm_head.weight" not in state:
            raise ValueError(f"{src}: a reduced vocabulary needs the drafter's lm_head.weight")
        ids = torch.tensor(list(draft_ids), dtype=torch.long)
        state["lm_head.weight"] = state["lm_head.weight"][ids]
        w2 = "markov_head.markov_w2.weight"
        if w2 in state:
            state[w2] = state[w2][ids]
        state["d2t"] = ids - torch.arange(len(ids))
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        state["t2d"] = t2d
    return _write(dst, out, state, dtype)
