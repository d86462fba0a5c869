"""No request can hurt the server or another request: every class of hostile
input gets a 4xx in the OpenAI error shape naming its field or limit, even
while innocent streams run beside it, whose outputs then equal their solo
runs; /abort_request; many concurrent text streams; faults inside a step."""

from __future__ import annotations

import concurrent.futures
import json
import sys
import textwrap
import threading
import time

import httpx
import pytest

from models_zoo import model_path
from server_harness import assert_documented, running_server

LIMITS = (
    "--max-n", "4",
    "--max-sequences-per-request", "8",
    "--max-stop-strings", "4",
    "--max-stop-length", "16",
    "--max-token-ids-logprob", "8",
    "--max-request-body-bytes", "65536",
)  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(
        model_path("qwen3"), *LIMITS, log_dir=str(tmp_path_factory.mktemp("r"))
    ) as s:
        yield s
        s.wait_idle()
        log = s.log()
        assert "Traceback" not in log and "never retrieved" not in log, log[-4000:]


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory):
    from specserve.tools.tiny_model import make_tiny_dspark

    root = tmp_path_factory.mktemp("spec")
    drafter = make_tiny_dspark(str(root / "drafter"), model_path("qwen3"))
    flags = ("--speculative-algorithm", "DSPARK", "--speculative-draft-model-path", drafter)
    with running_server(model_path("qwen3"), *flags, *LIMITS, log_dir=str(root)) as s:
        yield s
        s.wait_idle()
        assert "Traceback" not in s.log(), s.log()[-4000:]


def raw(s: str) -> bytes:
    """A JSON body written by hand (lone surrogate escapes, NaN, huge numbers)."""
    return s.encode()


CHAT = '"messages": [{"role": "user", "content": "hi"}]'

# (path, body, status, param): one example per class of bad input.
HOSTILE = [
    # Integers past what torch takes.
    ("/v1/completions", {"prompt": "x", "seed": 2**64}, 400, "seed"),
    ("/v1/completions", {"prompt": "x", "seed": -(2**63) - 1}, 400, "seed"),
    ("/generate", {"text": "x", "sampling_params": {"seed": 10**30}}, 400, "seed"),
    ("/v1/completions", {"prompt": [[5, 10**20]]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [2**63]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {str(2**70): 1}}, 400, "logit_bias"),
    ("/generate", {"text": "x", "logprob_start_len": 2**64}, 400, "logprob_start_len"),
    ("/generate", {"text": "x", "top_logprobs_num": -(2**70)}, 400, "top_logprobs_num"),
    ("/detokenize", {"tokens": [2**64]}, 400, "tokens"),
    # Wrong types are refused, never coerced.
    ("/v1/completions", {"prompt": [5, True]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [5, "5"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": True}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "logprobs": True}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "echo": "yes"}, 400, "echo"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": "1"}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {" 5": 1}}, 400, "logit_bias"),
    ("/generate", {"text": "x", "sampling_params": {"stop": {"a": 1}}}, 400, "sampling_params"),
    ("/generate", {"text": "x", "sampling_params": {"ignore_eos": "no"}}, 400, "sampling_params"),
    ("/generate", {"text": "x", "sampling_params": {"top_k": 1.5}}, 400, "sampling_params"),
    ("/generate", {"text": "x", "sampling_params": [1, 2]}, 400, "sampling_params"),
    ("/generate", {"input_ids": [1, [2]]}, 400, "input_ids"),
    ("/generate", {"text": "x", "return_logprob": 1}, 400, "return_logprob"),
    ("/generate", {"text": "x", "rid": 5}, 400, "rid"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
        400,
        "messages",
    ),
    ("/v1/chat/completions", {"messages": [{"role": 1}]}, 400, "messages"),
    (  # a text-only server (a Gemma 4 -it checkpoint's language model) and an image
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        400,
        "messages",
    ),
    (
        "/v1/completions",
        {"prompt": "x", "response_format": {"type": "yaml"}},
        400,
        "response_format",
    ),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    # Strings that are not UTF-8, and numbers JSON does not have.
    ("/v1/completions", raw('{"prompt": "a\\ud800b"}'), 400, "prompt"),
    ("/v1/completions", raw('{"prompt": "x", "stop": ["\\udfff"]}'), 400, "stop"),
    ("/generate", raw('{"text": "x", "rid": "\\ud83d"}'), 400, "rid"),
    ("/tokenize", raw('{"prompt": "\\ud800"}'), 400, "prompt"),
    (
        "/v1/chat/completions",
        raw('{"messages": [{"role": "user", "content": "\\ud800"}]}'),
        400,
        "messages",
    ),
    (
        "/v1/chat/completions",
        raw("{" + CHAT + ', "chat_template_kwargs": {"\\ud800": 1}}'),
        400,
        "chat_template_kwargs",
    ),
    ("/v1/completions", raw('{"prompt": "x", "temperature": NaN}'), 400, "temperature"),
    ("/v1/completions", raw('{"prompt": "x", "top_p": Infinity}'), 400, "top_p"),
    ("/v1/completions", raw('{"prompt": "x", "max_tokens": 1' + "0" * 5000 + "}"), 400, None),
    ("/v1/completions", raw("[" * 100000 + "]" * 100000), 413, None),
    ("/v1/completions", raw('{"prompt": ' + "[" * 5000 + "]" * 5000 + "}"), 400, None),
    # Limits.
    ("/v1/completions", {"prompt": "x", "n": 10**9}, 400, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 5}, 400, "n"),
    ("/v1/completions", {"prompt": ["a", "b", "c"], "n": 3}, 400, "prompt"),
    ("/generate", {"text": ["x"] * 9}, 400, "text"),
    ("/v1/completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": "y" * 17}, 400, "stop"),
    ("/generate", {"text": "x", "token_ids_logprob": list(range(9))}, 400, "token_ids_logprob"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**6}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x" * 70000}, 413, None),
    # Values whose math would not be finite.
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 1e-300}, 400, "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "temperature": -1e-300}, 400, "temperature"),
]


def post(server, path: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        return server.http.post(path, content=body, headers={"content-type": "application/json"})
    return server.http.post(path, json=body)


def assert_error(r: httpx.Response, status: int, param: str | None) -> None:
    assert r.status_code == status, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert err["message"] and err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err


@pytest.fixture(scope="module")
def openapi(server) -> dict:
    return server.http.get("/openapi.json").json()


@pytest.mark.parametrize(("path", "body", "status", "param"), HOSTILE)
def test_hostile_input_is_a_4xx_naming_the_field(
    server, openapi, path, body, status, param
) -> None:
    r = post(server, path, body)
    assert_error(r, status, param)
    assert_documented(openapi, "post", path, r)


def test_limits_name_their_flags(server) -> None:
    for body, flag in (
        ({"prompt": ["a", "b", "c"], "n": 3}, "--max-sequences-per-request"),
        ({"prompt": "x", "n": 5}, "--max-n"),
        ({"prompt": "x", "stop": ["a"] * 5}, "--max-stop-strings"),
        ({"prompt": "x", "stop": "y" * 17}, "--max-stop-length"),
        ({"prompt": "x" * 70000}, "--max-request-body-bytes"),
    ):
        r = server.http.post("/v1/completions", json=body)
        assert flag in r.json()["error"]["message"], r.text


def test_a_chunked_body_over_the_limit_is_refused(server) -> None:
    def chunks():
        yield b'{"prompt": "'
        for _ in range(100):
            yield b"x" * 1000
        yield b'"}'

    r = server.http.post(
        "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
    )
    assert_error(r, 413, None)


def test_edge_values_that_are_valid_work(server) -> None:
    """Seeds over the whole 64-bit range, top_k past the vocabulary (no cut),
    temperatures too small to divide by (greedy)."""
    base = {"prompt": "x y", "max_tokens": 6, "ignore_eos": True}
    for seed in (2**64 - 1, -(2**63), 0):
        r = server.http.post("/v1/completions", json={**base, "seed": seed, "n": 2})
        assert r.status_code == 200, r.text
    a = server.http.post("/v1/completions", json={**base, "seed": 3, "top_k": 2**70}).json()
    b = server.http.post("/v1/completions", json={**base, "seed": 3, "top_k": -1}).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    a = server.http.post("/v1/completions", json={**base, "temperature": 1e-30}).json()
    b = server.http.post("/v1/completions", json={**base, "temperature": 0}).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    # A seed that wraps (2**64 - 1 + choice 1 is seed 0): choice 1 equals seed 0.
    wrap = {**base, "temperature": 1.0}
    a = server.http.post("/v1/completions", json={**wrap, "seed": 2**64 - 1, "n": 2}).json()
    b = server.http.post("/v1/completions", json={**wrap, "seed": 0}).json()
    assert a["choices"][1]["text"] == b["choices"][0]["text"]


INNOCENT = [
    {"prompt": f"innocent {i} " * (i + 1), "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    for i in range(3)
] + [{"prompt": "seeded", "max_tokens": 24, "temperature": 0.8, "seed": 5, "ignore_eos": True}]


def streamed_text(server, body: dict, started: threading.Event | None = None) -> str:
    text = []
    with (
        httpx.Client(base_url=server.base, timeout=60) as c,
        c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r,
    ):
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            text.append(chunk["choices"][0]["text"])
            assert chunk["choices"][0]["finish_reason"] in (None, "length")
            if started is not None:
                started.set()
    return "".join(text)


@pytest.mark.parametrize("which", ["plain", "DSPARK"])
def test_hostile_requests_beside_innocent_streams_leave_them_as_they_were(request, which) -> None:
    server = request.getfixturevalue("server" if which == "plain" else "spec_server")
    solo = [
        server.http.post("/v1/completions", json=b).json()["choices"][0]["text"] for b in INNOCENT
    ]
    with concurrent.futures.ThreadPoolExecutor(len(INNOCENT) + 4) as pool:
        started = [threading.Event() for _ in INNOCENT]
        streams = [pool.submit(streamed_text, server, b, e) for b, e in zip(INNOCENT, started)]
        for e in started:
            assert e.wait(60)
        bad = list(pool.map(lambda case: (case, post(server, case[0], case[1])), HOSTILE))
        assert [f.result() for f in streams] == solo
    for (_, _, status, param), r in bad:
        assert_error(r, status, param)
    assert server.http.get("/health").status_code == 200
    server.wait_idle()


def long_generate(server, rid: str) -> dict:
    """A streamed /generate of 3000 tokens: its last event."""
    body = {
        "text": "x",
        "rid": rid,
        "stream": True,
        "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True},
    }
    last = None
    with (
        httpx.Client(base_url=server.base, timeout=60) as c,
        c.stream("POST", "/generate", json=body) as r,
    ):
        for line in r.iter_lines():
            if line.startswith("data: {"):
                last = json.loads(line[6:])
    return last


def wait_stats(server, running: int, queued: int = 0) -> None:
    """Polls until at least ``running`` requests run and ``queued`` wait."""
    deadline = time.monotonic() + 30
    while True:
        stats = server.http.get("/get_server_info").json()["stats"]
        if stats["running"] >= running and stats["queued"] >= queued:
            return
        assert time.monotonic() < deadline, stats
        time.sleep(0.02)


def test_abort_request_by_rid_and_all(server) -> None:
    def long_completion(rid: str) -> list[str | None]:
        body = {
            "prompt": "x",
            "rid": rid,
            "n": 2,
            "max_tokens": 3000,
            "ignore_eos": True,
            "stream": True,
        }
        finishes = []
        with (
            httpx.Client(base_url=server.base, timeout=60) as c,
            c.stream("POST", "/v1/completions", json=body) as r,
        ):
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    finishes += [ch["finish_reason"] for ch in json.loads(line[6:])["choices"]]
        return [f for f in finishes if f is not None]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        gen = pool.submit(long_generate, server, "long-gen")
        comp = pool.submit(long_completion, "long-cmpl")
        wait_stats(server, 3)
        assert server.http.post("/abort_request", json={"rid": "long-gen"}).json() == {"aborted": 1}
        last = gen.result(timeout=30)
        assert last["meta_info"]["finish_reason"]["type"] == "abort"
        assert last["meta_info"]["completion_tokens"] < 3000
        assert server.http.post("/abort_request", json={"rid": "long-cmpl"}).json() == {
            "aborted": 2
        }
        assert comp.result(timeout=30) == ["abort", "abort"]
        assert server.http.post("/abort_request", json={"rid": "unknown"}).json() == {"aborted": 0}
        others = [pool.submit(long_generate, server, f"all-{i}") for i in range(2)]
        wait_stats(server, 2)
        assert server.http.post("/abort_request", json={"abort_all": True}).json() == {"aborted": 2}
        for f in others:
            assert f.result(timeout=30)["meta_info"]["finish_reason"]["type"] == "abort"
    assert_error(server.http.post("/abort_request", json={}), 400, "rid")
    server.wait_idle()


def test_abort_all_neither_counts_nor_aborts_a_health_probe(tmp_path) -> None:
    """One request runs at a time, so a /health_generate probe waits behind
    a long request: abort_all aborts (and counts) the request alone, and the
    probe then generates its token."""
    with running_server(
        model_path("qwen3"), "--max-running-requests", "1", log_dir=str(tmp_path)
    ) as s:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            long = pool.submit(long_generate, s, "long")
            wait_stats(s, running=1)
            probe = pool.submit(s.http.get, "/health_generate")
            wait_stats(s, running=1, queued=1)
            assert s.http.post("/abort_request", json={"abort_all": True}).json() == {"aborted": 1}
            last = long.result(timeout=60)["meta_info"]
            assert last["finish_reason"]["type"] == "abort" and last["completion_tokens"] < 3000
            r = probe.result(timeout=60)
            assert r.status_code == 200 and r.json() == {"status": "ok"}, r.text
        s.wait_idle()


def test_many_concurrent_streamed_text_prompts(server) -> None:
    """HTTP threads tokenize while the engine thread detokenizes, many at once."""
    bodies = [
        {
            "prompt": f"def f{i}(x):\n" + "    y = x\n" * (i % 7 + 1),
            "max_tokens": 8,
            "temperature": 0,
        }
        for i in range(48)
    ]
    solo = {
        i: server.http.post("/v1/completions", json=bodies[i]).json()["choices"][0]["text"]
        for i in range(0, 48, 7)
    }
    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        got = list(pool.map(lambda b: streamed_text(server, b), bodies))
    assert all(got[i] == text for i, text in solo.items())
    server.wait_idle()


def test_disconnects_log_no_errors(server) -> None:
    body = {"prompt": "x", "max_tokens": 3000, "ignore_eos": True, "stream": True, "n": 2}
    for _ in range(3):
        with (
            httpx.Client(base_url=server.base, timeout=60) as c,
            c.stream("POST", "/v1/completions", json=body) as r,
        ):
            next(line for line in r.iter_lines() if line.startswith("data: "))
    server.wait_idle()
    log = server.log()
    assert "ERROR" not in log and "never retrieved" not in log, log[-4000:]


# ---- faults inside a step, through a server whose engine has them injected ----

FAULTS = textwrap.dedent(
    """
    import sys
    from specserve.engine.output_processor import OutputProcessor
    from specserve.runner.model_runner import ModelRunner

    commit, forward = OutputProcessor.commit, ModelRunner.forward

    def failing_commit(self, step, run, scores):
        if step.req.prompt_ids[:3] == [7, 7, 7]:
            raise RuntimeError("injected fault")
        return commit(self, step, run, scores)

    def failing_forward(self, batch):
        if any(s.req.prompt_ids[:3] == [6, 6, 6] for s in batch.steps):
            raise RuntimeError("CUDA error: injected device fault")
        return forward(self, batch)

    OutputProcessor.commit, ModelRunner.forward = failing_commit, failing_forward
    from specserve.cli import main
    sys.exit(main(["serve", *sys.argv[1:]]))
    """
)


def test_a_request_failing_in_a_step_fails_alone_and_a_device_error_stops_the_server(
    tmp_path,
) -> None:
    script = tmp_path / "faulty_server.py"
    script.write_text(FAULTS)
    body = {"prompt": [5, 9, 11], "max_tokens": 20, "temperature": 0, "ignore_eos": True}
    with running_server(
        model_path("qwen3"), log_dir=str(tmp_path), launch=[sys.executable, str(script)]
    ) as s:
        want = s.http.post("/v1/completions", json=body).json()
        doc = s.http.get("/openapi.json").json()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            streams = [pool.submit(streamed_text, s, body) for _ in range(2)]
            r = s.http.post("/v1/completions", json={"prompt": [7, 7, 7, 1], "max_tokens": 4})
            assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
            assert "injected fault" in r.json()["error"]["message"]
            assert_documented(doc, "post", "/v1/completions", r)
            events = s.http.post(
                "/v1/completions", json={"prompt": [7, 7, 7, 2], "max_tokens": 4, "stream": True}
            ).text
            assert '"error"' in events and "injected fault" in events and "[DONE]" in events
            assert [f.result() for f in streams] == [want["choices"][0]["text"]] * 2
        assert s.http.get("/health").status_code == 200
        s.wait_idle()
        # A device error: every request ends, and the process exits non-zero.
        r = s.http.post("/v1/completions", json={"prompt": [6, 6, 6], "max_tokens": 4})
        assert r.status_code in (500, 503), r.text
        assert_documented(doc, "post", "/v1/completions", r)
        assert s.proc.wait(timeout=60) == 1
        assert "the engine stopped" in s.log()


def test_health_reports_a_stopped_engine() -> None:
    from fastapi.testclient import TestClient

    from specserve import Engine
    from specserve.config import ServerConfig
    from specserve.server.app import create_app

    engine = Engine(model_path=model_path("qwen3"), device="cpu", max_total_tokens=256)
    try:
        client = TestClient(create_app(engine, ServerConfig()))
        assert client.get("/health").status_code == 200
        engine.error = "RuntimeError: CUDA error: injected"
        r = client.get("/health")
        assert r.status_code == 503 and "CUDA error" in r.json()["error"]["message"]
    finally:
        engine.shutdown()
