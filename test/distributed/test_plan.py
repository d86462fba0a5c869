"""The step plan's packing: every field of every entry survives the trip."""

from __future__ import annotations

from specserve.core import BatchEntry, ScheduledBatch
from specserve.distributed.plan import pack, unpack


def test_pack_unpack_round_trip() -> None:
    batch = ScheduledBatch(
        [
            BatchEntry([5, 6, 7], 0, [3, 4], [2], []),
            BatchEntry([9], 41, [0, 1, 2], [0], [[7, 8], [], [1]]),
            BatchEntry(list(range(30)), 12, list(range(11)), list(range(30)), [[2]]),
        ],
        [],
        (-1, 0, 3),
    )
    back = unpack(pack(batch))
    assert back.entries == batch.entries
    assert back.capture_layer_ids == batch.capture_layer_ids
    assert unpack(pack(ScheduledBatch([], []))).entries == []
