"""The DSpark block forward captured per batch bucket (CUDA graphs).

A round's block forward takes, per request, the features the last round
committed (at most ``block + 1`` context rows: their K/V are computed and
stored on the way) and the block ``[anchor, mask...]`` at the positions
after them. Padded to a bucket of requests and to ``block + 1`` context
rows each, it has one shape per bucket and replays from static buffers:
the features, the context rows' positions and draft slots, each block's
anchor, start, slots, KV length and draft page table. Padding rows write
their K/V to a scratch slot past the draft pool's pages; a padding request
is a block of its own at position 0. The Markov walk after it stays eager.
``capture`` is the target's (``runner/cuda_graph_runner.py``), with its
memory pool; on the CPU the tests replay eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.cache.block_pool import page_slots
from specserve.cache.kv_pool import KVPool
from specserve.host import upload
from specserve.layers.attention import AttentionMetadata, TritonAttentionBackend
from specserve.runner.cuda_graph_runner import Capture, Forward, StaticTables
from specserve.speculative.dspark_model import Attend, ContextRows, DSparkDraftModel
from specserve.speculative.dspark_v4_model import DSparkV4DraftModel


def paged_attend(backend, meta: AttentionMetadata) -> Attend:
    """Blocks ``[R, G, ...]`` attending through ``backend`` (already prepared
    for ``meta``): the rows flattened to the backend's ``[T, heads, D]``."""

    def attend(layer: int, q: torch.Tensor, bk: torch.Tensor, bv: torch.Tensor) -> torch.Tensor:
        rows = q.shape[0] * q.shape[1]
        o = backend.forward(
            layer, q.reshape(rows, *q.shape[2:]), bk.reshape(rows, *bk.shape[2:]),
            bv.reshape(rows, *bv.shape[2:]), meta,
        )  # fmt: skip
        return o.view(q.shape)

    return attend


def eager_block(
    model: DSparkDraftModel,
    backend,
    kv_pool: KVPool,
    x: BlockInputs,
    anchors: torch.Tensor,  # [R]
    block_size: int,
    page_size: int,
) -> torch.Tensor:
    """The blocks' outputs ``[R, G, d]``, run op by op: a non-causal paged
    batch over the draft pool, ``x``'s pending context rows' K/V computed
    and stored on the way (none under tensor parallelism: the target's
    forwards store them)."""
    g, device = block_size, anchors.device
    context = None
    if x.context_positions:
        slots = upload(x.context_slots, device)

        def store(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
            kv_pool.store(layer, slots, k, v)

        hidden = model.context_hidden(x.features)
        context = ContextRows(hidden, upload(x.context_positions, device), store)
    meta = AttentionMetadata(
        positions=upload([p + j for p in x.starts for j in range(g)], device),
        slot_mapping=upload([s for row in x.block_slots for s in row], device),
        q_lens=[g] * len(x.starts),
        kv_lens=[p + g for p in x.starts],
        page_tables=x.page_tables,
        page_size=page_size,
        causal=False,
    )
    backend.prepare(meta)
    starts = upload(x.starts, device)
    return model.block_hidden(anchors, starts, paged_attend(backend, meta), g, context)


def window_attend(
    model: DSparkV4DraftModel,
    kv_pool: KVPool,
    page_tables: list[list[int]],
    starts: list[int],
    page_size: int,
    first_pages: list[int] | None = None,
) -> Attend:
    """A windowed drafter's blocks, each over the last ``window`` context
    positions before its start, gathered from the draft pool (padding
    masked). ``first_pages``: the page index each table starts at (a
    window's pages only; 0 for whole tables)."""
    w = model.window
    assert w is not None
    slots, bias = [], []
    for i, (table, p) in enumerate(zip(page_tables, starts)):
        shift = 0 if first_pages is None else first_pages[i] * page_size
        lo = max(0, p - w)
        row = page_slots(table, lo - shift, p - shift, page_size)
        pad = w - len(row)
        slots.append([0] * pad + row)
        bias.append([float("-inf")] * pad + [0.0] * len(row))
    device = model.feature_weight.device
    index = upload(slots, device)  # [R, W]
    ctx_bias = upload(bias, device, torch.float32)
    ctx = [kv_pool.k[layer][index][:, :, 0] for layer in range(len(kv_pool.k))]
    return model.window_attend(ctx, ctx_bias)


@dataclass
class BlockInputs:
    """One round's blocks, host side (request ``i`` of ``R``)."""

    features: torch.Tensor  # [n, m * d] every request's pending features, in order
    context_rows: list[int]  # [R] pending rows per request (their sum is n)
    context_positions: list[int]  # [n]
    context_slots: list[int]  # [n]
    anchors: list[int]  # [R]
    starts: list[int]  # [R] each block's first position
    block_slots: list[list[int]]  # [R][G]
    page_tables: list[list[int]]  # [R] draft pages covering each block


class DraftBlockGraphs:
    def __init__(
        self,
        model: DSparkDraftModel,
        backend: TritonAttentionBackend,
        kv_pool: KVPool,
        block: int,
        context_length: int,
        scratch_slot: int,
        buckets: list[int],
        capture: Capture,
    ) -> None:
        self.model = model
        self.backend = backend
        self.kv_pool = kv_pool
        self.block = block
        self.rows = block + 1  # context rows per request: a round commits at most this many
        self.scratch_slot = scratch_slot
        self.buckets = buckets
        ps = kv_pool.page_size
        w = model.feature_weight
        most = buckets[-1]
        self.features = torch.zeros(most * self.rows, w.shape[1], dtype=w.dtype, device=w.device)
        self.context = torch.zeros(2, most * self.rows, dtype=torch.int64, device=w.device)
        self.context[1].fill_(scratch_slot)  # positions | slots
        self.requests = torch.zeros(2, most, dtype=torch.int64, device=w.device)  # anchors | starts
        self.block_slots = torch.full((most * block,), scratch_slot, device=w.device)
        max_pages = -(-(context_length + 2 * self.rows) // ps)
        self.tables = StaticTables(most, max_pages, ps, backend)
        self.graphs: dict[int, Forward] = {}
        self.replays = 0
        with torch.inference_mode():
            for bs in reversed(buckets):
                self.graphs[bs] = capture(self._forward(bs))

    def _forward(self, bs: int) -> Forward:
        g, n = self.block, bs * self.rows
        features, positions, slots = self.features[:n], self.context[0, :n], self.context[1, :n]
        anchors, starts = self.requests[0, :bs], self.requests[1, :bs]
        block_slots = self.block_slots[: bs * g]
        # (The Triton backend reads no positions: the block's RoPE is the model's.)
        meta = self.tables.metadata(g, bs, block_slots, block_slots, causal=False)
        attend = paged_attend(self.backend, meta)

        def store(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
            self.kv_pool.store(layer, slots, k, v)

        def forward() -> tuple[torch.Tensor, None]:
            context = ContextRows(self.model.context_hidden(features), positions, store)
            return self.model.block_hidden(anchors, starts, attend, g, context), None

        return forward

    def takes(self, num_requests: int, context_rows: list[int]) -> bool:
        """Whether a round of ``num_requests`` blocks with these pending
        context rows each fits a captured shape."""
        return num_requests <= self.buckets[-1] and max(context_rows) <= self.rows

    def run(self, x: BlockInputs) -> torch.Tensor:
        """The blocks' final-normed outputs ``[R, G, d]`` (a copy)."""
        r, g, c = len(x.anchors), self.block, self.rows
        bs = next(b for b in self.buckets if b >= r)
        n = bs * c
        positions, slots = [0] * n, [self.scratch_slot] * n
        where: list[int] = []  # each pending row's place among the padded rows
        at = 0
        for i, k in enumerate(x.context_rows):
            lo = i * c
            positions[lo : lo + k] = x.context_positions[at : at + k]
            slots[lo : lo + k] = x.context_slots[at : at + k]
            where.extend(range(lo, lo + k))
            at += k
        block_slots = [self.scratch_slot] * (bs * g)
        for i, row in enumerate(x.block_slots):
            block_slots[i * g : (i + 1) * g] = row
        kv_lens = [s + g for s in x.starts] + [g] * (bs - r)
        device = self.features.device
        if where:
            index = torch.tensor(where, device=device)
            self.features.index_copy_(0, index, x.features.to(self.features.dtype))
        self.context[:, :n].copy_(torch.tensor([positions, slots]), non_blocking=True)
        pad = [0] * (bs - r)
        self.requests[:, :bs].copy_(
            torch.tensor([x.anchors + pad, x.starts + pad]), non_blocking=True
        )
        self.block_slots[: bs * g].copy_(torch.tensor(block_slots), non_blocking=True)
        self.tables.fill(kv_lens, x.page_tables)
        hidden, _ = self.graphs[bs]()
        self.replays += 1
        return hidden[:r].clone()
