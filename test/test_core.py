"""The shared types' own behaviour."""

from specserve.core import SpecStats


def test_a_spec_snapshot_keeps_the_counts_of_its_time() -> None:
    """Deltas take snapshots every step; one taken before a round must not
    see it (the snapshot is shared only while no round comes)."""
    stats = SpecStats()
    stats.add(3)
    first = stats.snapshot()
    assert stats.snapshot() == first
    stats.add(2)
    later = stats.snapshot()
    assert (first.rounds, first.committed) == (1, 3)
    assert (later.rounds, later.committed) == (2, 5)
    assert (stats.rounds, stats.committed) == (2, 5)
