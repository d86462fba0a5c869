"""The safety net's measurements, one load bucket alone or the net itself
(the net under the planner's decisions: test_planner.py)."""

from __future__ import annotations

import pytest

from specserve.speculative.safety_net import (
    BLOCK_STEPS,
    PROBE_STEPS,
    SETTLE_STEPS,
    BucketNet,
    SafetyNet,
    load_bucket,
)


def test_plain_probes_count_by_their_median_within_a_blocks_steps() -> None:
    """A probe is a few noisy steps: plain's goodput beside the model is the
    median of its latest probes (a stalled one is outvoted); a whole plain
    block counts alone."""
    net = BucketNet()
    for goodput in (1.0, 1.0, 0.1):  # the last probe stalled
        net.add("plain", goodput, PROBE_STEPS, PROBE_STEPS / goodput)
    net.add("model", 2.0, BLOCK_STEPS, BLOCK_STEPS / 2.0)
    assert net.ratios == [pytest.approx(2.0)]
    net.add("plain", 0.5, BLOCK_STEPS, BLOCK_STEPS / 0.5)
    assert net.ratios[-1] == pytest.approx(4.0)


def test_the_steps_a_switch_costs_are_measured_by_neither_regime() -> None:
    """The first plain step after drafted ones runs slow (8-25% at 8
    requests), and the model's first after plain ones pays the drafter's
    catch-up: a block that follows the other regime's measures from its
    step after SETTLE_STEPS, so the ratio is the two steady states'."""
    net = SafetyNet()
    for _ in range(BLOCK_STEPS):
        assert net.regime(4) == "model"
        net.observe(8.0, 1.0, drafted=True)
    for seconds in [5.0] * SETTLE_STEPS + [1.0] * PROBE_STEPS:
        assert net.regime(4) == "plain"
        net.observe(4.0, seconds, drafted=False)
    for seconds in [5.0] * SETTLE_STEPS + [1.0] * BLOCK_STEPS:
        assert net.regime(4) == "model"  # it leads
        net.observe(8.0, seconds, drafted=True)
    net.regime(4)
    assert net.nets[load_bucket(4)].ratios == [pytest.approx(2.0), pytest.approx(2.0)]
