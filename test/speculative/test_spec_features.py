"""What equality with plain decoding cannot see: the verifier repairs any bad
draft, so these tests look at the drafts themselves, recorded as the target
verified them (``VerifyRecorder``): a token map's drafts stay in the map, the
n-gram lookup behind --speculative-ngram-first supplies drafts that are
accepted, and the confidence threshold shortens the chains it should."""

from __future__ import annotations

import os

import pytest
import torch

from models_zoo import model_path, random_prompts
from spec_helpers import VerifyRecorder
from specserve import Engine
from specserve.assets import DEMO_ROOT, demo_path
from specserve.tools.tiny_model import make_tiny_dspark

GREEDY = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}
# Random prompts, and one that repeats itself (n-gram matches from the start).
PROMPTS = random_prompts(3, [5, 17, 9], seed=61) + [[7, 8, 9, 10] * 6]
RIDS = [f"f{i}" for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def drafter(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("feature-drafter")
    return make_tiny_dspark(str(root / "g"), model_path("qwen3"), markov_head_type="gated", seed=1)


def engine(**kw) -> Engine:
    return Engine(
        model_path=model_path("qwen3"), device="cpu", max_total_tokens=4096, page_size=4, **kw
    )


@pytest.fixture(scope="module")
def plain() -> dict[str, list[int]]:
    eng = engine()
    try:
        outs = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY, rid=RIDS)
    finally:
        eng.shutdown()
    return {rid: o["output_ids"] for rid, o in zip(RIDS, outs)}


Proposed = dict[tuple[str, int], tuple[list[int], list[float] | None, int]]


def record_proposals(proposer) -> Proposed:
    """Wraps ``proposer.propose``: per (request, tokens committed), the drafts
    it proposed, their confidences (None without) and the limit it was given."""
    proposed: Proposed = {}
    inner = proposer.propose

    def recorded(reqs, max_lens):
        proposal = inner(reqs, max_lens)
        for i, (r, tokens, limit) in enumerate(zip(reqs, proposal.tokens, max_lens)):
            conf = None if proposal.confidence is None else list(proposal.confidence[i])
            proposed[(r.rid, len(r.output_ids))] = (list(tokens), conf, limit)
        return proposal

    proposer.propose = recorded
    return proposed


def verified_run(eng: Engine, plain: dict[str, list[int]]) -> VerifyRecorder:
    """The engine's greedy run of PROMPTS (then shut down), equal to plain
    decoding, with every verified chain recorded."""
    recorder = VerifyRecorder(eng)
    try:
        outs = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY, rid=RIDS)
    finally:
        eng.shutdown()
    assert {rid: o["output_ids"] for rid, o in zip(RIDS, outs)} == plain
    return recorder


@pytest.mark.skipif(
    not os.path.isfile(os.path.join(DEMO_ROOT, "target", "config.json")),
    reason="demo assets not built",
)
def test_token_map_drafts_only_mapped_tokens(tmp_path) -> None:
    """The demo's trained drafter with a sparse map (every third id, and what
    plain decoding emits but a third of it): the drafter would propose the
    missing tokens, as they are what the target says next, yet every verified
    draft is in the map, and many are accepted (the drafter's hot indices
    became token ids: read as ids, most would be outside the map)."""
    sp = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    demo = {"model_path": demo_path("target"), "device": "cpu", "max_total_tokens": 2048}
    prompts = ["class Queue:\n    def __init__(self, maxsize=0):\n", "for i in range(10):\n"]
    rids = ["q", "r"]
    eng = Engine(**demo)
    try:
        want = {rid: o["output_ids"] for rid, o in zip(rids, eng.generate(prompts, sp, rid=rids))}
        vocab = eng.runner.model_config.vocab_size
    finally:
        eng.shutdown()
    emitted = sorted({t for ids in want.values() for t in ids} - {*range(0, vocab, 3)})
    missing = set(emitted[::3])
    hot = sorted(({*range(0, vocab, 3)} | set(emitted)) - missing)
    torch.save(torch.tensor(hot), tmp_path / "map.pt")
    eng = Engine(
        **demo,
        speculative_algorithm="DSPARK",
        speculative_draft_model_path=demo_path("dspark"),
        speculative_token_map=str(tmp_path / "map.pt"),
    )
    recorder = VerifyRecorder(eng)
    try:
        got = {rid: o["output_ids"] for rid, o in zip(rids, eng.generate(prompts, sp, rid=rids))}
    finally:
        eng.shutdown()
    assert got == want
    drafts = [t for _, _, chain in recorder.chains for t in chain]
    assert drafts and set(drafts) <= set(hot), sorted(set(drafts) - set(hot))
    assert any(t in missing for ids in want.values() for t in ids)
    assert sum(recorder.accepted(want)) >= 20


def test_ngram_first_lookup_supplies_accepted_drafts(plain, drafter) -> None:
    """Wherever the lookup finds a match its drafts are what the target
    verifies, whole (the drafter's confidence policy takes them as certain),
    the drafter's everywhere else, and the lookup's drafts on the repeating
    prompt are accepted."""
    eng = engine(
        speculative_algorithm="DSPARK",
        speculative_draft_model_path=drafter,
        speculative_ngram_first=True,
        speculative_ngram_min_match=2,
    )
    found = record_proposals(eng.proposer.prompt_lookup)
    recorder = verified_run(eng, plain)
    accepted = recorder.accepted(plain)
    by_lookup = drafter_rounds = 0
    for (rid, committed, chain), kept in zip(recorder.chains, accepted):
        looked, _, limit = found[(rid, committed)]
        if looked:  # taken whole: lookup drafts count as certain
            assert chain == looked[:limit], (rid, committed)
            by_lookup += kept
        else:
            drafter_rounds += 1
    assert drafter_rounds > 0, "the drafter never drafted"
    assert by_lookup >= 10, by_lookup  # the repeating prompt's lookups are mostly kept
    assert not eng.proposer.prompt_lookup._indexes  # each went with its request


def test_confidence_threshold_cuts_chains_at_the_first_low_confidence(plain, drafter) -> None:
    """--speculative-dspark-confidence-threshold: each verified chain is its
    block's drafts before the first confidence under the threshold, so some
    chains are shorter than the block (a threshold the random drafter's
    confidences straddle), and rounds that drafted nothing verify nothing."""
    threshold = 0.5
    eng = engine(
        speculative_algorithm="DSPARK",
        speculative_draft_model_path=drafter,
        speculative_dspark_confidence_threshold=threshold,
    )
    proposed = record_proposals(eng.proposer)
    recorder = verified_run(eng, plain)
    verified = {(rid, committed): chain for rid, committed, chain in recorder.chains}
    assert set(verified) <= set(proposed)
    cut = whole = 0
    for key, (tokens, conf, limit) in proposed.items():
        keep = next((k for k, c in enumerate(conf) if c < threshold), len(conf))
        assert verified.get(key, []) == tokens[: min(keep, limit)], key
        cut += keep < min(len(tokens), limit)
        whole += 0 < keep == len(tokens)  # a whole block kept
    assert cut > 0 and whole > 0, (cut, whole)
