"""Grammar limits on the real server: a grammar over --max-grammar-length is
a 400 naming its field; a schema that compiles for minutes is a 400 at
--grammar-compile-timeout, its compile killed, while innocent streams
(unconstrained, and with a compiled grammar) are admitted and stream beside
it and finish as they do alone; no worker process outlives its compile or
the server."""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import pytest

from models_zoo import model_path
from process_helpers import HAS_PROC, alive, children, wait_busy
from server_harness import running_server

pytest.importorskip("xgrammar")
pytestmark = pytest.mark.skipif(not HAS_PROC, reason="reads /proc (Linux)")

TIMEOUT = 3.0
MAX_LENGTH = 30_000
# 2000 optional properties of any type (22.9k characters as the server
# serialises it): xgrammar 0.2.9
# compiles it for ~100 s on the tiny test tokenizer.
EXPLODING = {"type": "object", "properties": {str(i): {} for i in range(2000)}}
INNOCENT = [
    {"prompt": "plain", "max_tokens": 16, "temperature": 0, "ignore_eos": True},
    {"prompt": "word", "max_tokens": 16, "temperature": 0, "regex": "[a-z]{1,8}( [a-z]{1,8}){2}"},
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    flags = ("--grammar-compile-timeout", str(TIMEOUT), "--max-grammar-length", str(MAX_LENGTH))
    log_dir = str(tmp_path_factory.mktemp("g"))
    with running_server(model_path("qwen3"), *flags, log_dir=log_dir) as s:
        yield s
        s.wait_idle()
        workers = children(s.proc.pid)
        assert "Traceback" not in s.log(), s.log()[-4000:]
    assert not any(alive(w) for w in workers)  # none outlives the server


def streamed(server, body: dict, first: threading.Event | None = None) -> tuple[str, str]:
    """A streamed completion's text and finish reason; ``first`` is set at its
    first text."""
    text, finish = [], None
    with (
        httpx.Client(base_url=server.base, timeout=60) as c,
        c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r,
    ):
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                text.append(choice["text"])
                finish = choice["finish_reason"] or finish
                if first is not None and choice["text"]:
                    first.set()
    return "".join(text), finish


def assert_error(r: httpx.Response, param: str, message: str) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == (param, 400)
    assert re.fullmatch(message, error["message"]), error["message"]


def test_a_grammar_over_the_length_limit_is_a_400_naming_its_field(server) -> None:
    over = r"the grammar is \d+ characters, over the limit of 30000 \(--max-grammar-length\)"
    schema = {"type": "string", "description": "d" * MAX_LENGTH}
    for path, body, param in (
        (
            "/v1/completions",
            {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
                "name": "s", "schema": schema}}},
            "response_format",
        ),
        ("/v1/completions", {"prompt": "x", "ebnf": 'root ::= "' + "a" * MAX_LENGTH + '"'}, "ebnf"),
        ("/generate", {"text": "x", "sampling_params": {"regex": "a" * (MAX_LENGTH + 1)}}, "regex"),
        ("/generate", {"text": "x", "sampling_params": {"json_schema": schema}}, "json_schema"),
    ):  # fmt: skip
        assert_error(server.http.post(path, json=body), param, f"{param}: {over}")


def test_an_exploding_schema_times_out_beside_innocent_streams(server) -> None:
    solo = [streamed(server, body) for body in INNOCENT]  # also starts a compile worker
    assert re.fullmatch(INNOCENT[1]["regex"], solo[1][0]), solo
    (worker,) = children(server.proc.pid)
    answer: dict = {}

    def explode() -> None:
        format = {"type": "json_schema", "json_schema": {"name": "e", "schema": EXPLODING}}
        with httpx.Client(base_url=server.base, timeout=TIMEOUT + 60) as c:
            body = {"prompt": "x", "max_tokens": 8, "response_format": format}
            answer["response"] = c.post("/v1/completions", json=body)
        answer["ended"] = time.monotonic()

    start = time.monotonic()
    exploding = threading.Thread(target=explode, daemon=True)
    exploding.start()
    wait_busy(worker, exploding.is_alive)  # its worker is compiling
    results: list = [None] * len(INNOCENT)
    first = [threading.Event() for _ in INNOCENT]

    def innocent(i: int) -> None:
        results[i] = streamed(server, INNOCENT[i], first[i])

    streams = [threading.Thread(target=innocent, args=(i,)) for i in range(len(INNOCENT))]
    for t in streams:
        t.start()
    for e in first:
        e.wait(timeout=60)
    # Both were admitted and streamed while the exploding schema compiled ...
    assert exploding.is_alive() and all(e.is_set() for e in first)
    for t in streams:
        t.join(timeout=60)
    assert results == solo  # ... and are what they are alone
    exploding.join(timeout=TIMEOUT + 60)
    assert_error(
        answer["response"],
        "response_format",
        re.escape(f"response_format: the grammar did not compile within {TIMEOUT:g} s ")
        + r"\(--grammar-compile-timeout\)",
    )
    assert TIMEOUT <= answer["ended"] - start < TIMEOUT + 30
    # Its worker is killed and reaped; the server goes on compiling grammars.
    assert not alive(worker) and children(server.proc.pid) == set()
    r = server.http.post(
        "/v1/completions", json={"prompt": "x", "max_tokens": 4, "regex": "(yes|no)"}
    )
    assert r.status_code == 200 and re.fullmatch("yes|no", r.json()["choices"][0]["text"])
    (fresh,) = children(server.proc.pid)
    assert fresh != worker
    assert server.http.get("/health").status_code == 200
