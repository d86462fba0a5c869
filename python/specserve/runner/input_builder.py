"""Turns a ScheduledBatch into the flat tensors of one forward."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.cache.block_pool import page_slots
from specserve.core import ScheduledBatch
from specserve.host import upload
from specserve.layers.attention import AttentionMetadata


@dataclass
class ForwardInputs:
    input_ids: torch.Tensor  # [T] int64
    logit_index: torch.Tensor  # [R] int64: token rows whose logits are returned
    meta: AttentionMetadata
    # The tokens whose draft context K/V the forward stores (entries with
    # ``draft_pages``): their rows [n], positions [n] and draft slots [n].
    draft_context: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


def build_inputs(batch: ScheduledBatch, page_size: int, device: torch.device) -> ForwardInputs:
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logit_index: list[int] = []
    draft: tuple[list[int], list[int], list[int]] = ([], [], [])
    for e in batch.entries:
        n = len(e.token_ids)
        assert len(e.page_table) * page_size >= e.prefix_len + n, "page table too short"
        base = len(ids)
        ids.extend(e.token_ids)
        pos = range(e.prefix_len, e.prefix_len + n)
        positions.extend(pos)
        slots.extend(page_slots(e.page_table, e.prefix_len, e.prefix_len + n, page_size))
        logit_index.extend(base + r for r in e.logit_rows)
        if e.draft_pages:
            draft[0].extend(range(base, base + n))
            draft[1].extend(pos)
            draft[2].extend(page_slots(e.draft_pages, e.prefix_len, e.prefix_len + n, page_size))

    meta = AttentionMetadata(
        positions=upload(positions, device),
        slot_mapping=upload(slots, device),
        q_lens=[len(e.token_ids) for e in batch.entries],
        kv_lens=[e.prefix_len + len(e.token_ids) for e in batch.entries],
        page_tables=[e.page_table for e in batch.entries],
        page_size=page_size,
        entry_tables=[e.entry_tables for e in batch.entries],
    )
    context = tuple(upload(x, device) for x in draft) if draft[0] else None
    return ForwardInputs(upload(ids, device), upload(logit_index, device), meta, context)
