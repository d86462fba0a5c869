"""The safety net's measurements, one load bucket alone (the net under the
planner's decisions: test_planner.py)."""

from __future__ import annotations

import pytest

from specserve.speculative.safety_net import BLOCK_STEPS, PROBE_STEPS, BucketNet


def test_plain_probes_count_by_their_median_within_a_blocks_steps() -> None:
    """A probe is a few noisy steps: plain's goodput beside the model is the
    median of its latest probes (a stalled one is outvoted); a whole plain
    block counts alone."""
    net = BucketNet()
    for goodput in (1.0, 1.0, 0.1):  # the last probe stalled
        net.add("plain", goodput, PROBE_STEPS)
    net.add("model", 2.0, BLOCK_STEPS)
    assert net.ratios == [pytest.approx(2.0)]
    net.add("plain", 0.5, BLOCK_STEPS)
    assert net.ratios[-1] == pytest.approx(4.0)
