"""The FastAPI application: routes, authentication, errors."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specserve import __version__
from specserve.config import ServerConfig
from specserve.engine.data_parallel import DataParallelEngine
from specserve.engine.engine import Engine
from specserve.protocol.openai import DetokenizeRequest, TokenizeRequest
from specserve.server import native, openai_chat, openai_completions
from specserve.server.context import ServerContext
from specserve.server.errors import (
    APIError,
    error_body,
    error_responses,
    install_error_handlers,
    install_openapi,
)

OPEN_PATHS = ("/health",)  # answered without an API key (liveness probes)


def create_app(engine: Engine | DataParallelEngine, config: ServerConfig) -> FastAPI:
    app = FastAPI(title="specserve", version=__version__)
    ctx = ServerContext(engine, config, config.served_model_name or engine.config.model_path)
    app.state.ctx = ctx
    install_error_handlers(app)
    install_openapi(app, OPEN_PATHS if config.api_key else None)
    app.add_middleware(BodyLimit, limit=config.max_request_body_bytes)
    if config.api_key:
        _install_auth(app, config.api_key)
    # The OpenAI endpoints check the model name and stop with the engine.
    for module in (openai_completions, openai_chat):
        app.include_router(module.router, responses=error_responses(404, 503))
    app.include_router(native.router)
    created = int(time.time())

    @app.get("/health", responses=error_responses(503))
    async def health() -> Response:
        """Liveness: 503 once the engine has stopped on an error (the server
        then exits non-zero)."""
        if engine.error is not None:
            return _unhealthy(f"the engine stopped: {engine.error}")
        return JSONResponse({"status": "ok"})

    @app.get("/health_generate", responses=error_responses(503))
    async def health_generate(raw: Request) -> Response:
        """Healthy only if the engine generates a token within the deadline.
        The probe is not a client's request: ``abort_all`` leaves it alone."""
        greqs, _ = await ctx.build(input_ids=[[0]], sampling_params={"max_new_tokens": 1})
        probe = greqs[0].rid
        with engine.probing(probe):
            try:
                [out] = await asyncio.wait_for(ctx.collect(greqs, raw), timeout=60)
            except asyncio.TimeoutError:
                return _unhealthy("generation timed out")
        if out.finish_reason is None or out.finish_reason.type == "abort":
            why = out.finish_reason.message if out.finish_reason else None
            return _unhealthy(f"the probe was aborted: {why or 'no reason given'}")
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": ctx.model_name,
            "object": "model",
            "created": created,
            "owned_by": "specserve",
            "root": engine.config.model_path,
            "max_model_len": engine.requests.limits.context_length,
        }
        return {"object": "list", "data": [card]}

    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        server = dataclasses.asdict(config)
        server["api_key"] = None if config.api_key is None else "***"
        lim = engine.requests.limits
        return {
            "version": __version__,
            "served_model_name": ctx.model_name,
            "engine_args": dataclasses.asdict(engine.config),
            "server_args": server,
            "context_length": lim.context_length,
            "max_total_num_tokens": lim.capacity_tokens,
            "stats": engine.stats(),
            "speculative": _spec_info(engine),
        }

    @app.post("/tokenize", responses=error_responses(404))
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        ctx.check_model(body.model)
        tok = engine.tokenizer
        if isinstance(body.prompt, str):
            ids = await asyncio.to_thread(tok.encode, body.prompt, body.add_special_tokens)
        else:
            try:
                text = await asyncio.to_thread(tok.apply_chat_template, body.prompt)
            except Exception as e:  # no template, or the template rejects the messages
                raise APIError(f"prompt: cannot apply the chat template: {e}", "prompt") from None
            ids = await asyncio.to_thread(tok.encode, text, False)
        return {
            "tokens": ids,
            "count": len(ids),
            "max_model_len": engine.requests.limits.context_length,
        }

    @app.post("/detokenize", responses=error_responses(404))
    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        ctx.check_model(body.model)
        vocab = engine.requests.limits.vocab_size
        if not all(0 <= t < vocab for t in body.tokens):
            raise APIError(f"tokens: ids must be in [0, {vocab})", "tokens")
        return {"prompt": engine.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        hf = engine.tokenizer.hf
        return {
            "eos_token": hf.eos_token,
            "eos_token_id": hf.eos_token_id,
            "eos_token_ids": sorted(engine.eos_ids),
            "bos_token": hf.bos_token,
            "bos_token_id": hf.bos_token_id,
            "pad_token": hf.pad_token,
            "pad_token_id": hf.pad_token_id,
            "chat_template": hf.chat_template,
            "model_max_length": engine.requests.limits.context_length,
            "vocab_size": len(engine.tokenizer),
            "tokenizer_class": type(hf).__name__,
        }

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(ctx.metrics.render(), media_type="text/plain; version=0.0.4")

    return app


def _unhealthy(message: str) -> JSONResponse:
    return JSONResponse(error_body(message, "server_error", None, 503), 503)


def _spec_info(engine: Engine | DataParallelEngine) -> dict[str, Any] | None:
    if engine.proposer is None:
        return None
    st = engine.stats()
    return {
        "algorithm": engine.config.spec.algorithm,
        "draft_model_path": engine.config.spec.draft_model_path,
        "max_drafts": engine.proposer.max_drafts,
        "mean_accept_length": st["spec_accept_length"],
        "verify_rounds": st["spec_verify_rounds"],
        "adaptive": engine.config.spec.adaptive,
        # The cost model's decisions (stats has the rest of its counters).
        "plain_step_share": (
            st["spec_plain_steps"] / st["spec_steps"] if st.get("spec_steps") else None
        ),
    }


class BodyLimit:
    """Refuses request bodies over ``limit`` bytes with a 413, whether they
    declare their length or stream it chunked, before they are buffered."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = HTTPException(
            413,
            f"request body: larger than the limit of {self.limit} bytes (--max-request-body-bytes)",
        )
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await APIError(too_large.detail, None, 413).response()(scope, receive, send)
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise too_large  # an HTTPException: rendered by the error handlers
            return message

        await self.app(scope, limited, send)


def _install_auth(app: FastAPI, api_key: str) -> None:
    expected = f"Bearer {api_key}"

    @app.middleware("http")
    async def check_key(request: Request, call_next: Any) -> Response:
        if request.url.path in OPEN_PATHS or request.headers.get("authorization") == expected:
            return await call_next(request)
        body = error_body("missing or invalid API key", "authentication_error", None, 401)
        return JSONResponse(body, 401)
