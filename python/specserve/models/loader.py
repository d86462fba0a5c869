"""Loads HF checkpoints (single or sharded safetensors) into our models."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator

import torch
from safetensors import safe_open
from torch import nn

from specserve.config import ModelConfig
from specserve.distributed import SINGLE, RankGroup
from specserve.layers.linear import MergedLinear, Shard
from specserve.models.decoder import DecoderForCausalLM
from specserve.models.registry import resolve_model_class

logger = logging.getLogger(__name__)

# Checkpoint entries that carry no weights of ours.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
SCALE_SUFFIX = "_scale_inv"  # "<weight key>_scale_inv": an FP8 weight's block scales
# DeepSeek's own spelling: "<module>.scale" beside "<module>.weight".
DEEPSEEK_SCALE_SUFFIX = ".scale"


def scaled_weight(key: str) -> str | None:
    """The weight a block-scale tensor scales (either spelling), or None."""
    if key.endswith(SCALE_SUFFIX):
        return key[: -len(SCALE_SUFFIX)]
    if key.endswith(DEEPSEEK_SCALE_SUFFIX):
        return key[: -len(DEEPSEEK_SCALE_SUFFIX)] + ".weight"
    return None


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def checkpoint_files(model_path: str) -> list[str]:
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: no 'weight_map' object")
        files = sorted(set(weight_map.values()))
        for name in files:
            if not os.path.isfile(os.path.join(model_path, name)):
                raise ValueError(f"{index}: lists {name!r}, which is missing from {model_path!r}")
        return [os.path.join(model_path, name) for name in files]
    files = sorted(f for f in os.listdir(model_path) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"model_path: no *.safetensors checkpoint in {model_path!r}")
    return [os.path.join(model_path, name) for name in files]


def iter_checkpoint(
    files: list[str], plan: Callable[[str], tuple[bool, Shard | None]] | None = None
) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(file, key, tensor) for every tensor of the checkpoint that ``plan``
    reads (``plan(key)``: whether to read it, and the slice to read, None:
    the whole); the rest never leaves the file."""
    for path in files:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                read, shard = plan(key) if plan is not None else (True, None)
                if read:
                    tensor = f.get_tensor(key) if shard is None else read_shard(f, path, key, shard)
                    yield path, key, tensor


def read_whole(model: nn.Module, files: list[str], names: set[str]) -> dict[str, torch.Tensor]:
    """The tensors of ``model`` named ``names`` (our names), read whole from
    its checkpoint ``files`` whatever this rank holds of them (only those
    are read)."""
    rename = getattr(model, "checkpoint_key", None) or (lambda key: key)
    out = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if (ours := rename(key)) in names:
                    out[ours] = f.get_tensor(key)
    missing = sorted(names - set(out))
    if missing:
        raise ValueError(f"{os.path.dirname(files[0])}: missing tensor(s) {missing}")
    return out


def read_shard(f, path: str, key: str, shard: Shard) -> torch.Tensor:
    """``shard`` of tensor ``key`` of the open safetensors file ``f``."""
    part = f.get_slice(key)
    shape = part.get_shape()
    if shard.dim >= len(shape) or shape[shard.dim] != shard.full:
        raise ValueError(
            f"{path}: tensor {key!r} has shape {tuple(shape)}, config.json implies "
            f"{shard.full} along dimension {shard.dim}"
        )
    index = [slice(None)] * len(shape)
    index[shard.dim] = slice(shard.start, shard.start + shard.length)
    return part[tuple(index)]


def load_model(
    model_path: str,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    max_position: int | None = None,
    group: RankGroup = SINGLE,
    expert_parallel: bool = False,
) -> DecoderForCausalLM:
    """The model of ``cfg`` from ``model_path``: this rank's shard of it
    under tensor parallelism (``group``; ``expert_parallel``: whole experts
    split over the ranks), read slice by slice."""
    cls = resolve_model_class(cfg.architecture)
    kwargs: dict = {}
    if expert_parallel:
        if cfg.deepseek_v4 is None and not (cfg.gemma4 and cfg.gemma4.num_experts):
            raise ValueError(f"ep_size: {cfg.architecture} has no experts to split")
        kwargs["expert_parallel"] = True
    # Build without initialising (every parameter is overwritten by the
    # checkpoint), straight in the target dtype: no float32 copy ever exists.
    with torch.device("meta"):
        model = cls(cfg, max_position, group, **kwargs)
    model = keep_fp32_(materialize(model, dtype, device))
    if cfg.tie_word_embeddings and hasattr(model, "lm_head"):
        model.lm_head.weight = model.model.embed_tokens.weight
    load_weights(model, checkpoint_files(model_path))
    model.post_load()
    return model.requires_grad_(False).eval()


def materialize(model: nn.Module, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
    """A model built on ``meta``, given uninitialised storage of ``dtype`` on
    ``device`` (the cast happens on meta, where it costs nothing). Fresh
    tensors by shape rather than ``to_empty``: its ``empty_like`` of a meta
    tensor goes through torch's reference ops, 0.5 s of every start-up."""
    return model.to(dtype)._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))


def keep_fp32_(model: nn.Module) -> nn.Module:
    """Parameters named in ``model.keep_fp32`` (substrings) back to float32,
    whatever the serving dtype, as the reference keeps them."""
    for name, param in model.named_parameters():
        if any(p in name for p in getattr(model, "keep_fp32", ())):
            param.data = param.data.float()
    return model


def load_weights(model: DecoderForCausalLM, files: list[str]) -> None:
    """Loads a target checkpoint (``lm_head`` skipped when tied)."""
    skip = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    what = f"{model.config.architecture} with {model.config.num_hidden_layers} layers"
    load_state(model, files, what, skip, model.config.fp8_block)


def checkpoint_targets(model: nn.Module) -> dict[str, torch.Tensor]:
    """Checkpoint key -> the tensor it fills."""
    return checkpoint_layout(model)[0]


def checkpoint_layout(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, Shard]]:
    """Checkpoint key -> the tensor it fills, and the keys of which this
    rank reads a slice (tensor parallelism) -> that slice. Fused projections
    (``model.packed_modules``) take their checkpoint parts one by one; a
    module with a split weight says which part it holds
    (``checkpoint_part``); a model with its own layout says so itself
    (``model.checkpoint_layout``, or ``checkpoint_targets`` without slices)."""
    if hasattr(model, "checkpoint_layout"):
        return model.checkpoint_layout()
    if hasattr(model, "checkpoint_targets"):
        return model.checkpoint_targets(), {}
    packed = getattr(model, "packed_modules", {})
    modules = dict(model.named_modules())
    expected: dict[str, torch.Tensor] = {}
    shards: dict[str, Shard] = {}

    def add(key: str, dest: torch.Tensor, shard: Shard | None) -> None:
        expected[key] = dest
        if shard is not None:
            shards[key] = shard

    for name, param in model.named_parameters():
        module_name, _, attr = name.rpartition(".")
        module = modules[module_name]
        if isinstance(module, MergedLinear):
            parent, _, fused = module_name.rpartition(".")
            for i, part in enumerate(packed[fused]):
                add(f"{parent}.{part}.{attr}", *module.checkpoint_part(attr, i))
        elif hasattr(module, "checkpoint_part"):
            add(name, *module.checkpoint_part(attr))
        else:
            add(name, param.data, None)
    return expected, shards


def dequantize_fp8(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int],
    dtype: torch.dtype,
    shard: Shard | None = None,
) -> torch.Tensor:
    """``weight [N, K]`` float8_e4m3fn times its block's ``scale_inv
    [ceil(N / bn), ceil(K / bk)]``, in ``dtype``; ``shard``: ``weight`` is
    that slice of the tensor the scales are of."""
    n, k = weight.shape
    bn, bk = block
    row = shard.start if shard is not None and shard.dim == 0 else 0
    col = shard.start if shard is not None and shard.dim == 1 else 0
    scale = scale_inv.float().repeat_interleave(bn, dim=0)[row : row + n]
    scale = scale.repeat_interleave(bk, dim=1)[:, col : col + k]
    return (weight.float() * scale).to(dtype)


def _scales(files: list[str]) -> dict[str, torch.Tensor]:
    """Every block-scale tensor of the checkpoint (``*.weight_scale_inv``, or
    DeepSeek's ``*.scale``), by the weight it scales."""
    out = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                weight = scaled_weight(key)
                if weight is not None:
                    out[weight] = f.get_tensor(key)
    return out


def _weight_value(
    path: str,
    key: str,
    tensor: torch.Tensor,
    scales: dict,
    block: tuple[int, int] | None,
    dest: torch.Tensor,
    shard: Shard | None,
) -> torch.Tensor:
    """What ``key`` loads as: the tensor, or an FP8 weight dequantised (the
    ``shard`` of it read)."""
    if tensor.is_floating_point() and tensor.dtype not in FP8_DTYPES:
        return tensor
    if not tensor.is_floating_point() and not dest.is_floating_point():
        return tensor  # an integer table (hash routing's token -> experts)
    if tensor.dtype == torch.float8_e4m3fn and block is not None and key in scales:
        return dequantize_fp8(tensor, scales[key], block, dest.dtype, shard)
    why = (
        "an FP8 weight without its weight_scale_inv or a block-scaled quantization_config"
        if tensor.dtype == torch.float8_e4m3fn
        else "a format this loader does not read"
    )
    raise ValueError(f"{path}: tensor {key!r} is {tensor.dtype}: {why}")


def load_state(
    model: nn.Module,
    files: list[str],
    what: str,
    skip: set[str] = frozenset(),
    fp8_block: tuple[int, int] | None = None,
    rename: Callable[[str], str | None] | None = None,
) -> None:
    """Fills every parameter of ``model`` from ``files``; keys in ``skip``
    (the model's names, or checkpoint names of nothing it expects) are
    neither expected nor loaded; FP8
    block-scaled weights (``fp8_block``) are dequantised into the
    parameter's dtype. ``rename``: a checkpoint name -> the model's (None:
    not read), by default ``model.checkpoint_key``. Errors name the file
    and the key."""
    targets, shards = checkpoint_layout(model)
    expected = {k: v for k, v in targets.items() if k not in skip}
    scales = _scales(files) if fp8_block is not None else {}
    rename = rename or getattr(model, "checkpoint_key", None) or (lambda key: key)
    loaded: set[str] = set()
    left_out = 0

    def plan(key: str) -> tuple[bool, Shard | None]:
        """Whether this rank reads ``key``, and which slice of it."""
        nonlocal left_out
        if key.endswith(_IGNORED_SUFFIXES):
            return False, None
        if fp8_block is not None and scaled_weight(key) is not None:
            return False, None  # read with its weight
        ours = rename(key)
        if ours is None:  # another model's, or another rank's
            left_out += 1
            return False, None
        if ours in skip or (key in skip and ours not in expected):
            return False, None
        return True, shards.get(ours)

    for path, key, tensor in iter_checkpoint(files, plan):
        ours = rename(key)
        assert ours is not None
        if key in scales:
            scales[ours] = scales[key]
        key = ours
        if key not in expected:
            raise ValueError(
                f"{path}: unexpected tensor {key!r} for {what} (does config.json match the checkpoint?)"
            )
        dest = expected[key]
        if tuple(tensor.shape) != tuple(dest.shape):
            raise ValueError(
                f"{path}: tensor {key!r} has shape {tuple(tensor.shape)}, "
                f"config.json implies {tuple(dest.shape)}"
            )
        dest.copy_(_weight_value(path, key, tensor, scales, fp8_block, dest, shards.get(key)))
        loaded.add(key)
    if left_out:
        logger.info(
            "%s: %d checkpoint tensors (other ranks', MTP / drafter layers) left out",
            what, left_out,
        )  # fmt: skip
    missing = sorted(set(expected) - loaded)
    if missing:
        shown = ", ".join(repr(k) for k in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        where = (
            files[0] if len(files) == 1 else f"{len(files)} files in {os.path.dirname(files[0])}"
        )
        raise ValueError(f"{where}: missing tensor(s) {shown}{more}")
