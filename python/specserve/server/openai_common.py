"""Pieces shared by the OpenAI-compatible endpoints."""

from __future__ import annotations

import json
from typing import Any

from specserve.core import FinishReason
from specserve.protocol.openai import SamplingFields
from specserve.server.errors import APIError

# Engine field names in validation errors -> the OpenAI endpoints' own names.
BASE_RENAMES = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "return_logprob": "logprobs",
}

# OpenAI field -> SamplingParams field, for fields that are passed through when set.
_PASS_THROUGH = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "seed": "seed",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "logit_bias": "logit_bias",
}


def sampling_dict(body: SamplingFields, max_new_tokens: int) -> dict[str, Any]:
    sp: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "min_new_tokens": body.min_tokens,
        "ignore_eos": body.ignore_eos,
        "skip_special_tokens": body.skip_special_tokens,
    }
    for src, dst in _PASS_THROUGH.items():
        value = getattr(body, src)
        if value is not None:
            sp[dst] = value
    sp.update(_constraint(body))
    return sp


def _constraint(body: SamplingFields) -> dict[str, Any]:
    """Output constraints: ``response_format`` plus the ``json_schema`` /
    ``regex`` / ``ebnf`` extension fields (two of them at once is a 400)."""
    out: dict[str, Any] = {}
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        out["json_object"] = True
    elif rf is not None and rf.type == "json_schema":
        schema = rf.json_schema.schema_ if rf.json_schema is not None else None
        if schema is None:
            raise APIError(
                "response_format: json_schema needs a 'json_schema' object with a 'schema'",
                "response_format",
            )
        out["json_schema"] = json.dumps(schema)
    for name in ("json_schema", "regex", "ebnf"):
        value = getattr(body, name)
        if value is not None:
            if name in out:
                raise APIError(f"{name}: only one output constraint per request", name)
            out[name] = json.dumps(value) if isinstance(value, dict) else value
    return out


def constraint_renames(body: SamplingFields) -> dict[str, str]:
    """Errors about a constraint given as ``response_format`` name that field."""
    rf = body.response_format
    if rf is not None and rf.type in ("json_object", "json_schema"):
        return {"json_schema": "response_format", "json_object": "response_format"}
    return {}


def finish_name(reason: FinishReason | None) -> str | None:
    return reason.type if reason is not None else None


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
