"""Turns generate() arguments into validated ``GenerateRequest``s.

Every bad value is a ``ValueError`` that names its field; nothing invalid
reaches the scheduler.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from specserve.config import LimitsConfig
from specserve.core import LogprobOptions
from specserve.grammar.base import GrammarBackend
from specserve.sampling.params import SEED_MODULUS, SamplingParams
from specserve.tokenizer.tokenizer import Tokenizer, is_utf8


@dataclass
class GenerateRequest:
    """One prompt of a generate call, validated, before it becomes a ``Req``."""

    input_ids: list[int]
    sampling: SamplingParams
    logprob: LogprobOptions
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    grammar: Any = None  # the compiled output constraint, if any


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    context_length: int
    capacity_tokens: int  # KV pool size: a longer request could never run
    max_top_logprobs: int
    request: LimitsConfig = field(default_factory=LimitsConfig)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_id_list(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and all(_is_int(t) for t in v)


def _choice(first: GenerateRequest, j: int) -> GenerateRequest:
    """Choice ``j`` of a prompt: its own id and, when seeded, seed + j."""
    sp = first.sampling
    if sp.seed is not None:
        sp = dataclasses.replace(sp, seed=(sp.seed + j) % SEED_MODULUS)
    return GenerateRequest(list(first.input_ids), sp, first.logprob, grammar=first.grammar)


class RequestFactory:
    def __init__(
        self,
        tokenizer: Tokenizer,
        limits: Limits,
        grammar: Callable[[], GrammarBackend | None] = lambda: None,
    ) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.grammar = grammar  # the backend, created on first use

    def build(
        self,
        prompt: str | Sequence[str] | None = None,
        sampling_params: Any = None,
        input_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
        return_logprob: bool | Sequence[bool] = False,
        logprob_start_len: int | Sequence[int] | None = None,
        top_logprobs_num: int | Sequence[int] = 0,
        token_ids_logprob: Sequence[int] | Sequence[Sequence[int] | None] | None = None,
        return_text_in_logprobs: bool = False,
        rid: str | Sequence[str] | None = None,
        n: int = 1,
    ) -> tuple[list[GenerateRequest], bool]:
        """The requests, and whether the call was a batch (lists in, list out).

        ``n`` > 1 makes ``n`` requests of each prompt, in prompt order; with a
        seed, choice ``j`` samples with ``seed + j`` (modulo 2**64)."""
        cap = self.limits.request
        if not _is_int(n) or not 1 <= n <= cap.max_n:
            raise ValueError(f"n must be an integer in [1, {cap.max_n}] (--max-n), got {n!r}")
        if (prompt is None) == (input_ids is None):
            raise ValueError("prompt: give exactly one of a text prompt and input_ids")
        given = prompt if prompt is not None else input_ids
        batched = not isinstance(given, str) and not _is_id_list(given)
        if batched and not isinstance(given, (list, tuple)):
            raise ValueError("prompt must be a string, a list of strings or lists of token ids")
        count = len(given) if batched else 1  # type: ignore[arg-type]
        most = cap.max_sequences_per_request
        if most is not None and count * n > most:
            raise ValueError(
                f"prompt: {count} prompt(s) x n={n} exceed the {most} "
                "sequences a request may start (--max-sequences-per-request)"
            )
        if prompt is not None:
            texts = list(prompt) if batched else [prompt]
            if not all(isinstance(t, str) for t in texts):
                raise ValueError("prompt must be a string or a list of strings")
            if not all(is_utf8(t) for t in texts):
                raise ValueError("prompt: text must be valid UTF-8 (no lone surrogates)")
            prompts = [self.tokenizer.encode(t) for t in texts]
        else:
            assert input_ids is not None
            lists = list(input_ids) if batched else [input_ids]  # type: ignore[list-item]
            if not all(_is_id_list(p) for p in lists):
                raise ValueError("input_ids: expected a list of token ids or a list of them")
            prompts = [list(p) for p in lists]  # type: ignore[arg-type]
        if not prompts:
            raise ValueError("prompt: empty batch")
        if rid is not None and n > 1:
            raise ValueError("rid: one id per sequence, so not with n > 1")

        def spread(value: Any, name: str, single: Callable[[Any], bool]) -> list[Any]:
            if single(value):
                return [value] * count
            if not isinstance(value, (list, tuple)) or len(value) != count:
                raise ValueError(
                    f"{name}: expected one value or a list of {count} (one per prompt)"
                )
            return list(value)

        sps = spread(
            sampling_params,
            "sampling_params",
            lambda v: v is None or isinstance(v, (dict, SamplingParams)),
        )
        rls = spread(return_logprob, "return_logprob", lambda v: isinstance(v, bool))
        starts = spread(logprob_start_len, "logprob_start_len", lambda v: v is None or _is_int(v))
        tops = spread(top_logprobs_num, "top_logprobs_num", _is_int)
        tids = spread(token_ids_logprob, "token_ids_logprob", lambda v: v is None or _is_id_list(v))
        rids = spread(rid, "rid", lambda v: v is None or isinstance(v, str))
        named = [r for r in rids if r is not None]
        if len(set(named)) != len(named):
            raise ValueError("rid: request ids must be unique")
        if not isinstance(return_text_in_logprobs, bool):
            raise ValueError(
                f"return_text_in_logprobs must be a boolean, got {return_text_in_logprobs!r}"
            )
        reqs = []
        for i in range(count):
            first = self._one(
                prompts[i], sps[i], rls[i], starts[i], tops[i], tids[i],
                return_text_in_logprobs, rids[i],
            )  # fmt: skip
            reqs.append(first)
            reqs.extend(_choice(first, j) for j in range(1, n))
        return reqs, batched

    def _one(
        self,
        ids: list[int],
        sampling: Any,
        return_logprob: Any,
        logprob_start_len: int | None,
        top_logprobs_num: Any,
        token_ids_logprob: Any,
        return_text: bool,
        rid: str | None,
    ) -> GenerateRequest:
        lim = self.limits
        vocab = lim.vocab_size
        if not ids:
            raise ValueError("prompt: empty prompt (no tokens)")
        if not all(_is_int(t) and 0 <= t < vocab for t in ids):
            raise ValueError(f"input_ids: every token id must be an integer in [0, {vocab})")
        sp = SamplingParams.from_dict(sampling)
        cap = lim.request
        if len(sp.stop) > cap.max_stop_strings:
            raise ValueError(
                f"stop: {len(sp.stop)} stop strings exceed the limit of {cap.max_stop_strings} "
                "(--max-stop-strings)"
            )
        if any(len(s) > cap.max_stop_length for s in sp.stop):
            raise ValueError(
                f"stop: a stop string is longer than {cap.max_stop_length} characters "
                "(--max-stop-length)"
            )
        if any(t >= vocab for t in (sp.logit_bias or {})):
            raise ValueError(f"logit_bias: token ids must be < {vocab}")
        if any(t >= vocab for t in sp.stop_token_ids):
            raise ValueError(f"stop_token_ids: token ids must be < {vocab}")
        if not isinstance(return_logprob, bool):
            raise ValueError(f"return_logprob must be a boolean, got {return_logprob!r}")
        start = -1 if logprob_start_len is None else logprob_start_len
        if not _is_int(start) or not -1 <= start < len(ids):
            raise ValueError(
                f"logprob_start_len must be -1 or in [0, {len(ids)}) (the prompt length), "
                f"got {logprob_start_len!r}"
            )
        max_top = min(lim.max_top_logprobs, vocab)
        if not _is_int(top_logprobs_num) or not 0 <= top_logprobs_num <= max_top:
            raise ValueError(
                f"top_logprobs_num must be in [0, {max_top}], got {top_logprobs_num!r}"
            )
        tid = None
        if token_ids_logprob is not None:
            if not _is_id_list(token_ids_logprob) or not all(
                0 <= t < vocab for t in token_ids_logprob
            ):
                raise ValueError(f"token_ids_logprob: expected a list of token ids in [0, {vocab})")
            if len(token_ids_logprob) > cap.max_token_ids_logprob:
                raise ValueError(
                    f"token_ids_logprob: {len(token_ids_logprob)} ids exceed the limit of "
                    f"{cap.max_token_ids_logprob} (--max-token-ids-logprob)"
                )
            tid = tuple(token_ids_logprob) or None
        total = len(ids) + sp.max_new_tokens
        limits = (
            (lim.context_length, "the context length"),
            (lim.capacity_tokens, "the KV cache capacity"),
        )
        for limit, what in limits:
            if len(ids) > limit:
                raise ValueError(f"prompt: {len(ids)} tokens do not fit {what} ({limit} tokens)")
            if total > limit:
                raise ValueError(
                    f"max_new_tokens: the prompt ({len(ids)} tokens) plus max_new_tokens "
                    f"({sp.max_new_tokens}) exceeds {what} ({limit} tokens)"
                )
        if rid is not None and (not isinstance(rid, str) or not rid or not is_utf8(rid)):
            raise ValueError("rid must be a non-empty UTF-8 string")
        compiled = None
        spec = sp.grammar
        if spec is not None:
            backend = self.grammar()
            if backend is None:
                raise ValueError(
                    f"{spec.field}: constrained decoding is disabled (grammar backend none)"
                )
            if len(spec.text) > cap.max_grammar_length:
                raise ValueError(
                    f"{spec.field}: the grammar is {len(spec.text)} characters, over the limit "
                    f"of {cap.max_grammar_length} (--max-grammar-length)"
                )
            # Before admission, off the engine loop, within --grammar-compile-timeout.
            compiled = backend.compile(spec)
        opts = LogprobOptions(return_logprob, start, top_logprobs_num, tid, bool(return_text))
        return GenerateRequest(ids, sp, opts, rid or uuid.uuid4().hex, compiled)
