"""Rank 0's step plan: the ``ScheduledBatch`` a forward runs, packed into
one flat int64 tensor and broadcast on the control group, so that every
rank runs the same forward on its shard.

A plan is a header ``[step id, kind, payload length]`` and the payload:
the capture layer ids, then per entry ``[tokens, prefix, pages, logit
rows, further tables, each table's length]`` and the entry's lists. It
goes out as one message of ``INLINE`` values (a collective costs a few
hundred microseconds over gloo on a loopback); a longer payload's rest
follows in a second. Every plan carries the next step id; a rank that sees
another one raises.
"""

from __future__ import annotations

import torch

from specserve.core import BatchEntry, ScheduledBatch
from specserve.distributed.group import DistributedError, RankGroup

FORWARD, STOP = 1, 2
HEADER = 3
INLINE = 1024  # values of the first message (8 KiB): a decode step of ~100 requests


def pack(batch: ScheduledBatch) -> list[int]:
    out = [len(batch.capture_layer_ids), *batch.capture_layer_ids, len(batch.entries)]
    for e in batch.entries:
        out += [len(e.token_ids), e.prefix_len, len(e.page_table), len(e.logit_rows)]
        out += [len(e.entry_tables), *(len(t) for t in e.entry_tables)]
        out += e.token_ids + e.page_table + e.logit_rows
        for t in e.entry_tables:
            out += t
    return out


def unpack(values: list[int]) -> ScheduledBatch:
    at = 0

    def take(n: int) -> list[int]:
        nonlocal at
        at += n
        return values[at - n : at]

    capture = tuple(take(take(1)[0]))
    entries = []
    for _ in range(take(1)[0]):
        n_tok, prefix, n_pages, n_rows, n_tables = take(5)
        lengths = take(n_tables)
        tokens, pages, rows = take(n_tok), take(n_pages), take(n_rows)
        entries.append(BatchEntry(tokens, prefix, pages, rows, [take(n) for n in lengths]))
    assert at == len(values), "a plan with trailing values"
    return ScheduledBatch(entries, [], capture)


class PlanChannel:
    """Rank 0 sends each forward's plan; the other ranks receive it."""

    def __init__(self, group: RankGroup) -> None:
        self.group = group
        self.step_id = 0  # of the last plan sent or received

    def send(self, batch: ScheduledBatch | None) -> None:
        """Rank 0: the next forward (None: stop)."""
        if self.group.size == 1:
            return
        self.step_id += 1
        payload = pack(batch) if batch is not None else []
        kind = FORWARD if batch is not None else STOP
        values = torch.tensor([self.step_id, kind, len(payload), *payload], dtype=torch.int64)
        first = torch.zeros(INLINE, dtype=torch.int64)
        first[: min(INLINE, len(values))] = values[:INLINE]
        self.group.broadcast_control(first)
        if len(values) > INLINE:
            self.group.broadcast_control(values[INLINE:].contiguous())

    def recv(self) -> ScheduledBatch | None:
        """A worker: the next forward, or None when rank 0 stops."""
        first = self.group.broadcast_control(torch.empty(INLINE, dtype=torch.int64))
        step_id, kind, length = first[:HEADER].tolist()
        if step_id != self.step_id + 1:
            raise DistributedError(
                f"rank {self.group.rank}: plan for step {step_id}, expected {self.step_id + 1}"
            )
        self.step_id = step_id
        if kind == STOP:
            return None
        if kind != FORWARD:
            raise DistributedError(f"rank {self.group.rank}: a plan of unknown kind {kind}")
        payload = first[HEADER : HEADER + length]
        if HEADER + length > INLINE:
            rest = torch.empty(HEADER + length - INLINE, dtype=torch.int64)
            payload = torch.cat([payload, self.group.broadcast_control(rest)])
        return unpack(payload.tolist())
