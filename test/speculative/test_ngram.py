"""Prompt lookup's index against a scan of the whole history."""

from __future__ import annotations

import random

import pytest

from specserve.core import Req
from specserve.sampling.params import SamplingParams
from specserve.speculative.base import DraftProposal, Proposer
from specserve.speculative.ngram import NgramProposer
from specserve.speculative.ngram_first import NgramFirstProposer


def scanned(history: list[int], limit: int, max_match: int, min_match: int) -> list[int]:
    """The reference: what followed the latest earlier occurrence of the
    longest suffix (``max_match`` down to ``min_match`` tokens), by a scan."""
    for size in range(min(max_match, len(history) - 1), min_match - 1, -1):
        suffix = history[-size:]
        for start in range(len(history) - size - 1, -1, -1):
            if history[start : start + size] == suffix:
                return history[start + size : start + size + limit]
    return []


@pytest.mark.parametrize("seed", range(6))
def test_the_index_finds_what_a_scan_of_the_history_finds(seed) -> None:
    """A history grown a token at a time (few distinct tokens: many matches,
    at every size), looked up after each: the indexed lookup equals the
    scan, limits of 0 included."""
    rng = random.Random(seed)
    max_match, min_match = rng.choice([(4, 1), (3, 2), (5, 3), (1, 1)])
    proposer = NgramProposer(8, max_match, min_match)
    prompt = [rng.randrange(5) for _ in range(rng.randrange(1, 12))]
    req = Req("r", prompt, SamplingParams())
    for _ in range(80):
        limit = rng.randrange(0, 6)
        history = req.prompt_ids + req.output_ids
        want = scanned(history, limit, max_match, min_match) if limit else []
        assert proposer.propose([req], [limit]).tokens == [want]
        req.output_ids.append(rng.randrange(5))
    proposer.release(req)
    assert not proposer._indexes  # its index goes with it


class CountingDrafter(Proposer):
    """A drafter network's stand-in: drafts ``[7] * n`` and counts whom for."""

    max_drafts = 4

    def __init__(self) -> None:
        self.asked: list[list[str]] = []

    def propose(self, reqs, max_lens) -> DraftProposal:
        self.asked.append([r.rid for r in reqs])
        return DraftProposal([[7] * n for n in max_lens], [None] * len(reqs))


def test_ngram_first_prices_the_lookup_before_drafting_and_reuses_it() -> None:
    """``lookup`` says whom the lookup drafts for (the planner prices them at
    no drafter forward); ``propose`` takes those drafts as found and runs
    the drafter for the rest alone, and a request grown since is looked up
    afresh."""
    lookup = NgramProposer(4, 3, 1)
    drafter = CountingDrafter()
    proposer = NgramFirstProposer(lookup, drafter)
    repeating = Req("a", [1, 2, 3, 1, 2], SamplingParams())
    fresh = Req("b", [4, 5, 6], SamplingParams())
    calls = []
    inner = lookup.propose
    lookup.propose = lambda reqs, lens: calls.append(len(reqs)) or inner(reqs, lens)
    assert proposer.lookup([repeating, fresh], [2, 2]) == [True, False]
    got = proposer.propose([repeating, fresh], [2, 2])
    assert got.tokens == [[3, 1], [7, 7]]
    assert drafter.asked == [["b"]] and calls == [2]  # the lookup ran once
    repeating.output_ids.append(3)  # grown since: found afresh
    assert proposer.lookup([repeating], [3]) == [True]
    repeating.output_ids.append(1)
    assert proposer.propose([repeating], [3]).tokens == [scanned([1, 2, 3, 1, 2, 3, 1], 3, 3, 1)]
    assert calls == [2, 1, 1]
