"""``POST /v1/chat/completions``: chat template, logprobs, streaming."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request

from specserve.engine.request_factory import GenerateRequest
from specserve.protocol.openai import ChatCompletionRequest
from specserve.sampling.logprobs import TokenLogprob
from specserve.server.context import ServerContext, sse
from specserve.server.errors import APIError
from specserve.server.openai_common import (
    BASE_RENAMES,
    constraint_renames,
    finish_name,
    sampling_dict,
    usage,
)

router = APIRouter()

RENAMES = {
    **BASE_RENAMES,
    "top_logprobs_num": "top_logprobs",
    "input_ids": "messages",
    "prompt": "messages",
}
MAX_TOP_LOGPROBS = 20  # OpenAI's own cap for chat


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Any:
    ctx: ServerContext = raw.app.state.ctx
    ctx.check_model(body.model)
    top = body.top_logprobs
    if top is not None:
        cap = min(MAX_TOP_LOGPROBS, ctx.engine.config.max_top_logprobs)
        if not body.logprobs:
            raise APIError("top_logprobs requires logprobs to be true", "top_logprobs")
        if not 0 <= top <= cap:
            raise APIError(f"top_logprobs must be in [0, {cap}], got {top}", "top_logprobs")
    ids = await _apply_template(ctx, body)
    renames = {**RENAMES, **constraint_renames(body)}
    limit = body.max_tokens
    if body.max_completion_tokens is not None:  # the newer name wins, and errors use it
        limit = body.max_completion_tokens
        renames["max_new_tokens"] = "max_completion_tokens"
    if limit is None:  # as much as the context and the KV pool leave
        lim = ctx.engine.requests.limits
        limit = max(0, min(lim.context_length, lim.capacity_tokens) - len(ids))
    greqs, _ = await ctx.build(
        renames,
        input_ids=ids,
        sampling_params=sampling_dict(body, limit),
        return_logprob=body.logprobs,
        top_logprobs_num=top or 0,
        n=body.n,
    )
    head = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "created": int(time.time()),
        "model": ctx.model_name,
    }
    ctx.claim(body.rid, greqs)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return ctx.event_stream(_stream(ctx, body.rid, greqs, head, body.logprobs, include_usage))
    try:
        outs = await ctx.collect(greqs, raw)
    finally:
        ctx.release(body.rid)
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": o.text},
            "logprobs": {"content": _items(ctx, o.output_logprobs)} if body.logprobs else None,
            "finish_reason": finish_name(o.finish_reason),
        }
        for i, o in enumerate(outs)
    ]
    return {
        **head,
        "object": "chat.completion",
        "choices": choices,
        "usage": usage(len(ids), sum(o.completion_tokens for o in outs)),
    }


async def _apply_template(ctx: ServerContext, body: ChatCompletionRequest) -> list[int]:
    messages = []
    for m in body.messages:
        msg = m.model_dump(exclude_none=True)
        if isinstance(msg.get("content"), list):  # content parts: keep the text ones
            msg["content"] = "".join(
                p.get("text") or "" for p in msg["content"] if p.get("type") == "text"
            )
        messages.append(msg)
    tok = ctx.engine.tokenizer

    def render() -> list[int]:
        text = tok.apply_chat_template(
            messages,
            add_generation_prompt=body.add_generation_prompt,
            **(body.chat_template_kwargs or {}),
        )
        # The template writes its own special tokens; do not add a second BOS.
        return tok.encode(text, add_special_tokens=False)

    try:
        return await asyncio.to_thread(render)
    except ValueError as e:
        raise APIError(str(e), "messages") from None
    except Exception as e:  # template errors (jinja) are the client's messages' fault
        raise APIError(f"messages: the chat template failed: {e}", "messages") from None


def _items(ctx: ServerContext, entries: list[TokenLogprob]) -> list[dict[str, Any]]:
    tok = ctx.engine.tokenizer

    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = tok.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(tok.token_bytes(token_id))}

    return [
        {**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for lp, t in e.top or ()]}
        for e in entries
        if e.logprob is not None
    ]


async def _stream(
    ctx: ServerContext,
    group: str | None,
    greqs: list[GenerateRequest],
    head: dict[str, Any],
    with_logprobs: bool,
    include_usage: bool,
) -> AsyncIterator[str]:
    head = {**head, "object": "chat.completion.chunk"}

    def chunk(
        index: int, delta: dict[str, Any], logprobs: Any = None, finish: str | None = None
    ) -> str:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return sse({**head, "choices": [choice]})

    for i in range(len(greqs)):
        yield chunk(i, {"role": "assistant", "content": ""})
    completion_tokens = 0
    async with ctx.streaming(group, greqs) as deltas:
        async for i, out in deltas:
            completion_tokens += len(out.token_ids)
            if out.text or out.token_ids:
                lps = {"content": _items(ctx, out.output_logprobs)} if with_logprobs else None
                yield chunk(i, {"content": out.text}, lps)
            if out.finished:
                yield chunk(i, {}, None, finish_name(out.finish_reason))
    if include_usage:
        prompt_tokens = len(greqs[0].input_ids)
        yield sse({**head, "choices": [], "usage": usage(prompt_tokens, completion_tokens)})
    yield sse("[DONE]")
