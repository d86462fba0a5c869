"""Request bodies of the OpenAI-compatible endpoints (responses are plain dicts).

Types are strict (see ``protocol/base.py``); value ranges are checked by the
engine's request factory and the endpoints, before anything is admitted.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from specserve.protocol.base import RequestBody, StrictModel

TokenIds = list[int]


class StreamOptions(StrictModel):
    include_usage: bool = False


class JsonSchemaFormat(StrictModel):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingKnobs(StrictModel):
    """Sampling fields both APIs spell the same way (null: the default)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = Field(default=None, description="a string or a list of strings")
    stop_token_ids: TokenIds | None = None
    json_schema: str | dict[str, Any] | None = Field(
        default=None, description="a JSON schema, as an object or as a string"
    )
    regex: str | None = None
    ebnf: str | None = None


class SamplingFields(RequestBody, SamplingKnobs):
    """Sampling fields shared by completions and chat (OpenAI + SGLang/vLLM extras)."""

    model: str | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    skip_special_tokens: bool = True
    # Output constraints (one at most): this, or json_schema / regex / ebnf.
    response_format: ResponseFormat | None = None
    user: str | None = None
    # SGLang's extension: the id ``/abort_request`` takes.
    rid: str | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | TokenIds | list[TokenIds] = Field(
        description="a string, a list of strings, a list of token ids or a list of them"
    )
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None


class ContentPart(StrictModel):
    # Text only: an image or audio part is refused, never silently dropped.
    type: Literal["text"] = Field(description="'text' (images and audio are not served)")
    text: str | None = None


class ChatMessage(StrictModel):
    """Keys beyond ``role`` and ``content`` go to the chat template as they are."""

    model_config = {**StrictModel.model_config, "extra": "allow"}

    role: str
    content: str | list[ContentPart] | None = Field(
        default=None, description="a string, null or a list of content parts"
    )


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(RequestBody):
    prompt: str | list[dict[str, Any]] = Field(description="a string, or a list of chat messages")
    add_special_tokens: bool = True
    model: str | None = None


class DetokenizeRequest(RequestBody):
    tokens: TokenIds
    model: str | None = None
