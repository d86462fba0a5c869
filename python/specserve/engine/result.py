"""Result dicts (``text``, ``output_ids``, ``meta_info``) from request deltas."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from specserve.core import FinishReason
from specserve.engine.engine_core import RequestOutput
from specserve.engine.request_factory import GenerateRequest
from specserve.sampling.logprobs import TokenLogprob

TokenText = Callable[[int], str]


@dataclass
class ResultCollector:
    """Accumulates the deltas of one request until it finishes."""

    prompt_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    input_logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    spec: tuple[int, int] | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def add(self, out: RequestOutput) -> None:
        self.prompt_tokens = out.prompt_tokens
        self.spec = out.spec
        self.token_ids.extend(out.token_ids)
        self.text.append(out.text)
        self.output_logprobs.extend(out.output_logprobs)
        self.input_logprobs.extend(out.input_logprobs)
        if out.finished:
            self.finish_reason = out.finish_reason
            self.done.set()

    def as_output(self, rid: str) -> RequestOutput:
        return RequestOutput(
            rid=rid,
            token_ids=self.token_ids,
            text="".join(self.text),
            output_logprobs=self.output_logprobs,
            input_logprobs=self.input_logprobs,
            finished=self.done.is_set(),
            finish_reason=self.finish_reason,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=len(self.token_ids),
            spec=self.spec,
        )


def format_output(
    greq: GenerateRequest, out: RequestOutput, token_text: TokenText
) -> dict[str, Any]:
    """The native result of a whole request, or of one streamed delta."""
    meta: dict[str, Any] = {
        "id": greq.rid,
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "finish_reason": out.finish_reason.to_dict() if out.finish_reason else None,
    }
    if out.spec is not None:
        meta["spec_verify_ct"] = out.spec.rounds
        meta["spec_accept_length"] = out.spec.accept_length
    opts = greq.logprob
    if opts.return_logprob:
        text_of = token_text if opts.return_text_in_logprobs else None
        for kind, entries in (("input", out.input_logprobs), ("output", out.output_logprobs)):
            meta[f"{kind}_token_logprobs"] = [
                _triple(e.logprob, e.token_id, text_of) for e in entries
            ]
            meta[f"{kind}_top_logprobs"] = (
                [_pairs(e.top, text_of) for e in entries] if opts.top_logprobs_num else None
            )
            meta[f"{kind}_token_ids_logprobs"] = (
                [_pairs(e.ids, text_of) for e in entries] if opts.token_ids_logprob else None
            )
    return {"text": out.text, "output_ids": out.token_ids, "meta_info": meta}


def _triple(logprob: float | None, token_id: int, text_of: TokenText | None) -> tuple:
    return (logprob, token_id, text_of(token_id) if text_of else None)


def _pairs(pairs: list[tuple[float, int]] | None, text_of: TokenText | None) -> list[tuple] | None:
    # None only at the first prompt position, which nothing conditions.
    return None if pairs is None else [_triple(lp, tid, text_of) for lp, tid in pairs]
