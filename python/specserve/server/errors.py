"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException


class ErrorDetail(BaseModel):
    message: str
    type: str  # invalid_request_error, authentication_error, not_found_error, server_error
    param: str | None  # the field at fault, when one is
    code: int  # the HTTP status


class ErrorResponse(BaseModel):
    """The body of every error answer."""

    error: ErrorDetail


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
    return ErrorResponse(
        error=ErrorDetail(message=message, type=type, param=param, code=code)
    ).model_dump()


# What each error status means here, as /openapi.json describes it.
ERROR_STATUSES = {
    400: "Invalid request: the message names the field (param) or the limit",
    401: "Missing or invalid API key (--api-key)",
    404: "The model is not served here",
    413: "Request body larger than --max-request-body-bytes",
    500: "Internal error, or the request failed inside the engine",
    503: "The engine has stopped (shut down, or after a device error); "
    "/health_generate: its probe timed out or was aborted",
}
_REF = "#/components/schemas/{model}"


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` of a route: the error statuses it answers beside those
    every route may (see ``install_openapi``)."""
    return {s: {"model": ErrorResponse, "description": ERROR_STATUSES[s]} for s in statuses}


def install_openapi(app: FastAPI, open_paths: tuple[str, ...] | None) -> None:
    """``/openapi.json`` as the server answers. Every operation may answer a
    500 (the catch-all handler); one with a JSON body a 400 for a body that
    fails validation (FastAPI would list a 422, which this server never
    sends) and a 413 (``BodyLimit``); with an API key, every path but
    ``open_paths`` a 401 (None: no key). Routes declare the rest."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for unused in ("HTTPValidationError", "ValidationError"):
            schemas.pop(unused, None)
        error = ErrorResponse.model_json_schema(ref_template=_REF)
        schemas.update(error.pop("$defs", {}), ErrorResponse=error)
        for path, ops in doc["paths"].items():
            for op in ops.values():
                responses = op["responses"]
                responses.pop("422", None)
                statuses = [500]
                if "requestBody" in op:
                    statuses += [400, 413]
                if open_paths is not None and path not in open_paths:
                    statuses.append(401)
                for status in statuses:
                    responses.setdefault(str(status), _error_entry(status))
                op["responses"] = dict(sorted(responses.items()))
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]


def _error_entry(status: int) -> dict[str, Any]:
    schema = {"$ref": _REF.format(model=ErrorResponse.__name__)}
    return {
        "description": ERROR_STATUSES[status],
        "content": {"application/json": {"schema": schema}},
    }


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
