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


def build_inputs(batch: ScheduledBatch, page_size: int, device: torch.device) -> ForwardInputs:
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logit_index: list[int] = []
    for e in batch.entries:
        n = len(e.token_ids)
        assert len(e.page_table) * page_size >= e.prefix_len + n, "page table too short"
        base = len(ids)
        ids.extend(e.token_ids)
        pos = range(e.prefix_len, e.prefix_len + n)
        positions.extend(pos)
        slots.extend(page_slots(e.page_table, e.prefix_len, e.prefix_len + n, page_size))
        logit_index.extend(base + r for r in e.logit_rows)

    meta = AttentionMetadata(
        positions=upload(positions, device),
        slot_mapping=upload(slots, device),
        q_lens=[len(e.token_ids) for e in batch.entries],
        kv_lens=[e.prefix_len + len(e.token_ids) for e in batch.entries],
        page_tables=[e.page_table for e in batch.entries],
        page_size=page_size,
        entry_tables=[e.entry_tables for e in batch.entries],
    )
    return ForwardInputs(upload(ids, device), upload(logit_index, device), meta)
