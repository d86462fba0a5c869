"""Request bodies of the native endpoints (SGLang's shapes): ``/generate`` and
``/abort_request``."""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field

from specserve.protocol.base import STRICT, RequestBody
from specserve.protocol.openai import SamplingKnobs, TokenIds


class NativeSamplingParams(SamplingKnobs):
    """``sampling_params`` of ``/generate``: SamplingParams' fields, JSON-typed.
    Unknown keys are a 400 (a misspelt knob must not be silently ignored)."""

    model_config = ConfigDict(**{**STRICT, "extra": "forbid"})

    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    json_object: bool | None = None

    def as_dict(self) -> dict[str, Any]:
        return self.model_dump(exclude_unset=True)


class GenerateReqInput(RequestBody):
    text: str | list[str] | None = Field(default=None, description="a string or a list of them")
    input_ids: TokenIds | list[TokenIds] | None = Field(
        default=None, description="a list of token ids, or a list of them"
    )
    sampling_params: NativeSamplingParams | list[NativeSamplingParams] | None = Field(
        default=None, description="an object, or a list of them (one per prompt)"
    )
    return_logprob: bool | list[bool] = Field(
        default=False, description="a boolean, or a list of them"
    )
    logprob_start_len: int | list[int] | None = Field(
        default=None, description="an integer, or a list of them"
    )
    top_logprobs_num: int | list[int] = Field(
        default=0, description="an integer, or a list of them"
    )
    token_ids_logprob: TokenIds | list[TokenIds | None] | None = Field(
        default=None, description="a list of token ids, or one (or null) per prompt"
    )
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | list[str] | None = Field(default=None, description="a string or a list of them")

    def sampling_dicts(self) -> dict[str, Any] | list[dict[str, Any]] | None:
        sp = self.sampling_params
        if isinstance(sp, list):
            return [p.as_dict() for p in sp]
        return None if sp is None else sp.as_dict()


class AbortRequestInput(RequestBody):
    rid: str = ""
    abort_all: bool = False
