"""``POST /v1/completions``: legacy completions with logprobs and echo."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request

from specserve.engine.engine_core import RequestOutput
from specserve.engine.request_factory import GenerateRequest
from specserve.protocol.openai import CompletionRequest
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
    "top_logprobs_num": "logprobs",
    "input_ids": "prompt",
}


@dataclass
class _Choice:
    """One returned choice: its request, and what it has emitted so far."""

    index: int
    greq: GenerateRequest
    prompt_text: str
    echo: bool
    offset: int = 0  # characters of returned text so far (for text_offset)
    started: bool = False
    entries: list[TokenLogprob] = field(default_factory=list)


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, raw: Request) -> Any:
    ctx: ServerContext = raw.app.state.ctx
    ctx.check_model(body.model)
    if body.suffix is not None:
        raise APIError("suffix: not supported", "suffix")
    max_top = ctx.engine.config.max_top_logprobs
    if body.logprobs is not None and not 0 <= body.logprobs <= max_top:
        raise APIError(f"logprobs must be in [0, {max_top}], got {body.logprobs}", "logprobs")
    prompt = body.prompt
    if isinstance(prompt, list) and not prompt:
        raise APIError("prompt: must not be empty", "prompt")
    texts = isinstance(prompt, str) or isinstance(prompt[0], str)
    with_logprobs = body.logprobs is not None
    greqs, batched = await ctx.build(
        {**RENAMES, **constraint_renames(body)},
        prompt=prompt if texts else None,
        input_ids=None if texts else prompt,
        sampling_params=sampling_dict(body, 16 if body.max_tokens is None else body.max_tokens),
        return_logprob=with_logprobs,
        logprob_start_len=0 if body.echo and with_logprobs else -1,
        top_logprobs_num=body.logprobs or 0,
        n=body.n,
    )
    prompts = prompt if batched else [prompt]
    tok = ctx.engine.tokenizer
    choices = [
        _Choice(i, g, p if isinstance(p, str) else tok.decode(g.input_ids, False), body.echo)
        for i, (g, p) in enumerate(zip(greqs, (p for p in prompts for _ in range(body.n))))
    ]
    rid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    head = {"id": rid, "object": "text_completion", "created": created, "model": ctx.model_name}
    prompt_tokens = sum(len(g.input_ids) for g in greqs[:: body.n])
    ctx.claim(body.rid, greqs)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return ctx.event_stream(
            _stream(ctx, body.rid, choices, head, with_logprobs, include_usage, prompt_tokens)
        )
    try:
        outs = await ctx.collect(greqs, raw)
    finally:
        ctx.release(body.rid)
    return {
        **head,
        "choices": [_render(ctx, c, o, with_logprobs, final=True) for c, o in zip(choices, outs)],
        "usage": usage(prompt_tokens, sum(o.completion_tokens for o in outs)),
    }


def _render(
    ctx: ServerContext, c: _Choice, out: RequestOutput, with_logprobs: bool, final: bool
) -> dict[str, Any]:
    """The choice object for ``out`` (a whole result, or one streamed delta)."""
    text = out.text
    entries = list(out.output_logprobs)
    if c.echo and not c.started:
        text = c.prompt_text + text
    if c.echo:
        entries = list(out.input_logprobs) + entries
    c.started = True
    logprobs = _logprobs(ctx, c, entries) if with_logprobs else None
    return {
        "index": c.index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish_name(out.finish_reason) if final else None,
    }


def _logprobs(ctx: ServerContext, c: _Choice, entries: list[TokenLogprob]) -> dict[str, Any]:
    tok = ctx.engine.tokenizer
    tokens, token_lps, tops, offsets = [], [], [], []
    for e in entries:
        text = tok.token_text(e.token_id)
        tokens.append(text)
        token_lps.append(e.logprob)
        offsets.append(c.offset)
        c.offset += len(text)
        if e.logprob is None:
            tops.append(None)
            continue
        top: dict[str, float] = {}
        for lp, tid in e.top or ():
            top.setdefault(tok.token_text(tid), lp)
        top.setdefault(text, e.logprob)  # the sampled token is always listed
        tops.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": token_lps,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


async def _stream(
    ctx: ServerContext,
    group: str | None,
    choices: list[_Choice],
    head: dict[str, Any],
    with_logprobs: bool,
    include_usage: bool,
    prompt_tokens: int,
) -> AsyncIterator[str]:
    completion_tokens = 0
    async with ctx.streaming(group, [c.greq for c in choices]) as deltas:
        async for i, out in deltas:
            c = choices[i]
            completion_tokens += len(out.token_ids)
            echo_pending = c.echo and (out.input_logprobs or not c.started)
            if out.text or out.token_ids or out.finished or echo_pending:
                choice = _render(ctx, c, out, with_logprobs, final=out.finished)
                yield sse({**head, "choices": [choice]})
    if include_usage:
        yield sse({**head, "choices": [], "usage": usage(prompt_tokens, completion_tokens)})
    yield sse("[DONE]")
