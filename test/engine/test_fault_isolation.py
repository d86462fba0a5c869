"""A request whose part of a step raises fails alone; every other request's
output equals its solo run, and the engine keeps serving. Faults are
injected into each stage of the step (admission, drafting, the forward,
sampling, verification, the commit) for one marked request ("poison"),
in its prefill step and in a later decode step."""

from __future__ import annotations

import pytest

from models_zoo import model_path, random_prompts
from specserve import Engine
from specserve.engine.engine import EngineStopped

PROMPTS = random_prompts(4, [5, 9, 13, 7], seed=41)
PARAMS = [
    {"temperature": 0, "max_new_tokens": 10},
    {"temperature": 0.9, "seed": 7, "max_new_tokens": 10},
    {"temperature": 0, "max_new_tokens": 10, "repetition_penalty": 1.3},
    {"temperature": 0.7, "top_k": 20, "seed": 2**64 - 1, "max_new_tokens": 10},
]
POISON = {"temperature": 0, "max_new_tokens": 10}


def make_engine(**kw) -> Engine:
    return Engine(
        model_path=model_path("qwen3"),
        device="cpu",
        page_size=4,
        max_total_tokens=2048,
        chunked_prefill_size=256,
        **kw,
    )


def run_all(engine: Engine) -> list[dict]:
    """The innocent requests beside the poison one, all admitted together."""
    return engine.generate(
        input_ids=[*PROMPTS, [9, 8, 7, 6]],
        sampling_params=[*PARAMS, POISON],
        rid=[f"innocent-{i}" for i in range(len(PROMPTS))] + ["poison"],
        return_logprob=True,
        top_logprobs_num=2,
    )


def solo(engine: Engine) -> list[dict]:
    return [
        engine.generate(input_ids=p, sampling_params=sp, return_logprob=True, top_logprobs_num=2)
        for p, sp in zip(PROMPTS, PARAMS)
    ]


def poisoned(reqs, after_tokens: int) -> bool:
    return any(r.rid == "poison" and len(r.output_ids) >= after_tokens for r in reqs)


def check(engine: Engine, expected: list[dict], status: int = 500) -> None:
    out = run_all(engine)
    bad = out[-1]["meta_info"]["finish_reason"]
    assert bad["type"] == "abort" and "injected" in bad["message"], bad
    for got, want in zip(out, expected):
        assert got["output_ids"] == want["output_ids"]
        lp = [x[0] for x in got["meta_info"]["output_token_logprobs"]]
        ref = [x[0] for x in want["meta_info"]["output_token_logprobs"]]
        assert lp == pytest.approx(ref, abs=1e-5)
    assert engine.free_pages() == engine.total_pages()
    assert engine.error is None
    # Still serving.
    again = engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})
    assert again["meta_info"]["completion_tokens"] == 2


@pytest.fixture(scope="module")
def engine():
    eng = make_engine()
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def expected(engine):
    return solo(engine)


@pytest.mark.parametrize("after_tokens", [0, 3], ids=["prefill", "decode"])
@pytest.mark.parametrize("stage", ["forward", "sample", "score", "commit"])
def test_a_failing_stage_fails_only_its_request(engine, expected, monkeypatch, stage, after_tokens):
    core = engine.core

    def failing(original, reqs_of):
        def wrapped(*args, **kwargs):
            if poisoned(reqs_of(*args), after_tokens):
                raise RuntimeError("injected fault")
            return original(*args, **kwargs)

        return wrapped

    batch_reqs = lambda batch, *rest: [s.req for s in batch.steps]  # noqa: E731
    if stage == "forward":
        monkeypatch.setattr(core.runner, "forward", failing(core.runner.forward, batch_reqs))
    elif stage == "sample":
        monkeypatch.setattr(core, "_sample", failing(core._sample, batch_reqs))
    elif stage == "score":
        proc = core.output_processor
        steps_reqs = lambda steps, *rest: [s.req for s in steps]  # noqa: E731
        monkeypatch.setattr(proc, "score", failing(proc.score, steps_reqs))
    else:
        proc = core.output_processor
        step_req = lambda step, *rest: [step.req]  # noqa: E731
        monkeypatch.setattr(proc, "commit", failing(proc.commit, step_req))
    check(engine, expected)


def test_a_request_that_cannot_be_admitted_fails_alone(engine, expected, monkeypatch) -> None:
    from specserve.engine import engine_core

    real = engine_core.PenaltyState.create

    def create(prompt_ids, *args):
        if prompt_ids == [9, 8, 7, 6]:
            raise RuntimeError("injected fault")
        return real(prompt_ids, *args)

    monkeypatch.setattr(engine_core.PenaltyState, "create", staticmethod(create))
    poison = {**POISON, "repetition_penalty": 1.1}
    out = engine.generate(
        input_ids=[*PROMPTS, [9, 8, 7, 6]],
        sampling_params=[*PARAMS, poison],
        return_logprob=True,
        top_logprobs_num=2,
    )
    assert out[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert [o["output_ids"] for o in out[:-1]] == [o["output_ids"] for o in expected]


@pytest.fixture(scope="module")
def drafter(tmp_path_factory) -> str:
    from specserve.tools.tiny_model import make_tiny_dspark

    return make_tiny_dspark(str(tmp_path_factory.mktemp("drafter")), model_path("qwen3"))


@pytest.mark.parametrize("after_tokens", [0, 3], ids=["first-round", "later-round"])
@pytest.mark.parametrize("stage", ["propose", "verify"])
@pytest.mark.parametrize("algorithm", ["NGRAM", "DSPARK"])
def test_speculation_stages_fail_only_their_request(
    drafter, monkeypatch, algorithm, stage, after_tokens
) -> None:
    if algorithm == "NGRAM":
        eng = make_engine(speculative_algorithm="NGRAM", speculative_num_draft_tokens=4)
    else:
        eng = make_engine(speculative_algorithm="DSPARK", speculative_draft_model_path=drafter)
    try:
        expected = solo(eng)
        spec = eng.core.spec
        if stage == "propose":
            original = spec.proposer.propose

            def propose(reqs, limits):
                if poisoned(reqs, after_tokens):
                    raise RuntimeError("injected fault")
                return original(reqs, limits)

            monkeypatch.setattr(spec.proposer, "propose", propose)
        else:
            original = spec.verify

            def verify(batch, *args):
                if poisoned([s.req for s in batch.steps if s.verify], after_tokens):
                    raise RuntimeError("injected fault")
                return original(batch, *args)

            monkeypatch.setattr(spec, "verify", verify)
        check(eng, expected)
    finally:
        eng.shutdown()


def test_a_device_error_stops_the_engine_and_ends_every_request(monkeypatch) -> None:
    eng = make_engine()
    try:
        original = eng.core.runner.forward

        def forward(batch):
            if poisoned([s.req for s in batch.steps], 2):
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            return original(batch)

        monkeypatch.setattr(eng.core.runner, "forward", forward)
        out = run_all(eng)
        assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in out)
        assert "CUDA error" in out[0]["meta_info"]["finish_reason"]["message"]
        assert eng.error is not None and "illegal memory access" in eng.error
        with pytest.raises(EngineStopped):
            eng.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 1})
    finally:
        eng.shutdown()


def test_seeded_generators_are_restored_when_a_step_is_rerun(engine, monkeypatch) -> None:
    """A failed computation consumed the seeded requests' random streams;
    the rerun must draw what the solo run drew."""
    sp = {"temperature": 1.0, "seed": 11, "max_new_tokens": 6}
    want = engine.generate(input_ids=PROMPTS[0], sampling_params=sp)["output_ids"]
    core = engine.core
    original = core._compute

    def compute(batch):
        result = original(batch)  # draws from every generator, then fails
        if poisoned([s.req for s in batch.steps], 1):
            raise RuntimeError("injected fault")
        return result

    monkeypatch.setattr(core, "_compute", compute)
    out = engine.generate(
        input_ids=[PROMPTS[0], [9, 8, 7, 6]], sampling_params=[sp, POISON], rid=["a", "poison"]
    )
    assert out[0]["output_ids"] == want
