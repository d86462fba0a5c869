"""A DSpark / DFlash drafter in a tensor-parallel group: every rank runs
its shard, as it does the target's.

Each rank holds the drafter's layers split like the target's (heads, MLP
features), its own heads' part of the draft KV pool, and shares the target's
vocabulary-split embedding and head; the Markov head's ``W2`` is split by
vocabulary with them. Nothing but token ids and a few numbers per row
crosses the ranks:

- **Context K/V in the target's forward.** The hidden states are the same
  on every rank, so is every captured feature: each target forward stores
  its fed tokens' draft context K/V at the draft slots its plan carries
  (``BatchEntry.draft_pages``; ``store_context``). A rejected position's
  K/V is stale until the next block writes that position (a block starts at
  the next anchor and reaches past every rejected draft), so nothing reads
  it.
- **The block is a plan of its own** (``DraftPlan``: per row the anchor,
  start, whether greedy, the draft pages): rank 0 sends it, every rank runs
  the block forward over its heads.
- **Each slot's draft**: the logits stay on their shards; the greedy rows'
  tokens are a vocabulary-parallel argmax (one all-reduce of ``[R, 2]``
  int64); a sampled row's logits are gathered on rank 0, which draws (its
  ``q`` is the verifier's, on rank 0) and broadcasts the tokens back, since
  the Markov head's next correction depends on them. Without a Markov head
  (DFlash) every slot is decided at once. Confidences are rank 0's alone
  (the block outputs and ``W1`` are whole there).

Rank 0's ``DSparkProposer`` keeps the bookkeeping (draft pages, context
lengths) and the drafts; the workers keep nothing per request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.cache.block_pool import page_slots
from specserve.cache.kv_pool import KVPool
from specserve.config import EngineConfig
from specserve.distributed import RankGroup
from specserve.distributed.plan import PlanChannel
from specserve.host import upload
from specserve.layers.attention import make_attention_backend
from specserve.layers.parallel import VocabParallelHead, vocab_shard
from specserve.runner.model_runner import ModelRunner
from specserve.sampling.sampler import exponential_race
from specserve.sampling.vocab_parallel import gather_columns, vocab_parallel_argmax
from specserve.speculative.block_drafter import BlockDrafter
from specserve.speculative.block_graphs import BlockInputs, eager_block, window_attend
from specserve.speculative.drafter_loader import LoadedDrafter, draft_heads
from specserve.speculative.dspark_config import DSparkConfig


@dataclass(frozen=True)
class DraftPlan:
    """A round's blocks, as every rank runs them (row ``i`` of ``R``)."""

    anchors: list[int]  # [R]
    starts: list[int]  # [R] each block's first position (its anchor's)
    greedy: list[bool]  # [R] drafted by argmax (else sampled on rank 0)
    page_tables: list[list[int]]  # [R] draft pages covering each block

    def pack(self) -> list[int]:
        out = [len(self.anchors), *self.anchors, *self.starts, *map(int, self.greedy)]
        for table in self.page_tables:
            out += [len(table), *table]
        return out

    @classmethod
    def unpack(cls, values: list[int]) -> DraftPlan:
        r = values[0]
        anchors, starts = values[1 : 1 + r], values[1 + r : 1 + 2 * r]
        greedy = [bool(v) for v in values[1 + 2 * r : 1 + 3 * r]]
        at, tables = 1 + 3 * r, []
        for _ in range(r):
            n = values[at]
            tables.append(values[at + 1 : at + 1 + n])
            at += 1 + n
        assert at == len(values), "a draft plan with trailing values"
        return cls(anchors, starts, greedy, tables)


@dataclass
class Drawing:
    """Rank 0's means of drawing sampled drafts (per row of the plan)."""

    temperatures: torch.Tensor  # [R]
    noise: list[torch.Generator | None]  # [R] each row's own generator, if seeded
    shared: torch.Generator  # the others'


class DraftShard:
    """This rank's part of the drafter: its model shard, draft KV pool and
    attention backend (see the module docstring)."""

    def __init__(
        self,
        model: BlockDrafter,
        block_size: int,
        kv_pool: KVPool,
        page_size: int,
        backend,
        plans: PlanChannel,
    ) -> None:
        self.model = model
        self.block_len = block_size + model.lead  # the block's positions (see DSparkProposer)
        self.kv_pool = kv_pool
        self.page_size = page_size
        self.backend = backend
        self.plans = plans  # rank 0 sends the blocks' plans on it
        self.group = group = plans.group
        self.capture_layer_ids = model.config.target_layer_ids
        self.counts = column_counts(model, group)  # every rank's real logit columns

    # ---- context ---------------------------------------------------------------

    def store_context(
        self,
        features: torch.Tensor,  # [n, m * d] captured target layers of fed tokens
        positions: torch.Tensor,  # [n]
        slots: torch.Tensor,  # [n] their draft KV slots
    ) -> None:
        features = features.to(self.model.feature_weight.dtype)
        for layer, (k, v) in enumerate(self.model.context_kv(features, positions)):
            self.kv_pool.store(layer, slots, k, v)

    # ---- the block ------------------------------------------------------------

    def serve(self, values: list[int]) -> None:
        """A worker: runs the block of rank 0's plan ``values``."""
        self.run(DraftPlan.unpack(values))

    @torch.inference_mode()
    def run(
        self, plan: DraftPlan, drawing: Drawing | None = None, with_confidence: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Every rank: the plan's blocks. Rank 0 (``drawing`` given) gets the
        drafts ``[R, G]``, the distributions its sampled rows were drawn from
        ``[R, G, V]`` (zero rows for greedy ones; None when every row is
        greedy) and the confidences ``[R, G]`` (if asked for and the drafter
        has the head); the others' results mean nothing."""
        g, ps, device = self.block_len, self.page_size, self.model.feature_weight.device
        anchors = upload(plan.anchors, device)
        w = self.model.window
        if w is not None:  # each table holds its window's pages only
            first = [window_first_page(p, w, ps) for p in plan.starts]
            attend = window_attend(
                self.model, self.kv_pool, plan.page_tables, plan.starts, ps, first
            )
            hidden = self.model.block_hidden(anchors, upload(plan.starts, device), attend, g)
        else:  # the block writes its K/V past each context, then attends
            x = BlockInputs(
                features=self.model.feature_weight.new_zeros(0, 0),
                context_rows=[0] * len(plan.anchors),
                context_positions=[],
                context_slots=[],
                anchors=plan.anchors,
                starts=plan.starts,
                block_slots=[
                    page_slots(t, p, p + g, ps) for t, p in zip(plan.page_tables, plan.starts)
                ],
                page_tables=plan.page_tables,
            )
            hidden = eager_block(self.model, self.backend, self.kv_pool, x, anchors, g, ps)
        hidden = hidden[:, self.model.lead :]  # the drafts' slots
        return self._walk(hidden, anchors, plan.greedy, drawing, with_confidence)

    def _walk(
        self,
        hidden: torch.Tensor,  # [R, G, d], the same on every rank
        anchors: torch.Tensor,  # [R]
        greedy: list[bool],
        drawing: Drawing | None,
        with_confidence: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``BlockDrafter.draft`` with the logits on their shards."""
        model, group = self.model, self.group
        markov = model.markov_head if model.use_markov else None
        base = model.base_logits(hidden)  # [R, G, C] float32: this rank's columns
        r, g = base.shape[:2]
        sampled = [i for i, is_greedy in enumerate(greedy) if not is_greedy]
        q = None
        if sampled and group.is_first:
            q = base.new_zeros(r, g, model.vocab_head.full_vocab)
        prev, embeds, tokens = anchors, [], []
        state = markov.init_state(r, hidden) if markov is not None else None
        if markov is None:  # slots independent of each other: all decided at once
            flat = base.reshape(r * g, -1)
            rows = [i * g + k for k in range(g) for i in sampled]  # slot-major, as drawn
            ids = self._decide(flat, rows, drawing, q, broadcast=False)
            tokens = list(ids.view(r, g).unbind(1))
        for k in range(g if markov is not None else 0):
            logits, state, prev_embed = markov.step(prev, hidden[:, k], state, base[:, k])
            embeds.append(prev_embed)
            # The last slot's sampled tokens are rank 0's business alone.
            prev = self._decide(logits, sampled, drawing, q, broadcast=k < g - 1, slot=k)
            tokens.append(prev)
        conf = None
        if with_confidence and group.is_first:
            conf = model._confidence(hidden, embeds)
        return torch.stack(tokens, dim=1), q, conf

    def _decide(
        self,
        logits: torch.Tensor,  # [n, C] this rank's columns of n rows
        sampled: list[int],  # rows drawn on rank 0 (the others: argmax)
        drawing: Drawing | None,
        q: torch.Tensor | None,  # [R, G, V] rank 0's distributions, filled here
        broadcast: bool,
        slot: int | None = None,  # the rows' slot (None: rows are row * G + slot)
    ) -> torch.Tensor:
        """The rows' draft tokens ``[n]``: their argmax, and for ``sampled``
        rows rank 0's draw (the same on every rank when ``broadcast``)."""
        model, group = self.model, self.group
        head = model.vocab_head
        real = self.counts[group.rank]
        hot = model.shard_hot_ids if model.hot_ids is not None else None
        start = head.vocab_start if isinstance(head, VocabParallelHead) else 0
        ids, _ = vocab_parallel_argmax(logits, start, real, group, hot)
        if not sampled:
            return ids
        full = gather_columns(logits[sampled], self.counts, group)  # [S, V'] on rank 0
        if full is not None:
            assert drawing is not None and q is not None
            g = q.shape[1]
            for at, k in _slot_parts(sampled, slot, g):
                rows = [sampled[j] // g if slot is None else sampled[j] for j in at]
                temps = drawing.temperatures[rows][:, None]
                p = torch.softmax(full[at] / temps, dim=-1)  # [s, V']
                choice = exponential_race(p, [drawing.noise[i] for i in rows], drawing.shared)
                if model.hot_ids is not None:  # hot index -> token id, q zero off it
                    choice = model.hot_ids[choice]
                    p = p.new_zeros(len(rows), q.shape[2]).index_copy_(1, model.hot_ids, p)
                ids[[sampled[j] for j in at]] = choice
                q[rows, k] = p
        return group.broadcast(ids.contiguous()) if broadcast else ids


def _slot_parts(sampled: list[int], slot: int | None, g: int) -> list[tuple[list[int], int]]:
    """``sampled``'s indices grouped by slot, in slot order (one group when
    the rows are all of ``slot``): each group is drawn as one batch, as
    ``BlockDrafter.draft`` draws a slot's rows."""
    if slot is not None:
        return [(list(range(len(sampled))), slot)]
    by_slot: dict[int, list[int]] = {}
    for j, row in enumerate(sampled):
        by_slot.setdefault(row % g, []).append(j)
    return [(by_slot[k], k) for k in sorted(by_slot)]


def attach_draft_shard(
    config: EngineConfig, runner: ModelRunner, loaded: LoadedDrafter, kv_pool: KVPool
) -> DraftShard:
    """``runner``'s rank's part of the drafter ``loaded`` over ``kv_pool``
    (``drafter_loader.draft_kv_pool``), attached to the runner: its
    forwards store the draft context, and a worker serves block plans."""
    model, backend = loaded.model, None
    if isinstance(loaded.config, DSparkConfig):  # (a windowed drafter attends on its own)
        heads = draft_heads(loaded.config, runner.group).q_count
        backend = make_attention_backend(
            config.attention_backend, kv_pool, heads, runner.device, model.attention_layers
        )
    shard = DraftShard(model, loaded.block_size, kv_pool, runner.page_size, backend, runner.plans)
    runner.draft_shard = shard
    return shard


def window_first_page(start: int, window: int, page_size: int) -> int:
    """The first page a block at ``start`` of a windowed drafter reads."""
    return max(0, start - window) // page_size


def column_counts(model: BlockDrafter, group: RankGroup) -> list[int]:
    """Every rank's real logit columns: its slice of the vocabulary, or of
    the hot vocabulary (``restrict_vocab``)."""
    vocab = model.config.vocab_size
    counts = []
    for rank in range(group.size):
        other = RankGroup(rank, group.size)
        start, _, real = vocab_shard(vocab, other)
        if model.hot_ids is None:
            counts.append(real)
        else:
            hot = model.hot_ids
            counts.append(int(((hot >= start) & (hot < start + real)).sum()))
    return counts
