"""benchmark/soak.py: its checks catch what they name, its verdict fails a
leaking or wrong run, and a one-minute soak of a DSPARK demo server passes."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "benchmark")


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCH, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


checks = load("soak_checks")
report = load("soak_report")
Answer = checks.Answer


def case(name: str) -> checks.Case:
    return next(c for c in checks.make_cases([1, 2, 3]) if c.name == name)


def generated(logprobs: list[float], **extra) -> Answer:
    """A /generate answer with top-2 logprobs whose first entry is the token."""
    ids = list(range(10, 10 + len(logprobs)))
    return Answer(
        text="abc"[: len(logprobs)],
        tokens=ids,
        logprobs=list(logprobs),
        top=[[(i, lp), (99, lp - 1.0)] for i, lp in zip(ids, logprobs)],
        finish="length",
        extra={"completion_tokens": len(ids), "prompt_tokens": 4, "logprob_ids": list(ids),
               "input": [None, -1.0, -2.0, -3.0], "input_top": [], "ids": [], **extra},
    )  # fmt: skip


def test_a_greedy_answer_must_equal_its_reference_within_2e_5() -> None:
    ref = generated([-1.0, -2.0, -0.5])
    assert checks.mismatch(generated([-1.0, -2.0 + 1.5e-5, -0.5]), ref) is None
    assert "logprob 1" in checks.mismatch(generated([-1.0, -2.0 + 3e-5, -0.5]), ref)
    other = generated([-1.0, -2.0, -0.5])
    other.tokens[2] += 1
    assert "tokens" in checks.mismatch(other, ref)
    other = generated([-1.0, -2.0, -0.5])
    other.text = "abd"
    assert "text" in checks.mismatch(other, ref)
    other = generated([-1.0, -2.0, -0.5], input=[None, -1.0, -2.0, -3.1])
    assert "input 3" in checks.mismatch(other, ref)
    other = generated([-1.0, -2.0, -0.5])
    other.finish = "stop"
    assert "finish_reason" in checks.mismatch(other, ref)


def test_a_partial_answer_must_be_a_prefix_of_the_reference() -> None:
    ref = generated([-1.0, -2.0, -0.5])
    assert checks.prefix_mismatch(generated([-1.0, -2.0]), ref) is None
    assert "logprob 1" in checks.prefix_mismatch(generated([-1.0, -2.1]), ref)
    off = generated([-1.0, -2.0])
    off.tokens[1] = 7
    assert "tokens" in checks.prefix_mismatch(off, ref)


def test_top_lists_may_differ_only_by_a_tie_at_the_cut_off() -> None:
    same_top = checks.same_top
    assert same_top([("a", -1.0), ("b", -2.0)], [("a", -1.0), ("c", -2.0)])  # b and c tie
    assert not same_top([("a", -1.0), ("b", -2.0)], [("c", -1.0), ("b", -2.0)])
    assert not same_top([("a", -1.0), ("b", -2.0)], [("a", -1.0), ("b", -2.0001)])
    assert not same_top([("a", -1.0)], [("a", -1.0), ("b", -2.0)])


def test_shapes_one_logprob_entry_per_token_and_the_asked_top_k() -> None:
    gen = case("gen-logprobs")  # top 2, prompt logprobs from 0
    good = generated([-1.0, -2.0])
    assert checks.shape_errors(gen, [good], None, 1) == []
    assert "2 choices, asked for 1" in checks.shape_errors(gen, [good, good], None, 1)[0]
    short = generated([-1.0, -2.0])
    short.logprobs.pop()
    assert "lengths [1, 2]" in checks.shape_errors(gen, [short], None, 1)[0]
    wide = generated([-1.0, -2.0])
    wide.top[1].append((98, -9.0))
    assert "3 top logprobs at 1, asked for 2" in checks.shape_errors(gen, [wide], None, 1)[0]
    ids = generated([-1.0, -2.0], logprob_ids=[10, 12])
    assert "logprob ids differ" in checks.shape_errors(gen, [ids], None, 1)[0]
    prompt = generated([-1.0, -2.0], input=[None, -1.0, -2.0])
    assert "3 prompt logprobs, prompt 4 from 0" in checks.shape_errors(gen, [prompt], None, 1)[0]
    aborted = generated([-1.0, -2.0])
    aborted.finish = "abort"
    assert "finish_reason abort" in checks.shape_errors(gen, [aborted], None, 1)[0]

    cmpl = case("cmpl-logprobs")  # top 3, usage counts the tokens
    answer = Answer(text="ab", tokens=["a", "b"], logprobs=[-1.0, -2.0],
                    top=[[("a", -1.0)], [("c", -1.5), ("b", -2.0)]], finish="length",
                    extra={"text_offset": [0, 1]})  # fmt: skip
    assert checks.shape_errors(cmpl, [answer], {"completion_tokens": 2}, 1) == []
    assert (
        "2 tokens with logprobs, completion_tokens"
        in checks.shape_errors(cmpl, [answer], {"completion_tokens": 3}, 1)[0]
    )


def test_grammar_answers_validate_and_fullmatch() -> None:
    pet = case("chat-json-schema")
    assert checks.grammar_errors(pet, '{"kind": "cat", "age": 3, "name": "Tom"}', 0) == []
    assert "fails its schema" in checks.grammar_errors(pet, '{"kind": "cow", "age": 3, '
                                                            '"name": "Tom"}', 0)[0]  # fmt: skip
    assert "fails its schema" in checks.grammar_errors(pet, '{"kind": "cat"', 0)[0]
    number = case("gen-regex")
    assert checks.grammar_errors(number, "12.5", 0) == []
    assert checks.grammar_errors(number, "12.5x", 0) != []


def test_a_greedy_token_below_the_top_logprob_is_caught() -> None:
    gen = case("gen-logprobs")
    assert checks.greedy_top1_errors(gen, [generated([-1.0, -2.0])]) == []
    below = generated([-1.0, -2.0])
    below.top[1] = [(5, -1.5), (11, -2.0)]  # another token was more likely
    assert "greedy token 1" in checks.greedy_top1_errors(gen, [below])[0]


def figures(**change) -> dict:
    f = {"errors": {"expected_4xx": 3, "unexpected_4xx": 0, "5xx": 0, "lost": 0, "wrong": 0},
         "served": {"total": 40}, "drained": True, "pages_in_use_end": 0, "rss_judged": True,
         "rss_mb_warmup_end": 600.0, "rss_mb_last_load": 610.0, "rss_mb_end": 605.0,
         "rss_slope_mb_per_hour": 10.0, "fds_warmup_end": 14, "fds_end": 10,
         "threads_warmup_end": 10, "threads_end": 11}  # fmt: skip
    for key, value in change.items():
        if key in f["errors"]:
            f["errors"][key] = value
        else:
            f[key] = value
    return f


LIMITS = argparse.Namespace(max_rss_growth=64.0, max_rss_slope=64.0)


@pytest.mark.parametrize(
    "change, why",
    [
        ({"wrong": 1}, "1 wrong"),
        ({"lost": 2}, "2 lost"),
        ({"5xx": 1}, "1 5xx"),
        ({"unexpected_4xx": 1}, "1 unexpected_4xx"),
        ({"pages_in_use_end": 3}, "3 KV pages in use at the end"),
        ({"drained": False}, "KV pages in use at the end"),
        ({"rss_mb_end": 700.0}, "RSS grew 100.0 MB"),
        ({"rss_slope_mb_per_hour": 80.0}, "RSS slope 80.0 MB/hour"),
        ({"fds_end": 40}, "fds: 40 at the end"),
        ({"served": {}}, "no request served"),
    ],
)
def test_the_verdict_fails_a_leaking_or_wrong_run(change, why) -> None:
    assert report.verdict(figures(), LIMITS) == []
    assert any(why in w for w in report.verdict(figures(**change), LIMITS)), change


def test_a_short_run_reports_rss_without_judging_it() -> None:
    assert report.verdict(figures(rss_mb_end=900.0, rss_judged=False), LIMITS) == []


def run_soak(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, os.path.join(BENCH, "soak.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_a_missing_server_is_named() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = run_soak("--base-url", f"http://127.0.0.1:{port}", "--minutes", "0.1", timeout=60)
    assert done.returncode == 1
    assert f"cannot reach http://127.0.0.1:{port}" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_one_minute_dspark_soak_passes(tmp_path) -> None:
    """DSPARK only: a plain server's minute beside it would double the cost,
    and DSPARK runs more of the server (drafter, verify) on the same target."""
    out = tmp_path / "soak.json"
    done = run_soak("--minutes", "1", "--speculative-algorithm", "DSPARK", "--sample-interval",
                    "2", "--out", str(out), "--server-log", str(tmp_path / "server.log"),
                    timeout=580)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    f = json.loads(out.read_text())["figures"]
    assert f["passed"] and f["failures"] == []
    served = f["served"]
    assert served["total"] >= 8, served
    # Each of the six clients starts with a request of its own kind.
    for kind in ("greedy", "sampled", "disconnect", "abort"):
        assert served.get(kind, 0) >= 1, (kind, served)
    assert served.get("tokenize", 0) + served.get("health_generate", 0) >= 1, served
    assert f["errors"]["expected_4xx"] >= 1
    for cls in ("unexpected_4xx", "5xx", "lost", "wrong"):
        assert f["errors"][cls] == 0, (cls, f["error_samples"])
    assert f["drained"] and f["pages_in_use_end"] == 0
    assert f["pages_in_use_max"] > 0  # the load did hold pages
    assert f["server_exit_status"] == 0
