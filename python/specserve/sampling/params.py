"""Per-request sampling parameters (SGLang names), validated on construction."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from typing import Any

from specserve.grammar.base import GrammarSpec

# Temperatures this small sample greedily: dividing logits by them overflows
# float32 and the distribution turns into NaN.
GREEDY_BELOW = 1e-5
# Larger temperatures are taken as this one, the largest float32: above it a
# temperature is inf on the device, and a masked logit (-inf) divided by inf is
# NaN. Here every finite logit scales to about 0 and a masked one stays -inf:
# the uniform distribution over the allowed tokens, which is what any larger
# temperature means in float32 too.
MAX_TEMPERATURE = 3.4028234663852886e38
# Seeds: anything a client may mean by a 64-bit seed, signed or not, taken
# modulo 2**64 (what torch generators accept).
SEED_RANGE = (-(2**63), 2**64)
SEED_MODULUS = 2**64
# Keeps penalised logits, even divided by a temperature of GREEDY_BELOW,
# finite in float32 (a penalty of 1e-300 would not).
REPETITION_PENALTY = (0.01, 100.0)


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
        # Type checks first (nothing is coerced: a string is not a flag, a dict
        # is not a list of stops), then the containers are normalised so the
        # frozen object is self-contained, then the ranges.
        self._check_types()
        stop = self.stop
        object.__setattr__(self, "stop", (stop,) if isinstance(stop, str) else tuple(stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", _parse_logit_bias(self.logit_bias))
        if isinstance(self.json_schema, dict):
            object.__setattr__(self, "json_schema", json.dumps(self.json_schema))
        self._validate()
        # Both ends of the temperature, once, for every device-side division by it.
        if 0 < self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)  # logits / t would overflow float32
        elif self.temperature > MAX_TEMPERATURE:
            object.__setattr__(self, "temperature", MAX_TEMPERATURE)
        if self.seed is not None:
            object.__setattr__(self, "seed", self.seed % SEED_MODULUS)

    def _check_types(self) -> None:
        for name in ("ignore_eos", "skip_special_tokens", "no_stop_trim", "json_object"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be a boolean, got {value!r}")
        stop = self.stop
        if not (stop is None or isinstance(stop, str) or _is_seq(stop)):
            raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
        ids = self.stop_token_ids
        if not (ids is None or _is_seq(ids)):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {ids!r}")
        if not (self.json_schema is None or isinstance(self.json_schema, (str, dict))):
            raise ValueError(f"json_schema must be a string or an object, got {self.json_schema!r}")

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
            _is_num(self.repetition_penalty)
            and REPETITION_PENALTY[0] <= self.repetition_penalty <= REPETITION_PENALTY[1],
            "repetition_penalty",
            f"in [{REPETITION_PENALTY[0]}, {REPETITION_PENALTY[1]}]",
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
        check(
            self.seed is None
            or (_is_int(self.seed) and SEED_RANGE[0] <= self.seed < SEED_RANGE[1]),
            "seed",
            "null or an integer in [-2**63, 2**64)",
        )
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


def _is_seq(x: Any) -> bool:
    return isinstance(x, (list, tuple))


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _parse_logit_bias(bias: Any) -> dict[int, float]:
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be an object mapping token ids to numbers, got {bias!r}")
    out: dict[int, float] = {}
    for k, v in bias.items():
        # JSON keys are strings of decimal digits; the offline API may use ints.
        if _is_int(k):
            tid = k
        elif isinstance(k, str) and _DIGITS.fullmatch(k):
            tid = int(k)
        else:
            raise ValueError(f"logit_bias: key {k!r} is not a token id")
        if tid < 0 or not _is_num(v) or not -100 <= v <= 100:
            raise ValueError(
                f"logit_bias: entry {k!r}: {v!r} must be a number in [-100, 100] for a token id >= 0"
            )
        out[tid] = float(v)
    return out


_DIGITS = re.compile(r"[0-9]{1,18}")
