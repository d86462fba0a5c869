"""The step plan's packing: every field of every entry, and the rows decided
and scored on the shards, survive the trip."""

from __future__ import annotations

from specserve.core import ARGMAX, BatchEntry, ScheduledBatch, ScoreRows
from specserve.distributed.plan import pack, unpack
from specserve.speculative.draft_shard import DraftPlan


def test_pack_unpack_round_trip() -> None:
    batch = ScheduledBatch(
        [
            BatchEntry([5, 6, 7], 0, [3, 4], [2], []),
            BatchEntry([9], 41, [0, 1, 2], [0], [[7, 8], [], [1]], [6, 2, 9]),
            BatchEntry(list(range(30)), 12, list(range(11)), list(range(30)), [[2]]),
        ],
        [],
        (-1, 0, 3),
    )
    back, score = unpack(pack(batch))
    assert back.entries == batch.entries and score is None
    assert back.capture_layer_ids == batch.capture_layer_ids
    rows = ScoreRows([2, 3, 4], [17, ARGMAX, 9], 5, [[1, -1], [4, 5], [-1, -1]], [3, 0])
    back, score = unpack(pack(batch, rows))
    assert back.entries == batch.entries and score == rows
    argmax_only = ScoreRows([], [], 0, [], [1, 2])
    assert unpack(pack(batch, argmax_only))[1] == argmax_only
    assert unpack(pack(ScheduledBatch([], []), ScoreRows([], [], 0, [])))[1] == ScoreRows(
        [], [], 0, []
    )


def test_draft_plan_round_trip() -> None:
    plan = DraftPlan([5, 0, 77], [12, 0, 40], [True, False, True], [[3, 4, 8], [1], []])
    assert DraftPlan.unpack(plan.pack()) == plan
    assert DraftPlan.unpack(DraftPlan([], [], [], []).pack()) == DraftPlan([], [], [], [])
