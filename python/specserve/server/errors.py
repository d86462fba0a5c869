"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import re
from collections.abc import Sequence
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

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, e: Exception) -> JSONResponse:
        # A bug, not the client's fault; still an answer in the OpenAI shape
        # (Starlette logs the traceback).
        return APIError(f"internal error: {e!r}", None, 500, "server_error").response()

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, e: HTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return APIError(str(e.detail), None, e.status_code, kind).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        # FastAPI answers 422 by default; OpenAI clients expect 400 naming the field.
        return validation_error(e.errors()).response()


def validation_error(errors: Sequence[Any]) -> APIError:
    """One 400 from pydantic's errors. A value that fits no branch of a union
    yields errors for every branch; the one that got furthest into the value
    (deepest location, then the branch with the fewest errors, then the
    highest index) says best what is wrong."""
    if not errors:
        return APIError("invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return APIError(f"request body is not valid JSON: {first.get('msg', '')}")
    ctx = first.get("ctx") or {}
    if first.get("type") == "utf8":
        return APIError(first.get("msg", "invalid string"), ctx.get("param"))
    paths = [_field_path(err.get("loc", ())) for err in errors]
    # Errors per union branch: the branch with fewer errors is nearer the value.
    branches = [_branch(err.get("loc", ())) for err in errors]
    per_branch = {b: branches.count(b) for b in branches}

    def rank(i: int) -> tuple[int, int, int, int]:
        return (len(paths[i]), -per_branch[branches[i]], _last_index(paths[i]), -i)

    best = max(range(len(errors)), key=rank)
    path = paths[best]
    where = ".".join(map(str, path)) or "request body"
    param = str(path[0]) if path else None
    return APIError(f"{where}: {errors[best].get('msg', 'invalid value')}", param)


def _field_path(loc: Sequence[Any]) -> list[Any]:
    """The location without FastAPI's ``body`` prefix and pydantic's union
    branch tags (``str``, ``list[int]``, model names, ...)."""
    return [p for p in loc if p != "body" and not (isinstance(p, str) and _is_tag(p))]


def _branch(loc: Sequence[Any]) -> tuple[Any, ...]:
    """The location up to its first union branch tag (the branch it tried)."""
    for i, p in enumerate(loc):
        if isinstance(p, str) and p != "body" and _is_tag(p):
            return tuple(loc[: i + 1])
    return tuple(loc)


def _is_tag(part: str) -> bool:
    return "[" in part or part[:1].isupper() or part in _TYPE_TAGS


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _last_index(path: Sequence[Any]) -> int:
    ints = [p for p in path if isinstance(p, int)]
    return ints[-1] if ints else -1
