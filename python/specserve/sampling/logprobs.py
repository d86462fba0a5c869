"""Scores committed tokens: token logprob, top-k and requested token ids.

One call per step covers every scored row of the batch (prompt positions and
committed outputs alike) through the row-logprob kernel dispatcher.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.host import upload
from specserve.kernels.logprobs import RowLogprobs, row_logprobs

# What a masked / impossible token reports instead of -inf (JSON has no -inf).
MIN_LOGPROB = -9999.0


@dataclass
class TokenLogprob:
    """Logprob data of one scored position: the token, its top-k, requested ids."""

    token_id: int
    logprob: float | None  # None only for the first prompt position
    top: list[tuple[float, int]] | None = None  # (logprob, id), descending
    ids: list[tuple[float, int]] | None = None  # (logprob, id), in the requested order


@dataclass(frozen=True)
class RowQuery:
    """One row to score. ``token_id`` None: the token is not known on the host
    yet (it was sampled or verified on the device in this step); its slot in
    the device tokens handed to ``score_rows_device`` says which it is."""

    row: int  # row of the scoring logits
    token_id: int | None  # the token whose logprob is reported
    temperature: float  # 1.0 in raw mode
    top_k: int  # 0: no top logprobs
    ids: tuple[int, ...] | None  # token_ids_logprob, or None


def score_rows_device(
    logits: torch.Tensor,
    queries: Sequence[RowQuery],
    device_tokens: torch.Tensor | None = None,
    backend: str = "auto",
) -> RowLogprobs | None:
    """``logits [R, V]`` float32 scored on its device, one kernel call, no
    host reads: the queries whose ``token_id`` is None take, in order, the
    entries of ``device_tokens``. Values come clamped at MIN_LOGPROB; None
    when there is nothing to score."""
    if not queries:
        return None
    device = logits.device
    # The kernel reads just these rows of the (possibly much larger) logits.
    rows = upload([q.row for q in queries], device)
    known = [0 if q.token_id is None else q.token_id for q in queries]
    token_ids = upload(known, device)
    unknown = [i for i, q in enumerate(queries) if q.token_id is None]
    if unknown:
        assert device_tokens is not None and device_tokens.numel() == len(unknown)
        slots = upload(unknown, device)
        token_ids[slots] = device_tokens.to(torch.int64)
    temps = None
    if any(q.temperature != 1.0 for q in queries):
        temps = torch.tensor([q.temperature for q in queries], dtype=torch.float32).to(device)
    top_k = max(q.top_k for q in queries)
    width = max(len(q.ids) if q.ids else 0 for q in queries)
    gather = None
    if width:
        padded = [list(q.ids or ()) + [-1] * (width - len(q.ids or ())) for q in queries]
        gather = upload(padded, device)
    out = row_logprobs(logits, token_ids, temps, top_k, gather, backend=backend, row_ids=rows)
    return clamped(out)


def clamped(out: RowLogprobs) -> RowLogprobs:
    """``out`` as it is reported: values clamped at ``MIN_LOGPROB``."""
    return RowLogprobs(
        out.token_logprobs.clamp(min=MIN_LOGPROB),
        out.top_values.clamp(min=MIN_LOGPROB),
        out.top_ids,
        out.ids_logprobs.clamp(min=MIN_LOGPROB),
    )


def scored_tensors(out: RowLogprobs | None) -> list[torch.Tensor | None]:
    """What a host fetch must copy of ``score_rows_device``'s result."""
    if out is None:
        return [None] * 4
    return [out.token_logprobs, out.top_values, out.top_ids, out.ids_logprobs]


def entries_from_host(
    queries: Sequence[RowQuery], host: Sequence[list | None], token_ids: Sequence[int]
) -> list[TokenLogprob]:
    """``TokenLogprob`` per query from the fetched ``scored_tensors``;
    ``token_ids``: every query's token, now known on the host."""
    if not queries:
        return []
    token_lp, top_v, top_i, ids_lp = host
    result = []
    for n, q in enumerate(queries):
        top = list(zip(top_v[n][: q.top_k], top_i[n][: q.top_k])) if q.top_k else None
        ids = list(zip(ids_lp[n][: len(q.ids)], q.ids)) if q.ids else None
        result.append(TokenLogprob(token_ids[n], token_lp[n], top, ids))
    return result
