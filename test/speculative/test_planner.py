"""The planner that picks each step's verify lengths: its decisions under
injected costs and estimates, its safety net, and engines whose steps it
turns plain against plain decoding. (The choice itself: test_draft_choice;
the costs: test_cost_model, test_step_costs.)"""

from __future__ import annotations

import random
import time

import pytest

from models_zoo import model_path, random_prompts
from specserve import Engine
from specserve.speculative import planner as planner_module
from specserve.speculative.draft_choice import survival_of
from specserve.speculative.dspark import DSparkProposer
from specserve.speculative.planner import HOLD_MAX, MARGIN, PRIOR, SpecPlanner
from specserve.speculative.safety_net import (
    BLOCK_STEPS,
    EXPLORE_LOSS,
    EXPLORE_MAX,
    EXPLORE_MIN,
    FIRST_PAIRS,
    NET_WINDOW,
    PROBE_STEPS,
    SETTLE_STEPS,
    SafetyNet,
    load_bucket,
)
from specserve.speculative.step_costs import (
    CATCH_UP_REQUESTS,
    CATCH_UP_ROWS,
    STEADY_ROWS,
    CostTable,
)
from specserve.tools.tiny_model import make_tiny_dspark


def flat_planner(step: float = 1.0) -> SpecPlanner:
    return SpecPlanner(4, CostTable([1, 64], [1, 8], [[step, step], [step, step]]))


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
    assert planner.cost.step_seconds(1, 1) == pytest.approx(fast, rel=0.05)
    assert planner.cost.step_seconds(1, 8) == pytest.approx(verify, rel=0.05)
    assert planner.cost.draft_seconds(1) == pytest.approx(drafting, rel=0.05)
    planner.net = SafetyNet()  # the model's decision, not the safety net's
    assert planner.before_draft(owns, limits, 1, 0) == [7]


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
        learnt = planner.cost.draft_seconds(1)
        assert learnt < 0.0001  # corrected online
        assert planner.after_draft([survival], 1, 1) == [best(learnt if gate else 0.0056)]
    assert best(0.0001) == best(0.0)  # so the budget schedule kept the table's price


def test_a_request_turned_plain_by_hard_text_drafts_again_within_a_few_steps() -> None:
    """At one request the engine's estimates and the request's own see the
    same rounds; the engine's move slower, so they stay a longer-run
    reference: a request whose own fell after a hard stretch drifts back
    to them and drafts again within a few plain steps (at one weight for
    both, it waited for the engine's drift back: 19 steps here)."""
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
    assert planner.cost.catch_up_seconds(22) == pytest.approx(0.008)
    for _ in range(20):  # as priced: a steady round, and one catching up 100 rows
        planner.observe_draft(1, 0.002)
        planner.observe_draft(1, 0.042, pending=100)
    assert planner.cost.draft_seconds(1) == pytest.approx(0.002, rel=1e-6)
    # Measured online only (no profile), a catch-up round is not a round's price.
    online = SpecPlanner(4, CostTable([1], [1], [[1.0]]))
    online.observe_draft(1, 0.5, pending=100)
    assert online.cost.draft_seconds(1) == 0.0
    online.observe_draft(1, 0.002)
    assert online.cost.draft_seconds(1) == pytest.approx(0.002)


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
    planner: SpecPlanner,
    steps: int,
    spec: tuple,
    plain: tuple,
    requests: int = 4,
    lengths: list[int] | None = None,
) -> list[bool]:
    """``run_steps``, as the blocks begun in them (a block is one regime's:
    whether it speculated); ``lengths`` gets each block's steps run."""
    out, seen = [], planner.net.block
    for _ in range(steps):
        [drafted] = run_steps(planner, 1, spec, plain, requests)
        if planner.net.block is not seen:
            seen = planner.net.block
            out.append(drafted)
            if lengths is not None:
                lengths.append(0)
        if lengths is not None:
            lengths[-1] += 1
        assert not out or drafted == out[-1], "a block mixes regimes"
    return out


def expected_lengths(spoke: list[bool], plain_steps: list[int]) -> list[int]:
    """Each block's steps: a model's BLOCK_STEPS, a plain one's from
    ``plain_steps`` in turn, each with SETTLE_STEPS more after a switch."""
    plain = iter(plain_steps)
    out = []
    for k, s in enumerate(spoke):
        n = BLOCK_STEPS if s else next(plain)
        out.append(n + (SETTLE_STEPS if k and spoke[k - 1] != s else 0))
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


# A bucket's first blocks: the model's and plain's probes in turn, until its
# first verdict (FIRST_PAIRS of the model's blocks measured).
OPENING = [k % 2 == 0 for k in range(2 * FIRST_PAIRS - 1)]
OPEN = len(OPENING)
# Its steps (each switch settles first).
OPENING_STEPS = sum(BLOCK_STEPS if s else PROBE_STEPS for s in OPENING) + SETTLE_STEPS * (OPEN - 1)

# The loser's waits as it gets measured: fourfold from EXPLORE_MIN to
# EXPLORE_MAX (a gap of 100% alone would wait the most at once).
GROWING = [EXPLORE_MIN << k for k in range(0, (EXPLORE_MAX // EXPLORE_MIN).bit_length(), 2)]


def test_the_net_turns_a_losing_bucket_plain_and_explores_it_by_its_loss() -> None:
    """The model (a flat table: drafts look free) speculates; measured,
    speculation delivers half of plain's goodput. The bucket is plain once
    its opening has measured FIRST_PAIRS ratios, and the model's blocks grow
    rarer as they keep losing: the wait grows fourfold per block measured,
    up to EXPLORE_MAX."""
    planner = flat_planner()
    steps = OPENING_STEPS + BLOCK_STEPS * (sum(GROWING) + 2 * len(GROWING) + EXPLORE_MAX + 1)
    lengths: list[int] = []
    spoke = run_blocks(planner, steps, spec=(4, 2.0), plain=(4, 1.0), lengths=lengths)
    assert spoke[:OPEN] == OPENING  # each regime measured in turn (plain: in probes)
    assert waits(spoke[OPEN:], True)[: len(GROWING) + 1] == [*GROWING, EXPLORE_MAX]
    # Whole blocks but the opening's plain ones, probes; the last block runs on.
    probes = [PROBE_STEPS] * OPENING.count(False)
    whole = expected_lengths(spoke, probes + [BLOCK_STEPS] * len(spoke))
    assert lengths[:-1] == whole[:-1]
    assert planner.stats.forced_plain == sum(n for n, s in zip(lengths, spoke) if not s)
    # A heavier load starts plain too (``_neighbours_lead``).
    assert run_steps(planner, 1, spec=(4, 2.0), plain=(4, 1.0), requests=16) == [False]


def test_a_winning_model_keeps_its_bucket_and_plain_is_probed_rarely() -> None:
    """Plain, losing by half, is measured in probes of PROBE_STEPS steps,
    each step half a model step's time: a probe costs an eighth of a model
    block's time at the gap, so probes come eight times as often as a
    losing model's blocks of its own length would (past the growth)."""
    planner = flat_planner()
    steps = OPENING_STEPS + BLOCK_STEPS * (1 + sum(GROWING) + len(GROWING))
    lengths: list[int] = []
    spoke = run_blocks(planner, steps, spec=(16, 2.0), plain=(4, 1.0), lengths=lengths)
    assert spoke[:OPEN] == OPENING
    by_loss = round(1.0 * (PROBE_STEPS * 1.0) / (BLOCK_STEPS * 2.0) / EXPLORE_LOSS)
    expected = [min(w, by_loss) for w in GROWING]
    assert waits(spoke[OPEN:], False)[: len(expected)] == expected
    probes = expected_lengths(spoke, [PROBE_STEPS] * len(spoke))
    assert lengths[:-1] == probes[:-1]
    assert planner.stats.forced_plain == sum(n for n, s in zip(lengths, spoke) if not s)


def test_a_losing_models_wait_counts_its_blocks_time() -> None:
    """At a high load a model's step takes several plain ones' time: a
    losing model's block costs that many plain blocks of loss, so it waits
    that many times longer (by steps alone, exploring it took a quarter of
    a 32-client wave's time)."""
    planner = flat_planner()
    # 3 s a model step for 10% less goodput than plain's 1 s steps.
    spoke = run_blocks(planner, BLOCK_STEPS * 400, spec=(27.0, 3.0), plain=(10.0, 1.0))
    assert spoke[:OPEN] == OPENING
    gap = 10.0 / 9.0 - 1
    by_loss = round(gap * 3.0 / EXPLORE_LOSS)  # 33 plain blocks (by steps alone: 11)
    expected = [min(w, by_loss) for w in GROWING]
    assert waits(spoke[OPEN:], True)[: len(expected)] == expected


def test_an_exploration_that_finds_the_loser_ahead_brings_the_next_one_soon() -> None:
    """The model lost (half plain's goodput) until its waits grew; then the
    text turns easy and it runs 1.5x plain. The first exploration to find
    it ahead brings the next at EXPLORE_MIN (not at a fourfold longer
    wait), and so on until the new explorations outvote the old ones in
    the median (the opening's blocks, past NET_WINDOW steps, no longer
    count): the bucket is the model's again."""
    planner = flat_planner()
    losing = run_blocks(planner, OPENING_STEPS + BLOCK_STEPS * 30, spec=(4, 2.0), plain=(4, 1.0))
    assert waits(losing[OPEN:], True) == GROWING[:2]  # and the next armed at GROWING[2]
    assert GROWING[2] * BLOCK_STEPS > NET_WINDOW
    spoke = run_blocks(planner, BLOCK_STEPS * 120, spec=(6, 1.0), plain=(4, 1.0))
    found = waits(spoke, True)
    assert found[0] > EXPLORE_MIN  # the wait armed while it lost
    # Two losing explorations against the new ones: the third outvotes them.
    assert found[1:3] == [EXPLORE_MIN] * 2 and found[3] == 0
    assert planner.net.nets[load_bucket(4)].winner() == "model"
    assert spoke[-16:].count(True) >= 14  # plain in probes only


def test_one_slow_block_does_not_condemn_a_regime_for_long() -> None:
    """Plain's first probe was slow (a stall): it is the reference of the
    opening's first two model blocks, so the model leads, but its later
    blocks outvote them within EXPLORE_MIN blocks, and plain's real
    goodput wins."""
    planner = flat_planner()
    spoke = run_blocks(planner, BLOCK_STEPS, spec=(4, 1.0), plain=(4, 1.0))
    spoke += run_blocks(planner, PROBE_STEPS, spec=(4, 1.0), plain=(4, 10.0))
    spoke += run_blocks(planner, BLOCK_STEPS * 40, spec=(4, 1.2), plain=(4, 1.0))
    assert spoke[:OPEN] == OPENING
    assert False in spoke[OPEN : OPEN + EXPLORE_MIN + 1]  # plain again soon
    # Plain's real goodput wins the bucket: the stalled probe is one of its last few.
    assert planner.net.nets[load_bucket(4)].winner() == "plain"
    assert spoke[-20:].count(False) >= 19


def test_a_stalled_first_block_does_not_decide_a_bucket() -> None:
    """The model leads by 1.3x but its first block stalled: the bucket's
    first verdict waits for FIRST_PAIRS ratios, whose median is the lead,
    and the model keeps the bucket (on its first ratio alone, 0.1, plain
    took it for the next EXPLORE_MIN blocks)."""
    planner = flat_planner()
    spoke = run_blocks(planner, BLOCK_STEPS, spec=(4, 10.0), plain=(4, 1.0))  # a stall
    spoke += run_blocks(planner, BLOCK_STEPS * 20, spec=(5.2, 1.0), plain=(4, 1.0))
    assert spoke[:OPEN] == OPENING
    assert spoke[OPEN : OPEN + EXPLORE_MIN] == [True] * EXPLORE_MIN


def test_a_close_race_is_explored_often_and_a_tie_goes_plain() -> None:
    planner = flat_planner()
    # 3% apart: below EXPLORE_MIN blocks' worth of loss, so every EXPLORE_MIN.
    spoke = run_blocks(planner, BLOCK_STEPS * 20, spec=(4, 1.03), plain=(4, 1.0))
    assert spoke[OPEN : OPEN + 2 * EXPLORE_MIN + 2] == ([False] * EXPLORE_MIN + [True]) * 2
    tie = flat_planner()
    spoke = run_blocks(tie, OPENING_STEPS + BLOCK_STEPS * 4, spec=(4, 1.0), plain=(4, 1.0))
    assert spoke[OPEN : OPEN + 3] == [False] * 3  # speculation must win by NET_MARGIN


def test_a_new_load_bucket_starts_from_its_neighbours_verdict() -> None:
    """Speculation gains less the more requests share a step: above a load
    where plain won, a new bucket starts plain (whole blocks) and explores
    the model as a loser; below one the model won, it starts with the model
    and probes plain later. Without such a neighbour, the model first."""
    planner = flat_planner()
    run_blocks(planner, OPENING_STEPS, spec=(4, 2.0), plain=(4, 1.0))  # plain won
    heavier = run_blocks(planner, BLOCK_STEPS * 5, spec=(16, 2.0), plain=(16, 1.0), requests=16)
    assert heavier == [False] * EXPLORE_MIN + [True]
    probes = OPENING.count(False) * (PROBE_STEPS + SETTLE_STEPS)
    # (the first plain block settles after the opening's last, the model's)
    assert planner.stats.forced_plain == probes + SETTLE_STEPS + BLOCK_STEPS * EXPLORE_MIN
    lighter = run_blocks(planner, BLOCK_STEPS * 2, spec=(1, 2.0), plain=(1, 1.0), requests=1)
    assert lighter[:2] == [True, False]  # plain won above: no verdict for a lighter load

    planner = flat_planner()
    run_blocks(planner, OPENING_STEPS, spec=(64, 2.0), plain=(16, 1.0), requests=16)
    lighter = run_blocks(planner, BLOCK_STEPS * 5, spec=(16, 2.0), plain=(4, 1.0))
    assert planner.net.nets[load_bucket(16)].winner() == "model"
    assert lighter[: EXPLORE_MIN + 1] == [True] * EXPLORE_MIN + [False]  # then a probe


def test_a_models_block_measures_the_steps_it_drafts_for() -> None:
    """A model's block measures its steps that drafted, those beside
    prefill chunks included, not a step that only prefills: the steps the
    model makes plain itself (hard text) are plain steps. Where it drafted
    for fewer than PROBE_STEPS of them, it measures them all."""
    planner = flat_planner()
    assert planner.regime(4) == "model"
    planner.observe_step(4, 64, 0, 0, 4, 3.0, 0.0)  # prefill alone: nobody decodes
    planner.observe_step(4, 40, 4, 16, 12, 1.0, 2.0)  # a round beside a chunk, drafting charged
    planner.observe_step(4, 4, 4, 0, 4, 1.0, 0.1, drafted=False)  # the model's plain step
    block = planner.net.block
    assert block.steps == 2
    assert (block.drafted.steps, block.drafted.tokens, block.drafted.seconds) == (1, 12, 3.0)
    assert (block.every.steps, block.every.tokens, block.every.seconds) == (2, 16, 4.1)

    planner = flat_planner()
    for k in range(BLOCK_STEPS):  # drafting in a quarter of its steps: those measured
        assert planner.regime(4) == "model"
        if k % 4:
            planner.observe_step(4, 4, 4, 0, 4, 1.0, 0.0, drafted=False)
        else:
            planner.observe_step(4, 20, 4, 16, 12, 2.0, 0.0)
    assert planner.regime(4) == "plain"  # a probe beside it
    assert planner.net.nets[load_bucket(4)].blocks[-1].goodput == pytest.approx(6.0)


def test_a_model_that_keeps_choosing_plain_is_judged_and_the_nets_plain_takes_over() -> None:
    """At a high load the model chooses plain nearly every step and pays its
    decisions (and the rare round it drafts): its blocks measure below
    plain's, so the bucket goes plain by the net. (Counting only its drafted
    steps, such blocks said nothing, and a 16-request engine never had a
    verdict: 0.958x plain where the net's plain steps ran 0.985x.)"""
    # Every token costs a whole step: drafts never pay.
    planner = SpecPlanner(4, CostTable([1, 64], [1, 8], [[1.0, 8.0], [64.0, 512.0]]))
    owns, limits = [[0.9] * 4] * 4, [4] * 4
    steps = OPENING_STEPS + BLOCK_STEPS * 12
    for _ in range(steps):
        assert not any(planner.before_draft(owns, limits, 4, 0))
        by_net = planner.net.block.regime == "plain"
        # A plain step takes 1 s; the model's decision 0.05 s more.
        planner.observe_step(4, 4, 4, 0, 4, 1.0, 0.0 if by_net else 0.05)
    net = planner.net.nets[load_bucket(4)]
    assert net.measured and net.winner() == "plain"
    assert net.lead == pytest.approx(1 / 1.05)
    assert planner.stats.forced_plain > steps * 0.6


def test_the_net_charges_a_steps_prefill_chunks_alike_whichever_regime_ran_it() -> None:
    """Prefill is the arrivals' work, not a regime's: of a step with a
    chunk, the net takes off the chunk's seconds as a plain step of the
    step's shape prices them (here, a table linear in tokens: 1 ms a token,
    so a 32-token chunk 32 ms), whether the step verified drafts or not,
    and counts the decoding requests' tokens."""
    table = CostTable([1, 64], [1, 8], [[0.001, 0.008], [0.064, 0.512]])
    charged = {}
    for drafts in (4, 0):  # 4 requests verifying a draft each, or plain
        planner = SpecPlanner(4, table, gate=False)  # the table uncorrected
        assert planner.regime(5) == "model"
        decode = 4 + drafts
        planner.observe_step(5, decode + 32, 4, drafts, 8, 0.100, 0.005, decode_tokens=decode)
        tally = planner.net.block.every
        assert tally.tokens == 8
        charged[drafts] = 0.100 + 0.005 - tally.seconds
        # Decoding alone: all of its seconds.
        planner.observe_step(4, decode, 4, drafts, 8, 0.050, 0.005, decode_tokens=decode)
        assert 0.100 + 0.005 + 0.055 - tally.seconds == pytest.approx(charged[drafts])
    assert charged[4] == pytest.approx(0.032) and charged[0] == pytest.approx(0.032)
    # A chunk priced at more than its step took leaves the decoding half its price.
    planner = SpecPlanner(4, table, gate=False)
    planner.regime(5)
    planner.observe_step(5, 36, 4, 0, 4, 0.010, 0.0, decode_tokens=4)
    assert planner.net.block.every.seconds == pytest.approx(0.002)


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
        before = planner.net.block.drafted.tokens
        planner.observe_round(None, 4, accepted, None, predicted)
        planner.observe_step(1, 5, 1, 4, accepted + 1, 1.0, 0.0)
        rounds.append((predicted, accepted))
        scale = sum(a + 1 for _, a in rounds) / sum(p for p, _ in rounds)
        assert planner.net.block.drafted.tokens - before == pytest.approx(predicted * scale)


def test_reset_forgets_what_was_learnt_but_keeps_the_table() -> None:
    planner = flat_planner()
    run_steps(planner, BLOCK_STEPS * 3, spec=(4, 2.0), plain=(4, 1.0))
    planner.observe_round(None, 4, 0, [0.5] * 4)
    planner.reset()
    assert planner.rates == [PRIOR] * 4 and not planner.cost.correction and not planner.net.nets
    assert planner.net.block is None
    assert planner.cost.step_seconds(4, 4) == pytest.approx(1.0)
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


def test_estimates_before_drafting_predict_what_rounds_commit_after_the_cut() -> None:
    """The rates that decide who drafts predict the tokens a round commits
    once ``after_draft`` has cut its drafts by their confidences. Half the
    rounds are confident (all 4 drafts kept, each accepted at 0.9), half
    not (cut to 1 draft, accepted at 0.3). Counted where verified only,
    positions 2-4 are measured on the confident rounds alone and promise
    20% more tokens than the rounds commit; a cut draft counted as a miss,
    the estimate matches."""

    def run(cut_counts: bool) -> tuple[float, float]:
        """The mean over rounds of the tokens predicted before each (past a
        warm-up), and of those accepted."""
        rng = random.Random(0)
        planner, own = flat_planner(), None
        predicted, accepted_total, rounds = 0.0, 0, 4000
        for k in range(rounds):
            predicted += sum(survival_of(planner.estimates(own)))
            kept, p = (4, 0.9) if k % 2 else (1, 0.3)
            accepted = 0
            while accepted < kept and rng.random() < p:
                accepted += 1
            accepted_total += accepted
            drafted = 4 if cut_counts else None
            own = planner.observe_round(own, kept, accepted, None, drafted=drafted)
        return predicted / rounds, accepted_total / rounds

    predicted, committed = run(cut_counts=True)
    assert predicted == pytest.approx(committed, rel=0.05)
    predicted, committed = run(cut_counts=False)
    assert predicted > 1.15 * committed


def test_a_step_that_drafts_is_priced_at_the_verify_its_cut_will_run() -> None:
    """A drafter with a confidence head drafts whole chains, which
    ``after_draft`` cuts; the estimates count a cut draft as a miss (the
    test above), so they predict what the cut rounds commit, and the verify
    must be priced as cut too. Here the cut keeps every draft of half the
    rounds and the first draft of the others: priced as drafted, no choice
    beats plain; priced at the drafts the cut keeps (by brute force over
    the choices), drafting wins by a fifth, and the planner drafts."""
    table = CostTable([1], [1, 5], [[1.0, 3.0]])  # 1 .. 5 tokens: 0.5 s a draft
    drafter = CostTable([1], [1], [[0.5]])
    planner = SpecPlanner(4, table, draft_costs=drafter)
    confident, unsure = [0.99] * 4, [0.99, 0.01, 0.01, 0.01]
    assert planner.after_draft([confident], 1, 1) == [4]
    assert planner.after_draft([unsure], 1, 1) == [1]
    for _ in range(40):
        planner.after_draft([confident], 1, 1)
        planner.after_draft([unsure], 1, 1)
    kept = planner.kept[load_bucket(1)]
    assert kept[0] == pytest.approx(1.0) and kept[1:] == pytest.approx([0.5] * 3, abs=0.06)

    own = [0.8] * 4
    survival = survival_of(own)

    def best(shares: list[float]) -> float:
        """The best rate with drafts over plain's, each draft fed at its share."""
        return max(
            (1 + sum(survival[:b])) / (table(1, 1 + sum(shares[:b])) + 0.5) for b in range(1, 5)
        ) / (1 / table(1, 1))

    assert best([1.0] * 4) < 1 + MARGIN < 1.15 < best([1.0, 0.5, 0.5, 0.5])
    planner.net = SafetyNet()  # the model's decision, not the safety net's
    assert planner.before_draft([own], [4], 1, 0) == [4]
    planner.kept.clear()  # a load whose cut was never seen: priced as drafted
    assert planner.before_draft([own], [4], 1, 0) == [0]


def test_a_request_whose_drafts_were_all_cut_counts_a_miss() -> None:
    planner = flat_planner()
    own = planner.observe_cut([0.8] * 4)
    assert own[0] < 0.8 and own[1:] == [0.8] * 3 and planner.rates[0] < PRIOR


def test_a_calibration_that_cuts_every_chain_recovers_while_it_cuts() -> None:
    """A run of rejections takes the first position's calibration near 0, and
    ``after_draft`` cuts the next chains to none, unverified: each cut moves
    the calibration back toward the head's word, and chains are verified
    again within a few steps. (Verified rounds alone moving it, it stayed
    low for good: at one request, a fifth of the steps drafted for
    nothing.)"""
    planner = SpecPlanner(4, CostTable([1, 64], [1, 8], [[1.0, 2.0], [64.0, 128.0]]))
    conf = [0.6] * 4
    for _ in range(40):  # the first draft rejected every round
        planner.observe_round(None, 4, 0, conf)
    cuts = 0
    while planner.after_draft([planner.calibrated(conf)], 1, 1) == [0]:
        planner.observe_cut(None)
        cuts += 1
        assert cuts < 30, "the calibration never lets a chain be verified again"
    assert cuts > 0


def test_estimates_recover_while_nobody_drafts() -> None:
    """Rejections at high load must not keep a later, lighter load from
    speculating: while every step is plain, the engine's estimates move back
    to the long-run ones, the prior before any round was verified (slowly:
    acceptance does not change with load, and a few dozen plain steps must
    not make every draft look likely), and a table on which drafts pay gets
    them again."""
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


def test_estimates_recover_toward_what_verified_rounds_accepted() -> None:
    """An engine whose verified rounds accepted 30% of their drafts, on a
    table where a draft pays only above about half: its plain steps take the
    estimates back to 30%, not to the prior's 80%, so it never drafts again
    to find out (at 16 requests, recovering toward the prior made full
    chains look worth drafting every few dozen steps, each such step about
    0.8x plain). Drafts cut before verification count as misses in the
    engine's estimates but not in the long run."""
    half = CostTable([1, 64], [1, 2], [[1.0, 1.5], [64.0, 96.0]])  # a draft: half a step
    planner = SpecPlanner(1, half)
    for k in range(300):
        planner.observe_round(None, 1, 1 if k % 10 < 3 else 0, None)
    assert planner.long_rates[0] == pytest.approx(0.3, abs=0.1)
    for _ in range(2000):
        assert planner.before_draft([None], [1], 1, 0) == [0]
    assert planner.rates[0] == pytest.approx(planner.long_rates[0], abs=0.01)
    long = list(planner.long_rates)
    for _ in range(50):
        planner.observe_cut(None)
    assert planner.long_rates == long and planner.rates[0] < long[0]
    # The same engine with the prior kept as the long run drafts again.
    planner.long_rates = [PRIOR]
    assert any(any(planner.before_draft([None], [1], 1, 0)) for _ in range(500))


def test_a_plain_choice_by_a_wide_margin_holds_at_the_same_load(monkeypatch) -> None:
    """Drafts worth 0.6 of a plain step: the choice holds for HOLD_MAX
    steps at the same load without deciding again (at 32 requests each
    decision cost 5% of the step), with the estimates recovering as fresh
    plain decisions make them; another load decides afresh, and so does a
    near tie."""
    calls = []
    rated = planner_module.rated_drafts
    monkeypatch.setattr(
        planner_module, "rated_drafts", lambda *a, **kw: calls.append(1) or rated(*a, **kw)
    )
    linear = CostTable([1, 64], [1, 8], [[1.0, 8.0], [64.0, 512.0]])  # a token's cost each
    held, fresh = SpecPlanner(4, linear), SpecPlanner(4, linear)
    held.rates = fresh.rates = [0.2] * 4  # one draft: 1.2 tokens in 2 tokens time
    assert held.before_draft([None], [4], 1, 0) == [0] and len(calls) == 1
    assert fresh.before_draft([None], [4], 1, 0) == [0]
    for _ in range(HOLD_MAX):
        assert held.holds_plain(1, 0)
        assert fresh.before_draft([None], [4], 1, 0) == [0]
    assert len(calls) == 2 + HOLD_MAX  # the fresh planner's only
    assert held.rates == pytest.approx(fresh.rates)  # recovering alike
    assert not held.holds_plain(1, 0)  # the hold ran out
    assert held.before_draft([None], [4], 1, 0) == [0]
    assert not held.holds_plain(1, 8)  # a prefill chunk beside: decided afresh
    assert not held.holds_plain(1, 0)  # and the hold is gone
    # Beside a chunk, the hold keeps to chunks within a factor of two.
    chunky = SpecPlanner(4, linear)
    chunky.rates = [0.1] * 4  # one draft: 1.1 tokens in 6 tokens' time, not 5
    assert chunky.before_draft([None], [4], 1, 4) == [0]
    assert chunky.holds_plain(1, 5) and chunky.holds_plain(1, 7)
    assert not chunky.holds_plain(1, 8)
    # It keeps to the requests' load bucket: C, and the C - 1 left while
    # one is replaced.
    steep = CostTable([1, 64], [1, 8], [[1.0, 80.0], [64.0, 5120.0]])  # drafts dear
    busy = SpecPlanner(4, steep)
    busy.rates = [0.2] * 4
    assert busy.before_draft([None] * 16, [4] * 16, 16, 0) == [0] * 16
    assert busy.holds_plain(15, 0) and busy.holds_plain(16, 0) and busy.holds_plain(9, 0)
    assert not busy.holds_plain(17, 0)
    tie = SpecPlanner(4, linear)
    tie.rates = [0.999] * 4  # drafts worth 0.998 of plain: within the margin, no lead
    assert tie.before_draft([None], [4], 1, 0) == [0]
    assert not tie.holds_plain(1, 0)


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

    def after_draft(self, survival, requests, fixed_tokens, chunk=False):
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


class Sparse(Alternating):
    """Drafts on every fourth decision: runs of plain steps between rounds."""

    def before_draft(self, owns, limits, requests, extra, drafting=0, **_):
        self.calls += 1
        return list(limits) if self.calls % 4 == 0 else [0] * len(limits)


def test_drafting_resumed_from_rows_copied_out_is_exact(drafters, plain_outputs) -> None:
    """A request's pending features copied out of the steps' shared tensors
    (here once they keep 10 other rows alive: every few plain steps) are
    the rows the drafter reads when drafting resumes: every round drafts
    what it drafts from the rows kept in place, and ids and logprobs ==
    plain."""
    drafts, copies = [], []
    for max_shared_rows in (None, 10):
        eng = engine(
            speculative_algorithm="DSPARK", speculative_draft_model_path=drafters["DSPARK"]
        )
        try:
            proposer = eng.proposer
            proposer.max_shared_rows = max_shared_rows
            eng.core.spec.planner = Sparse(proposer.max_drafts)
            proposed, propose, copied = {}, proposer.propose, [0]

            def recorded(reqs, max_lens, propose=propose, proposed=proposed):
                proposal = propose(reqs, max_lens)
                for r, tokens in zip(reqs, proposal.tokens):
                    proposed[(r.rid, len(r.output_ids))] = list(tokens)
                return proposal

            def on_target_features(req, *a, inner=proposer.on_target_features, copied=copied):
                inner(req, *a)
                st = req.draft_state
                copied[0] += st.copied == len(st.pending)

            proposer.propose, proposer.on_target_features = recorded, on_target_features
            outs = eng.generate(
                input_ids=PROMPTS,
                sampling_params=GREEDY,
                return_logprob=True,
                top_logprobs_num=3,
                rid=[f"c{i}" for i in range(len(PROMPTS))],
            )
            for o, p in zip(outs, plain_outputs):
                assert o["output_ids"] == p["output_ids"]
                assert lp(o) == pytest.approx(lp(p), abs=1e-5)
            drafts.append(proposed)
            copies.append(copied[0])
        finally:
            eng.shutdown()
    assert copies[0] == 0 < copies[1]
    assert drafts[0] and drafts[1] == drafts[0]


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


@pytest.mark.parametrize("why", ["costs", "net"])
def test_a_plain_step_runs_no_drafter_and_no_extra_copy(drafters, plain_outputs, why) -> None:
    """Every step plain, by the cost model (a table on which drafts never
    pay) or by the safety net (whatever the table): the drafter never runs,
    and each step reads the device back once, as a plain engine does."""
    eng = engine(speculative_algorithm="DSPARK", speculative_draft_model_path=drafters["DSPARK"])
    ref = engine()
    try:
        if why == "costs":  # every token costs as much as a whole step
            table = CostTable([1, 64], [1, 8], [[1.0, 8.0], [64.0, 512.0]])
        else:  # drafts look free, but the net holds every bucket plain
            table = CostTable([1, 64], [1, 8], [[1.0, 1.0], [1.0, 1.0]])
        planner = eng.core.spec.planner = SpecPlanner(eng.proposer.max_drafts, table)
        if why == "net":
            planner.net.regime = lambda requests: "plain"
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
        forced = stats["spec_forced_plain_steps"]  # (by the costs: the net's probes)
        assert forced == stats["spec_steps"] if why == "net" else forced < stats["spec_steps"]
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
        assert planner.cost.costs.counts[0] == 1 and planner.cost.costs.chains[0] == 1
        # The drafter's round is profiled at the same counts.
        assert planner.cost.draft_costs is not None
        assert planner.cost.draft_costs.counts == planner.cost.costs.counts
        assert all(row[0] > 0 for row in planner.cost.draft_costs.times)
        # And what a row to catch up adds to a round, over several requests'
        # rows (its price may round to 0 on a tiny drafter: it is timed).
        assert (
            min(planner.cost.draft_costs.counts[-1], CATCH_UP_REQUESTS),
            CATCH_UP_ROWS,
        ) in profiled
        assert planner.cost.draft_row >= 0
        outs = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert [o["output_ids"] for o in outs] == [p["output_ids"] for p in plain_outputs]
        assert eng.stats()["spec_steps"] > 0
    finally:
        eng.shutdown()


def test_a_driver_that_turns_elsewhere_between_steps_charges_no_step_for_it(drafters) -> None:
    """The busy loop's time between two steps counts as the next step's (its
    deltas, commands taken in); after ``EngineCore.idle`` it does not: a
    driver that runs another engine's step meanwhile (the lockstep
    benchmark) must not make this engine's steps look dearer, which would
    make drafting look cheaper by comparison."""
    from specserve.core import Req

    eng = engine(speculative_algorithm="DSPARK", speculative_draft_model_path=drafters["DSPARK"])
    try:
        core = eng.core
        sampling = {"max_new_tokens": 16, "ignore_eos": True}
        for prompt in PROMPTS[:2]:
            (g,), _ = eng.requests.build(None, sampling, input_ids=prompt)
            assert core.add(Req(g.rid, g.input_ids, g.sampling, g.logprob, eng.eos_ids)) is None
        for _ in range(3):
            core.step()
        stats = core.spec.planner.stats

        def charged(idle: bool) -> float:
            before = stats.measured_seconds
            time.sleep(0.5)  # another engine's step, say
            if idle:
                core.idle()
            core.step()
            return stats.measured_seconds - before

        assert charged(idle=False) >= 0.5
        assert charged(idle=True) < 0.25
        assert core.has_work()
    finally:
        eng.shutdown()
