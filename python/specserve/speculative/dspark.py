"""The DSpark / DFlash proposer: draft context in paged K/V, one block per round.

Per request it keeps the draft context of every committed position before
the anchor: captured target features arrive after each prefill chunk and
each verify round (only committed rows), are turned into context K/V on the
next draft, and live in pages of a draft KV pool that are freed with the
request (finish, abort or preemption; a recomputed request rebuilds its
context from freshly captured features, never from stale slots).

The block reads that pool through the target's attention backends (the
paged Triton kernel on CUDA), as a non-causal batch: each layer writes the
block's own K/V into the slots past the context (scratch, overwritten by
real context K/V once those positions are committed) and attends to the
context and the whole block in one call.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specserve.cache.block_pool import BlockPool, page_slots
from specserve.cache.kv_pool import KVPool
from specserve.config import EngineConfig
from specserve.core import Req
from specserve.host import HostStaging, upload
from specserve.layers.attention import AttentionMetadata, make_attention_backend
from specserve.models.loader import checkpoint_files, load_state, materialize
from specserve.runner.model_runner import ModelRunner
from specserve.speculative.base import DraftProposal, Proposer
from specserve.speculative.confidence import SpsTable, budget_lengths, profile_sps, static_lengths
from specserve.speculative.dspark_model import Attend, DSparkConfig, DSparkDraftModel

logger = logging.getLogger(__name__)

# Cached positions before each chain when profiling verify rounds.
PROFILE_PREFIX = 256


@dataclass
class LoadedDrafter:
    model: DSparkDraftModel
    config: DSparkConfig
    block_size: int
    kv_bytes_per_page: int  # a page of its KV pool (the target's page size)
    activation_bytes: int  # its share of the largest step (see ModelRunner.allocate_kv)


@dataclass
class DSparkState:
    pages: list[int] = field(default_factory=list)
    ctx_len: int = 0  # positions whose context K/V are cached
    pending: list[torch.Tensor] = field(default_factory=list)  # features of ctx_len..
    pending_len: int = 0


class DSparkProposer(Proposer):
    def __init__(
        self,
        model: DSparkDraftModel,
        block_size: int,
        kv_pool: KVPool,
        block_pool: BlockPool,
        threshold: float = 0.0,
        sps: SpsTable | None = None,
        seed: int = 0,
        attention_backend: str | None = None,
    ) -> None:
        self.model = model
        self.max_drafts = block_size
        self.capture_layer_ids = model.config.target_layer_ids
        self.kv_pool = kv_pool
        self.block_pool = block_pool
        device = model.fc.weight.device
        heads = model.config.num_attention_heads
        self.attn_backend = make_attention_backend(attention_backend, kv_pool, heads, device)
        self.threshold = threshold
        self.sps = sps  # budget mode when set
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed + 1)
        self.staging = HostStaging(device)

    # ---- construction ----------------------------------------------------------

    @classmethod
    def load(cls, config: EngineConfig, runner: ModelRunner) -> LoadedDrafter:
        """The drafter's weights, checked against the target, before the KV
        pools are sized (they count in the memory budget like the target's)."""
        spec = config.spec
        assert spec.draft_model_path is not None
        dcfg = DSparkConfig.from_path(spec.draft_model_path)
        tcfg = runner.model_config
        _check_compatible(dcfg, tcfg.hidden_size, tcfg.vocab_size, tcfg.num_hidden_layers)
        block = dspark_block_size(spec.block_size, spec.num_draft_tokens, dcfg.block_size)
        if block > dcfg.block_size:
            raise ValueError(
                f"speculative_dspark_block_size: {block} exceeds the drafter's block size {dcfg.block_size}"
            )
        if block < dcfg.block_size:
            logger.warning(
                "drafting blocks of %d with a drafter trained on blocks of %d: the block attends "
                "to itself without a causal mask, so its drafts differ from a full block's",
                block, dcfg.block_size,
            )  # fmt: skip
        dflash = spec.algorithm == "DFLASH"
        model = load_draft_model(spec.draft_model_path, dcfg, runner, use_heads=not dflash)
        page = KVPool.bytes_per_page(
            dcfg.num_hidden_layers, runner.page_size, dcfg.num_key_value_heads, dcfg.head_dim,
            runner.dtype,
        )  # fmt: skip
        return LoadedDrafter(
            model, dcfg, block, page, _activation_bytes(config, dcfg, block, runner, page)
        )

    @classmethod
    def from_config(
        cls, config: EngineConfig, runner: ModelRunner, loaded: LoadedDrafter | None = None
    ) -> DSparkProposer:
        """The proposer over ``runner``'s allocated pool size; ``loaded``: the
        drafter ``load`` returned (loaded now if not given)."""
        spec = config.spec
        loaded = loaded or cls.load(config, runner)
        model, dcfg, block = loaded.model, loaded.config, loaded.block_size
        pages = runner.num_pages + scratch_pages(config, block)
        kv = KVPool(
            dcfg.num_hidden_layers, pages, runner.page_size,
            dcfg.num_key_value_heads, dcfg.head_dim, runner.dtype, runner.device,
        )  # fmt: skip
        blocks = BlockPool(pages, runner.page_size)
        sps = None
        if spec.schedule == "budget" and not model.use_confidence:
            logger.warning("budget scheduling needs a confidence head; verifying whole blocks")
        elif spec.schedule == "budget":
            path = spec.sps_table_path
            if path and os.path.exists(path):
                sps = SpsTable.load(path)
            else:
                sps = profile_runner(runner, block, config.scheduler.max_running_requests)
                if path:  # profiled once, reused by later starts
                    sps.save(path)
        return cls(
            model, block, kv, blocks, spec.confidence_threshold, sps, config.random_seed,
            config.attention_backend,
        )  # fmt: skip

    # ---- state -------------------------------------------------------------------

    def on_target_features(self, req: Req, start: int, features: torch.Tensor) -> None:
        st = req.draft_state
        if st is None:
            st = req.draft_state = DSparkState()
        assert start == st.ctx_len + st.pending_len, "context features must arrive in order"
        st.pending.append(features)
        st.pending_len += features.shape[0]

    def release(self, req: Req) -> None:
        st = req.draft_state
        if st is not None:
            self.block_pool.release(st.pages)
        req.draft_state = None

    def _flush(self, reqs: Sequence[Req]) -> None:
        """Turns pending features into cached context K/V, for all requests at once."""
        todo = [r for r in reqs if r.draft_state is not None and r.draft_state.pending]
        if not todo:
            return
        ps = self.block_pool.page_size
        feats, positions, slots = [], [], []
        for r in todo:
            st = r.draft_state
            end = st.ctx_len + st.pending_len
            self._cover(st, end)
            feats.extend(st.pending)
            positions.extend(range(st.ctx_len, end))
            slots.extend(page_slots(st.pages, st.ctx_len, end, ps))
        device = self.model.fc.weight.device
        features = torch.cat(feats).to(self.model.fc.weight.dtype)
        pos_t = torch.tensor(positions, device=device)
        slot_t = torch.tensor(slots, device=device)
        for layer, (k, v) in enumerate(self.model.context_kv(features, pos_t)):
            self.kv_pool.store(layer, slot_t, k, v)
        # Only now, so that a step that fails above reruns this flush whole.
        for r in todo:
            st = r.draft_state
            st.ctx_len, st.pending, st.pending_len = st.ctx_len + st.pending_len, [], 0

    def _cover(self, st: DSparkState, length: int) -> None:
        """Pages for ``st``'s positions ``[0, length)``."""
        need = self.block_pool.pages_for(length) - len(st.pages)
        if need > 0:
            pages = self.block_pool.allocate(need)
            # Never fails: a request's draft context is shorter than its target
            # KV, and the draft pool has the target's pages plus every running
            # request's block (see scratch_pages).
            assert pages is not None, "draft KV pool exhausted"
            st.pages.extend(pages)

    def _block_metadata(self, reqs: Sequence[Req]) -> AttentionMetadata:
        """The blocks as one non-causal paged batch: request ``i``'s block sits at
        positions ``ctx_len .. ctx_len + gamma - 1`` of its draft pages."""
        g, ps = self.max_drafts, self.block_pool.page_size
        positions, slots, kv_lens = [], [], []
        for r in reqs:
            st = r.draft_state
            end = st.ctx_len + g
            self._cover(st, end)
            positions.extend(range(st.ctx_len, end))
            slots.extend(page_slots(st.pages, st.ctx_len, end, ps))
            kv_lens.append(end)
        device = self.model.fc.weight.device
        return AttentionMetadata(
            positions=upload(positions, device),
            slot_mapping=upload(slots, device),
            q_lens=[g] * len(reqs),
            kv_lens=kv_lens,
            page_tables=[r.draft_state.pages for r in reqs],
            page_size=ps,
            causal=False,
        )

    def _paged_attend(self, meta: AttentionMetadata) -> Attend:
        backend = self.attn_backend
        backend.prepare(meta)

        def attend(layer: int, q: torch.Tensor, bk: torch.Tensor, bv: torch.Tensor) -> torch.Tensor:
            rows = q.shape[0] * q.shape[1]
            o = backend.forward(
                layer, q.reshape(rows, *q.shape[2:]), bk.reshape(rows, *bk.shape[2:]),
                bv.reshape(rows, *bv.shape[2:]), meta,
            )  # fmt: skip
            return o.view(q.shape)

        return attend

    # ---- proposing ---------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, reqs: Sequence[Req], max_lens: Sequence[int]) -> DraftProposal:
        self._flush(reqs)
        for r in reqs:
            assert r.draft_state is not None and r.draft_state.ctx_len == r.seq_len - 1, (
                "the draft context must cover every position before the anchor"
            )
        device = self.model.fc.weight.device
        attend = self._paged_attend(self._block_metadata(reqs))
        anchors = torch.tensor([r.output_ids[-1] for r in reqs], device=device)
        starts = torch.tensor([r.seq_len - 1 for r in reqs], device=device)
        hidden = self.model.block_hidden(anchors, starts, attend, self.max_drafts)
        temps = torch.tensor(
            [r.sampling.temperature if not r.sampling.greedy else 0.0 for r in reqs], device=device
        )
        # Confidences only matter when they choose verify lengths.
        needed = self.sps is not None or self.threshold > 0
        tokens, probs, conf = self.model.draft(
            hidden,
            anchors,
            temps,
            [r.generator for r in reqs],
            self.generator,
            needed,
            greedy_rows=[r.sampling.greedy for r in reqs],
        )
        token_lists, conf_lists = self.staging.fetch([tokens, conf])  # the step's first copy
        out_tokens, out_q, out_conf = [], [], []
        for i, (r, limit) in enumerate(zip(reqs, max_lens)):
            out_tokens.append(token_lists[i][:limit])
            out_q.append(None if r.sampling.greedy or probs is None else probs[i, :limit])
            if conf_lists is not None:
                out_conf.append(conf_lists[i][:limit])
        return DraftProposal(out_tokens, out_q, out_conf if conf_lists is not None else None)

    def verify_lengths(self, proposal: DraftProposal) -> list[int]:
        if proposal.confidence is None:
            return [len(t) for t in proposal.tokens]
        if self.sps is not None:
            return budget_lengths(proposal.confidence, self.sps)
        return static_lengths(proposal.confidence, self.threshold)


def dspark_block_size(block_flag: int | None, chain_flag: int | None, trained: int) -> int:
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


def _check_compatible(dcfg: DSparkConfig, hidden: int, vocab: int, num_layers: int) -> None:
    if dcfg.hidden_size != hidden or dcfg.vocab_size != vocab:
        raise ValueError(
            f"speculative_draft_model_path: the drafter (hidden {dcfg.hidden_size}, vocab "
            f"{dcfg.vocab_size}) does not fit the target (hidden {hidden}, vocab {vocab})"
        )
    if dcfg.num_target_layers != num_layers:
        raise ValueError(
            f"speculative_draft_model_path: the drafter was made for a {dcfg.num_target_layers}-layer "
            f"target, this one has {num_layers}"
        )
    ids = dcfg.target_layer_ids
    if (
        not ids
        or any(b <= a for a, b in zip(ids, ids[1:]))
        or ids[0] < -1
        or ids[-1] > num_layers - 2
    ):
        raise ValueError(
            f"speculative_draft_model_path: target_layer_ids {list(ids)} must be strictly increasing "
            f"in [-1, {num_layers - 2}] (the last layer's output is normed and cannot be used)"
        )


def load_draft_model(
    path: str, dcfg: DSparkConfig, runner: ModelRunner, use_heads: bool = True
) -> DSparkDraftModel:
    with torch.device("meta"):
        model = DSparkDraftModel(
            dcfg,
            use_markov=use_heads,
            use_confidence=use_heads,
            context_length=runner.context_length,
        )
    model = materialize(model, runner.dtype, runner.device)
    target = runner.model
    skip: set[str] = set()
    # The drafter's embedding and lm_head are copies of the target's: share them.
    if model.embed_tokens.weight.shape == target.model.embed_tokens.weight.shape:
        model.embed_tokens = target.model.embed_tokens
        skip.add("embed_tokens.weight")
    if model.lm_head.weight.shape == target.lm_head.weight.shape:
        model.lm_head = target.lm_head
        skip.add("lm_head.weight")
    load_state(
        model, checkpoint_files(path), f"{dcfg.num_hidden_layers}-layer DSpark drafter", skip
    )
    model.post_load()
    return model.requires_grad_(False).eval()


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


def profile_runner(runner: ModelRunner, block: int, max_running: int) -> SpsTable:
    """Steps/s of verify forwards of B tokens (chains of block + 1 over a cached
    prefix, the attention path real rounds take), measured now."""
    chain = block + 1
    prefix = max(0, min(PROFILE_PREFIX, runner.context_length - chain))
    counts = [n for n in (1, 2, 4, 8, 16, 32, 64) if n <= max_running]
    sizes = sorted({n * chain for n in counts} | {1})
    table = profile_sps(lambda tokens: runner.verify_forward(tokens, chain, prefix), sizes)
    logger.info(
        "verify steps/s by batch tokens: %s", json.dumps({b: round(table(b), 1) for b in sizes})
    )
    return table
