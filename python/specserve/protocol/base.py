"""The strict base of every request body: JSON types as they are, no coercion.

A client that sends ``true`` or ``"5"`` where a number or a token id belongs,
``NaN`` / ``Infinity`` (which Python's JSON parser accepts), or a string with
a lone surrogate escape (``"\\ud800"``, valid JSON but not encodable as UTF-8,
so no tokenizer, log or response can carry it) gets a 400 naming the field.
Ranges that depend on the model (token ids, context length) are checked by
the engine's ``RequestFactory`` before admission.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic_core import PydanticCustomError

from specserve.tokenizer.tokenizer import is_utf8

# Every nested model shares these rules; unknown fields are ignored, as
# OpenAI-compatible servers commonly do, so newer clients keep working.
STRICT = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class StrictModel(BaseModel):
    model_config = STRICT


class RequestBody(StrictModel):
    """A top-level request body: also refuses strings that are not UTF-8."""

    @model_validator(mode="before")
    @classmethod
    def _utf8_only(cls, data: Any) -> Any:
        bad = find_lone_surrogate(data)
        if bad is not None:
            raise PydanticCustomError(
                "utf8",
                "{path}: strings must be valid UTF-8 (a lone surrogate escape is not)",
                {"path": bad or "body", "param": bad.split(".")[0] if bad else None},
            )
        return data


def find_lone_surrogate(value: Any, path: str = "") -> str | None:
    """The dotted path of the first string (or object key) in ``value`` that
    cannot be encoded as UTF-8, or None."""
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            if not is_utf8(item):
                return where
        elif isinstance(item, dict):
            for k, v in item.items():
                key = f"{where}.{k}" if where else str(k)
                if isinstance(k, str) and not is_utf8(k):
                    return where or "body"
                stack.append((v, key))
        elif isinstance(item, list):
            stack.extend((v, f"{where}.{i}") for i, v in enumerate(item))
    return None
