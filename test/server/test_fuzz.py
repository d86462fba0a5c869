"""Fuzzing every POST endpoint from the server's own OpenAPI schema.

Bodies are drawn (derandomized, bounded counts) from the request schemas the
server publishes at ``/openapi.json``: any instance of the schema, plausible
ones (values in ranges a model serves), either with one field swapped for a
hostile value (no field takes it: NaN, a number below every range, a lone
surrogate, deep nesting) or for an odd one (some fields take it), and raw
garbage. Every answer must be a status the document lists for the endpoint,
a 2xx or a 4xx in the OpenAI error shape; every hostile body a 4xx; most
plausible bodies a 2xx; streams must end with ``[DONE]`` and carry no
internal error. A sweep then sets each field of each endpoint, in turn, to
each hostile value. Afterwards the server is healthy and every KV page is
free. The figures are printed at the end (run with -s).
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
from server_harness import assert_documented, running_server

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
COUNTS: Counter[tuple[str, str, str]] = Counter()  # (path, kind, "2xx" / "4xx" / ...)
# Per endpoint: at least this many plausible bodies, and this share of them
# served (2xx; 0.85 to 1.0 measured, derandomized).
MIN_PLAUSIBLE = 10
MIN_SERVED = 0.6


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


# Values no field takes (each one-field-made-hostile body must get a 4xx):
# numbers JSON has not, numbers below every range, strings that are not
# UTF-8, lists of no field's item type, nesting no field has.
REJECTED = [
    float("nan"),
    float("inf"),
    -float("inf"),
    -1e300,
    -(2**70),
    -(2**63) - 1,
    "\ud800",
    "a\udfffb",
    {"\ud800": 1},
    [True, "5", None],
    [[[[[[[[[[1]]]]]]]]]],
]
# Odd values that some fields take (top_k past 64 bits, an empty stop list,
# a boolean for a flag): any answer but a 5xx.
ODD_VALUES = st.one_of(
    st.integers(min_value=2**63 - 2, max_value=2**70),
    st.integers(min_value=-5, max_value=-1),
    st.booleans(),
    st.none(),
    st.sampled_from([1e308, 1e-308, "", "5", "true", [], {}, "x" * 5000, list(range(3000))]),
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


# Plausible values, so that most of the bodies get through validation and
# exercise the engine (sampling, penalties, logprobs, n, streams).
NUMBER = {"type": "number"}
NULL = {"type": "null"}
TEXT = {"type": "string", "minLength": 1, "maxLength": 24}
IDS = {
    "type": "array",
    "items": {"type": "integer", "minimum": 0, "maximum": 500},
    "minItems": 1,
    "maxItems": 8,
}
PLAUSIBLE = {
    "max_tokens": {"type": "integer", "minimum": 0, "maximum": 6},
    "max_new_tokens": {"type": "integer", "minimum": 0, "maximum": 6},
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
    "stop": {"anyOf": [TEXT, {"type": "array", "items": TEXT, "maxItems": 3}]},
    "logit_bias": {
        "type": "object",
        "patternProperties": {"^[1-4][0-9]{0,2}$": {**NUMBER, "minimum": -100, "maximum": 100}},
        "additionalProperties": False,
        "maxProperties": 3,
    },
}
# Fields whose random values (a model name, a grammar) are almost always refused.
PLAUSIBLE_NULL = ("model", "suffix", "regex", "ebnf", "json_schema", "response_format", "rid")


def few(item: dict[str, Any]) -> dict[str, Any]:
    """One or two of ``item`` (a batch, within --max-sequences-per-request with n <= 3)."""
    return {"type": "array", "items": item, "minItems": 1, "maxItems": 2}


MESSAGES = {
    "type": "array",
    "minItems": 1,
    "maxItems": 3,
    "items": {
        "type": "object",
        "properties": {"role": {"enum": ["system", "user", "assistant"]}, "content": TEXT},
        "required": ["role", "content"],
        "additionalProperties": False,
    },
}
# Per request model: plausible schemas of its own fields, and the fields a
# plausible body has (a token budget: the defaults pass the context length).
BODIES: dict[str, tuple[dict[str, Any], list[str]]] = {
    "CompletionRequest": ({"prompt": {"anyOf": [TEXT, few(TEXT), IDS, few(IDS)]}}, ["max_tokens"]),
    "ChatCompletionRequest": (
        {"messages": MESSAGES, "max_completion_tokens": NULL},
        ["max_tokens"],
    ),
    "GenerateReqInput": (
        {
            "sampling_params": {"$ref": "#/components/schemas/NativeSamplingParams"},
            "return_logprob": {"type": "boolean"},
            "token_ids_logprob": {"anyOf": [IDS, NULL]},
        },
        ["sampling_params"],
    ),
    "NativeSamplingParams": ({}, ["max_new_tokens"]),
    "TokenizeRequest": ({"prompt": {"anyOf": [TEXT, MESSAGES]}}, []),
    "AbortRequestInput": ({"rid": TEXT}, ["rid"]),
}
# /generate takes exactly one of a text prompt and token ids.
ONE_OF = {"GenerateReqInput": {"text": {"anyOf": [TEXT, few(TEXT)]}, "input_ids": few(IDS)}}


def plausible(schemas: dict[str, Any]) -> dict[str, Any]:
    """The component schemas with PLAUSIBLE ranges for the fields it names
    (keeping each field's own type: ``logprobs`` is an integer in one API and
    a boolean in the other), token ids within the vocabulary, the fields of
    PLAUSIBLE_NULL left out, then each model's BODIES and ONE_OF."""
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
    for name, (fields, required) in BODIES.items():
        out[name]["properties"].update(fields)
        out[name]["required"] = sorted({*out[name].get("required", ()), *required})
    for name, alternatives in ONE_OF.items():
        model = out.pop(name)
        variants = []
        for field, schema in alternatives.items():
            nulls = {other: NULL for other in alternatives if other != field}
            props = {**model["properties"], **nulls, field: schema}
            variants.append({**model, "properties": props, "required": [*model["required"], field]})
        out[name] = {"anyOf": variants}
    return out


def body_strategy(openapi: dict[str, Any], path: str) -> st.SearchStrategy[tuple[str, bytes]]:
    """``(kind, body)``: ``schema`` (any instance of the request schema),
    ``plausible`` (one with PLAUSIBLE values), ``hostile`` (either, one field
    set to a REJECTED value), ``odd`` (one field set to an odd value) or
    ``garbage``."""
    ref = request_schema(openapi, path)
    name = ref["$ref"].rsplit("/", 1)[1]
    fields = sorted(openapi["components"]["schemas"][name]["properties"])
    components = openapi["components"]
    schema = hypothesis_jsonschema.from_schema({**ref, "components": components})
    likely = hypothesis_jsonschema.from_schema(
        {**ref, "components": {**components, "schemas": plausible(components["schemas"])}}
    )

    def mutate(values: st.SearchStrategy[Any]) -> Any:
        def one_field(body: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
            return st.builds(
                lambda key, value: {**body, key: value}, st.sampled_from(fields), values
            )

        return st.one_of(schema, likely).flatmap(one_field)

    as_json = lambda body: json.dumps(body).encode()  # noqa: E731  (NaN and surrogates as escapes)
    tagged = lambda kind, bodies: bodies.map(lambda b: (kind, as_json(b)))  # noqa: E731
    return st.one_of(
        tagged("schema", schema),
        tagged("plausible", likely),
        tagged("hostile", mutate(st.sampled_from(REJECTED))),
        tagged("odd", mutate(ODD_VALUES)),
        st.sampled_from(RAW_GARBAGE).map(lambda b: ("garbage", b)),
    )


def request_schema(openapi: dict[str, Any], path: str) -> dict[str, Any]:
    return openapi["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]


def check_answer(openapi: dict[str, Any], path: str, kind: str, r: httpx.Response) -> None:
    COUNTS[path, kind, f"{r.status_code // 100}xx"] += 1
    assert r.status_code < 500, (r.status_code, r.text[:1000])
    assert_documented(openapi, "post", path, r)
    if kind == "hostile":
        assert 400 <= r.status_code < 500, (r.status_code, r.text[:1000])
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


def post(server, path: str, body: bytes) -> httpx.Response:
    return server.http.post(path, content=body, headers={"content-type": "application/json"})


def share(path: str, kind: str, cls: str = "2xx") -> tuple[int, int]:
    """How many of ``path``'s ``kind`` bodies got a ``cls`` answer, of how many."""
    of_kind = {c: n for (p, k, c), n in COUNTS.items() if (p, k) == (path, kind)}
    return of_kind.get(cls, 0), sum(of_kind.values())


@pytest.mark.parametrize("path", ENDPOINTS)
def test_fuzz_endpoint(server, openapi, path) -> None:
    """Every answer as documented and no 5xx; every hostile body refused;
    enough plausible ones served (a validator that refuses all fails)."""

    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=body_strategy(openapi, path))
    def run(case: tuple[str, bytes]) -> None:
        kind, body = case
        check_answer(openapi, path, kind, post(server, path, body))

    run()
    ok, sent = share(path, "plausible")
    assert sent >= MIN_PLAUSIBLE and ok >= MIN_SERVED * sent, (ok, sent)
    assert share(path, "hostile", "4xx")[1] >= MIN_PLAUSIBLE


# A body each endpoint serves, from which the sweep below makes one field hostile.
BASE = {
    "/v1/completions": {"prompt": "x", "max_tokens": 1},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
    "/generate": {"text": "x", "sampling_params": {"max_new_tokens": 1}},
    "/tokenize": {"prompt": "x"},
    "/detokenize": {"tokens": [1]},
    "/abort_request": {"rid": "nobody"},
}


def one_field_hostile(openapi: dict[str, Any], path: str) -> list[tuple[str, str, Any]]:
    """``(field, param, body)``: BASE with each field of the request schema,
    and each field of an object BASE gives (``sampling_params``), set to
    each REJECTED value; ``param`` is the top-level field the error names."""
    schemas = openapi["components"]["schemas"]

    def props(schema: dict[str, Any]) -> dict[str, Any]:
        refs = [schema, *schema.get("anyOf", [])]
        named = [schemas[r["$ref"].rsplit("/", 1)[1]] for r in refs if "$ref" in r]
        return named[0].get("properties", {}) if named else {}

    base = BASE[path]
    cases = []
    for name, schema in props(request_schema(openapi, path)).items():
        cases += [(name, name, {**base, name: v}) for v in REJECTED]
        if isinstance(base.get(name), dict):
            for inner in props(schema):
                cases += [
                    (f"{name}.{inner}", name, {**base, name: {**base[name], inner: v}})
                    for v in REJECTED
                ]
    return cases


@pytest.mark.parametrize("path", ENDPOINTS)
def test_every_field_refuses_every_hostile_value(server, openapi, path) -> None:
    """Each field of each endpoint (and of ``sampling_params``), one at a
    time, set to each REJECTED value in a body that is otherwise served: a
    4xx in the OpenAI shape, as documented, naming that field."""
    assert server.http.post(path, json=BASE[path]).status_code == 200
    wrong = []
    cases = one_field_hostile(openapi, path)
    for field, param, body in cases:
        r = post(server, path, json.dumps(body).encode())
        assert r.status_code < 500, (field, r.text[:500])
        assert_documented(openapi, "post", path, r)
        named = r.json()["error"]["param"] if r.status_code >= 400 else None
        if not 400 <= r.status_code < 500 or named not in (param, field.split(".")[-1]):
            wrong.append((field, json.dumps(body[param])[:60], r.status_code, named))
    assert len(cases) >= 2 * len(REJECTED) and wrong == [], wrong


def test_after_the_fuzz_the_server_is_healthy_and_every_page_free(server) -> None:
    assert server.http.get("/health").status_code == 200
    assert server.http.get("/health_generate").status_code == 200
    stats = server.wait_idle()
    assert stats["grammar_matchers"] == 0
    assert server.proc.poll() is None  # no crash
    figures: Counter[str] = Counter()
    for (path, kind, cls), n in sorted(COUNTS.items()):
        figures[cls] += n
        print(f"fuzz {path} {kind} {cls}: {n}")
    print(f"fuzz: {dict(figures)}")
    assert sum(figures.values()) >= len(ENDPOINTS) * EXAMPLES * 0.9 and figures["5xx"] == 0
