"""Pieces shared by the OpenAI-compatible endpoints."""

from __future__ import annotations

from typing import Any

from specserve.engine.request import FinishReason
from specserve.protocol.openai import SamplingFields

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
    return sp


def finish_name(reason: FinishReason | None) -> str | None:
    return reason.type if reason is not None else None


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def seeded(sp: dict[str, Any], choice: int) -> dict[str, Any]:
    """Sampling params of choice ``choice`` of ``n``: with a seed, each choice
    gets its own reproducible stream (``seed + choice``)."""
    if choice == 0 or sp.get("seed") is None:
        return sp
    return {**sp, "seed": sp["seed"] + choice}
