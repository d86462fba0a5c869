"""Rank 0's step plan: the ``ScheduledBatch`` a forward runs, packed into
one flat int64 tensor and broadcast on the control group, so that every
rank runs the same forward on its shard.

A plan is a header ``[step id, kind, payload length]`` and the payload.
A forward's: the capture layer ids, then per entry ``[tokens, prefix,
pages, logit rows, draft pages, further tables, each table's length]`` and
the entry's lists, then the rows the forward decides and scores on the
shards (``ScoreRows``: ``[count, top-k, width, argmax count]``, rows,
tokens, requested ids, argmax rows; a count of -1 for none). A drafter
block's plan is a kind of its own (``speculative.draft_shard``). A plan
goes out as one message of ``INLINE`` values (a collective costs a few
hundred microseconds over gloo on a loopback); a longer payload's rest
follows in a second. Every plan carries the next step id; a rank that sees
another one raises.
"""

from __future__ import annotations

import torch

from specserve.core import BatchEntry, ScheduledBatch, ScoreRows
from specserve.distributed.group import DistributedError, RankGroup

FORWARD, STOP, DRAFT = 1, 2, 3
HEADER = 3
INLINE = 1024  # values of the first message (8 KiB): a decode step of ~100 requests


def pack(batch: ScheduledBatch, score: ScoreRows | None = None) -> list[int]:
    out = [len(batch.capture_layer_ids), *batch.capture_layer_ids, len(batch.entries)]
    for e in batch.entries:
        out += [len(e.token_ids), e.prefix_len, len(e.page_table), len(e.logit_rows)]
        out += [len(e.draft_pages), len(e.entry_tables), *(len(t) for t in e.entry_tables)]
        out += e.token_ids + e.page_table + e.logit_rows + e.draft_pages
        for t in e.entry_tables:
            out += t
    if score is None:
        return out + [-1]
    width = len(score.ids[0]) if score.ids else 0
    out += [len(score.rows), score.top_k, width, len(score.argmax)]
    out += score.rows + score.token_ids
    for ids in score.ids:
        out += ids
    return out + score.argmax


def unpack(values: list[int]) -> tuple[ScheduledBatch, ScoreRows | None]:
    at = 0

    def take(n: int) -> list[int]:
        nonlocal at
        at += n
        return values[at - n : at]

    capture = tuple(take(take(1)[0]))
    entries = []
    for _ in range(take(1)[0]):
        n_tok, prefix, n_pages, n_rows, n_draft, n_tables = take(6)
        lengths = take(n_tables)
        tokens, pages, rows, draft = take(n_tok), take(n_pages), take(n_rows), take(n_draft)
        tables = [take(n) for n in lengths]
        entries.append(BatchEntry(tokens, prefix, pages, rows, tables, draft))
    batch = ScheduledBatch(entries, [], capture)
    n = take(1)[0]
    score = None
    if n >= 0:
        top_k, width, n_argmax = take(3)
        rows, tokens = take(n), take(n)
        ids = [take(width) for _ in range(n)]
        score = ScoreRows(rows, tokens, top_k, ids, take(n_argmax))
    assert at == len(values), "a plan with trailing values"
    return batch, score


# What a worker receives: the target's forward with its scored rows, or a
# drafter block's plan (``speculative.draft_shard.DraftPlan``'s values).
Plan = tuple[ScheduledBatch, ScoreRows | None] | list[int]


class PlanChannel:
    """Rank 0 sends each forward's plan; the other ranks receive it."""

    def __init__(self, group: RankGroup) -> None:
        self.group = group
        self.step_id = 0  # of the last plan sent or received

    def send(self, batch: ScheduledBatch | None, score: ScoreRows | None = None) -> None:
        """Rank 0: the next forward and the rows it scores (None: stop)."""
        if batch is None:
            self._send(STOP, [])
        else:
            self._send(FORWARD, pack(batch, score))

    def send_draft(self, values: list[int]) -> None:
        """Rank 0: a drafter block forward (its plan's packed values)."""
        self._send(DRAFT, values)

    def _send(self, kind: int, payload: list[int]) -> None:
        if self.group.size == 1:
            return
        self.step_id += 1
        values = torch.tensor([self.step_id, kind, len(payload), *payload], dtype=torch.int64)
        first = torch.zeros(INLINE, dtype=torch.int64)
        first[: min(INLINE, len(values))] = values[:INLINE]
        self.group.broadcast_control(first)
        if len(values) > INLINE:
            self.group.broadcast_control(values[INLINE:].contiguous())

    def recv(self) -> Plan | None:
        """A worker: the next forward and its scored rows (or a draft plan's
        values), or None when rank 0 stops."""
        first = self.group.broadcast_control(torch.empty(INLINE, dtype=torch.int64))
        step_id, kind, length = first[:HEADER].tolist()
        if step_id != self.step_id + 1:
            raise DistributedError(
                f"rank {self.group.rank}: plan for step {step_id}, expected {self.step_id + 1}"
            )
        self.step_id = step_id
        if kind == STOP:
            return None
        if kind not in (FORWARD, DRAFT):
            raise DistributedError(f"rank {self.group.rank}: a plan of unknown kind {kind}")
        payload = first[HEADER : HEADER + length]
        if HEADER + length > INLINE:
            rest = torch.empty(HEADER + length - INLINE, dtype=torch.int64)
            payload = torch.cat([payload, self.group.broadcast_control(rest)])
        return unpack(payload.tolist()) if kind == FORWARD else payload.tolist()
