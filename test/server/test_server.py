"""The real server in a subprocess, driven by the official openai client and raw HTTP."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time

import httpx
import pytest
import torch

from models_zoo import hf_logits, model_path, random_prompts
from server_harness import assert_documented, running_server

openai = pytest.importorskip("openai")

TOL = 1e-4
BODY_LIMIT = 2**20  # bytes (--max-request-body-bytes)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(
        model_path("qwen3"),
        "--max-request-body-bytes",
        str(BODY_LIMIT),
        log_dir=str(tmp_path_factory.mktemp("logs")),
    ) as s:
        yield s
        s.wait_idle()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0)


def model_name(server) -> str:
    return server.http.get("/v1/models").json()["data"][0]["id"]


def test_completion_loglikelihood_like_lm_eval(server, client) -> None:
    """echo + logprobs=1 + max_tokens=1 on token ids, scored against transformers."""
    ids = random_prompts(1, [14], seed=31)[0]
    r = client.completions.create(
        model=model_name(server), prompt=[ids], echo=True, logprobs=1, max_tokens=1, temperature=0
    )
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None
    ref = torch.log_softmax(hf_logits("qwen3", ids), dim=-1)
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(float(ref[i - 1, ids[i]]), abs=TOL)
        top_text, top_lp = max(lp.top_logprobs[i].items(), key=lambda kv: kv[1])
        if int(ref[i - 1].argmax()) == ids[i]:
            assert top_lp == lp.token_logprobs[i]  # bit-identical for the greedy token
        assert lp.tokens[i] in lp.top_logprobs[i]
    assert r.choices[0].text.startswith(
        server.http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    )
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 1
    offsets = lp.text_offset
    assert offsets[0] == 0 and all(a <= b for a, b in zip(offsets, offsets[1:]))


def test_completion_stream_equals_non_stream(server, client) -> None:
    kwargs = dict(
        model=model_name(server),
        prompt="def add(a, b):",
        max_tokens=12,
        temperature=0,
        logprobs=3,
        echo=True,
    )
    full = client.completions.create(**kwargs)
    chunks = list(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    streamed = [
        x
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for x in c.choices[0].logprobs.token_logprobs
    ]
    assert streamed == full.choices[0].logprobs.token_logprobs
    tops = [
        x
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for x in c.choices[0].logprobs.top_logprobs
    ]
    assert tops == full.choices[0].logprobs.top_logprobs
    offsets = [
        x
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for x in c.choices[0].logprobs.text_offset
    ]
    assert offsets == full.choices[0].logprobs.text_offset
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == full.choices[0].finish_reason and all(f is None for f in finals[:-1])


def test_batch_prompts_n_and_stop(server, client) -> None:
    r = client.completions.create(
        model=model_name(server),
        prompt=["one two", "three four five"],
        n=2,
        max_tokens=6,
        temperature=0.9,
        seed=5,
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    base = client.completions.create(
        model=model_name(server), prompt="alpha beta", max_tokens=20, temperature=0
    )
    text = base.choices[0].text
    if len(text) > 6:
        stop = text[3:6]
        cut = client.completions.create(
            model=model_name(server), prompt="alpha beta", max_tokens=20, temperature=0, stop=[stop]
        )
        assert cut.choices[0].text == text[: text.index(stop)]
        assert cut.choices[0].finish_reason == "stop"


def test_echo_with_zero_max_tokens_scores_the_prompt(server, client) -> None:
    ids = random_prompts(1, [9], seed=32)[0]
    r = client.completions.create(
        model=model_name(server), prompt=ids, echo=True, logprobs=0, max_tokens=0
    )
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == 9 and r.usage.completion_tokens == 0
    ref = torch.log_softmax(hf_logits("qwen3", ids), dim=-1)
    assert lp.token_logprobs[1:] == pytest.approx(
        [float(ref[i - 1, ids[i]]) for i in range(1, 9)], abs=TOL
    )
    assert all(len(t) == 1 for t in lp.top_logprobs[1:])  # logprobs=0: just the token itself


def test_chat_plain_and_streamed_with_logprobs(server, client) -> None:
    kwargs = dict(
        model=model_name(server),
        messages=[{"role": "user", "content": "hello there"}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    full = client.chat.completions.create(**kwargs)
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens
    assert all(len(item.top_logprobs) == 3 for item in content)
    raw = b"".join(bytes(item.bytes) for item in content)
    assert raw.decode("utf-8", errors="replace") == full.choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].logprobs is None
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert chunks[-1].choices[0].logprobs is None
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == full.choices[0].message.content
    items = [i for c in chunks if c.choices[0].logprobs for i in c.choices[0].logprobs.content]
    assert [(i.token, i.logprob) for i in items] == [(i.token, i.logprob) for i in content]
    # The logprobs are the model's: re-score prompt + completion with transformers.
    prompt_ids = server.http.post(
        "/tokenize", json={"prompt": [{"role": "user", "content": "hello there"}]}
    ).json()["tokens"]
    r = server.http.post(
        "/generate",
        json={
            "input_ids": prompt_ids,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0},
            "return_logprob": True,
        },
    ).json()
    ref = torch.log_softmax(hf_logits("qwen3", prompt_ids + r["output_ids"]), dim=-1)
    for j, item in enumerate(content):
        assert item.logprob == pytest.approx(
            float(ref[len(prompt_ids) - 1 + j, r["output_ids"][j]]), abs=TOL
        )


def test_native_generate_single_batch_and_stream(server) -> None:
    body = {
        "text": "print(",
        "sampling_params": {"max_new_tokens": 6, "temperature": 0},
        "return_logprob": True,
        "top_logprobs_num": 2,
        "logprob_start_len": 0,
    }
    single = server.http.post("/generate", json=body).json()
    assert single["meta_info"]["completion_tokens"] == len(single["output_ids"])
    assert single["meta_info"]["input_token_logprobs"][0][0] is None
    batch = server.http.post("/generate", json={**body, "text": ["print(", "x ="]}).json()
    assert isinstance(batch, list) and batch[0]["output_ids"] == single["output_ids"]
    with server.http.stream("POST", "/generate", json={**body, "stream": True}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["text"] == single["text"] and last["output_ids"] == single["output_ids"]
    assert (
        last["meta_info"]["output_token_logprobs"] == single["meta_info"]["output_token_logprobs"]
    )


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
        ("/v1/completions", {"prompt": "x", "top_p": 2}, "top_p"),
        ("/v1/completions", {"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 100000}, "max_tokens"),
        ("/v1/completions", {"prompt": [[5] * 4100]}, "prompt"),
        ("/v1/completions", {"prompt": ""}, "prompt"),
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
        ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
        ("/v1/completions", {"prompt": "x", "response_format": {"type": "xml"}}, "response_format"),
        ("/v1/completions", {"prompt": "x", "regex": "a("}, "regex"),
        ("/v1/completions", {"prompt": "x", "regex": "a", "ebnf": 'root ::= "a"'}, "ebnf"),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {"type": "json_schema"},
            },
            "response_format",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": {"type": "nope"}},
                },
            },
            "response_format",
        ),
        ("/v1/completions", {"prompt": [[10**7]]}, "prompt"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
            "top_logprobs",
        ),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": "hi"}, "messages"),
        ("/generate", {"text": "x", "sampling_params": {"top_k": -3}}, "top_k"),
        (
            "/generate",
            {"text": "x", "logprob_start_len": 5, "return_logprob": True},
            "logprob_start_len",
        ),
        ("/generate", {"text": "x", "sampling_params": {"json_schema": "{bad"}}, "json_schema"),
        ("/generate", {"text": "x", "input_ids": [1, 2]}, "text"),
        ("/generate", {"text": ["a", "b"], "rid": ["same", "same"]}, "rid"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "json_schema": "{bad"},
            "json_schema",
        ),
    ],
)
def test_bad_input_is_a_400_naming_the_field(server, path, body, param) -> None:
    r = server.http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]
    r = server.http.get("/health_generate")
    assert r.status_code == 200, (r.text, server.log()[-4000:])


def test_unknown_model_and_malformed_json(server) -> None:
    r = server.http.post("/v1/completions", json={"prompt": "x", "model": "nope"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = server.http.post(
        "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = server.http.get("/no/such/path")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert server.http.get("/health_generate").status_code == 200


POSTS = ["/v1/completions", "/v1/chat/completions", "/generate", "/tokenize", "/detokenize"]
POSTS += ["/abort_request"]
ERROR = {"error": {"message": "m", "type": "invalid_request_error", "param": None, "code": 400}}


def test_openapi_lists_the_statuses_the_server_answers(server) -> None:
    """No operation lists FastAPI's 422 (never sent); every POST lists a 400
    whose schema is the OpenAI error shape; real bad requests get a status
    the document lists for them, with a body that fits its schema."""
    jsonschema = pytest.importorskip("jsonschema")
    doc = server.http.get("/openapi.json").json()
    ops = {(m, p): op for p, methods in doc["paths"].items() for m, op in methods.items()}
    assert {("post", p) for p in POSTS} == {k for k in ops if k[0] == "post"}
    assert [k for k, op in ops.items() if "422" in op["responses"]] == []
    assert not {"HTTPValidationError", "ValidationError"} & set(doc["components"]["schemas"])
    assert [k for k, op in ops.items() if "401" in op["responses"]] == []  # no --api-key
    for path in POSTS:
        entry = ops["post", path]["responses"]["400"]
        schema = {**entry["content"]["application/json"]["schema"], "components": doc["components"]}
        jsonschema.validate(ERROR, schema)
        for wrong in (
            {"detail": [{"loc": ["body"], "msg": "m", "type": "t"}]},  # FastAPI's 422 body
            {"error": {k: v for k, v in ERROR["error"].items() if k != "param"}},
            {"error": {**ERROR["error"], "code": "400"}},
        ):
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(wrong, schema)
    big = b'{"prompt": "' + b"x" * BODY_LIMIT + b'"}'
    cases = [(path, b"{", 400) for path in POSTS] + [(path, big, 413) for path in POSTS]
    cases += [
        ("/v1/completions", {"prompt": 5}, 400),
        ("/v1/chat/completions", {"messages": []}, 400),
        ("/generate", {"text": "x", "sampling_params": {"top_p": 2}}, 400),
        ("/tokenize", {"prompt": 5}, 400),
        ("/detokenize", {"tokens": [10**7]}, 400),
        ("/abort_request", {}, 400),
    ]
    chat = {"messages": [{"role": "user", "content": "x"}]}
    for path, body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", chat)):
        cases.append((path, {**body, "model": "nope"}, 404))
    cases += [("/tokenize", {"prompt": "x", "model": "nope"}, 404)]
    cases += [("/detokenize", {"tokens": [1], "model": "nope"}, 404)]
    for path, body, status in cases:
        if isinstance(body, bytes):
            headers = {"content-type": "application/json"}
            r = server.http.post(path, content=body, headers=headers)
        else:
            r = server.http.post(path, json=body)
        assert r.status_code == status, (path, r.status_code, r.text[:300])
        assert_documented(doc, "post", path, r)
    for path in ("/health", "/health_generate", "/v1/models"):
        assert_documented(doc, "get", path, server.http.get(path))


def test_disconnect_mid_stream_frees_everything(server) -> None:
    before = server.wait_idle()
    body = {"prompt": "x", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(base_url=server.base, timeout=60) as c,
        c.stream("POST", "/v1/completions", json=body) as r,
    ):
        next(line for line in r.iter_lines() if line.startswith("data: "))
    after = server.wait_idle()
    # The request was cut short by the disconnect, not run to its 3000 tokens.
    assert after["finished"].get("abort", 0) == before["finished"].get("abort", 0) + 1
    assert after["generated_tokens"] - before["generated_tokens"] < 3000


def test_many_concurrent_requests_queue_instead_of_failing(server) -> None:
    import concurrent.futures

    def one(i: int) -> int:
        r = server.http.post(
            "/v1/completions", json={"prompt": f"item {i}", "max_tokens": 5, "ignore_eos": True}
        )
        return r.json()["usage"]["completion_tokens"]

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        assert list(pool.map(one, range(24))) == [5] * 24
    server.wait_idle()


def test_tokenizer_endpoints_models_and_info(server) -> None:
    info = server.http.get("/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>"
    toks = server.http.post(
        "/tokenize", json={"prompt": "hello world", "add_special_tokens": False}
    ).json()
    assert toks["count"] == len(toks["tokens"]) > 0
    text = server.http.post("/detokenize", json={"tokens": toks["tokens"]}).json()["prompt"]
    assert text == "hello world"
    assert server.http.post("/detokenize", json={"tokens": [10**7]}).status_code == 400
    info = server.http.get("/get_server_info").json()
    assert info["max_total_num_tokens"] == 4096 and info["engine_args"]["cache"]["page_size"] == 4


def test_metrics_parse(server) -> None:
    text = server.http.get("/metrics").text
    sample = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{[a-z_]+="[^"]*"\})? [-+0-9.eEinfINFa]+$')
    names = set()
    for line in text.strip().splitlines():
        if line.startswith("#"):
            assert re.match(r"^# (HELP|TYPE) [a-zA-Z_:][a-zA-Z0-9_:]* .+$", line), line
            continue
        assert sample.match(line), line
        math.isfinite(float(line.rsplit(" ", 1)[1]))
        names.add(line.split("{")[0].split(" ")[0])
    for needed in (
        "specserve_time_to_first_token_seconds_bucket",
        "specserve_inter_token_latency_seconds_count",
        "specserve_generation_tokens_total",
        "specserve_num_requests_running",
        "specserve_kv_cache_usage_ratio",
    ):
        assert needed in names
    gen = float(re.search(r"^specserve_generation_tokens_total (\S+)$", text, re.M).group(1))
    assert gen > 0


def test_api_key_is_required_when_set(tmp_path) -> None:
    with running_server(model_path("qwen3"), api_key="sesame", log_dir=str(tmp_path)) as s:
        assert httpx.get(s.base + "/health").status_code == 200
        r = httpx.get(s.base + "/v1/models")
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert (
            httpx.get(s.base + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code
            == 401
        )
        assert s.http.get("/v1/models").status_code == 200
        doc = s.http.get("/openapi.json").json()
        ops = {(m, p): op for p, methods in doc["paths"].items() for m, op in methods.items()}
        assert [k for k, op in ops.items() if "401" not in op["responses"]] == [("get", "/health")]
        assert_documented(doc, "get", "/v1/models", r)
        r = httpx.post(s.base + "/generate", json={"text": "x"})
        assert r.status_code == 401
        assert_documented(doc, "post", "/generate", r)
        c = openai.OpenAI(base_url=s.base + "/v1", api_key="sesame", max_retries=0)
        assert (
            c.completions.create(
                model=model_name(s), prompt="hi", max_tokens=2
            ).usage.completion_tokens
            == 2
        )


def test_cli_errors_are_one_clear_line(tmp_path) -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "specserve.launch_server",
            "--model-path",
            str(tmp_path / "missing"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "model_path" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = subprocess.run(
        [sys.executable, "-m", "specserve.launch_server", "--model-path", "x", "--bogus-flag"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0 and "Traceback" not in r.stderr and "--bogus-flag" in r.stderr


def test_sigterm_ends_in_flight_requests_and_exits_cleanly(tmp_path) -> None:
    import signal
    import threading

    with running_server(
        model_path("qwen3"), "--log-level", "info", "--stats-interval", "0.2", log_dir=str(tmp_path)
    ) as s:
        events: list[str] = []
        body = {"prompt": "x", "max_tokens": 3000, "ignore_eos": True, "stream": True}

        def consume() -> None:
            with (
                httpx.Client(base_url=s.base, timeout=60) as c,
                c.stream("POST", "/v1/completions", json=body) as r,
            ):
                events.extend(line[6:] for line in r.iter_lines() if line.startswith("data: "))

        reader = threading.Thread(target=consume)
        reader.start()
        deadline = time.monotonic() + 30
        while len(events) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.5)  # long enough for a status line
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(timeout=30) == 0
        reader.join(30)
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"
        log = s.log()
        assert "KV capacity 4096 tokens" in log and "loaded in" in log
        assert re.search(r"running \d+, queued \d+, KV usage [\d.]+%, generation [\d.]+ tok/s", log)


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"enum": ["ada", "bob"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "pets": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    },
    "required": ["name", "age", "pets"],
}


def test_constrained_output_through_the_openai_client(server, client) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
    }
    kwargs = dict(
        model=model_name(server),
        messages=[{"role": "user", "content": "who?"}],
        max_tokens=120,
        temperature=0,
        response_format=fmt,
        logprobs=True,
        top_logprobs=2,
    )
    full = client.chat.completions.create(**kwargs)
    jsonschema.validate(json.loads(full.choices[0].message.content), SCHEMA)
    assert len(full.choices[0].logprobs.content) == full.usage.completion_tokens
    assert full.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    )
    r = client.completions.create(
        model=model_name(server),
        prompt="date:",
        max_tokens=30,
        temperature=0.8,
        seed=4,
        extra_body={"regex": "20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"},
    )
    assert re.fullmatch("20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]", r.choices[0].text)
    obj = client.completions.create(
        model=model_name(server),
        prompt="{",
        max_tokens=150,
        temperature=0,
        extra_body={"json_schema": json.dumps(SCHEMA)},
    )
    jsonschema.validate(json.loads(obj.choices[0].text), SCHEMA)
    native = server.http.post(
        "/generate",
        json={
            "text": "x",
            "sampling_params": {"ebnf": 'root ::= "on" | "off"', "max_new_tokens": 5},
        },
    ).json()
    assert native["text"] in ("on", "off")


def test_invalid_grammar_next_to_valid_requests(server) -> None:
    import concurrent.futures

    def valid(i: int) -> str:
        return server.http.post(
            "/v1/completions", json={"prompt": f"n{i}", "max_tokens": 10, "regex": "[0-9]{2}"}
        ).json()["choices"][0]["text"]

    def invalid(_: int) -> int:
        return server.http.post(
            "/v1/completions", json={"prompt": "x", "regex": "[0-9"}
        ).status_code

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        good = [pool.submit(valid, i) for i in range(6)]
        bad = [pool.submit(invalid, i) for i in range(4)]
        assert all(re.fullmatch("[0-9]{2}", f.result()) for f in good)
        assert all(f.result() == 400 for f in bad)
    assert server.wait_idle()["grammar_matchers"] == 0
