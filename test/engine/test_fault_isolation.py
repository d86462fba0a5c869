"""A request whose part of a step raises fails alone, with its error
(finish_reason abort, the error's text, status 500); every other request's
output equals its solo run, every KV page (the drafter's own pool too) is
free after, and the engine keeps serving. Faults are injected into each
stage of the step (admission, drafting, the forward, sampling,
verification, the commit) for one marked request ("poison"), in its
prefill step and in a later decode step, plain and under speculation."""

from __future__ import annotations

from typing import Any

import pytest

from models_zoo import model_path, random_prompts
from specserve import Engine
from specserve.cache.block_pool import BlockPool
from specserve.core import FinishReason
from specserve.engine.engine import EngineStopped

PROMPTS = random_prompts(4, [5, 9, 13, 7], seed=41)
PARAMS = [
    {"temperature": 0, "max_new_tokens": 10},
    {"temperature": 0.9, "seed": 7, "max_new_tokens": 10},
    {"temperature": 0, "max_new_tokens": 10, "repetition_penalty": 1.3},
    {"temperature": 0.7, "top_k": 20, "seed": 2**64 - 1, "max_new_tokens": 10},
]
POISON = {"temperature": 0, "max_new_tokens": 10}
POISON_IDS = [9, 8, 7, 9, 8, 7, 9, 8]  # NGRAM drafts for it from the start
FAULT = "RuntimeError: injected fault"


def make_engine(**kw) -> Engine:
    return Engine(
        model_path=model_path("qwen3"),
        device="cpu",
        page_size=4,
        max_total_tokens=2048,
        chunked_prefill_size=256,
        **kw,
    )


def every_pool(engine: Engine) -> list[BlockPool]:
    """The target's KV pools and a drafter's own draft KV pool (DSPARK's,
    which ``Engine.free_pages`` does not count)."""
    draft = getattr(engine.proposer, "block_pool", None)
    return [*engine.core.pools, *([draft] if draft is not None else [])]


def run_all(
    engine: Engine, monkeypatch, poison: dict[str, Any] = POISON
) -> tuple[list[dict], list[FinishReason | None]]:
    """The innocent requests beside the poison one, all admitted together:
    the results, and each one's finish reason as the engine ended it (its
    status is not in the result dict)."""
    rids = [f"innocent-{i}" for i in range(len(PROMPTS))] + ["poison"]
    reasons: dict[str, FinishReason | None] = {}
    fmt = engine.format

    def spy(greq, out):
        reasons[greq.rid] = out.finish_reason
        return fmt(greq, out)

    monkeypatch.setattr(engine, "format", spy)
    out = engine.generate(
        input_ids=[*PROMPTS, POISON_IDS],
        sampling_params=[*PARAMS, poison],
        rid=rids,
        return_logprob=True,
        top_logprobs_num=2,
    )
    assert len(out) == len(rids)
    return out, [reasons[r] for r in rids]


def solo(engine: Engine) -> list[dict]:
    return [
        engine.generate(input_ids=p, sampling_params=sp, return_logprob=True, top_logprobs_num=2)
        for p, sp in zip(PROMPTS, PARAMS)
    ]


def poisoned(reqs, after_tokens: int) -> bool:
    return any(r.rid == "poison" and len(r.output_ids) >= after_tokens for r in reqs)


def assert_failed(reason: FinishReason | None, result: dict, text: str = FAULT) -> None:
    """The request failed with the injected error: abort, its text, and the
    status its HTTP answer gets (500: not the client's fault)."""
    assert reason is not None and (reason.type, reason.status) == ("abort", 500), reason
    assert reason.message is not None and text in reason.message, reason
    assert result["meta_info"]["finish_reason"] == reason.to_dict()


def assert_all_free(engine: Engine) -> None:
    pools = every_pool(engine)
    assert [p.free_pages() for p in pools] == [p.total_pages() for p in pools]


def check(engine: Engine, expected: list[dict], monkeypatch) -> None:
    out, reasons = run_all(engine, monkeypatch)
    assert_failed(reasons[-1], out[-1])
    for got, want in zip(out, expected):
        assert got["output_ids"] == want["output_ids"]
        lp = [x[0] for x in got["meta_info"]["output_token_logprobs"]]
        ref = [x[0] for x in want["meta_info"]["output_token_logprobs"]]
        assert lp == pytest.approx(ref, abs=1e-5)
    assert_all_free(engine)
    assert engine.error is None
    # Still serving.
    again = engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})
    assert again["meta_info"]["completion_tokens"] == 2


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """``get(algorithm)``: an engine (built once per module) and its requests' solo runs."""
    from specserve.tools.tiny_model import make_tiny_dspark

    built: dict[str, tuple[Engine, list[dict]]] = {}

    def get(algorithm: str) -> tuple[Engine, list[dict]]:
        if algorithm not in built:
            if algorithm == "plain":
                eng = make_engine()
            elif algorithm == "NGRAM":
                eng = make_engine(speculative_algorithm="NGRAM", speculative_num_draft_tokens=4)
            else:
                root = str(tmp_path_factory.mktemp("drafter"))
                drafter = make_tiny_dspark(root, model_path("qwen3"))
                eng = make_engine(
                    speculative_algorithm="DSPARK", speculative_draft_model_path=drafter
                )
            built[algorithm] = (eng, solo(eng))
        return built[algorithm]

    yield get
    for eng, _ in built.values():
        eng.shutdown()


# Under DSPARK the forward is a verify forward that captures the drafter's
# features, and the commit hands them on; sampling and scoring are shared.
STAGES = [("plain", stage) for stage in ("forward", "sample", "score", "commit")]
STAGES += [("DSPARK", "forward"), ("DSPARK", "commit")]


@pytest.mark.parametrize("after_tokens", [0, 3], ids=["prefill", "decode"])
@pytest.mark.parametrize(("algorithm", "stage"), STAGES)
def test_a_failing_stage_fails_only_its_request(
    engines, monkeypatch, algorithm, stage, after_tokens
) -> None:
    engine, expected = engines(algorithm)
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
    check(engine, expected, monkeypatch)


@pytest.mark.parametrize("algorithm", ["plain", "DSPARK"])
def test_a_request_that_cannot_be_admitted_fails_alone(engines, monkeypatch, algorithm) -> None:
    from specserve.engine import engine_core

    engine, expected = engines(algorithm)
    real = engine_core.PenaltyState.create

    def create(prompt_ids, *args):
        if prompt_ids == POISON_IDS:
            raise RuntimeError("injected fault")
        return real(prompt_ids, *args)

    monkeypatch.setattr(engine_core.PenaltyState, "create", staticmethod(create))
    out, reasons = run_all(engine, monkeypatch, {**POISON, "repetition_penalty": 1.1})
    assert_failed(reasons[-1], out[-1])
    assert out[-1]["output_ids"] == []
    assert [o["output_ids"] for o in out[:-1]] == [o["output_ids"] for o in expected]
    assert_all_free(engine)


@pytest.mark.parametrize("after_tokens", [0, 3], ids=["first-round", "later-round"])
@pytest.mark.parametrize("stage", ["propose", "verify"])
@pytest.mark.parametrize("algorithm", ["NGRAM", "DSPARK"])
def test_speculation_stages_fail_only_their_request(
    engines, monkeypatch, algorithm, stage, after_tokens
) -> None:
    eng, expected = engines(algorithm)
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
    check(eng, expected, monkeypatch)


def test_a_device_error_stops_the_engine_and_ends_every_request(monkeypatch) -> None:
    eng = make_engine()
    try:
        original = eng.core.runner.forward

        def forward(batch):
            if poisoned([s.req for s in batch.steps], 2):
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            return original(batch)

        monkeypatch.setattr(eng.core.runner, "forward", forward)
        out, reasons = run_all(eng, monkeypatch)
        for result, reason in zip(out, reasons):
            assert_failed(reason, result, "CUDA error: an illegal memory access")
        assert eng.error is not None and "illegal memory access" in eng.error
        with pytest.raises(EngineStopped):
            eng.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 1})
    finally:
        eng.shutdown()


def test_seeded_generators_are_restored_when_a_step_is_rerun(engines, monkeypatch) -> None:
    """A failed computation consumed the seeded requests' random streams;
    the rerun must draw what the solo run drew."""
    engine, _ = engines("plain")
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
        input_ids=[PROMPTS[0], POISON_IDS], sampling_params=[sp, POISON], rid=["a", "poison"]
    )
    assert out[0]["output_ids"] == want
    assert out[1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert FAULT in out[1]["meta_info"]["finish_reason"]["message"]
