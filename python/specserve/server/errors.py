"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException


class APIError(Exception):
    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.type = type

    def response(self) -> JSONResponse:
        return JSONResponse(
            error_body(self.message, self.type, self.param, self.status), self.status
        )


def error_body(message: str, type: str, param: str | None, code: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


_FIELD = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)")


def from_value_error(e: ValueError, renames: dict[str, str] | None = None) -> APIError:
    """Engine validation errors start with the field they name; rename it to
    the endpoint's spelling (``max_new_tokens`` -> ``max_tokens``, ...)."""
    message = str(e)
    m = _FIELD.match(message)
    param = m.group(1) if m else None
    if param and renames and param in renames:
        message = renames[param] + message[len(param) :]
        param = renames[param]
    return APIError(message, param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, e: HTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return APIError(str(e.detail), None, e.status_code, kind).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        # FastAPI answers 422 by default; OpenAI clients expect 400 naming the field.
        errors = e.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return APIError(f"request body is not valid JSON: {first.get('msg', '')}").response()
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = loc[0] if loc else None
        where = ".".join(loc) or "request body"
        message = f"{where}: {first.get('msg', 'invalid request')}"
        return APIError(message, param).response()
