"""Per-request sampling parameters (SGLang names), validated on construction."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

from specserve.grammar.base import GrammarSpec


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0): no top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False  # keep the matched stop string in the text
    # At most one output constraint.
    json_schema: str | None = None  # a JSON schema (text, or an object serialised here)
    json_object: bool = False  # any JSON object
    regex: str | None = None
    ebnf: str | None = None

    def __post_init__(self) -> None:
        # Normalise the container fields so the frozen object is self-contained.
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", _parse_logit_bias(self.logit_bias))
        if isinstance(self.json_schema, dict):
            object.__setattr__(self, "json_schema", json.dumps(self.json_schema))
        self._validate()

    def _validate(self) -> None:
        def check(cond: bool, field: str, expect: str) -> None:
            if not cond:
                raise ValueError(f"{field} must be {expect}, got {getattr(self, field)!r}")

        check(
            _is_int(self.max_new_tokens) and self.max_new_tokens >= 0,
            "max_new_tokens",
            "an integer >= 0",
        )
        check(
            _is_int(self.min_new_tokens) and self.min_new_tokens >= 0,
            "min_new_tokens",
            "an integer >= 0",
        )
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens ({self.min_new_tokens}) must be <= max_new_tokens ({self.max_new_tokens})"
            )
        check(_is_num(self.temperature) and self.temperature >= 0, "temperature", "a number >= 0")
        check(_is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", "in (0, 1]")
        check(_is_int(self.top_k) and self.top_k >= -1, "top_k", "-1 (disabled) or an integer >= 0")
        check(_is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", "in [0, 1]")
        check(
            _is_num(self.repetition_penalty) and self.repetition_penalty > 0,
            "repetition_penalty",
            "> 0",
        )
        check(
            _is_num(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
            "frequency_penalty",
            "in [-2, 2]",
        )
        check(
            _is_num(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
            "presence_penalty",
            "in [-2, 2]",
        )
        check(self.seed is None or _is_int(self.seed), "seed", "an integer or null")
        check(
            all(isinstance(s, str) and s for s in self.stop),
            "stop",
            "a non-empty string or a list of them",
        )
        check(
            all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "a list of token ids",
        )
        for name in ("json_schema", "regex", "ebnf"):
            check(
                getattr(self, name) is None or isinstance(getattr(self, name), str),
                name,
                "a string",
            )
        given = [n for n in ("json_schema", "json_object", "regex", "ebnf") if getattr(self, n)]
        if len(given) > 1:
            raise ValueError(
                f"{given[1]}: only one output constraint per request, got {', '.join(given)}"
            )

    @property
    def grammar(self) -> GrammarSpec | None:
        if self.json_schema is not None:
            return GrammarSpec("json_schema", self.json_schema)
        if self.json_object:
            return GrammarSpec("json_object")
        if self.regex is not None:
            return GrammarSpec("regex", self.regex)
        if self.ebnf is not None:
            return GrammarSpec("ebnf", self.ebnf)
        return None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    @property
    def needs_filter(self) -> bool:
        return self.top_k > 1 or self.top_p < 1.0 or self.min_p > 0.0

    @classmethod
    def from_dict(cls, d: dict[str, Any] | SamplingParams | None) -> SamplingParams:
        if d is None:
            return cls()
        if isinstance(d, SamplingParams):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"sampling_params must be an object, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"sampling_params: unknown field(s) {', '.join(map(repr, unknown))}")
        try:
            return cls(
                **{k: v for k, v in d.items() if v is not None or k in ("seed", "logit_bias")}
            )
        except TypeError as e:
            raise ValueError(f"sampling_params: {e}") from None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _parse_logit_bias(bias: Any) -> dict[int, float]:
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be an object mapping token ids to numbers, got {bias!r}")
    out: dict[int, float] = {}
    for k, v in bias.items():
        try:
            tid = int(k)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias: key {k!r} is not a token id") from None
        if tid < 0 or not _is_num(v) or not -100 <= v <= 100:
            raise ValueError(
                f"logit_bias: entry {k!r}: {v!r} must be a number in [-100, 100] for a token id >= 0"
            )
        out[tid] = float(v)
    return out
