"""A logits row that is no distribution (a NaN or +inf logit from the model,
or nothing left possible after processing) ends its request alone, with a
message and an internal-error status, never a silent token; the other
requests of the batch go on exactly as in their solo runs. Rows are poisoned
by wrapping the runner's forward, for plain sampling rows and verify rows,
greedy and sampled."""

from __future__ import annotations

import os

import pytest
import torch

from models_zoo import model_path
from spec_helpers import OracleProposer
from specserve import Engine
from specserve.assets import DEMO_ROOT, demo_path

pytestmark = pytest.mark.skipif(
    not os.path.isfile(os.path.join(DEMO_ROOT, "target", "config.json")),
    reason="demo assets not built",
)

INNOCENT = {
    "def f(x):": {"temperature": 0, "max_new_tokens": 6},
    "import os\n": {"temperature": 0.7, "top_k": 20, "seed": 2**64 - 1, "max_new_tokens": 6},
    "class A:": {"temperature": 0, "max_new_tokens": 6, "repetition_penalty": 1.3},
    "y = ": {"temperature": 0.8, "seed": 4, "max_new_tokens": 6, "regex": "[ab]{1,3}"},
}
# Both poisoned requests of a batch: a greedy one and a sampled one.
POISON = {
    "poison-greedy": ("for i in", {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}),
    "poison-sampled": (
        "while True:",
        {"temperature": 0.8, "seed": 3, "max_new_tokens": 6, "ignore_eos": True},
    ),
}
NOT_FINITE = "the model's logits at this position are not finite"
ALL_MINUS_INF = "the model's logits at this position are all -inf"
NOTHING_POSSIBLE = "no token is possible at this position"
LOGPROBS = {"return_logprob": True, "top_logprobs_num": 2}


def make_engine(spec: bool) -> Engine:
    extra = {}
    if spec:
        extra = {
            "speculative_algorithm": "DSPARK",
            "speculative_draft_model_path": demo_path("dspark"),
        }
    return Engine(model_path=demo_path("target"), device="cpu", max_total_tokens=4096, **extra)


@pytest.fixture(scope="module", params=["plain", "dspark"])
def setup(request):
    """An engine and the solo run of every request on it, unpoisoned."""
    eng = make_engine(request.param == "dspark")
    solo = {p: eng.generate(p, sp, **LOGPROBS) for p, sp in INNOCENT.items()}
    solo |= {rid: eng.generate(p, sp) for rid, (p, sp) in POISON.items()}
    yield eng, solo
    eng.shutdown()


def spec(eng: Engine) -> bool:
    return eng.core.spec is not None


def run_batch(eng: Engine, extra: dict[str, tuple[str, dict]]) -> dict[str, dict]:
    """The innocent requests and ``extra`` (rid -> prompt, params), admitted together."""
    rids = [f"innocent-{i}" for i in range(len(INNOCENT))] + list(extra)
    prompts = list(INNOCENT) + [p for p, _ in extra.values()]
    params = list(INNOCENT.values()) + [sp for _, sp in extra.values()]
    outs = eng.generate(prompts, params, rid=rids, **LOGPROBS)
    return dict(zip(rids, outs))


def check_innocents(eng: Engine, outs: dict[str, dict], solo: dict[str, dict]) -> None:
    for i, prompt in enumerate(INNOCENT):
        got, want = outs[f"innocent-{i}"], solo[prompt]
        assert got["output_ids"] == want["output_ids"], prompt
        lp = [x[0] for x in got["meta_info"]["output_token_logprobs"]]
        ref = [x[0] for x in want["meta_info"]["output_token_logprobs"]]
        assert lp == pytest.approx(ref, abs=1e-5)
    assert eng.free_pages() == eng.total_pages()
    assert eng.error is None
    again = eng.generate("z", {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True})
    assert again["meta_info"]["completion_tokens"] == 2


def check_failed(out: dict, message: str, internal: bool = True) -> None:
    """Aborted with ``message``: an internal error (a 500 over HTTP), or,
    when not ``internal``, the request's own doing (a 400)."""
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort", reason
    assert reason["message"].startswith("internal error") == internal, reason
    assert message in reason["message"], reason


# What a poisoned request's rows get, for the greedy one and the sampled one.
POISONS = {
    "nan": (lambda rows: rows.fill_(float("nan")),) * 2,
    "one-nan-or-inf": (  # a single bad entry: a NaN, or a +inf
        lambda rows: rows[:, 7].fill_(float("nan")),
        lambda rows: rows[:, 7].fill_(float("inf")),
    ),
    "-inf": (lambda rows: rows.fill_(float("-inf")),) * 2,
}


@pytest.mark.parametrize("after_tokens", [0, 1], ids=["prefill", "decode"])
@pytest.mark.parametrize("kind", list(POISONS))
def test_a_poisoned_row_fails_only_its_request(setup, monkeypatch, kind, after_tokens) -> None:
    eng, solo = setup
    runner = eng.core.runner
    original = runner.forward
    verified = set()  # the poisoned requests whose poisoned rows were a verify chain

    def forward(batch):
        fwd = original(batch)
        with torch.inference_mode():
            for i, step in enumerate(batch.steps):
                req = step.req
                if req.rid in POISON and len(req.output_ids) >= after_tokens:
                    # Every row of the request: its sampling row or its whole chain.
                    poison = POISONS[kind][list(POISON).index(req.rid)]
                    poison(fwd.logits[fwd.row_offsets[i] : fwd.row_offsets[i + 1]])
                    if step.verify:
                        verified.add(req.rid)
        return fwd

    monkeypatch.setattr(runner, "forward", forward)
    outs = run_batch(eng, POISON)
    for rid in POISON:
        out = outs[rid]
        check_failed(out, ALL_MINUS_INF if kind == "-inf" else NOT_FINITE)
        # Nothing from a poisoned row was committed: what it has is its clean run's start.
        ids, clean = out["output_ids"], solo[rid]["output_ids"]
        assert after_tokens <= len(ids) < len(clean) and ids == clean[: len(ids)], (ids, clean)
    # Under DSPARK the decode poisoning hits verify rows, greedy and sampled.
    assert verified == (set(POISON) if spec(eng) and after_tokens else set())
    check_innocents(eng, outs, solo)


def test_constraints_that_exclude_every_token_fail_alone(setup) -> None:
    """A valid request whose stop ids, held back by min_new_tokens, are the
    whole vocabulary: nothing is possible, not a silent token 0, and it is
    the request's own doing (a 400, not an internal error)."""
    eng, solo = setup
    every = list(range(eng.core.runner.vocab_size))
    sp = {"max_new_tokens": 4, "min_new_tokens": 2, "stop_token_ids": every}
    outs = run_batch(eng, {"boxed-in": ("a", sp)})
    check_failed(outs["boxed-in"], NOTHING_POSSIBLE, internal=False)
    assert outs["boxed-in"]["output_ids"] == []
    check_innocents(eng, outs, solo)


@pytest.mark.parametrize("poisoned_row", [2, 1], ids=["after-the-accepted", "accepted"])
def test_only_the_rows_a_chain_commits_from_count(poisoned_row) -> None:
    """Verify rows after the first rejection decide nothing: a NaN there leaves
    the request as it would have been; a NaN in a row it commits from fails it.
    Every round proposes 3 drafts of which exactly the first is right (so rows
    0 and 1 of each chain commit)."""
    prompt = [5, 9, 13, 7, 11]
    sp = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
    plain = Engine(model_path=model_path("qwen3"), device="cpu", max_total_tokens=1024)
    try:
        want = plain.generate(input_ids=prompt, sampling_params=sp)["output_ids"]
    finally:
        plain.shutdown()
    proposer = OracleProposer({"r": want}, schedule=[1], max_drafts=3)
    eng = Engine(
        model_path=model_path("qwen3"), device="cpu", max_total_tokens=1024, proposer=proposer
    )
    try:
        original = eng.core.runner.forward
        poisoned = []

        def forward(batch):
            fwd = original(batch)
            with torch.inference_mode():
                for i, step in enumerate(batch.steps):
                    if step.verify and len(step.drafts) == 3:
                        lo, hi = fwd.row_offsets[i], fwd.row_offsets[i + 1]
                        fwd.logits[lo + poisoned_row : hi].fill_(float("nan"))
                        poisoned.append(len(step.req.output_ids))
            return fwd

        eng.core.runner.forward = forward
        out = eng.generate(input_ids=prompt, sampling_params=sp, rid="r")
    finally:
        eng.shutdown()
    if poisoned_row == 2:
        assert out["output_ids"] == want
        assert len(poisoned) >= 2 and 1 in proposer.observed["r"]
    else:
        check_failed(out, NOT_FINITE)
        assert out["output_ids"] == want[:1]  # the prefill's token; the first round failed
