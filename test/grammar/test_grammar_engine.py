"""Constrained generation through the Engine, checked with independent oracles:
``jsonschema``, ``re.fullmatch``, Python's own parser."""

from __future__ import annotations

import ast
import json
import re

import pytest
import torch

from models_zoo import hf_logits, model_path, random_prompts
from specserve import Engine

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 10, "maximum": 99},
        "kind": {"enum": ["cat", "dog", "emu"]},
        "ok": {"type": "boolean"},
        "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]$"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}},
            "required": ["age"],
        },
    },
    "required": ["id", "kind", "ok", "code", "tags", "owner"],
}
REGEX = r"(GET|POST) /[a-z]{1,8}(/[a-z]{1,8}){0,2} HTTP/1\.[01]"
# A regular-looking but recursive grammar: sums of products of small numbers.
EBNF = r"""
root ::= expr
expr ::= term (("+" | "-") term){0,3}
term ::= num ("*" num){0,2} | "(" expr ")"
num ::= [1-9] [0-9]{0,2}
"""


@pytest.fixture(scope="module")
def engine():
    eng = Engine(model_path=model_path("qwen3"), device="cpu", max_total_tokens=8192, page_size=4)
    yield eng
    assert eng.stats()["grammar_matchers"] == 0
    eng.shutdown()


@pytest.fixture(scope="module")
def processed():
    eng = Engine(
        model_path=model_path("qwen3"),
        device="cpu",
        max_total_tokens=4096,
        logprobs_mode="processed",
    )
    yield eng
    eng.shutdown()


def finished_by_grammar(out) -> bool:
    return out["meta_info"]["finish_reason"]["type"] == "stop"


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_json_schema_outputs_validate(engine, temperature) -> None:
    prompts = ["Give me a record:", "json please", "{"]
    sp = {
        "json_schema": json.dumps(SCHEMA),
        "max_new_tokens": 200,
        "temperature": temperature,
        "seed": 3,
    }
    outs = engine.generate(prompts, sp, return_logprob=True)
    for o in outs:
        assert finished_by_grammar(o), o
        jsonschema.validate(json.loads(o["text"]), SCHEMA)
        meta = o["meta_info"]
        assert (
            len(meta["output_token_logprobs"]) == meta["completion_tokens"] == len(o["output_ids"])
        )
        assert o["output_ids"][-1] in engine.eos_ids  # nothing after the grammar's end


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_regex_and_ebnf_outputs_match(engine, temperature) -> None:
    outs = engine.generate(
        ["request:", "expression:"],
        [
            {"regex": REGEX, "max_new_tokens": 60, "temperature": temperature, "seed": 1},
            {"ebnf": EBNF, "max_new_tokens": 80, "temperature": temperature, "seed": 2},
        ],
    )
    assert finished_by_grammar(outs[0]) and re.fullmatch(REGEX, outs[0]["text"])
    assert finished_by_grammar(outs[1])
    tree = ast.parse(outs[1]["text"], mode="eval")  # Python's parser agrees it is an expression
    assert isinstance(tree.body, (ast.BinOp, ast.Constant))


def test_json_object_is_valid_json(engine) -> None:
    tok = engine.tokenizer
    # Nudge the random model to close strings and objects; the mask keeps it legal.
    closers = {
        t: 6.0
        for t in tok.encode('"}', add_special_tokens=False)
        + tok.encode("}", add_special_tokens=False)
    }
    out = engine.generate(
        "obj:",
        {"json_object": True, "max_new_tokens": 200, "logit_bias": closers, "temperature": 0},
    )
    assert finished_by_grammar(out)
    assert isinstance(json.loads(out["text"]), dict)


def test_mixed_batch_of_constrained_and_free_requests(engine) -> None:
    prompts = random_prompts(4, [5, 9], seed=41)
    free_sp = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    alone = engine.generate(input_ids=prompts[1], sampling_params=free_sp)
    outs = engine.generate(
        input_ids=prompts,
        sampling_params=[
            {"regex": "[ab]{3}", "max_new_tokens": 10},
            free_sp,
            {"json_schema": json.dumps(SCHEMA), "max_new_tokens": 200, "temperature": 0.7},
            {"ebnf": 'root ::= "x" | "yy"', "max_new_tokens": 10},
        ],
        return_logprob=True,
    )
    assert re.fullmatch("[ab]{3}", outs[0]["text"])
    assert outs[1]["output_ids"] == alone["output_ids"]  # the free request is unaffected
    jsonschema.validate(json.loads(outs[2]["text"]), SCHEMA)
    assert outs[3]["text"] in ("x", "yy")


def test_invalid_grammars_are_value_errors_and_the_engine_keeps_serving(engine) -> None:
    for sp, field in (
        ({"regex": "(unclosed"}, "regex"),
        ({"json_schema": "{not json"}, "json_schema"),
        ({"ebnf": "root ::= ("}, "ebnf"),
        ({"regex": "a", "ebnf": 'root ::= "a"'}, "ebnf"),
    ):
        with pytest.raises(ValueError, match=f"^{field}: "):
            engine.generate("x", sp)
    assert engine.generate("x", {"regex": "ok", "max_new_tokens": 5})["text"] == "ok"


def test_raw_logprobs_ignore_the_mask_and_processed_report_minus_9999(engine, processed) -> None:
    p = random_prompts(1, [7], seed=42)[0]
    sp = {"regex": "(yes|no)", "max_new_tokens": 5, "temperature": 0}
    forbidden = engine.tokenizer.encode("zzz", add_special_tokens=False)[:1]
    kwargs = dict(
        input_ids=p,
        sampling_params=sp,
        return_logprob=True,
        top_logprobs_num=5,
        token_ids_logprob=forbidden,
    )
    raw = engine.generate(**kwargs)
    assert raw["text"] in ("yes", "no")
    ref = torch.log_softmax(hf_logits("qwen3", p + raw["output_ids"]), dim=-1)
    for j, (lp, tid, _) in enumerate(raw["meta_info"]["output_token_logprobs"]):
        assert lp == pytest.approx(
            float(ref[len(p) - 1 + j, tid]), abs=1e-4
        )  # the model's own numbers
    assert raw["meta_info"]["output_token_ids_logprobs"][0][0][0] > -9999.0
    proc = processed.generate(**kwargs)
    assert proc["output_ids"] == raw["output_ids"]
    meta = proc["meta_info"]
    assert meta["output_token_ids_logprobs"][0][0][0] == -9999.0  # forbidden by the grammar
    for top in meta["output_top_logprobs"]:
        values = [v for v, _, _ in top]
        assert all(v == -9999.0 or v > -1e4 for v in values) and all(v == v for v in values)
    # The first step allows only the first tokens of "yes" / "no": the rest of its top 5 is masked.
    assert -9999.0 in [v for v, _, _ in meta["output_top_logprobs"][0]]
    assert math_isclose_sum(meta["output_top_logprobs"][0])


def math_isclose_sum(top) -> bool:
    """The allowed entries carry all the probability mass of a masked row."""
    mass = sum(torch.tensor(v).exp().item() for v, _, _ in top if v > -9999.0)
    return abs(mass - 1.0) < 1e-4


def test_grammar_backend_none_disables_constraints() -> None:
    eng = Engine(
        model_path=model_path("qwen3"), device="cpu", max_total_tokens=1024, grammar_backend="none"
    )
    try:
        with pytest.raises(ValueError, match="^regex: constrained decoding is disabled"):
            eng.generate("x", {"regex": "a+"})
        assert (
            eng.generate("x", {"max_new_tokens": 2, "ignore_eos": True})["meta_info"][
                "completion_tokens"
            ]
            == 2
        )
    finally:
        eng.shutdown()


def test_a_grammar_that_ends_before_min_new_tokens_still_ends_cleanly(engine) -> None:
    out = engine.generate("x", {"regex": "(yes|no)", "min_new_tokens": 6, "max_new_tokens": 10})
    assert out["text"] in ("yes", "no") and out["meta_info"]["finish_reason"]["type"] == "stop"
