"""The cost model that picks each step's verify lengths: the decision
against a brute-force search, its tables, its online corrections and safety
net, and engines whose steps it turns plain against plain decoding."""

from __future__ import annotations

import itertools
import json

import pytest

from models_zoo import model_path, random_prompts
from specserve import Engine
from specserve.speculative.dspark import DSparkProposer
from specserve.speculative.planner import (
    MARGIN,
    PRIOR,
    SpecPlanner,
    static_lengths,
    survival_of,
)
from specserve.speculative.planner import (
    choose_drafts as choose_listed,
)
from specserve.speculative.safety_net import (
    BLOCK_STEPS,
    EXPLORE_LOSS,
    EXPLORE_MAX,
    EXPLORE_MIN,
    PROBE_STEPS,
    SafetyNet,
    load_bucket,
)
from specserve.speculative.step_costs import (
    CATCH_UP_REQUESTS,
    CATCH_UP_ROWS,
    STEADY_ROWS,
    CostTable,
    StepCosts,
    profile_costs,
)
from specserve.tools.tiny_model import make_tiny_dspark


def choose_drafts(survival, step_seconds, fixed_tokens, draft_seconds=None) -> list[int]:
    """The planner's choice, its costs given as functions of the step's
    tokens and of the requests drafting."""
    steps = [step_seconds(fixed_tokens + b) for b in range(sum(map(len, survival)) + 1)]
    drafts = None
    if draft_seconds is not None:
        drafts = [draft_seconds(k) for k in range(len(survival) + 1)]
    return choose_listed(survival, steps, drafts)


def test_static_lengths_stop_at_the_first_low_confidence() -> None:
    conf = [[0.9, 0.8, 0.3, 0.9], [0.2, 0.9], [0.7, 0.7, 0.7], []]
    assert static_lengths(conf, 0.5) == [2, 0, 3, 0]
    assert static_lengths(conf, 0.0) == [4, 2, 3, 0]


def test_a_flat_table_verifies_whole_blocks() -> None:
    survival = [survival_of([0.5] * 4), survival_of([0.1] * 4)]
    assert choose_drafts(survival, lambda t: 1.0, 2) == [4, 4]


def test_a_steep_table_chooses_plain_for_everyone() -> None:
    survival = [survival_of([0.9] * 4)] * 3
    # Each token costs as much as the whole plain step.
    assert choose_drafts(survival, lambda t: float(t), 3) == [0, 0, 0]
    # The drafter's cost alone can make it plain too.
    assert choose_drafts(survival, lambda t: 1.0, 3, lambda n: 10.0) == [0, 0, 0]


def test_a_mixed_batch_gives_drafts_to_the_confident_first() -> None:
    survival = [survival_of([0.95] * 4), survival_of([0.2] * 4), survival_of([0.6] * 4)]

    # A plain step of 3 tokens costs 1; every token past 5 costs 0.3.
    def step(t: int) -> float:
        return 1.0 + 0.3 * max(0, t - 5)

    lengths = choose_drafts(survival, step, 3)
    assert lengths[0] >= lengths[2] >= lengths[1]
    assert lengths[0] > 0 and lengths[1] == 0


def goodput(survival, lengths, step, fixed, draft) -> float:
    expected = len(survival) + sum(sum(s[:k]) for s, k in zip(survival, lengths))
    seconds = step(fixed + sum(lengths))
    if draft is not None and any(lengths):
        seconds += draft(sum(k > 0 for k in lengths))
    return expected / seconds


@pytest.mark.parametrize("seed", range(12))
def test_the_choice_is_the_best_of_every_prefix_combination(seed) -> None:
    """Brute force over every (k_1..k_R): none beats the chosen lengths'
    expected tokens per second, on a staircase (bucketed) cost."""
    import random

    rng = random.Random(seed)
    survival = [survival_of([rng.random() for _ in range(3)]) for _ in range(3)]
    stair = [rng.uniform(0.5, 1.5) for _ in range(4)]

    def step(t: int) -> float:  # constant within buckets of 4 tokens, rising
        return sum(stair[: 1 + t // 4])

    def draft(n: int) -> float:
        return 0.2 * n

    chosen = choose_drafts(survival, step, 3, draft)
    best = max(
        goodput(survival, ks, step, 3, draft) for ks in itertools.product(range(4), repeat=3)
    )
    assert goodput(survival, chosen, step, 3, draft) == pytest.approx(best)


def test_the_cost_table_interpolates_and_round_trips(tmp_path) -> None:
    table = CostTable([1, 4], [1, 8], [[1.0, 2.0], [4.0, 8.0]])
    assert table(1, 1) == pytest.approx(1.0)
    assert table(4, 32) == pytest.approx(8.0)
    assert table(1, 4) == pytest.approx(1.0 + 3 / 7)  # 4 tokens for 1 request
    assert table(2, 2) == pytest.approx(2.0)  # between 1 and 4 requests at 1 token each
    assert table(8, 8) == pytest.approx(8.0)  # linear past 4 requests: 1 + 3 * 7 / 3
    path = tmp_path / "costs.json"
    draft = CostTable([1, 4], [1], [[0.5], [0.9]])
    StepCosts(table, draft, draft_row=0.003).save(str(path))
    back = StepCosts.load(str(path))
    assert back.target(3, 9) == pytest.approx(table(3, 9))
    assert back.draft is not None and back.draft(2, 2) == pytest.approx(draft(2, 2))
    assert back.draft_row == pytest.approx(0.003)
    StepCosts(table).save(str(path))  # no drafter profiled (n-gram)
    assert StepCosts.load(str(path)).draft is None
    (tmp_path / "old.json").write_text(json.dumps({"1": 100.0}))  # the old format
    with pytest.raises(ValueError, match="sps_table_path"):
        StepCosts.load(str(tmp_path / "old.json"))


def test_profiled_tables_are_monotone() -> None:
    noisy = {(1, 1): 2.0, (1, 4): 1.0, (2, 1): 1.5, (2, 4): 3.0}
    clock = [0.0]

    def forward(n: int, c: int) -> None:
        clock[0] += noisy[(n, c)]

    table = profile_costs(forward, [1, 2], [1, 4], repeats=1, clock=lambda: clock[0])
    assert table.times == [[2.0, 2.0], [2.0, 3.0]]


def flat_planner(step: float = 1.0) -> SpecPlanner:
    return SpecPlanner(4, CostTable([1, 64], [1, 8], [[step, step], [step, step]]))


def test_the_online_correction_moves_a_wrong_table_toward_measured_times() -> None:
    planner = flat_planner(0.001)  # 1 ms: ten times too cheap
    before = planner.step_seconds(4, 4)
    for _ in range(60):
        planner.observe_step(4, 4, 4, 0, 4, 0.010, 0.0)
    after = planner.step_seconds(4, 4)
    assert before == pytest.approx(0.001)
    assert after == pytest.approx(0.010, rel=0.05)
    # A cell never measured takes the measured factor (here of its only
    # measured neighbour); once measured, its own.
    assert planner.step_seconds(64, 512) == pytest.approx(0.010, rel=0.05)
    for _ in range(60):
        planner.observe_step(64, 512, 64, 448, 512, 0.002, 0.0)
    assert planner.step_seconds(64, 512) == pytest.approx(0.002, rel=0.05)
    assert planner.step_seconds(4, 4) == pytest.approx(0.010, rel=0.05)


def test_a_table_profiled_under_load_is_right_once_any_step_is_measured() -> None:
    """Profiled while another process ran, every cell 40x too dear. A table
    wrong by one factor decides as a right one; correcting only the cells
    measured made it wrong by two: a plain engine measures plain steps
    only, so its plain cell came down and the verify cells and drafter it
    never ran stayed 40x dear (beyond the 16x a correction could reach),
    and it never drafted again (a sweep's batch-1 DSPARK server stepped
    plain 100% of the time, where fixed lengths gave 1.5x plain)."""
    fast, verify, drafting = 0.004, 0.006, 0.002  # plain, an 8-token verify, a round
    table = CostTable([1, 8], [1, 8], [[40 * fast, 40 * verify]] * 2)
    draft = CostTable([1, 8], [1], [[40 * drafting], [40 * drafting]])
    planner = SpecPlanner(7, table, draft_costs=draft)
    owns, limits = [None], [7]
    assert planner.before_draft(owns, limits, 1, 0) == [7]
    for _ in range(60):  # plain steps, measured
        planner.observe_step(1, 1, 1, 0, 1, fast, 0.0)
    assert planner.step_seconds(1, 1) == pytest.approx(fast, rel=0.05)
    assert planner.step_seconds(1, 8) == pytest.approx(verify, rel=0.05)
    assert planner.draft_seconds(1) == pytest.approx(drafting, rel=0.05)
    planner.net = SafetyNet()  # the model's decision, not the safety net's
    assert planner.before_draft(owns, limits, 1, 0) == [7]


def test_one_slow_step_moves_the_correction_by_a_factor_not_to_itself() -> None:
    """A first launch or a stall 20x the table must not make the cell look
    20x dearer (which once kept a batch-1 engine plain for hundreds of
    steps); steps as the table says keep it there."""
    planner = flat_planner(0.001)
    planner.observe_step(1, 4, 1, 3, 2, 0.020, 0.0)
    assert 0.001 < planner.step_seconds(1, 4) < 0.0015
    for _ in range(30):
        planner.observe_step(1, 4, 1, 3, 2, 0.001, 0.0)
    assert planner.step_seconds(1, 4) == pytest.approx(0.001, rel=0.05)


def test_an_unmeasured_drafter_load_is_priced_from_the_measured_ones() -> None:
    """A load the drafter never ran at is not free (the first rounds at 32
    requests once cost a sweep 8%): a power law through the measured
    buckets, between and past them; below them the smallest's cost."""
    planner = flat_planner()
    assert planner.draft_seconds(8) == 0.0  # nothing measured: optimistic
    planner.observe_draft(1, 0.002)
    planner.observe_draft(8, 0.008)  # 2x per doubling of 8 = 2**3: slope 2/3
    assert planner.draft_seconds(1) == pytest.approx(0.002)
    assert planner.draft_seconds(2) == pytest.approx(0.002 * 2 ** (2 / 3))
    assert planner.draft_seconds(32) == pytest.approx(0.008 * 4 ** (2 / 3))
    planner.observe_draft(16, 0.005)  # cheaper than 8: the slope past it is 0, not negative
    assert planner.draft_seconds(64) == pytest.approx(0.005)
    assert planner._draft_curve(8, 8)[0] == 0.0  # what is paid anyway costs nothing more


def test_refined_lengths_count_the_paid_drafting_in_the_rounds_time() -> None:
    """After drafting, the lengths maximise the round's tokens over all of
    its time, the drafting (as predicted) included: every round pays it,
    so a draft is worth its verify at the round's rate, not at the
    verify's alone. The budget schedule prices it from its table alone."""
    verify = CostTable([1], [1, 8], [[0.0065, 0.0099]])  # 1 request: 1 .. 8 tokens
    survival = [0.9, 0.8, 0.6, 0.4, 0.18, 0.16, 0.15]

    def best(paid: float) -> int:  # brute force over the round's lengths
        return max(range(8), key=lambda b: (1 + sum(survival[:b])) / (paid + verify(1, 1 + b)))

    assert best(0.0) < best(0.0056)  # the drafting decides here
    free = SpecPlanner(7, verify)  # a drafter never measured: free
    assert free.after_draft([survival], 1, 1) == [best(0.0)]
    drafter = CostTable([1, 8], [1], [[0.0056], [0.0200]])
    for gate in (True, False):
        planner = SpecPlanner(7, verify, gate=gate, draft_costs=drafter)
        assert planner.after_draft([survival], 1, 1) == [best(0.0056)]
        for _ in range(60):  # rounds far cheaper than profiled
            planner.observe_draft(1, 0.00001)
        learnt = planner.draft_seconds(1)
        assert learnt < 0.0001  # corrected online
        assert planner.after_draft([survival], 1, 1) == [best(learnt if gate else 0.0056)]
    assert best(0.0001) == best(0.0)  # so the budget schedule kept the table's price


def test_a_request_turned_plain_by_hard_text_drafts_again_within_a_few_steps() -> None:
    """At one request the engine's estimates and the request's own see the
    same rounds; the engine's move slower, so they stay a longer-run
    reference: a request whose own fell after a hard stretch drifts back
    to them and drafts again within a few plain steps (at one weight for
    both, it waited for the drift toward the prior: 19 steps here)."""
    table = CostTable([1], [1, 8], [[1.0, 1.0]])  # verifying is free
    planner = SpecPlanner(4, table, draft_costs=CostTable([1], [1], [[1.5]]))
    own = None
    for _ in range(40):  # easy text: every draft taken
        own = planner.observe_round(own, 4, 4, None)
    for _ in range(10):  # hard text: the first draft rejected every round
        own = planner.observe_round(own, 4, 0, None)
    # Drafting pays where its expected tokens beat the drafter's price.
    assert 1 + sum(survival_of(planner.rates)) > 2.5 * (1 + MARGIN)
    assert 1 + sum(survival_of(own)) < 2.5
    plain_steps = 0
    while not any(planner.before_draft([own], [4], 1, 0)):
        own = planner.drift(own)
        plain_steps += 1
        assert plain_steps <= 4


def test_a_profiled_drafter_prices_every_load_and_is_corrected_online() -> None:
    """With the drafter's round profiled at start-up, no load is unmeasured
    (a first slow round at 8 requests once priced 1 request's round at 8's
    for hundreds of steps, and kept a batch-1 engine plain); measured rounds
    correct their bucket as the step's cells are corrected."""
    draft = CostTable([1, 8], [1], [[0.002], [0.008]])
    planner = SpecPlanner(4, CostTable([1], [1], [[1.0]]), draft_costs=draft)
    assert planner.draft_seconds(1) == pytest.approx(0.002)
    assert planner.draft_seconds(4) == pytest.approx(0.002 + 0.006 * 3 / 7)
    planner.observe_draft(8, 0.160)  # one stall: a bounded step, not 20x
    assert 0.008 < planner.draft_seconds(8) < 0.012
    for _ in range(60):
        planner.observe_draft(8, 0.016)
    assert planner.draft_seconds(8) == pytest.approx(0.016, rel=0.05)
    # A load never measured takes the measured factor; once measured, its own.
    assert planner.draft_seconds(1) == pytest.approx(0.004, rel=0.05)
    for _ in range(60):
        planner.observe_draft(1, 0.0025)
    assert planner.draft_seconds(1) == pytest.approx(0.0025, rel=0.05)
    assert planner.draft_seconds(8) == pytest.approx(0.016, rel=0.05)


def test_a_request_with_context_to_catch_up_drafts_only_where_it_pays() -> None:
    """Taking committed positions into the drafter's context costs per row
    (a prompt, or the steps a request did not draft), once for the rounds
    the request has left. Two requests alike but for that: only the one
    with nothing to catch up drafts its last round; rounds that caught up as
    priced leave the drafter's correction where it was."""
    draft = CostTable([1, 2], [1], [[0.002], [0.003]])
    planner = SpecPlanner(
        4,
        CostTable([1, 2], [1, 5], [[0.010, 0.011], [0.011, 0.012]]),
        draft_costs=draft,
        draft_row=0.0004,
    )
    owns, limits = [[0.6] * 4, [0.6] * 4], [4, 4]
    assert planner.before_draft(owns, limits, 2, 0, pending=[2, 2]) == [4, 4]
    assert planner.before_draft(owns, limits, 2, 0, pending=[2, 22]) == [4, 0]
    # Paid once for the rounds a request has left: a long one drafts anyway.
    assert planner.before_draft(owns, limits, 2, 0, pending=[2, 22], remaining=[1000] * 2) == [
        4,
        4,
    ]
    assert planner.catch_up_seconds(22) == pytest.approx(0.008)
    for _ in range(20):  # as priced: a steady round, and one catching up 100 rows
        planner.observe_draft(1, 0.002)
        planner.observe_draft(1, 0.042, pending=100)
    assert planner.draft_seconds(1) == pytest.approx(0.002, rel=1e-6)
    # Measured online only (no profile), a catch-up round is not a round's price.
    online = SpecPlanner(4, CostTable([1], [1], [[1.0]]))
    online.observe_draft(1, 0.5, pending=100)
    assert online.draft_seconds(1) == 0.0
    online.observe_draft(1, 0.002)
    assert online.draft_seconds(1) == pytest.approx(0.002)


def run_steps(planner: SpecPlanner, steps: int, spec: tuple, plain: tuple, requests: int = 4):
    """``steps`` decisions at ``requests`` decoding requests, each step then
    measured: ``spec`` / ``plain`` = (tokens generated, seconds) of a step
    that verified drafts / none. Returns whether each step speculated."""
    owns, limits = [[0.9] * 4] * requests, [4] * requests
    out = []
    for _ in range(steps):
        drafted = any(planner.before_draft(owns, limits, requests, 0))
        tokens, seconds = spec if drafted else plain
        fed = requests * 5 if drafted else requests
        planner.observe_step(requests, fed, requests, 4 * requests * drafted, tokens, seconds, 0.0)
        out.append(drafted)
    return out


def run_blocks(
    planner: SpecPlanner, steps: int, spec: tuple, plain: tuple, requests: int = 4
) -> list[bool]:
    """``run_steps``, as the blocks begun in them (a block is one regime's:
    whether it speculated)."""
    out, seen = [], planner.net.block
    for _ in range(steps):
        [drafted] = run_steps(planner, 1, spec, plain, requests)
        if planner.net.block is not seen:
            seen = planner.net.block
            out.append(drafted)
        assert not out or drafted == out[-1], "a block mixes regimes"
    return out


def waits(spoke: list[bool], explored: bool) -> list[int]:
    """The winner's blocks before each of the loser's (``explored``) blocks."""
    out, run = [], 0
    for s in spoke:
        if s == explored:
            out.append(run)
            run = 0
        else:
            run += 1
    return out


# The loser's waits as it gets measured: doubling from EXPLORE_MIN to
# EXPLORE_MAX (a gap of 100% alone would wait the most at once).
DOUBLING = [EXPLORE_MIN << k for k in range((EXPLORE_MAX // EXPLORE_MIN).bit_length())]


def test_the_net_turns_a_losing_bucket_plain_and_explores_it_by_its_loss() -> None:
    """The model (a flat table: drafts look free) speculates; measured,
    speculation delivers half of plain's goodput. After one block of each,
    the bucket is plain, and the model's blocks grow rarer as they keep
    losing: the wait doubles per block measured, up to EXPLORE_MAX."""
    planner = flat_planner()
    # Whole blocks: the first plain one is a probe.
    steps = BLOCK_STEPS * (1 + sum(DOUBLING) + len(DOUBLING) + EXPLORE_MAX + 1) + PROBE_STEPS
    spoke = run_blocks(planner, steps, spec=(4, 2.0), plain=(4, 1.0))
    assert spoke[:2] == [True, False]  # each regime measured once (plain: a probe)
    assert waits(spoke[2:], True) == [*DOUBLING, EXPLORE_MAX]
    assert planner.stats.forced_plain == steps - BLOCK_STEPS * spoke.count(True)
    # A heavier load starts plain too (``_neighbours_lead``).
    assert run_steps(planner, 1, spec=(4, 2.0), plain=(4, 1.0), requests=16) == [False]


def test_a_winning_model_keeps_its_bucket_and_plain_is_probed_rarely() -> None:
    """Plain, losing by half, is measured in probes of PROBE_STEPS steps;
    each costs a quarter of a block's loss, so they come four times as
    often as a losing model's blocks would (past the doubling)."""
    planner = flat_planner()
    steps = BLOCK_STEPS * (2 + sum(DOUBLING) + len(DOUBLING))
    spoke = run_blocks(planner, steps, spec=(16, 2.0), plain=(4, 1.0))
    assert spoke[:2] == [True, False]
    by_loss = round(1.0 * PROBE_STEPS / BLOCK_STEPS / EXPLORE_LOSS)
    expected = [min(w, by_loss) for w in DOUBLING]
    assert waits(spoke[2:], False)[: len(expected)] == expected
    assert planner.stats.forced_plain == PROBE_STEPS * spoke.count(False)


def test_one_slow_block_does_not_condemn_a_regime_for_long() -> None:
    """Plain's only block was slow (a stall): the model leads, but plain is
    measured again within EXPLORE_MIN blocks, and its real goodput wins."""
    planner = flat_planner()
    spoke = run_blocks(planner, BLOCK_STEPS, spec=(4, 1.0), plain=(4, 1.0))
    spoke += run_blocks(planner, PROBE_STEPS, spec=(4, 1.0), plain=(4, 10.0))
    spoke += run_blocks(planner, BLOCK_STEPS * 40, spec=(4, 1.2), plain=(4, 1.0))
    assert spoke[:2] == [True, False]
    assert spoke[2 + EXPLORE_MIN] is False  # measured again soon
    # Plain's real goodput wins the bucket: the stall is one block of its last few.
    assert planner.net.nets[load_bucket(4)].winner() == "plain"
    assert spoke[-20:].count(False) >= 19


def test_a_close_race_is_explored_often_and_a_tie_goes_plain() -> None:
    planner = flat_planner()
    # 3% apart: below EXPLORE_MIN blocks' worth of loss, so every EXPLORE_MIN.
    spoke = run_blocks(planner, BLOCK_STEPS * 20, spec=(4, 1.03), plain=(4, 1.0))
    assert spoke[2 : 2 + 2 * EXPLORE_MIN + 2] == ([False] * EXPLORE_MIN + [True]) * 2
    tie = flat_planner()
    spoke = run_blocks(tie, BLOCK_STEPS * 6, spec=(4, 1.0), plain=(4, 1.0))
    assert spoke[2:5] == [False] * 3  # speculation must win by NET_MARGIN


def test_a_new_load_bucket_starts_from_its_neighbours_verdict() -> None:
    """Speculation gains less the more requests share a step: above a load
    where plain won, a new bucket starts plain (whole blocks) and explores
    the model as a loser; below one the model won, it starts with the model
    and probes plain later. Without such a neighbour, the model first."""
    planner = flat_planner()
    run_blocks(planner, BLOCK_STEPS + PROBE_STEPS, spec=(4, 2.0), plain=(4, 1.0))  # plain won
    heavier = run_blocks(planner, BLOCK_STEPS * 5, spec=(16, 2.0), plain=(16, 1.0), requests=16)
    assert heavier == [False] * EXPLORE_MIN + [True]
    assert planner.stats.forced_plain == PROBE_STEPS + BLOCK_STEPS * EXPLORE_MIN
    lighter = run_blocks(planner, BLOCK_STEPS * 2, spec=(1, 2.0), plain=(1, 1.0), requests=1)
    assert lighter[:2] == [True, False]  # plain won above: no verdict for a lighter load

    planner = flat_planner()
    run_blocks(planner, BLOCK_STEPS + PROBE_STEPS, spec=(64, 2.0), plain=(16, 1.0), requests=16)
    lighter = run_blocks(planner, BLOCK_STEPS * 5, spec=(16, 2.0), plain=(4, 1.0))
    assert planner.net.nets[load_bucket(16)].winner() == "model"
    assert lighter[: EXPLORE_MIN + 1] == [True] * EXPLORE_MIN + [False]  # then a probe


def test_a_models_block_measures_the_steps_it_drafts_for() -> None:
    """A model's block measures its steps that drafted, the first after
    plain steps (a drafter's catch-up) and those beside prefill chunks
    included; the steps the model makes plain itself are plain steps, and
    a block of them says nothing: the model decides again."""
    planner = flat_planner()
    assert planner.regime(4) == "model"
    planner.observe_step(4, 64, 0, 0, 4, 3.0, 0.0)  # prefill alone: nobody decodes
    planner.observe_step(4, 40, 4, 16, 12, 1.0, 2.0)  # a round beside a chunk, drafting charged
    planner.observe_step(4, 4, 4, 0, 4, 1.0, 0.1, drafted=False)  # the model's plain step
    block = planner.net.block
    assert (block.steps, block.measured, block.tokens, block.seconds) == (2, 1, 12, 3.0)

    planner = flat_planner()
    for _ in range(BLOCK_STEPS):  # the model's own plain steps only
        assert planner.regime(4) == "model"
        planner.observe_step(4, 4, 4, 0, 4, 1.0, 0.0, drafted=False)
    assert planner.regime(4) == "model" and not planner.net.nets[load_bucket(4)].ratios
    for _ in range(BLOCK_STEPS):  # now it drafts
        assert planner.regime(4) == "model"
        planner.observe_step(4, 20, 4, 16, 12, 1.0, 0.0)
    assert planner.regime(4) == "plain"  # a probe beside it


def test_the_net_credits_a_round_its_prediction_scaled_by_what_rounds_committed() -> None:
    """A block's text must not decide a regime by chance: a round counts in
    its block at the tokens predicted for it (from the confidences where
    the drafter has them, else the request's rates), times what rounds
    committed over what was predicted for them, whatever it committed."""
    planner = flat_planner()
    own = [0.9, 0.8, 0.5, 0.5]
    assert planner.predicted_tokens(own, None, 3) == pytest.approx(1 + sum(survival_of(own[:3])))
    conf = [0.6, 0.6, 0.6, 0.6]
    calibrated = 1 + sum(planner.calibrated(conf[:2]))
    assert planner.predicted_tokens(own, planner.calibrated(conf), 2) == pytest.approx(calibrated)

    rounds = [(3.0, 0), (3.0, 2), (2.5, 4), (3.5, 4)] * 8  # (predicted, accepted of 4)
    for predicted, accepted in rounds:
        planner.observe_round(None, 4, accepted, None, predicted)
        planner.observe_step(1, 5, 1, 4, accepted + 1, 1.0, 0.0)  # no block yet
    for predicted, accepted in ((2.0, 4), (4.0, 0)):  # easy text under a low estimate, and back
        assert planner.regime(1) == "model"
        before = planner.net.block.tokens
        planner.observe_round(None, 4, accepted, None, predicted)
        planner.observe_step(1, 5, 1, 4, accepted + 1, 1.0, 0.0)
        rounds.append((predicted, accepted))
        scale = sum(a + 1 for _, a in rounds) / sum(p for p, _ in rounds)
        assert planner.net.block.tokens - before == pytest.approx(predicted * scale)


def test_reset_forgets_what_was_learnt_but_keeps_the_table() -> None:
    planner = flat_planner()
    run_steps(planner, BLOCK_STEPS * 3, spec=(4, 2.0), plain=(4, 1.0))
    planner.observe_round(None, 4, 0, [0.5] * 4)
    planner.reset()
    assert planner.rates == [PRIOR] * 4 and not planner.correction and not planner.net.nets
    assert planner.net.block is None
    assert planner.step_seconds(4, 4) == pytest.approx(1.0)
    assert any(planner.before_draft([[0.9] * 4] * 4, [4] * 4, 4, 0))


def test_estimates_follow_acceptance_and_calibrate_confidences() -> None:
    planner = flat_planner()
    own = None
    for _ in range(40):  # every round: the first two drafts accepted, the third rejected
        own = planner.observe_round(own, 4, 2, [0.5, 0.5, 0.5, 0.5])
    assert own[0] > 0.95 and own[1] > 0.95 and own[2] < 0.1
    assert own[3] == pytest.approx(PRIOR)  # never observed: the prior
    cal = planner.calibrated([0.5, 0.5, 0.5, 0.5])
    assert cal[0] == pytest.approx(1.0, abs=0.05)  # 0.5 predicted, ~1 observed
    assert cal[2] < 0.1
    other = None
    for _ in range(20):  # another request whose drafts are all accepted
        other = planner.observe_round(other, 4, 4, None)
    assert own[2] < 0.1 < planner.rates[2]  # the engine's estimate is everyone's
    drifted = planner.drift(own)
    assert own[2] < drifted[2] < planner.rates[2]  # toward the engine's estimate


def test_estimates_recover_while_nobody_drafts() -> None:
    """Rejections at high load must not keep a later, lighter load from
    speculating: while every step is plain, the engine's estimates move back
    to the prior (slowly: acceptance does not change with load, and a few
    dozen plain steps must not make every draft look likely), and a table
    on which drafts pay gets them again."""
    steep = SpecPlanner(4, CostTable([1, 64], [1, 8], [[1.0, 8.0], [64.0, 512.0]]))
    steep.rates = [0.05] * 4
    for _ in range(10):
        assert not any(steep.before_draft([None], [4], 1, 0))
    assert steep.rates[0] < 0.2
    for _ in range(1000):
        assert not any(steep.before_draft([None], [4], 1, 0))
    assert steep.rates == pytest.approx([PRIOR] * 4, abs=0.01)
    flat = flat_planner()
    flat.rates = steep.rates
    assert any(flat.before_draft([None], [4], 1, 0))


# ---- engines --------------------------------------------------------------------------

GREEDY = {"temperature": 0, "max_new_tokens": 20, "ignore_eos": True}
PROMPTS = random_prompts(4, [5, 19, 9, 30], seed=61) + [[7, 8, 9, 10] * 5]


class Alternating(SpecPlanner):
    """Drafts on every other decision: plain steps between speculative ones."""

    def __init__(self, width: int) -> None:
        super().__init__(width, CostTable([1], [1], [[1.0]]))
        self.calls = 0

    def before_draft(self, owns, limits, requests, extra, drafting=0, **_):
        self.calls += 1
        return list(limits) if self.calls % 2 else [0] * len(limits)

    def after_draft(self, survival, requests, fixed_tokens):
        return [len(s) for s in survival]


@pytest.fixture(scope="module")
def drafters(tmp_path_factory):
    root = tmp_path_factory.mktemp("planner-drafters")
    target = model_path("qwen3")
    return {
        "DSPARK": make_tiny_dspark(str(root / "v"), target),
        "DFLASH": make_tiny_dspark(str(root / "d"), target, markov_rank=0, confidence_head=False),
    }


def engine(**kw) -> Engine:
    if "speculative_algorithm" in kw:  # the default, which the suite's fixture turns off
        kw.setdefault("speculative_adaptive", "on")
    kw.setdefault("max_total_tokens", 4096)
    kw.setdefault("page_size", 4)
    return Engine(model_path=model_path("qwen3"), device="cpu", **kw)


@pytest.fixture(scope="module")
def plain_outputs():
    eng = engine()
    try:
        out = eng.generate(
            input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True, top_logprobs_num=3
        )
    finally:
        eng.shutdown()
    return out


def lp(out) -> list[float]:
    return [t[0] for t in out["meta_info"]["output_token_logprobs"]]


@pytest.mark.parametrize("alg", ["DSPARK", "DFLASH"])
def test_drafting_resumed_after_plain_steps_is_exact(drafters, plain_outputs, alg) -> None:
    """Plain steps between rounds (a planner alternating), with chunked
    prefill and a pool small enough to preempt: ids and logprobs == plain."""
    eng = engine(
        speculative_algorithm=alg,
        speculative_draft_model_path=drafters[alg],
        chunked_prefill_size=8,
        max_total_tokens=160,
    )
    try:
        eng.core.spec.planner = Alternating(eng.proposer.max_drafts)
        outs = eng.generate(
            input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True, top_logprobs_num=3
        )
        for o, p in zip(outs, plain_outputs):
            assert o["output_ids"] == p["output_ids"]
            assert lp(o) == pytest.approx(lp(p), abs=1e-5)
        stats = eng.stats()
        assert 0 < stats["spec_plain_steps"] < stats["spec_steps"]
        assert stats["spec_verify_rounds"] > 0 and stats["preemptions"] > 0
    finally:
        eng.shutdown()


def test_sampling_resumed_after_plain_steps_scores_as_plain(drafters) -> None:
    """Sampled output under plain steps and rounds mixed: each token's
    logprob is what plain decoding's scoring of the same text gives. (No
    seed: a seeded request is pinned to its own lengths.)"""
    sp = {"temperature": 0.8, "max_new_tokens": 16, "ignore_eos": True}
    eng = engine(speculative_algorithm="DSPARK", speculative_draft_model_path=drafters["DSPARK"])
    try:
        eng.core.spec.planner = Alternating(eng.proposer.max_drafts)
        outs = eng.generate(input_ids=PROMPTS[:3], sampling_params=sp, return_logprob=True)
    finally:
        eng.shutdown()
    plain = engine()
    try:
        for prompt, o in zip(PROMPTS[:3], outs):
            scored = plain.generate(
                input_ids=prompt + o["output_ids"],
                sampling_params={"max_new_tokens": 1, "temperature": 0},
                return_logprob=True,
                logprob_start_len=len(prompt) - 1,
            )
            expected = [t[0] for t in scored["meta_info"]["input_token_logprobs"]][1:]
            assert lp(o) == pytest.approx(expected, abs=1e-5)
    finally:
        plain.shutdown()


def test_a_plain_step_runs_no_drafter_and_no_extra_copy(drafters, plain_outputs) -> None:
    """A table on which drafts never pay: every step plain, the drafter never
    runs, and each step reads the device back once, as a plain engine does."""
    eng = engine(speculative_algorithm="DSPARK", speculative_draft_model_path=drafters["DSPARK"])
    ref = engine()
    try:
        # Every token costs as much as a whole step.
        eng.core.spec.planner = SpecPlanner(
            eng.proposer.max_drafts, CostTable([1, 64], [1, 8], [[1.0, 8.0], [64.0, 512.0]])
        )
        calls = {"propose": 0}
        inner = eng.proposer.propose

        def propose(*a, **kw):
            calls["propose"] += 1
            return inner(*a, **kw)

        eng.proposer.propose = propose
        fetches = {}
        for name, e in (("spec", eng), ("plain", ref)):
            staging, real = e.core.staging, e.core.staging.fetch
            fetches[name] = [0]

            def counted(tensors, real=real, n=fetches[name]):
                n[0] += 1
                return real(tensors)

            staging.fetch = counted
        outs = eng.generate(
            input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True, top_logprobs_num=3
        )
        again = ref.generate(
            input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True, top_logprobs_num=3
        )
        assert calls["propose"] == 0
        assert fetches["spec"][0] == fetches["plain"][0]
        for o, p, q in zip(outs, again, plain_outputs):
            assert o["output_ids"] == p["output_ids"] == q["output_ids"]
            assert lp(o) == pytest.approx(lp(p), abs=1e-6)
        stats = eng.stats()
        assert stats["spec_steps"] == stats["spec_plain_steps"] > 0
        assert stats["spec_verify_rounds"] == 0
    finally:
        eng.shutdown()
        ref.shutdown()


def test_a_seeded_request_keeps_its_tokens_whatever_the_load(drafters) -> None:
    """A seeded sampled request verifies its own lengths however the planner
    decides for the rest (here: plain for everyone), so its tokens are the
    fixed-length engine's, alone or beside a batch."""
    seeded = {"temperature": 0.8, "max_new_tokens": 16, "ignore_eos": True, "seed": 11}
    others = [{**GREEDY, "max_new_tokens": 16}] * (len(PROMPTS) - 1)
    kw = {"speculative_algorithm": "DSPARK", "speculative_draft_model_path": drafters["DSPARK"]}
    fixed = engine(**kw, speculative_adaptive="off")
    try:
        want = fixed.generate(input_ids=PROMPTS[0], sampling_params=seeded)["output_ids"]
    finally:
        fixed.shutdown()
    eng = engine(**kw)
    try:
        eng.core.spec.planner = SpecPlanner(  # every token costs as much as a whole step
            eng.proposer.max_drafts, CostTable([1, 64], [1, 8], [[1.0, 8.0], [64.0, 512.0]])
        )
        alone = eng.generate(input_ids=PROMPTS[0], sampling_params=seeded)["output_ids"]
        batch = eng.generate(input_ids=PROMPTS, sampling_params=[seeded, *others])
        assert alone == batch[0]["output_ids"] == want
        stats = eng.stats()
        assert stats["spec_verify_rounds"] > 0 and stats["spec_plain_steps"] > 0
    finally:
        eng.shutdown()


def test_the_default_engine_profiles_its_table_and_stays_exact(
    drafters, plain_outputs, monkeypatch
) -> None:
    profiled = []  # (requests, pending rows) of every round the profile ran
    original = DSparkProposer.profile_round

    def profile_round(self, n, prefix, pending=STEADY_ROWS):
        profiled.append((n, pending))
        return original(self, n, prefix, pending)

    monkeypatch.setattr(DSparkProposer, "profile_round", profile_round)
    eng = engine(speculative_algorithm="DSPARK", speculative_draft_model_path=drafters["DSPARK"])
    try:
        planner = eng.core.spec.planner
        assert planner is not None and planner.gate
        assert planner.costs.counts[0] == 1 and planner.costs.chains[0] == 1
        # The drafter's round is profiled at the same counts.
        assert planner.draft_costs is not None
        assert planner.draft_costs.counts == planner.costs.counts
        assert all(row[0] > 0 for row in planner.draft_costs.times)
        # And what a row to catch up adds to a round, over several requests'
        # rows (its price may round to 0 on a tiny drafter: it is timed).
        assert (min(planner.draft_costs.counts[-1], CATCH_UP_REQUESTS), CATCH_UP_ROWS) in profiled
        assert planner.draft_row >= 0
        outs = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert [o["output_ids"] for o in outs] == [p["output_ids"] for p in plain_outputs]
        assert eng.stats()["spec_steps"] > 0
    finally:
        eng.shutdown()
