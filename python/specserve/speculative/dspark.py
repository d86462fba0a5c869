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
context and the whole block in one call. A windowed drafter (DeepSeek-V4's,
``window`` set) reads only the last ``window`` context positions, gathered
for its own sink attention, and its pages behind the window are freed as
the context grows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from specserve.cache.block_pool import BlockPool, page_slots, release_behind
from specserve.cache.kv_pool import KVPool
from specserve.config import EngineConfig
from specserve.core import Req
from specserve.distributed import DistributedError
from specserve.host import HostStaging, upload
from specserve.layers.attention import (
    TritonAttentionBackend,
    make_attention_backend,
)
from specserve.runner.model_runner import ModelRunner
from specserve.sampling.params import SamplingParams
from specserve.speculative.base import DraftProposal, Proposer
from specserve.speculative.block_drafter import BlockDrafter
from specserve.speculative.block_graphs import (
    BlockInputs,
    DraftBlockGraphs,
    eager_block,
    window_attend,
)
from specserve.speculative.draft_choice import static_lengths
from specserve.speculative.draft_shard import (
    DraftPlan,
    DraftShard,
    Drawing,
    attach_draft_shard,
    window_first_page,
)
from specserve.speculative.drafter_loader import (
    LoadedDrafter,
    draft_kv_pool,
    load_drafter,
    pool_pages,
)
from specserve.speculative.dspark_model import Attend

logger = logging.getLogger(__name__)

# The made-up requests a round is profiled on (``profile_round``).
PROFILE_SAMPLING = SamplingParams(temperature=0.0)


# The bytes of other requests' features that one request's pending rows may
# keep alive (as the rest of the step tensors they are rows of) before its
# own rows are copied out: a request held plain beside 63 others would keep
# 64 rows for each of its own. Requests that draft again within a few
# hundred steps never pay the copy.
SHARED_BYTES = 64 << 20


@dataclass
class DSparkState:
    pages: list[int] = field(default_factory=list)
    ctx_len: int = 0  # positions whose context K/V are cached
    # Features of ctx_len..: rows ``[first, first + count)`` of a step's
    # captured tensor each, sliced only when the drafter takes them (most
    # steps at a high load hand rows on that no round reads for a while).
    pending: list[tuple[torch.Tensor, int, int]] = field(default_factory=list)
    pending_len: int = 0
    copied: int = 0  # the entries of ``pending`` up to its last copy-out
    shared_rows: int = 0  # the rows of the later ones' tensors that are not its own

    def pending_features(self) -> list[torch.Tensor]:
        """The pending rows, in order (``[count, m * d]`` each)."""
        return [t[a : a + n] for t, a, n in self.pending]

    def copy_out(self) -> None:
        """The rows of the entries since the last copy-out as one tensor of
        their own, so that the step tensors they came from can go."""
        tail = self.pending[self.copied :]
        rows = torch.cat([t[a : a + n] for t, a, n in tail])
        self.pending[self.copied :] = [(rows, 0, rows.shape[0])]
        self.copied, self.shared_rows = len(self.pending), 0


class DSparkProposer(Proposer):
    def __init__(
        self,
        model: BlockDrafter,
        block_size: int,
        kv_pool: KVPool,
        block_pool: BlockPool,
        threshold: float = 0.0,
        want_confidence: bool = False,
        seed: int = 0,
        attention_backend: str | None = None,
        shard: DraftShard | None = None,
    ) -> None:
        """``shard``: the drafter runs in a tensor-parallel group (rank 0's
        part of it; its target forwards store the draft context)."""
        self.model = model
        self.max_drafts = block_size
        # The block's positions: its drafts' slots, after the lead slots
        # (slot 0 the anchor's bonus token in the 1 + N layout).
        self.block_len = block_size + model.lead
        self.capture_layer_ids = model.config.target_layer_ids
        # SHARED_BYTES in rows, once the first features show their width.
        self.max_shared_rows: int | None = None
        self.kv_pool = kv_pool
        self.block_pool = block_pool
        device = model.feature_weight.device
        self.shard = shard
        self.attn_backend = shard.backend if shard is not None else None
        if model.window is None and shard is None:  # a windowed drafter attends on its own
            heads = model.config.num_attention_heads
            self.attn_backend = make_attention_backend(
                attention_backend, kv_pool, heads, device, model.attention_layers
            )
        if shard is not None:
            self.context_pages = self._context_pages
        self.threshold = threshold
        # Confidences only matter when they choose verify lengths (the
        # threshold, or the engine's cost model).
        self.want_confidence = model.use_confidence and (want_confidence or threshold > 0)
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed + 1)
        self.staging = HostStaging(device)
        self.graphs: DraftBlockGraphs | None = None  # set by capture_graphs

    # ---- construction ----------------------------------------------------------

    @classmethod
    def from_config(
        cls, config: EngineConfig, runner: ModelRunner, loaded: LoadedDrafter | None = None
    ) -> DSparkProposer:
        """The proposer over ``runner``'s allocated pool size; ``loaded``: what
        ``load_drafter`` returned (loaded now if not given)."""
        spec = config.spec
        loaded = loaded or load_drafter(config, runner)
        model, block = loaded.model, loaded.block_size
        kv = draft_kv_pool(config, runner, loaded)
        blocks = BlockPool(pool_pages(config, runner, loaded), runner.page_size)
        if spec.schedule == "budget" and not spec.adaptive and not model.use_confidence:
            logger.warning("budget scheduling needs a confidence head; verifying whole blocks")
        shard = None
        if config.draft_tp_size > 1:
            shard = attach_draft_shard(config, runner, loaded, kv)
        proposer = cls(
            model, block, kv, blocks, spec.confidence_threshold,
            spec.adaptive or spec.schedule == "budget", config.random_seed,
            config.attention_backend, shard,
        )  # fmt: skip
        return proposer

    def capture_graphs(self, runner: ModelRunner) -> None:
        """Captures the block forward with the target's capture and buckets
        (with the Triton attention backend, not for a windowed drafter; the
        draft pool must hold a page past its allocator's)."""
        target = runner.graphs
        assert target is not None, "the target's forwards are captured first"
        scratch = self.block_pool.total_pages() * self.block_pool.page_size
        if (
            self.model.window is None
            and isinstance(self.attn_backend, TritonAttentionBackend)
            and self.kv_pool.k[0].shape[0] > scratch
        ):
            self.graphs = DraftBlockGraphs(
                self.model, self.attn_backend, self.kv_pool, self.block_len,
                runner.context_length, scratch, target.buckets, target.capture,
            )  # fmt: skip

    # ---- state -------------------------------------------------------------------

    def _context_pages(self, req: Req, start: int, end: int) -> list[int]:
        """The draft pages of ``req``'s positions ``[0, end)`` (covered now),
        where every rank's target forward stores the context K/V of those
        from ``start``. A windowed drafter's pages behind the window of
        every later block go back to the pool."""
        st = req.draft_state
        if st is None:
            st = req.draft_state = DSparkState()
        if self.model.window is not None:
            release_behind(st.pages, start - self.model.window, self.block_pool)
        self._cover(st, end)
        return st.pages

    def on_target_features(
        self, req: Req, start: int, captured: torch.Tensor, first: int = 0, count: int | None = None
    ) -> None:
        if self.shard is not None:
            return  # their K/V are in the pool already (``_context_pages``)
        st = req.draft_state
        if st is None:
            st = req.draft_state = DSparkState()
        assert start == st.ctx_len + st.pending_len, "context features must arrive in order"
        count = captured.shape[0] - first if count is None else count
        st.pending.append((captured, first, count))
        st.pending_len += count
        others = captured.shape[0] - count
        if others:
            st.shared_rows += others
            limit = self.max_shared_rows
            if limit is None:
                row = captured.shape[1] * captured.element_size()
                limit = self.max_shared_rows = SHARED_BYTES // row
            if st.shared_rows > limit:
                st.copy_out()

    def release(self, req: Req) -> None:
        st = req.draft_state
        if st is not None:
            self.block_pool.release([p for p in st.pages if p >= 0])
        req.draft_state = None

    @property
    def pools(self) -> list[BlockPool]:
        return [self.block_pool]

    def profile_round(self, n: int, prefix: int, pending: int = 2) -> Callable[[], None] | None:
        if self.shard is not None:  # a split drafter's rounds are plans every rank joins
            return None
        # As long a context as the free draft pages hold for n blocks.
        ps, g = self.block_pool.page_size, self.block_len
        prefix = min(prefix, self.block_pool.free_pages() // n * ps - g)
        rows = min(pending, prefix)
        if rows < 1:
            return None
        d = self.model.feature_weight.shape[1]

        def round_() -> None:
            reqs = []
            for i in range(n):
                req = Req(f"profile-{i}", [0] * prefix, PROFILE_SAMPLING)
                req.output_ids = [0]
                feats = self.model.feature_weight.new_zeros(rows, d)
                # The context K/V before the pending rows are whatever the
                # pages hold: only the time counts.
                req.draft_state = DSparkState([], prefix - rows, [(feats, 0, rows)], rows)
                reqs.append(req)
            try:
                self.propose(reqs, [self.max_drafts] * n)
            finally:
                for req in reqs:
                    self.release(req)

        return round_

    def pending_rows(self, req: Req) -> int:
        st = req.draft_state
        # (A split drafter's context is stored by the target's forwards.)
        return 0 if st is None or self.shard is not None else st.pending_len

    def _pending(
        self, reqs: Sequence[Req]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The pending features of ``reqs`` ``[n, m * d]``, their positions and
        draft slots ``[n]`` (their pages covered); None when there are none."""
        todo = [r for r in reqs if r.draft_state is not None and r.draft_state.pending]
        if not todo:
            return None
        ps = self.block_pool.page_size
        feats, positions, slots = [], [], []
        for r in todo:
            st = r.draft_state
            end = st.ctx_len + st.pending_len
            self._cover(st, end)
            feats.extend(st.pending_features())
            positions.extend(range(st.ctx_len, end))
            slots.extend(page_slots(st.pages, st.ctx_len, end, ps))
        device = self.model.feature_weight.device
        features = torch.cat(feats).to(self.model.feature_weight.dtype)
        return features, upload(positions, device), upload(slots, device)

    def _flush(self, reqs: Sequence[Req]) -> None:
        """Turns pending features into cached context K/V on their own (a
        prompt's, and the windowed drafter's, which gathers its context
        before the block runs)."""
        pending = self._pending(reqs)
        if pending is not None:
            features, positions, slots = pending
            for layer, (k, v) in enumerate(self.model.context_kv(features, positions)):
                self.kv_pool.store(layer, slots, k, v)
        self._settle(reqs)

    def _settle(self, reqs: Sequence[Req]) -> None:
        """The pending features' K/V are in the pool: they are context now.
        Only once the forward that stored them is done, so that a step that
        fails reruns it whole."""
        for r in reqs:
            st = r.draft_state
            if st is not None and st.pending:
                st.ctx_len, st.pending, st.pending_len = st.ctx_len + st.pending_len, [], 0
                st.copied, st.shared_rows = 0, 0
                self._slide(st)

    def _slide(self, st: DSparkState) -> None:
        """A windowed drafter reads only the last ``window`` context positions."""
        if self.model.window is not None:
            release_behind(st.pages, st.ctx_len - self.model.window, self.block_pool)

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

    def _block_inputs(self, reqs: Sequence[Req]) -> BlockInputs:
        """Each request's pending features (the context rows the block forward
        stores on its way) and its block at the positions after them, ``p ..
        p + gamma - 1`` of its draft pages (covered here)."""
        g, ps = self.block_len, self.block_pool.page_size
        feats: list[torch.Tensor] = []
        x = BlockInputs(torch.empty(0), [], [], [], [], [], [], [])
        for r in reqs:
            st = r.draft_state
            assert st is not None and st.ctx_len + st.pending_len == r.seq_len - 1, (
                "the draft context must cover every position before the anchor"
            )
            p = st.ctx_len + st.pending_len
            self._cover(st, p + g)
            feats.extend(st.pending_features())
            x.context_rows.append(st.pending_len)
            x.context_positions.extend(range(st.ctx_len, p))
            x.context_slots.extend(page_slots(st.pages, st.ctx_len, p, ps))
            x.anchors.append(r.output_ids[-1])
            x.starts.append(p)
            x.block_slots.append(page_slots(st.pages, p, p + g, ps))
            x.page_tables.append(st.pages)
        w = self.model.feature_weight
        x.features = torch.cat(feats).to(w.dtype) if feats else w.new_zeros(0, w.shape[1])
        return x

    def _window_attend(self, reqs: Sequence[Req]) -> Attend:
        """Each block over the last ``window`` context positions before its
        anchor, gathered from the draft pool."""
        ctx_lens = [r.draft_state.ctx_len for r in reqs]
        tables = [r.draft_state.pages for r in reqs]
        return window_attend(self.model, self.kv_pool, tables, ctx_lens, self.block_pool.page_size)

    # ---- proposing ---------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, reqs: Sequence[Req], max_lens: Sequence[int]) -> DraftProposal:
        device = self.model.feature_weight.device
        if self.shard is not None:
            return self._propose_on_shards(reqs, max_lens)
        if self.model.window is not None:
            self._flush(reqs)
            anchors = torch.tensor([r.output_ids[-1] for r in reqs], device=device)
            starts = torch.tensor([r.seq_len - 1 for r in reqs], device=device)
            for r in reqs:
                st = r.draft_state
                assert st is not None and st.ctx_len == r.seq_len - 1, (
                    "the draft context must cover every position before the anchor"
                )
            attend = self._window_attend(reqs)
            hidden = self.model.block_hidden(anchors, starts, attend, self.block_len)
        else:
            # A round's commits (a few rows per request) ride the block's
            # forward; a prompt's features (whole prefills) take the K/V-only
            # pass first, which does not compute queries for them.
            if any(_pending_len(r) > self.max_drafts + 1 for r in reqs):
                self._flush(reqs)
            x = self._block_inputs(reqs)
            anchors = upload(x.anchors, device)
            if self.graphs is not None and self.graphs.takes(len(reqs), x.context_rows):
                hidden = self.graphs.run(x)
            else:
                hidden = eager_block(
                    self.model, self.attn_backend, self.kv_pool, x, anchors, self.block_len,
                    self.block_pool.page_size,
                )  # fmt: skip
        self._settle(reqs)
        hidden = hidden[:, self.model.lead :]  # the drafts' slots
        temps = torch.tensor(
            [r.sampling.temperature if not r.sampling.greedy else 0.0 for r in reqs], device=device
        )
        tokens, probs, conf = self.model.draft(
            hidden,
            anchors,
            temps,
            [r.generator for r in reqs],
            self.generator,
            self.want_confidence,
            greedy_rows=[r.sampling.greedy for r in reqs],
        )
        return self._proposal(reqs, max_lens, tokens, probs, conf)

    def _propose_on_shards(self, reqs: Sequence[Req], max_lens: Sequence[int]) -> DraftProposal:
        """The blocks run by every rank of the group (``DraftShard``): the
        draft context is in the pool, stored by the target's forwards."""
        assert self.shard is not None
        g, w, ps = self.block_len, self.model.window, self.block_pool.page_size
        tables = []
        for r in reqs:
            st = r.draft_state
            assert st is not None, "the target's forwards cover every draft context"
            st.ctx_len = r.seq_len - 1
            if w is None:  # the block writes its K/V past the context
                self._cover(st, st.ctx_len + g)
                tables.append(st.pages)
            else:  # the block reads its window's pages only
                self._slide(st)
                tables.append(st.pages[window_first_page(st.ctx_len, w, ps) :])
        plan = DraftPlan(
            anchors=[r.output_ids[-1] for r in reqs],
            starts=[r.draft_state.ctx_len for r in reqs],
            greedy=[r.sampling.greedy for r in reqs],
            page_tables=tables,
        )
        temps = [r.sampling.temperature if not r.sampling.greedy else 0.0 for r in reqs]
        drawing = Drawing(
            upload(temps, self.model.feature_weight.device, torch.float32),
            [r.generator for r in reqs],
            self.generator,
        )
        self.shard.plans.send_draft(plan.pack())
        try:
            tokens, probs, conf = self.shard.run(plan, drawing, self.want_confidence)
        except Exception as e:  # the other ranks may be in a collective of it
            raise DistributedError(f"rank 0 failed in a tensor-parallel draft: {e!r}") from e
        return self._proposal(reqs, max_lens, tokens, probs, conf)

    def _proposal(
        self,
        reqs: Sequence[Req],
        max_lens: Sequence[int],
        tokens: torch.Tensor,  # [R, G]
        probs: torch.Tensor | None,  # [R, G, V]
        conf: torch.Tensor | None,  # [R, G]
    ) -> DraftProposal:
        """Each request's drafts up to its limit (one read back)."""
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
        return static_lengths(proposal.confidence, self.threshold)


def _pending_len(req: Req) -> int:
    return 0 if req.draft_state is None else req.draft_state.pending_len
