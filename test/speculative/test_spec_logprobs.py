"""Logprobs under speculation come from the target verify row of each
committed token: long accepted runs (an oracle proposer), rejections with
residual draws, stops and grammar termination inside runs."""

from __future__ import annotations

import json

import pytest
import torch

from models_zoo import hf_logits, model_path, random_prompts
from spec_helpers import OracleProposer
from specserve import Engine

TOL = 1e-4
GREEDY = {"temperature": 0, "max_new_tokens": 30, "ignore_eos": True}
LP = dict(return_logprob=True, top_logprobs_num=5, token_ids_logprob=[4, 9, 300])


def make(mode: str, proposer=None) -> Engine:
    return Engine(
        model_path=model_path("qwen3"),
        device="cpu",
        max_total_tokens=4096,
        page_size=4,
        logprobs_mode=mode,
        proposer=proposer,
    )


def close(a: list, b: list) -> None:
    assert [t[1] for t in a] == [t[1] for t in b]
    assert [t[0] for t in a] == pytest.approx([t[0] for t in b], abs=TOL)


@pytest.fixture(scope="module", params=["raw", "processed"])
def plain(request):
    eng = make(request.param)
    yield eng
    eng.shutdown()


@pytest.mark.parametrize("schedule", [[99], [0, 2, 4, 1, 3]])  # all accepted; every accept length
def test_greedy_logprobs_equal_plain_decoding(plain, schedule) -> None:
    prompts = random_prompts(2, [7, 15], seed=71)
    rids = ["a", "b"]
    want = plain.generate(input_ids=prompts, sampling_params=GREEDY, rid=rids, **LP)
    oracle = OracleProposer(
        {r: w["output_ids"] for r, w in zip(rids, want)}, schedule, max_drafts=4
    )
    eng = make(plain.config.logprobs_mode, oracle)
    try:
        got = eng.generate(input_ids=prompts, sampling_params=GREEDY, rid=rids, **LP)
        for g, w in zip(got, want):
            assert g["output_ids"] == w["output_ids"]
            gm, wm = g["meta_info"], w["meta_info"]
            close(gm["output_token_logprobs"], wm["output_token_logprobs"])
            for a, b in zip(gm["output_top_logprobs"], wm["output_top_logprobs"]):
                close(a, b)
            for a, b in zip(gm["output_token_ids_logprobs"], wm["output_token_ids_logprobs"]):
                close(a, b)
            assert len(gm["output_token_logprobs"]) == gm["completion_tokens"]
            assert gm["spec_accept_length"] > (4.0 if schedule == [99] else 1.5)
    finally:
        eng.shutdown()


def test_sampled_tokens_report_their_target_row(plain) -> None:
    """Rejections and residual draws happen (the oracle's drafts are deterministic
    and often refused at temperature 1.5); every committed token still reports
    the target's logprob at its position, as prefill re-scoring computes it."""
    p = random_prompts(1, [9], seed=72)[0]
    sp = {"temperature": 1.5, "max_new_tokens": 25, "ignore_eos": True, "seed": 5}
    greedy_cont = plain.generate(input_ids=p, sampling_params={**GREEDY, "max_new_tokens": 60})[
        "output_ids"
    ]
    oracle = OracleProposer({"s": greedy_cont, "s2": greedy_cont}, [99], max_drafts=4)
    eng = make(plain.config.logprobs_mode, oracle)
    try:
        out = eng.generate(input_ids=p, sampling_params=sp, rid="s", return_logprob=True)
        again = eng.generate(input_ids=p, sampling_params=sp, rid="s2", return_logprob=True)
        assert again["output_ids"] == out["output_ids"]  # same seed, same result
        assert (
            again["meta_info"]["output_token_logprobs"] == out["meta_info"]["output_token_logprobs"]
        )
    finally:
        eng.shutdown()
    seq = p + out["output_ids"]
    logits = hf_logits("qwen3", seq)
    if plain.config.logprobs_mode == "processed":
        logits = logits / sp["temperature"]
    ref = torch.log_softmax(logits, dim=-1)
    lps = out["meta_info"]["output_token_logprobs"]
    assert len(lps) == out["meta_info"]["completion_tokens"]
    for j, (lp, tid, _) in enumerate(lps):
        assert lp == pytest.approx(float(ref[len(p) - 1 + j, tid]), abs=TOL)


def test_counts_after_cuts_inside_runs(plain) -> None:
    p = random_prompts(1, [8], seed=73)[0]
    base = plain.generate(input_ids=p, sampling_params={**GREEDY, "max_new_tokens": 60})
    ids, text = base["output_ids"], base["text"]
    for sp in (
        {**GREEDY, "max_new_tokens": 11},
        {**GREEDY, "stop_token_ids": [ids[6]]},
        {**GREEDY, "stop": [text[len(text) // 2 : len(text) // 2 + 3]]},
    ):
        want = plain.generate(input_ids=p, sampling_params=sp, **LP)
        eng = make(plain.config.logprobs_mode, OracleProposer({"c": ids}, [99], max_drafts=4))
        try:
            got = eng.generate(input_ids=p, sampling_params=sp, rid="c", **LP)
        finally:
            eng.shutdown()
        meta = got["meta_info"]
        assert got["output_ids"] == want["output_ids"]
        assert (
            len(meta["output_token_logprobs"])
            == meta["completion_tokens"]
            == len(got["output_ids"])
        )
        assert len(meta["output_top_logprobs"]) == meta["completion_tokens"]
        close(meta["output_token_logprobs"], want["meta_info"]["output_token_logprobs"])


def test_grammar_termination_inside_a_run(plain) -> None:
    pytest.importorskip("xgrammar")
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {"k": {"enum": ["ab", "cd"]}}, "required": ["k"]}
    sp = {"json_schema": json.dumps(schema), "temperature": 0, "max_new_tokens": 40}
    p = random_prompts(1, [6], seed=74)[0]
    want = plain.generate(input_ids=p, sampling_params=sp, **LP)
    # The oracle keeps proposing past the end of the JSON (EOS then junk).
    cont = want["output_ids"] + [40, 41, 42, 43, 44]
    eng = make(plain.config.logprobs_mode, OracleProposer({"g": cont}, [99], max_drafts=4))
    try:
        got = eng.generate(input_ids=p, sampling_params=sp, rid="g", **LP)
        assert eng.stats()["grammar_matchers"] == 0
    finally:
        eng.shutdown()
    assert got["output_ids"] == want["output_ids"]
    jsonschema.validate(json.loads(got["text"]), schema)
    meta = got["meta_info"]
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"]
    close(meta["output_token_logprobs"], want["meta_info"]["output_token_logprobs"])
    if plain.config.logprobs_mode == "processed":
        # Tokens the grammar forbids report -9999 in the top-k, never -inf.
        assert any(v == -9999.0 for top in meta["output_top_logprobs"] for v, _, _ in top)


def test_triton_kernels_in_the_speculative_path(plain) -> None:
    """Chain verification and committed-row logprobs through the Triton kernels
    (interpreted on the CPU) give what the torch references give."""
    prompts = random_prompts(2, [5, 9], seed=75)
    want = plain.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 8}, **LP)
    oracle = OracleProposer({r: w["output_ids"] for r, w in zip("ab", want)}, [2, 99], max_drafts=3)
    eng = Engine(
        model_path=model_path("qwen3"),
        device="cpu",
        max_total_tokens=1024,
        page_size=4,
        logprobs_mode=plain.config.logprobs_mode,
        proposer=oracle,
        kernel_backend="triton",
    )
    try:
        got = eng.generate(
            input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 8}, rid=["a", "b"], **LP
        )
        sampled = eng.generate(
            input_ids=prompts[0],
            sampling_params={"temperature": 1.0, "seed": 3, "max_new_tokens": 6},
            return_logprob=True,
        )
    finally:
        eng.shutdown()
    for g, w in zip(got, want):
        assert g["output_ids"] == w["output_ids"]
        close(g["meta_info"]["output_token_logprobs"], w["meta_info"]["output_token_logprobs"])
        for a, b in zip(
            g["meta_info"]["output_top_logprobs"], w["meta_info"]["output_top_logprobs"]
        ):
            close(a, b)
    assert (
        len(sampled["meta_info"]["output_token_logprobs"])
        == sampled["meta_info"]["completion_tokens"]
    )
