"""Fuzzing every POST endpoint from the server's own OpenAPI schema.

Bodies are drawn (derandomized, bounded counts) from the request schemas the
server publishes at ``/openapi.json``: valid instances, valid instances with
one field swapped for a hostile value (a wrong type, an integer past 64 bits,
NaN, a lone surrogate, deep nesting, a huge string), and raw garbage. Every
answer must be a 2xx, or a 4xx in the OpenAI error shape; streams must end
with ``[DONE]`` and carry no internal error; afterwards the server is healthy
and every KV page is free. The figures are printed at the end (run with -s).
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from models_zoo import model_path
from server_harness import running_server

hypothesis_jsonschema = pytest.importorskip("hypothesis_jsonschema")

ENDPOINTS = [
    "/v1/completions",
    "/v1/chat/completions",
    "/generate",
    "/tokenize",
    "/detokenize",
    "/abort_request",
]
EXAMPLES = 150  # per endpoint
COUNTS: Counter[str] = Counter()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    flags = (
        "--context-length", "96",  # bounds what any request can cost
        "--max-n", "4",
        "--max-sequences-per-request", "8",
        "--max-request-body-bytes", "200000",
    )  # fmt: skip
    with running_server(
        model_path("qwen3"), *flags, log_dir=str(tmp_path_factory.mktemp("fuzz"))
    ) as s:
        yield s


@pytest.fixture(scope="module")
def openapi(server) -> dict[str, Any]:
    return server.http.get("/openapi.json").json()


HOSTILE_VALUES = st.one_of(
    st.integers(min_value=2**63 - 2, max_value=2**70),
    st.integers(min_value=-(2**70), max_value=-1),
    st.booleans(),
    st.none(),
    st.sampled_from(
        [
            float("nan"),
            float("inf"),
            -float("inf"),
            1e308,
            1e-308,
            "\ud800",
            "a\udfffb",
            "",
            "5",
            "true",
            [],
            {},
            [True, "5", None],
            [[[[[[[[[[1]]]]]]]]]],
            {"\ud800": 1},
            "x" * 5000,
            list(range(3000)),
        ]
    ),
    st.text(max_size=20),
    st.lists(st.integers(min_value=-5, max_value=10**6), max_size=5),
)

RAW_GARBAGE = [
    b"",
    b"null",
    b"[]",
    b'"text"',
    b"{",
    b'{"prompt": "x"',
    b"\xff\xfe",
    b'{"prompt": "\\ud800"}',
    b"[" * 20000 + b"]" * 20000,
    b'{"a": ' * 3000 + b"1" + b"}" * 3000,
    b'{"prompt": NaN, "max_tokens": Infinity}',
    b'{"max_tokens": 1' + b"0" * 5000 + b"}",
]


# Plausible values, so that a share of the bodies gets through validation and
# exercises the engine (sampling, penalties, logprobs, n, streams).
NUMBER = {"type": "number"}
PLAUSIBLE = {
    "max_tokens": {"type": "integer", "minimum": 0, "maximum": 12},
    "max_new_tokens": {"type": "integer", "minimum": 0, "maximum": 12},
    "min_tokens": {"type": "integer", "minimum": 0, "maximum": 3},
    "min_new_tokens": {"type": "integer", "minimum": 0, "maximum": 3},
    "temperature": {**NUMBER, "minimum": 0, "maximum": 2},
    "top_p": {**NUMBER, "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": -1, "maximum": 50},
    "min_p": {**NUMBER, "minimum": 0, "maximum": 1},
    "repetition_penalty": {**NUMBER, "minimum": 0.5, "maximum": 2},
    "frequency_penalty": {**NUMBER, "minimum": -2, "maximum": 2},
    "presence_penalty": {**NUMBER, "minimum": -2, "maximum": 2},
    "n": {"type": "integer", "minimum": 1, "maximum": 3},
    "logprobs": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 5}, {"type": "boolean"}]},
    "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 5},
    "top_logprobs_num": {"type": "integer", "minimum": 0, "maximum": 5},
    "seed": {"type": "integer", "minimum": -(2**63), "maximum": 2**64 - 1},
    "logprob_start_len": {"type": "integer", "minimum": -1, "maximum": 2},
}


NULL = {"type": "null"}
# Fields whose random values (a model name, a grammar) are almost always refused.
PLAUSIBLE_NULL = ("model", "suffix", "regex", "ebnf", "json_schema", "response_format", "rid")


def plausible(schemas: dict[str, Any]) -> dict[str, Any]:
    """The component schemas with PLAUSIBLE ranges for the fields it names
    (keeping each field's own type: ``logprobs`` is an integer in one API and
    a boolean in the other), token ids within the vocabulary, and the fields
    of PLAUSIBLE_NULL left out."""
    out = json.loads(json.dumps(schemas))

    def token_ids(node: Any) -> None:
        if isinstance(node, dict):
            if node.get("type") == "array" and node.get("items", {}).get("type") == "integer":
                node["items"] = {"type": "integer", "minimum": 0, "maximum": 500}
                node["maxItems"] = 8
            for value in node.values():
                token_ids(value)
        elif isinstance(node, list):
            for value in node:
                token_ids(value)

    for model in out.values():
        props = model.get("properties", {})
        for name, prop in props.items():
            if name in PLAUSIBLE_NULL:
                props[name] = NULL
            elif name in PLAUSIBLE:
                types = json.dumps(prop)
                ranged = PLAUSIBLE[name].get("anyOf", [PLAUSIBLE[name]])
                keep = [r for r in ranged if f'"{r["type"]}"' in types]
                if keep:
                    props[name] = keep[0] if len(keep) == 1 else {"anyOf": keep}
    token_ids(out)
    return out


def body_strategy(openapi: dict[str, Any], path: str) -> st.SearchStrategy[bytes]:
    ref = openapi["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    name = ref["$ref"].rsplit("/", 1)[1]
    fields = sorted(openapi["components"]["schemas"][name]["properties"])
    components = openapi["components"]
    valid = st.one_of(
        hypothesis_jsonschema.from_schema({**ref, "components": components}),
        hypothesis_jsonschema.from_schema(
            {**ref, "components": {**components, "schemas": plausible(components["schemas"])}}
        ),
    )

    def mutate(body: Any) -> st.SearchStrategy[Any]:
        if not isinstance(body, dict):
            return st.just(body)
        return st.builds(
            lambda key, value: {**body, key: value}, st.sampled_from(fields), HOSTILE_VALUES
        )

    as_json = lambda body: json.dumps(body).encode()  # noqa: E731  (NaN and surrogates as escapes)
    return st.one_of(
        valid.map(as_json),
        valid.flatmap(mutate).map(as_json),
        st.sampled_from(RAW_GARBAGE),
    )


def check_answer(r: httpx.Response) -> None:
    COUNTS["sent"] += 1
    COUNTS[f"{r.status_code // 100}xx"] += 1
    assert r.status_code < 500, (r.status_code, r.text[:1000])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert err["code"] == r.status_code and err["message"], err
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", r.text[-500:]
        for event in events[:-1]:
            parsed = json.loads(event)
            assert "error" not in parsed or parsed["error"]["code"] < 500, parsed
    else:
        r.json()


@pytest.mark.parametrize("path", ENDPOINTS)
def test_fuzz_endpoint(server, openapi, path) -> None:
    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(body=body_strategy(openapi, path))
    def run(body: bytes) -> None:
        r = server.http.post(path, content=body, headers={"content-type": "application/json"})
        check_answer(r)

    run()


def test_after_the_fuzz_the_server_is_healthy_and_every_page_free(server) -> None:
    assert server.http.get("/health").status_code == 200
    assert server.http.get("/health_generate").status_code == 200
    stats = server.wait_idle()
    assert stats["grammar_matchers"] == 0
    assert server.proc.poll() is None  # no crash
    print(f"\nfuzz: {dict(COUNTS)}")
    assert COUNTS["sent"] >= len(ENDPOINTS) * EXAMPLES * 0.9 and COUNTS["5xx"] == 0
