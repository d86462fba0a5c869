"""The planner's decision against a brute-force search: a global top-B of
the requests' survival estimates over a step's cost curve."""

from __future__ import annotations

import itertools

import pytest

from specserve.speculative import draft_choice
from specserve.speculative.draft_choice import choose_drafts as choose_listed
from specserve.speculative.draft_choice import rated_drafts, static_lengths, survival_of
from specserve.speculative.planner import MARGIN


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


def test_a_request_whose_drafts_are_found_drafts_where_the_drafter_is_dear() -> None:
    """Prompt lookup found the first request's drafts: it joins without the
    drafter's forward (nor its context to catch up), so it verifies them
    where the drafter's cost makes a drafting request plain."""
    survival = [survival_of([0.9] * 4)] * 2
    steps = [1.0] * 9  # verifying is free
    drafts = [0.0, 10.0, 20.0]  # the drafter, for 0 / 1 / 2 requests
    assert choose_listed(survival, steps, drafts) == [0, 0]
    assert choose_listed(survival, steps, drafts, free=[True, False]) == [4, 0]
    assert choose_listed(survival, steps, drafts, 0.0, [5.0, 0.0], [True, False]) == [4, 0]


def goodput(survival, lengths, step, fixed, draft) -> float:
    expected = len(survival) + sum(sum(s[:k]) for s, k in zip(survival, lengths))
    seconds = step(fixed + sum(lengths))
    if draft is not None and any(lengths):
        seconds += draft(sum(k > 0 for k in lengths))
    return expected / seconds


@pytest.mark.parametrize("scan", ["list", "array"])
@pytest.mark.parametrize("seed", range(12))
def test_the_choice_is_the_best_of_every_prefix_combination(seed, scan, monkeypatch) -> None:
    """Brute force over every (k_1..k_R): none beats the chosen lengths'
    expected tokens per second, on a staircase (bucketed) cost, whichever
    scan (Python's list, numpy's arrays) finds them."""
    import random

    monkeypatch.setattr(draft_choice, "NUMPY_DRAFTS", 0 if scan == "array" else 10**9)
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


@pytest.mark.parametrize("seed", range(4))
def test_the_array_scan_chooses_as_the_list_scan(seed, monkeypatch) -> None:
    """Past the brute force's reach (up to 64 requests of 7 drafts, ties,
    prompt lookup, requests dear to join, drafts a cut may drop), both
    scans choose alike and rate the choice alike to the last bit."""
    import random

    rng = random.Random(seed)
    for _ in range(150):
        r, width = rng.choice([2, 9, 64]), rng.choice([1, 7])
        rates = [
            [rng.choice([rng.random(), 0.5, 1.0, 0.0]) for _ in range(width)] for _ in range(r)
        ]
        survival = [survival_of(x[: rng.randint(0, width)]) for x in rates]
        slope = rng.choice([0.0, rng.uniform(0, 0.05)])
        steps = [0.01 * (1 + slope * k) for k in range(r * width + 1)]
        drafts = [0.0] + [rng.uniform(0.0, 0.01) * k**0.5 for k in range(1, r + 1)]
        join = [rng.choice([0.0, rng.uniform(0, 0.005)]) for _ in range(r)]
        free = [rng.random() < 0.3 for _ in range(r)] if rng.random() < 0.3 else None
        fed = [rng.uniform(0.2, 1.0) for _ in range(width)] if rng.random() < 0.5 else None
        got = []
        for threshold in (10**9, 0):
            monkeypatch.setattr(draft_choice, "NUMPY_DRAFTS", threshold)
            got.append(rated_drafts(survival, steps, drafts, MARGIN, join, free, fed))
        assert got[0] == got[1]
