"""``POST /generate``: the native API (SGLang's request and response shapes).

Streaming follows SGLang: every event carries the whole result so far
(cumulative ``text``, ``output_ids`` and logprobs), so the last event equals
the non-streamed response.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request

from specserve.engine.request_factory import GenerateRequest
from specserve.engine.result import ResultCollector
from specserve.protocol.native import AbortRequestInput, GenerateReqInput
from specserve.server.context import ServerContext, sse
from specserve.server.errors import APIError, error_responses

router = APIRouter()


@router.post("/generate", responses=error_responses(503))
async def generate(body: GenerateReqInput, raw: Request) -> Any:
    ctx: ServerContext = raw.app.state.ctx
    greqs, batched = await ctx.build(
        {"prompt": "text"},
        prompt=body.text,
        input_ids=body.input_ids,
        sampling_params=body.sampling_dicts(),
        return_logprob=body.return_logprob,
        logprob_start_len=body.logprob_start_len,
        top_logprobs_num=body.top_logprobs_num,
        token_ids_logprob=body.token_ids_logprob,
        return_text_in_logprobs=body.return_text_in_logprobs,
        rid=body.rid,
    )
    if body.stream:
        return ctx.event_stream(_stream(ctx, greqs, batched))
    outs = await ctx.collect(greqs, raw)
    results = [ctx.engine.format(g, o) for g, o in zip(greqs, outs)]
    return results if batched else results[0]


@router.post("/abort_request")
async def abort_request(body: AbortRequestInput, raw: Request) -> dict[str, Any]:
    """SGLang's endpoint: aborts a queued or running request by ``rid`` (the
    ``rid`` of a ``/generate`` prompt or of an OpenAI request), or all of them
    (``abort_all``); answers how many were in flight."""
    ctx: ServerContext = raw.app.state.ctx
    if body.abort_all:  # health probes (/health_generate) are left alone
        return {"aborted": ctx.engine.abort_all("aborted by /abort_request")}
    if not body.rid:
        raise APIError("rid: give the id of the request to abort, or abort_all", "rid")
    return {"aborted": ctx.abort(body.rid)}


async def _stream(
    ctx: ServerContext, greqs: list[GenerateRequest], batched: bool
) -> AsyncIterator[str]:
    cols = [ResultCollector() for _ in greqs]
    async with ctx.streaming(None, greqs) as deltas:
        async for i, out in deltas:
            cols[i].add(out)
            result = ctx.engine.format(greqs[i], cols[i].as_output(greqs[i].rid))
            if batched:
                result["index"] = i
            yield sse(result)
    yield sse("[DONE]")
