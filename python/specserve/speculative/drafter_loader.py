"""Loads a DSpark / DFlash drafter before the KV pools are sized: its
weights (checked against the target), its block size, and what its pool
pages and largest step cost in the memory budget."""

from __future__ import annotations

import json
import logging
import pickle
from dataclasses import dataclass

import torch

from specserve.cache.kv_pool import KVPool
from specserve.config import EngineConfig
from specserve.distributed import SINGLE, RankGroup
from specserve.layers.parallel import HeadSplit
from specserve.models.deepseek_v4 import pack_weights
from specserve.models.loader import (
    checkpoint_files,
    checkpoint_targets,
    keep_fp32_,
    load_state,
    materialize,
    read_whole,
)
from specserve.runner.model_runner import ModelRunner
from specserve.speculative.block_drafter import BlockDrafter
from specserve.speculative.drafter_formats import DrafterCheckpoint, read_drafter
from specserve.speculative.dspark_config import DSparkConfig
from specserve.speculative.dspark_model import DSparkDraftModel
from specserve.speculative.dspark_v4_model import DSparkV4Config, DSparkV4DraftModel

logger = logging.getLogger(__name__)


@dataclass
class LoadedDrafter:
    model: BlockDrafter
    config: DSparkConfig | DSparkV4Config
    block_size: int
    kv_bytes_per_page: int  # a page of its KV pool (the target's page size)
    activation_bytes: int  # its share of the largest step (see ModelRunner.allocate_kv)


def load_drafter(config: EngineConfig, runner: ModelRunner) -> LoadedDrafter:
    """The drafter's weights, checked against the target, before the KV
    pools are sized (they count in the memory budget like the target's)."""
    spec = config.spec
    assert spec.draft_model_path is not None
    if runner.model_config.deepseek_v4 is not None:
        return load_v4_drafter(config, runner)
    hint = dspark_block_size(spec.block_size, spec.num_draft_tokens, None)
    ckpt = read_drafter(spec.draft_model_path, hint)
    for choice in ckpt.choices:
        logger.info("drafter (%s format): %s", ckpt.format, choice)
    dcfg = ckpt.config
    tcfg = runner.model_config
    check_compatible(dcfg, tcfg.hidden_size, tcfg.vocab_size, tcfg.num_hidden_layers)
    block = drafted_block(config, dcfg.block_size)
    if block < dcfg.block_size:
        logger.warning(
            "drafting blocks of %d with a drafter trained on blocks of %d: the block attends "
            "to itself without a causal mask, so its drafts differ from a full block's",
            block, dcfg.block_size,
        )  # fmt: skip
    dflash = spec.algorithm == "DFLASH"
    group = drafter_group(config, runner)
    if dcfg.draft_vocab_size is not None:
        _check_reduced_vocab(config, group)
    model = load_draft_model(spec.draft_model_path, ckpt, runner, not dflash, group)
    if spec.token_map:
        model.restrict_vocab(load_token_map(spec.token_map, dcfg.vocab_size, runner.device))
    page = KVPool.bytes_per_page(
        dcfg.num_hidden_layers, runner.page_size, draft_heads(dcfg, group).kv_count,
        dcfg.head_dim, runner.dtype,
    )  # fmt: skip
    return LoadedDrafter(
        model, dcfg, block, page, _activation_bytes(config, dcfg, block + model.lead, runner, page)
    )


def _check_reduced_vocab(config: EngineConfig, group: RankGroup) -> None:
    """A drafter with its own reduced vocabulary drafts from it alone, on one rank."""
    if config.spec.token_map:
        raise ValueError(
            "speculative_token_map: the drafter has its own reduced vocabulary "
            "(draft_vocab_size), which is its token map"
        )
    if group.size > 1:
        raise ValueError(
            "speculative_draft_tensor_parallel_size: a drafter with its own reduced vocabulary "
            "(draft_vocab_size) drafts on rank 0; pass 1"
        )


def drafted_block(config: EngineConfig, trained: int) -> int:
    """The block a round drafts (``dspark_block_size``), at most the drafter's own."""
    spec = config.spec
    block = dspark_block_size(spec.block_size, spec.num_draft_tokens, trained)
    if block > trained:
        raise ValueError(
            f"speculative_dspark_block_size: {block} exceeds the drafter's block size {trained}"
        )
    return block


def dspark_block_size(
    block_flag: int | None, chain_flag: int | None, trained: int | None
) -> int | None:
    """The block drafted per round: ``--speculative-dspark-block-size``, or
    ``--speculative-num-draft-tokens`` less the anchor (SGLang's name for the
    verify chain), or the drafter's own; the two flags must agree when both
    are given."""
    from_chain = None if chain_flag is None else chain_flag - 1
    if block_flag is not None and from_chain is not None and block_flag != from_chain:
        raise ValueError(
            f"speculative_num_draft_tokens ({chain_flag}) must be "
            f"speculative_dspark_block_size + 1 = {block_flag + 1}: a verify chain is the "
            f"anchor plus one block of drafts"
        )
    return block_flag or from_chain or trained


def check_compatible(dcfg: DSparkConfig, hidden: int, vocab: int, num_layers: int) -> None:
    if dcfg.hidden_size != hidden or dcfg.vocab_size != vocab:
        raise ValueError(
            f"speculative_draft_model_path: the drafter (hidden {dcfg.hidden_size}, vocab "
            f"{dcfg.vocab_size}) does not fit the target (hidden {hidden}, vocab {vocab})"
        )
    if dcfg.num_target_layers is not None and dcfg.num_target_layers != num_layers:
        raise ValueError(
            f"speculative_draft_model_path: the drafter was made for a {dcfg.num_target_layers}-layer "
            f"target, this one has {num_layers}"
        )
    ids = dcfg.target_layer_ids
    if (
        not ids
        or any(b <= a for a, b in zip(ids, ids[1:]))
        or ids[0] < -1
        or ids[-1] > num_layers - 1
    ):
        raise ValueError(
            f"speculative_draft_model_path: target_layer_ids {list(ids)} must be strictly increasing "
            f"in [-1, {num_layers - 1}]"
        )


def drafter_group(config: EngineConfig, runner: ModelRunner) -> RankGroup:
    """The group the drafter is split over: the target's, or rank 0 alone
    (``EngineConfig.draft_tp_size``)."""
    return runner.group if config.draft_tp_size > 1 else SINGLE


def load_draft_model(
    path: str, ckpt: DrafterCheckpoint, runner: ModelRunner, use_heads: bool, group: RankGroup
) -> DSparkDraftModel:
    dcfg = ckpt.config
    with torch.device("meta"):
        model = DSparkDraftModel(
            dcfg,
            use_markov=use_heads,
            use_confidence=use_heads,
            context_length=runner.context_length,
            group=group,
        )
    model = materialize(model, runner.dtype, runner.device)
    target = runner.model
    skip: set[str] = set()
    if group.size < runner.group.size:
        # The target's are split over the ranks; the drafter runs on rank 0
        # alone, with whole copies of them read from the target checkpoint.
        targets = checkpoint_targets(model)
        dests = {
            "embed_tokens.weight": ("embed", targets["embed_tokens.weight"]),
            "lm_head.weight": ("head", targets["lm_head.weight"]),
        }
        skip |= load_target_vocab(runner, dests, "model.embed_tokens.weight", "lm_head.weight")
    # The drafter's embedding and lm_head are copies of the target's: share
    # them (under tensor parallelism, this rank's slices of them).
    elif model.embed_tokens.weight.shape == target.model.embed_tokens.weight.shape:
        model.embed_tokens = target.model.embed_tokens
        skip.add("embed_tokens.weight")
    if group is runner.group and model.lm_head.weight.shape == target.lm_head.weight.shape:
        model.lm_head = target.lm_head
        skip.add("lm_head.weight")
    what = f"{dcfg.num_hidden_layers}-layer DSpark drafter ({ckpt.format} format)"
    load_state(model, checkpoint_files(path), what, skip, rename=ckpt.checkpoint_key)
    model.post_load()
    return model.requires_grad_(False).eval()


def draft_heads(dcfg: DSparkConfig, group: RankGroup) -> HeadSplit:
    """The drafter's attention heads on this rank of ``group`` (all at one rank)."""
    return HeadSplit.of(dcfg.num_attention_heads, dcfg.num_key_value_heads, group)


def draft_kv_pool(config: EngineConfig, runner: ModelRunner, loaded: LoadedDrafter) -> KVPool:
    """The drafter's KV pool on ``runner``'s rank: the target's pages plus
    every running request's block (``scratch_pages``; a windowed drafter's
    windows too), and one page past its allocator's, where a captured
    block's padding writes. ``pool_pages`` is the allocator's share."""
    dcfg = loaded.config
    pages = pool_pages(config, runner, loaded)
    if isinstance(dcfg, DSparkV4Config):
        layers, kv_heads, head_dim = dcfg.num_stages, 1, runner.model_config.head_dim
    else:
        layers, head_dim = dcfg.num_hidden_layers, dcfg.head_dim
        kv_heads = draft_heads(dcfg, drafter_group(config, runner)).kv_count
    return KVPool(
        layers, pages + 1, runner.page_size, kv_heads, head_dim, runner.dtype, runner.device
    )


def pool_pages(config: EngineConfig, runner: ModelRunner, loaded: LoadedDrafter) -> int:
    """The pages the drafter's KV allocator hands out (see ``draft_kv_pool``)."""
    pages = runner.num_pages + scratch_pages(config, loaded.block_size + loaded.model.lead)
    if isinstance(loaded.config, DSparkV4Config):
        # Every running request's window, beside the target's window pages.
        pages += scratch_pages(config, loaded.model.window)
    return pages


def load_target_vocab(
    runner: ModelRunner, dests: dict[str, tuple[str, torch.Tensor]], embed: str, head: str
) -> set[str]:
    """Fills ``dests`` (the drafter's tensors by name: each the "embed" or
    the "head" kind; those of the target's shape are filled) with the
    target's whole embedding and head, which are split over the ranks (the
    target's names ``embed`` and ``head``); returns the names so filled.
    The drafter runs on rank 0 alone."""
    tcfg = runner.model_config
    source = {"embed": embed, "head": embed if tcfg.tie_word_embeddings else head}
    wanted = {
        name: source[kind]
        for name, (kind, d) in dests.items()
        if d.shape == (tcfg.vocab_size, tcfg.hidden_size)
    }
    files = checkpoint_files(runner.config.model_path)
    whole = read_whole(runner.model, files, set(wanted.values()))
    for name, src in wanted.items():
        dests[name][1].copy_(whole[src])
    return set(wanted)


def load_v4_drafter(config: EngineConfig, runner: ModelRunner) -> LoadedDrafter:
    """DeepSeek-V4's drafter: ``mtp.*`` of the draft path (the target
    checkpoint itself when it bundles one), sharing the target's embedding
    and head."""
    spec = config.spec
    path = spec.draft_model_path
    tcfg = runner.model_config
    dcfg = DSparkV4Config.from_path(path, tcfg)
    block = drafted_block(config, dcfg.block_size)
    use_heads = spec.algorithm != "DFLASH"
    group = drafter_group(config, runner)
    with torch.device("meta"):
        model = DSparkV4DraftModel(
            tcfg, dcfg, use_heads, runner.context_length, group,
            expert_parallel=group.size > 1 and config.parallel.ep_size > 1,
        )  # fmt: skip
    model = keep_fp32_(materialize(model, runner.dtype, runner.device))
    if group.size < runner.group.size:  # whole copies on rank 0 (the drafter's own modules)
        dests = {
            "embed": ("embed", model.embed.weight.data),
            "head": ("head", model.head.weight.data),
        }
        load_target_vocab(runner, dests, "embed.weight", "head.weight")
        model.head.post_load()
    else:  # the target's (under tensor parallelism, this rank's slices of them)
        model.embed, model.head = runner.model.embed, runner.model.head
    what = f"{dcfg.num_stages}-stage DeepSeek-V4 DSpark drafter"
    load_state(model, checkpoint_files(path), what, fp8_block=tcfg.fp8_block)
    pack_weights(model.stages)
    model = model.requires_grad_(False).eval()
    if spec.token_map:
        model.restrict_vocab(load_token_map(spec.token_map, tcfg.vocab_size, runner.device))
    page = KVPool.bytes_per_page(dcfg.num_stages, runner.page_size, 1, tcfg.head_dim, runner.dtype)
    r = config.scheduler.max_running_requests
    window = r * model.window * dcfg.num_stages * tcfg.head_dim * runner.dtype.itemsize
    logits = r * block * tcfg.vocab_size * 4 * 4
    scratch = (scratch_pages(config, block) + scratch_pages(config, model.window)) * page
    return LoadedDrafter(model, dcfg, block, page, int(1.25 * (logits + window)) + scratch)


def load_token_map(path: str, vocab_size: int, device: torch.device) -> torch.Tensor:
    """The hot vocabulary of ``--speculative-token-map``: token ids ``[H]``,
    ascending, from a ``.pt`` file (a tensor or list, as SGLang reads it) or
    a ``.json`` list."""
    name = "speculative_token_map"
    try:
        if path.endswith(".json"):
            with open(path) as f:
                raw = json.load(f)
        else:
            raw = torch.load(path, map_location="cpu", weights_only=True)
        ids = torch.as_tensor(raw)
    except (OSError, ValueError, RuntimeError, TypeError, pickle.UnpicklingError) as e:
        raise ValueError(f"{name}: cannot read {path!r} as a list of token ids ({e})") from None
    if ids.dim() != 1 or ids.numel() == 0 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"{name}: {path!r} must hold a non-empty 1-D list of token ids")
    ids = ids.long()
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(
            f"{name}: token ids must be in [0, {vocab_size}), got {int(ids.min())}..{int(ids.max())}"
        )
    ids = ids.unique()  # sorted: ties between hot tokens go to the lower id, as over the vocabulary
    return ids.to(device)


def scratch_pages(config: EngineConfig, block: int) -> int:
    """Draft pages beyond the target's: a block is written past its request's
    context, up to ``block`` positions further than the target has reserved."""
    ps = config.cache.page_size
    return config.scheduler.max_running_requests * -(-block // ps)


def _activation_bytes(
    config: EngineConfig, dcfg: DSparkConfig, block: int, runner: ModelRunner, page_bytes: int
) -> int:
    """An upper estimate of a drafting step: every running request's block
    logits (float32, with the probabilities and the Markov-corrected copies),
    the draft pool's scratch pages, and with the torch attention backend its
    context K/V gathered for one draft layer at full context."""
    r = config.scheduler.max_running_requests
    elem = runner.dtype.itemsize
    logits = r * block * dcfg.vocab_size * 4 * 4
    scratch = scratch_pages(config, block) * page_bytes
    context = 0
    if config.attention_backend == "torch_native":
        context = 2 * r * runner.context_length * dcfg.num_key_value_heads * dcfg.head_dim * elem
    return int(1.25 * (logits + context)) + scratch
