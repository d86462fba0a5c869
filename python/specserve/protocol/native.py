"""Request body of the native ``/generate`` endpoint (SGLang's shape)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class GenerateReqInput(BaseModel):
    model_config = ConfigDict(extra="ignore")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] = 0
    token_ids_logprob: list[int] | list[list[int] | None] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | list[str] | None = None
