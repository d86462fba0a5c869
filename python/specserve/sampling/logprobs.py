"""Scores committed tokens: token logprob, top-k and requested token ids.

One call per step covers every scored row of the batch (prompt positions and
committed outputs alike) through the row-logprob kernel dispatcher.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.kernels.logprobs import row_logprobs

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
    row: int  # row of the scoring logits
    token_id: int  # the token whose logprob is reported
    temperature: float  # 1.0 in raw mode
    top_k: int  # 0: no top logprobs
    ids: tuple[int, ...] | None  # token_ids_logprob, or None


def score_rows(
    logits: torch.Tensor, queries: Sequence[RowQuery], backend: str = "auto"
) -> list[TokenLogprob]:
    """``logits [R, V]`` float32; one ``TokenLogprob`` per query, in order."""
    if not queries:
        return []
    device = logits.device
    # The kernel reads just these rows of the (possibly much larger) logits.
    rows = torch.tensor([q.row for q in queries], dtype=torch.int64, device=device)
    token_ids = torch.tensor([q.token_id for q in queries], dtype=torch.int64, device=device)
    temps = None
    if any(q.temperature != 1.0 for q in queries):
        temps = torch.tensor([q.temperature for q in queries], dtype=torch.float32, device=device)
    top_k = max(q.top_k for q in queries)
    width = max(len(q.ids) if q.ids else 0 for q in queries)
    gather = None
    if width:
        padded = [list(q.ids or ()) + [-1] * (width - len(q.ids or ())) for q in queries]
        gather = torch.tensor(padded, dtype=torch.int64, device=device)
    out = row_logprobs(logits, token_ids, temps, top_k, gather, backend=backend, row_ids=rows)
    token_lp = out.token_logprobs.clamp(min=MIN_LOGPROB).tolist()
    top_v = out.top_values.clamp(min=MIN_LOGPROB).tolist()
    top_i = out.top_ids.tolist()
    ids_lp = out.ids_logprobs.clamp(min=MIN_LOGPROB).tolist()
    result = []
    for n, q in enumerate(queries):
        top = list(zip(top_v[n][: q.top_k], top_i[n][: q.top_k])) if q.top_k else None
        ids = list(zip(ids_lp[n][: len(q.ids)], q.ids)) if q.ids else None
        result.append(TokenLogprob(q.token_id, token_lp[n], top, ids))
    return result
