"""The shared commit path on hand-made runs of several tokens per request:
truncation at the first stop, logprobs of exactly the committed tokens, and
text that never shows half a character."""

from __future__ import annotations

import pytest
import torch

from models_zoo import model_path
from specserve.core import LogprobOptions, Req, ReqStep
from specserve.engine.output_processor import OutputProcessor, PendingRuns
from specserve.host import HostStaging
from specserve.sampling.params import SamplingParams
from specserve.tokenizer.tokenizer import Tokenizer

V = 528


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(model_path("qwen3"))


def make(tok: Tokenizer, text_run: str | None = None, eos=frozenset({2}), **sp) -> Req:
    r = Req(
        "r",
        [5, 6, 7],
        SamplingParams(**sp),
        LogprobOptions(return_logprob=True, top_logprobs_num=2),
        eos,
    )
    r.num_computed = r.seq_len
    return r


def commit(proc: OutputProcessor, req: Req, run: list[int], logits: torch.Tensor) -> None:
    """Scores and commits ``run`` as the engine does: on the device, one fetch."""
    step = ReqStep(req, req.prompt_len, 0, True)
    pending = PendingRuns([0], [list(range(len(run)))], torch.tensor(run))
    scores = proc.score([step], [0, len(run)], [pending], logits)
    host = HostStaging("cpu").fetch(pending.tensors() + scores.tensors())
    (commit_run,) = pending.commits(host[0], host[1])
    (step_scores,) = scores.finish(host[2:], host[0])
    proc.commit(step, commit_run, step_scores)


def words(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize(
    ("case", "params", "expect_n", "reason"),
    [
        ("eos inside the run", {}, 3, {"type": "stop", "matched": 2}),
        ("length cap inside the run", {"max_new_tokens": 2}, 2, {"type": "length"}),
        ("stop id inside the run", {"stop_token_ids": [40]}, 2, {"type": "stop", "matched": 40}),
        ("no stop", {"ignore_eos": True}, 5, None),
    ],
)
def test_run_is_truncated_at_the_first_stop(tok, case, params, expect_n, reason) -> None:
    proc = OutputProcessor(tok, "raw", context_length=4096)
    req = make(tok, **params)
    run = [30, 40, 2, 50, 60]
    logits = torch.randn(len(run), V, generator=torch.Generator().manual_seed(0))
    commit(proc, req, run, logits)
    assert req.output_ids == run[:expect_n]
    assert (req.finish_reason.to_dict() if req.finish_reason else None) == reason
    assert len(req.output_logprobs) == expect_n
    ref = torch.log_softmax(logits, dim=-1)
    for j, e in enumerate(req.output_logprobs):
        assert e.token_id == run[j] and e.logprob == pytest.approx(float(ref[j, run[j]]), abs=1e-5)
        assert [t[1] for t in e.top] == ref[j].topk(2).indices.tolist()


def test_stop_string_inside_a_run_cuts_text_and_tokens(tok) -> None:
    proc = OutputProcessor(tok, "raw", context_length=4096)
    ids = words(tok, "alpha beta gamma delta")
    req = make(tok, stop=["ta gam"], ignore_eos=True)
    commit(proc, req, ids, torch.zeros(len(ids), V))
    decoded = [tok.decode(ids[: i + 1]) for i in range(len(ids))]
    n = next(i + 1 for i, d in enumerate(decoded) if "ta gam" in d)
    assert req.output_ids == ids[:n] and len(req.output_logprobs) == n
    assert req.text == "alpha be" and req.finish_reason.matched == "ta gam"


def test_stop_string_spanning_two_runs(tok) -> None:
    proc = OutputProcessor(tok, "raw", context_length=4096)
    ids = words(tok, "one two three four")
    req = make(tok, stop=["two th"], ignore_eos=True)
    half = 2  # "one" " two" | " three" ...
    commit(proc, req, ids[:half], torch.zeros(half, V))
    assert not req.finished and req.text == tok.decode(ids[:half])
    commit(proc, req, ids[half:], torch.zeros(len(ids) - half, V))
    assert req.finished and req.text == "one "


def test_multibyte_characters_are_released_whole(tok) -> None:
    text = "naïve café 😀 日本語 ok"
    ids = words(tok, text)
    assert len(ids) > len(text.split())  # the characters really are split over tokens
    proc = OutputProcessor(tok, "raw", context_length=4096)
    req = make(tok, ignore_eos=True, max_new_tokens=len(ids))
    seen = []
    for t in ids:
        commit(proc, req, [t], torch.zeros(1, V))
        seen.append(req.text)
        assert "\ufffd" not in req.text
    assert req.text == text == tok.decode(ids)
    assert any(a == b for a, b in zip(seen, seen[1:]))  # some tokens had to wait for the next


def test_max_new_tokens_cut_mid_character_flushes_like_decode(tok) -> None:
    ids = words(tok, "😀")
    assert len(ids) >= 2
    proc = OutputProcessor(tok, "raw", context_length=4096)
    req = make(tok, ignore_eos=True, max_new_tokens=1)
    commit(proc, req, ids, torch.zeros(len(ids), V))
    assert req.output_ids == ids[:1] and req.text == tok.decode(ids[:1])
