"""The safety net's measurements, one load bucket alone or the net itself
(the net under the planner's decisions: test_planner.py)."""

from __future__ import annotations

import pytest

from specserve.speculative.safety_net import (
    BLOCK_STEPS,
    FIRST_PAIRS,
    NET_RECENT,
    NET_WINDOW,
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
    assert net.plain_goodput() == pytest.approx(1.0)
    net.add("plain", 0.5, BLOCK_STEPS, BLOCK_STEPS / 0.5)
    assert net.plain_goodput() == pytest.approx(0.5)


def test_plain_probes_far_apart_count_the_latest() -> None:
    """Probes a model that leads by far runs rarely: the reference is the
    latest probes within NET_WINDOW steps, the latest one always, so that
    probes stalled by a burst long ago do not stand for plain now."""
    net = BucketNet()
    for _ in range(3):  # stalled probes
        net.steps += PROBE_STEPS
        net.add("plain", 0.1, PROBE_STEPS, PROBE_STEPS / 0.1)
    net.steps += NET_WINDOW
    net.add("model", 1.0, BLOCK_STEPS, BLOCK_STEPS / 1.0)
    assert net.ratios == [pytest.approx(10.0)]  # against the stalled ones
    net.steps += PROBE_STEPS
    net.add("plain", 1.0, PROBE_STEPS, PROBE_STEPS / 1.0)  # a probe on a quiet machine
    assert net.plain_goodput() == pytest.approx(1.0)
    assert net.ratios == [pytest.approx(1 / 0.55)]  # the mean of the two sides


def test_a_models_block_is_measured_against_plain_around_it() -> None:
    """The machine speeds up from plain's goodput 1 to 2 while the model runs
    1.5 times plain: each of the model's blocks between two probes (not
    only the one next to a probe) is measured against the mean of the two,
    which it lies between in time, so drift cancels (by the probe before
    alone: 2.25; by the one after: 1.125)."""
    net = BucketNet()
    net.add("plain", 1.0, PROBE_STEPS, PROBE_STEPS / 1.0)
    for _ in range(3):
        net.add("model", 2.25, BLOCK_STEPS, BLOCK_STEPS / 2.25)
    assert net.ratios == [pytest.approx(2.25)] * 3  # until plain is measured after them
    net.add("plain", 2.0, BLOCK_STEPS, BLOCK_STEPS / 2.0)
    assert net.ratios == [pytest.approx(1.5)] * 3
    net.add("model", 3.0, BLOCK_STEPS, BLOCK_STEPS / 3.0)  # after the last plain block
    assert net.ratios[-1] == pytest.approx(1.5) and net.lead == pytest.approx(1.5)


def test_the_models_blocks_decide_by_the_median_of_their_latest() -> None:
    """A stalled block, or one of hard text, is one vote of NET_RECENT: the
    lead is the median of the model's latest blocks' ratios, and a block
    older than those no longer counts."""
    net = BucketNet()
    net.add("plain", 1.0, BLOCK_STEPS, float(BLOCK_STEPS))
    for goodput in [0.1, 0.2] + [1.4] * (NET_RECENT - 2):
        net.add("model", goodput, BLOCK_STEPS, BLOCK_STEPS / goodput)
    assert net.lead == pytest.approx(1.4) and net.winner() == "model"
    for _ in range(NET_RECENT // 2 + 1):
        net.add("model", 0.9, BLOCK_STEPS, BLOCK_STEPS / 0.9)
    assert net.lead == pytest.approx(0.9) and net.winner() == "plain"
    assert len(net.ratios) == NET_RECENT


def test_the_models_blocks_that_count_are_those_of_the_buckets_latest_steps() -> None:
    """The blocks the model ran as the winner count while they are within the
    bucket's last NET_WINDOW steps; its explorations (run while plain held
    the bucket) however old; the latest FIRST_PAIRS always. So once the hard
    text that gave plain the bucket is that far behind, the explorations
    decide (at one request, hard text's blocks outvoted the explorations
    after it for 530 steps)."""
    net = BucketNet()

    def block(regime: str, goodput: float) -> None:
        net.steps += BLOCK_STEPS  # as the SafetyNet counts a bucket's blocks
        net.add(regime, goodput, BLOCK_STEPS, BLOCK_STEPS / goodput)

    block("plain", 1.0)
    for _ in range(NET_RECENT):  # easy text: the model leads
        block("model", 1.5)
    hard_from = net.steps
    for _ in range(NET_RECENT // 2 + 1):  # hard text: the model loses the bucket
        block("model", 0.8)
    assert net.winner() == "plain"
    assert all(not b.explored for b in net.blocks)  # each ran as the winner
    wait = NET_WINDOW // BLOCK_STEPS // 2  # plain's blocks between explorations
    for _ in range(wait):
        block("plain", 1.0)
    block("model", 1.5)  # an exploration on easy text
    assert net.blocks[-1].explored

    def in_window(at: int) -> bool:
        return net.steps - at < NET_WINDOW

    hard = sum(in_window(hard_from + BLOCK_STEPS * (k + 1)) for k in range(NET_RECENT // 2 + 1))
    assert 0 < hard < NET_RECENT // 2 + 1
    assert net.ratios == [pytest.approx(0.8)] * hard + [pytest.approx(1.5)]
    assert net.winner() == "plain"
    for _ in range(wait):
        block("plain", 1.0)
    block("model", 1.5)  # the hard blocks are past the window: the latest FIRST_PAIRS count
    assert FIRST_PAIRS == 3
    assert net.ratios == [pytest.approx(r) for r in (0.8, 1.5, 1.5)]
    assert net.winner() == "model"


def test_explorations_count_however_old() -> None:
    """Explorations are few and far apart: they count however long ago they
    ran (the last NET_RECENT of the model's blocks), so that a losing
    model's latest few do not take back a bucket by chance."""
    net = BucketNet()
    net.steps += BLOCK_STEPS
    net.add("plain", 1.0, BLOCK_STEPS, float(BLOCK_STEPS))
    for goodput in [0.8] * 5 + [1.2, 1.2]:
        net.steps += NET_WINDOW  # plain's blocks between
        net.add("plain", 1.0, BLOCK_STEPS, float(BLOCK_STEPS))
        net.add("model", goodput, BLOCK_STEPS, BLOCK_STEPS / goodput)
    # The opening's three (before a verdict) are past the window; the two
    # losing explorations still count (by the latest three: the model's).
    assert net.ratios == [pytest.approx(r) for r in (0.8, 0.8, 1.2, 1.2)]
    assert net.winner() == "plain"


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
