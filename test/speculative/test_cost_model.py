"""The costs the planner predicts: profiled tables corrected online by
measured steps and drafting rounds."""

from __future__ import annotations

import itertools

import pytest

from specserve.speculative.cost_model import CostModel
from specserve.speculative.step_costs import CostTable


def flat_costs(step: float = 1.0) -> CostModel:
    return CostModel(CostTable([1, 64], [1, 8], [[step, step], [step, step]]))


def test_the_online_correction_moves_a_wrong_table_toward_measured_times() -> None:
    model = flat_costs(0.001)  # 1 ms: ten times too cheap
    before = model.step_seconds(4, 4)
    for _ in range(60):
        model.observe_step(4, 4, 0.010, learn=True)
    after = model.step_seconds(4, 4)
    assert before == pytest.approx(0.001)
    assert after == pytest.approx(0.010, rel=0.05)
    # A cell never measured takes the measured factor (here of its only
    # measured neighbour); once measured, its own.
    assert model.step_seconds(64, 512) == pytest.approx(0.010, rel=0.05)
    for _ in range(60):
        model.observe_step(64, 512, 0.002, learn=True)
    assert model.step_seconds(64, 512) == pytest.approx(0.002, rel=0.05)
    assert model.step_seconds(4, 4) == pytest.approx(0.010, rel=0.05)


def test_a_steps_seconds_are_its_curves_points_made_monotone() -> None:
    """``step_seconds`` (a point) and ``step_curve`` (a run of tokens, its
    first plain, the others verifying) price a step alike, in every cell and
    past the table's ends, corrected or not, with prefill chunks or not;
    the curve never falls (a draft more never makes a step cheaper, where
    cells corrected apart disagree)."""
    model = CostModel(CostTable([1, 8, 64], [1, 4, 8], [[1, 2, 3], [2, 5, 9], [9, 30, 70]]))
    for requests, tokens, seconds, verify, chunk in [
        (4, 4, 3.0, False, False),
        (4, 20, 1.0, True, False),
        (4, 20, 4.0, False, True),
        (32, 40, 50.0, True, True),
        (32, 40, 5.0, True, False),
    ]:
        model.observe_step(requests, tokens, seconds, learn=True, verify=verify, chunk=chunk)
    falls = 0
    for requests in (1, 3, 4, 8, 32, 100):
        for first in (requests, 2 * requests):
            for chunk in (False, True):
                n = 12 * requests
                for verify in (False, True):
                    curve = model.step_curve(requests, first, n, verify, chunk)
                    points = [
                        model.step_seconds(requests, first + k, verify or k > 0, chunk)
                        for k in range(n)
                    ]
                    falls += any(b < a for a, b in zip(points, points[1:]))
                    assert curve == pytest.approx(list(itertools.accumulate(points, max)))
    assert falls  # the points themselves do fall here: the curve's floor is tested


def test_a_verifying_step_is_corrected_apart_from_a_plain_one_of_its_tokens() -> None:
    """The table times the forward alone; a verifying step pays per row
    besides (every row's logits processed, verified, committed). A plain
    step with a prefill chunk as long must not price it: measured at 16
    requests, such steps outnumbered the verifying ones four to one and
    priced them 20% cheap."""
    model = flat_costs(0.010)
    for k in range(200):  # four chunked steps per verifying one, in one cell
        verify = k % 5 == 0
        model.observe_step(16, 72, 0.017 if verify else 0.013, learn=True, verify=verify)
    assert model.step_seconds(16, 72, verify=True) == pytest.approx(0.017, rel=0.02)
    assert model.step_seconds(16, 72) == pytest.approx(0.013, rel=0.02)
    # The curve prices its plain first token as plain, every draft as verifying.
    curve = model.step_curve(16, 72, 2)
    assert curve == pytest.approx([0.013, 0.017], rel=0.02)
    # A verifying cell never measured takes its row's verifying correction.
    assert model.step_seconds(16, 16 * 8, verify=True) == pytest.approx(0.017, rel=0.02)


def test_what_speculation_adds_follows_the_plain_steps_of_its_load() -> None:
    """The machine's speed moves by 10-30% over seconds. Verifying steps and
    drafting rounds are measured only while the model drafts, plain steps
    all the time: a stretch of slow drafting rounds, priced on its own,
    stayed dear after the machine sped up again, the model drafted no
    more, and nothing corrected it (at 4 requests the verify priced at 1.4x
    what it took). Priced relative to the plain steps of their load, they
    follow the machine as plain steps measure it."""
    draft = CostTable([1, 8], [1], [[0.005], [0.008]])
    model = CostModel(CostTable([1, 64], [1, 64], [[0.010, 0.010], [0.010, 0.010]]), draft)
    slow = 1.3
    for _ in range(100):  # drafting every other step on a slow machine
        model.observe_step(4, 4, 0.010 * slow, learn=True)
        model.observe_step(4, 32, 0.014 * slow, learn=True, verify=True)
        model.observe_draft(4, 0.009 * slow)
    assert model.step_seconds(4, 32, verify=True) == pytest.approx(0.014 * slow, rel=0.02)
    assert model.draft_seconds(4) == pytest.approx(0.009 * slow, rel=0.02)
    for _ in range(100):  # plain steps alone, the machine fast again
        model.observe_step(4, 4, 0.010, learn=True)
    assert model.step_seconds(4, 4) == pytest.approx(0.010, rel=0.02)
    assert model.step_seconds(4, 32, verify=True) == pytest.approx(0.014, rel=0.02)
    assert model.draft_seconds(4) == pytest.approx(0.009, rel=0.02)
    # Another load's plain steps say nothing of this one's.
    for _ in range(100):
        model.observe_step(32, 32, 0.010 * slow, learn=True)
    assert model.step_seconds(4, 32, verify=True) == pytest.approx(0.014, rel=0.02)


def test_a_stall_while_drafting_does_not_price_drafting_out_for_good() -> None:
    """A verifying step or a drafting round that stalled moves its shape by
    a factor of 2 ** ALPHA at most: shapes are measured only while the
    model drafts, so a shape a stall took dear would stand, the model
    plain. The load's correction takes the rest, and plain steps take it
    back."""
    draft = CostTable([1, 8], [1], [[0.005], [0.008]])
    model = CostModel(CostTable([1, 64], [1, 64], [[0.010, 0.010], [0.010, 0.010]]), draft)
    for _ in range(100):
        model.observe_step(4, 4, 0.010, learn=True)
        model.observe_step(4, 32, 0.014, learn=True, verify=True)
        model.observe_draft(4, 0.009)
    model.observe_step(4, 32, 0.014 * 20, learn=True, verify=True)  # a stall each
    model.observe_draft(4, 0.009 * 20)
    for _ in range(30):  # plain steps alone
        model.observe_step(4, 4, 0.010, learn=True)
    assert model.step_seconds(4, 32, verify=True) < 0.014 * 2**0.1 * 1.01
    assert model.draft_seconds(4) < 0.009 * 2**0.1 * 1.01


def test_steps_with_prefill_chunks_are_corrected_apart_from_the_decoding_alone() -> None:
    """A chunk's tokens are one request's in a row, which the table (over
    requests' chains) prices cheap: at 63 requests, a plain cell measured
    mostly with chunks priced the decoding alone 1.6x its verifying
    neighbour, and a draft looked as if it made the step cheaper. Here
    plain steps with a chunk (3 in 4, 30 ms) and without (20 ms) share a
    cell of the table; verifying steps without one take 22 ms."""
    model = flat_costs(0.025)
    for k in range(400):
        chunk = k % 4 != 0
        model.observe_step(63, 100, 0.030 if chunk else 0.020, learn=True, chunk=chunk)
        if k % 8 == 0:
            model.observe_step(63, 101, 0.022, learn=True, verify=True)
    assert model.step_seconds(63, 100) == pytest.approx(0.020, rel=0.02)
    assert model.step_seconds(63, 100, chunk=True) == pytest.approx(0.030, rel=0.02)
    # Deciding a step without a chunk: a draft costs, not saves.
    curve = model.step_curve(63, 100, 3)
    assert curve == pytest.approx([0.020, 0.022, 0.022], rel=0.02)
    assert curve[0] < curve[1]


def test_one_slow_step_moves_the_correction_by_a_factor_not_to_itself() -> None:
    """A first launch or a stall 20x the table must not make the cell look
    20x dearer (which once kept a batch-1 engine plain for hundreds of
    steps); steps as the table says keep it there."""
    model = flat_costs(0.001)
    model.observe_step(1, 4, 0.020, learn=True)
    assert 0.001 < model.step_seconds(1, 4) < 0.0015
    for _ in range(30):
        model.observe_step(1, 4, 0.001, learn=True)
    assert model.step_seconds(1, 4) == pytest.approx(0.001, rel=0.05)


def test_an_unmeasured_drafter_load_is_priced_from_the_measured_ones() -> None:
    """A load the drafter never ran at is not free (the first rounds at 32
    requests once cost a sweep 8%): a power law through the measured
    buckets, between and past them; below them the smallest's cost."""
    model = flat_costs()
    assert model.draft_seconds(8) == 0.0  # nothing measured: optimistic
    model.observe_draft(1, 0.002)
    model.observe_draft(8, 0.008)  # 2x per doubling of 8 = 2**3: slope 2/3
    assert model.draft_seconds(1) == pytest.approx(0.002)
    assert model.draft_seconds(2) == pytest.approx(0.002 * 2 ** (2 / 3))
    assert model.draft_seconds(32) == pytest.approx(0.008 * 4 ** (2 / 3))
    model.observe_draft(16, 0.005)  # cheaper than 8: the slope past it is 0, not negative
    assert model.draft_seconds(64) == pytest.approx(0.005)
    assert model.draft_curve(8, 8)[0] == 0.0  # what is paid anyway costs nothing more


def test_a_profiled_drafter_prices_every_load_and_is_corrected_online() -> None:
    """With the drafter's round profiled at start-up, no load is unmeasured
    (a first slow round at 8 requests once priced 1 request's round at 8's
    for hundreds of steps, and kept a batch-1 engine plain); measured rounds
    correct their bucket as the step's cells are corrected."""
    draft = CostTable([1, 8], [1], [[0.002], [0.008]])
    model = CostModel(CostTable([1], [1], [[1.0]]), draft_costs=draft)
    assert model.draft_seconds(1) == pytest.approx(0.002)
    assert model.draft_seconds(4) == pytest.approx(0.002 + 0.006 * 3 / 7)
    model.observe_draft(8, 0.160)  # one stall: a bounded step, not 20x
    assert 0.008 < model.draft_seconds(8) < 0.012
    for _ in range(60):
        model.observe_draft(8, 0.016)
    assert model.draft_seconds(8) == pytest.approx(0.016, rel=0.05)
    # A load never measured takes the measured factor; once measured, its own.
    assert model.draft_seconds(1) == pytest.approx(0.004, rel=0.05)
    for _ in range(60):
        model.observe_draft(1, 0.0025)
    assert model.draft_seconds(1) == pytest.approx(0.0025, rel=0.05)
    assert model.draft_seconds(8) == pytest.approx(0.016, rel=0.05)


def test_a_profiled_drafter_prices_each_count_within_its_bucket() -> None:
    """A round for 25 requests costs what the profile says of 25, not of 16,
    its bucket's first (at 25 of 32 requests drafting, rounds took 1.7x
    what the staircase priced, and requests 17-31 joined for free); the
    bucket's measured factor scales every count in it."""
    draft = CostTable([1, 32], [1], [[0.001], [0.032]])  # 1 ms per request
    model = CostModel(CostTable([1], [1], [[1.0]]), draft_costs=draft)
    assert model.draft_seconds(25) == pytest.approx(0.025)
    curve = model.draft_curve(16, 15)  # 16 drafting anyway, up to 15 more
    assert curve[9] == pytest.approx(0.009) and curve == sorted(curve)
    for _ in range(60):  # the 16-31 bucket measured at twice the profile
        model.observe_draft(20, 0.040)
    assert model.draft_seconds(25) == pytest.approx(0.050, rel=0.05)
    assert model.draft_seconds(17) == pytest.approx(0.034, rel=0.05)


def test_a_table_without_learning_keeps_its_prediction() -> None:
    """A saved table decides alone (the budget schedule): measured steps
    report what it predicted and leave it as it was."""
    model = flat_costs(0.001)
    for _ in range(20):
        model.observe_step(4, 4, 0.010, learn=False)
    assert model.predicted_seconds() == pytest.approx(20 * 0.001)
    assert model.step_seconds(4, 4) == pytest.approx(0.001)


def test_a_step_curve_read_again_is_what_a_fresh_model_computes() -> None:
    """Curves are kept between reads (a step asks twice at one load): every
    read, again at the same load or after steps moved the corrections, is
    what a model that measured the same steps and never read computes."""
    import random

    rng = random.Random(8)
    table = CostTable([1, 8, 64], [1, 4, 8], [[1, 2, 3], [2, 5, 9], [9, 30, 70]])
    loads = [
        (1, 1, 8, False, False),
        (1, 1, 8, True, False),
        (8, 8, 30, False, True),
        (30, 40, 9, True, True),
    ]
    model, steps = CostModel(table), []
    for _ in range(200):
        if rng.random() < 0.5:
            load = rng.choice(loads)
            fresh = CostModel(table)
            for step in steps:
                fresh.observe_step(*step)
            assert model.step_curve(*load) == pytest.approx(fresh.step_curve(*load), rel=1e-12)
        else:
            requests, tokens = rng.choice([1, 8, 30]), rng.randint(1, 64)
            step = (requests, tokens, rng.uniform(0.5, 4.0), True, rng.random() < 0.5, False)
            steps.append(step)
            model.observe_step(*step)


def test_measured_steps_waiting_to_correct_the_table_read_as_corrected_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Measured steps correct the table in batches (OBSERVE_BATCH), but every
    read settles those waiting first: reads anywhere among the measurements
    price as with each step corrected at once, and the seconds predicted of
    the steps are each step's as priced just before its measurement."""
    import random

    from specserve.speculative import cost_model

    rng = random.Random(3)
    ops = []
    for _ in range(300):
        requests, tokens = rng.choice([1, 3, 8, 30]), rng.randint(1, 64)
        verify, chunk = rng.random() < 0.4, rng.random() < 0.2
        if rng.random() < 0.15:
            ops.append(("read", requests, tokens, verify, chunk))
        else:
            seconds = rng.uniform(0.5, 4.0) * (1 + tokens / 8)
            ops.append(("step", requests, tokens, verify, chunk, seconds))

    def run(batch: int) -> tuple[list[float], float, float]:
        monkeypatch.setattr(cost_model, "OBSERVE_BATCH", batch)
        table = CostTable([1, 8, 64], [1, 4, 8], [[1, 2, 3], [2, 5, 9], [9, 30, 70]])
        model = CostModel(table, CostTable([1, 64], [1], [[2.0], [8.0]]), draft_row=0.01)
        reads, priced = [], 0.0
        for op in ops:
            if op[0] == "read":
                _, requests, tokens, verify, chunk = op
                reads.append(model.step_seconds(requests, tokens, verify, chunk))
                reads.extend(model.step_curve(requests, tokens, 3, verify, chunk))
                reads.append(model.draft_seconds(requests))
                reads.append(model.catch_up_seconds(tokens))
            else:
                _, requests, tokens, verify, chunk, seconds = op
                if batch == 1:  # the oracle: the price just before the measurement
                    priced += model.step_seconds(requests, tokens, verify, chunk)
                model.observe_step(requests, tokens, seconds, True, verify, chunk)
        return reads, model.predicted_seconds(), priced

    waited, predicted, _ = run(16)
    at_once, predicted_at_once, priced = run(1)
    assert waited == pytest.approx(at_once, rel=1e-12)
    assert predicted == pytest.approx(priced, rel=1e-12)
    assert predicted_at_once == pytest.approx(priced, rel=1e-12)
