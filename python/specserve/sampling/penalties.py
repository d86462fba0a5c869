"""Logit processing before sampling: logit bias, repetition / frequency /
presence penalties and the min-new-tokens stop suppression.

The per-request state (token counts) lives in the request's ``PenaltyState``
and is updated on every commit.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specserve.host import upload
from specserve.sampling.params import SamplingParams


@dataclass
class PenaltyState:
    """Token statistics of one request, on the logits' device."""

    output_counts: torch.Tensor  # [V] float32: occurrences in the output
    seen: torch.Tensor  # [V] bool: in the prompt or the output (repetition penalty)

    @classmethod
    def create(cls, prompt_ids: list[int], vocab_size: int, device: torch.device) -> PenaltyState:
        seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        seen[torch.tensor(prompt_ids, dtype=torch.int64, device=device)] = True
        return cls(torch.zeros(vocab_size, dtype=torch.float32, device=device), seen)

    def add(self, token_ids: list[int]) -> None:
        ids = torch.tensor(token_ids, dtype=torch.int64, device=self.seen.device)
        self.output_counts.index_add_(0, ids, torch.ones(len(token_ids), device=ids.device))
        self.seen[ids] = True


@dataclass
class RowControls:
    """What ``process_logits`` needs of the request behind one row."""

    params: SamplingParams
    penalty: PenaltyState | None
    num_output_tokens: int  # including ``extra_tokens``
    stop_ids: frozenset[int]  # ids suppressed while under min_new_tokens
    # Drafts this row comes after (a verify row): part of its history too.
    extra_tokens: tuple[int, ...] = ()

    @property
    def holds_stops(self) -> bool:
        return self.num_output_tokens < self.params.min_new_tokens and bool(self.stop_ids)

    @property
    def active(self) -> bool:
        """Whether processing changes this row at all."""
        return bool(self.params.logit_bias) or self.penalty is not None or self.holds_stops


def process_logits(logits: torch.Tensor, rows: Sequence[RowControls]) -> torch.Tensor:
    """Applies bias, penalties and min-token suppression to ``logits [N, V]``
    in place: each kind for all its rows at once (a few ops whatever N is, and
    a few per request, never per entry: a bias may name every token)."""
    vocab, device = logits.shape[1], logits.device
    bias = [
        (members, _ids(b), _array(b.values(), np.float32))
        for members, r in _by_request(rows, lambda r: bool(r.params.logit_bias))
        if (b := r.params.logit_bias) is not None
    ]
    if bias:
        ri, ti, values = _entries(bias, vocab)
        index = (upload(ri, device), upload(ti, device))
        logits.index_put_(index, upload(values, device, logits.dtype), accumulate=True)
    penalised = [i for i, r in enumerate(rows) if r.penalty is not None]
    if penalised:
        logits[penalised] = _penalties(logits[penalised], [rows[i] for i in penalised])
    held = [
        (members, _ids(r.stop_ids), np.full(len(r.stop_ids), -np.inf, np.float32))
        for members, r in _by_request(rows, lambda r: r.holds_stops)
    ]
    if held:
        ri, ti, values = _entries(held, vocab)
        index = (upload(ri, device), upload(ti, device))
        logits.index_put_(index, upload(values, device, logits.dtype))
    return logits


def _by_request(
    rows: Sequence[RowControls], applies: Callable[[RowControls], bool]
) -> list[tuple[list[int], RowControls]]:
    """The rows ``applies`` to, grouped by request (a verify chain's rows share
    its parameters and stop ids): each group's row indices and its first row."""
    groups: dict[tuple[int, int], tuple[list[int], RowControls]] = {}
    for i, r in enumerate(rows):
        if applies(r):
            groups.setdefault((id(r.params), id(r.stop_ids)), ([], r))[0].append(i)
    return list(groups.values())


def _array(values: Collection, dtype: type) -> np.ndarray:
    return np.fromiter(values, dtype, len(values))


def _ids(tokens: Collection[int]) -> np.ndarray:
    return _array(tokens, np.int64)


def _entries(
    groups: list[tuple[list[int], np.ndarray, np.ndarray]], vocab: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row, token, value) triples of ``groups``, each some rows that all take
    the same ``tokens`` with ``values``; tokens past the vocabulary are left out."""
    ri, ti, vi = [], [], []
    for members, tokens, values in groups:
        keep = tokens < vocab
        ri.append(np.repeat(np.asarray(members, dtype=np.int64), int(keep.sum())))
        ti.append(np.tile(tokens[keep], len(members)))
        vi.append(np.tile(values[keep], len(members)))
    return np.concatenate(ri), np.concatenate(ti), np.concatenate(vi)


def apply_logit_bias(logits: torch.Tensor, bias: dict[int, float]) -> torch.Tensor:
    """Adds ``bias`` to every row of ``logits [n, V]`` in place (ids past V ignored)."""
    ids = [t for t in bias if t < logits.shape[1]]
    if ids:
        values = torch.tensor([bias[t] for t in ids], dtype=logits.dtype, device=logits.device)
        logits[:, ids] += values
    return logits


def _penalties(x: torch.Tensor, rows: list[RowControls]) -> torch.Tensor:
    """Repetition (CTRL / HF rule: positive logits shrink, negative ones grow
    more negative), frequency and presence penalties for ``x [n, V]``, whose
    history is the request's plus the row's ``extra_tokens``."""
    device = x.device
    counts = torch.stack([r.penalty.output_counts for r in rows])  # type: ignore[union-attr]
    seen = torch.stack([r.penalty.seen for r in rows])  # type: ignore[union-attr]
    extra = [(k, t) for k, r in enumerate(rows) for t in r.extra_tokens]
    if extra:
        ki, ti = zip(*extra)
        index = (upload(ki, device), upload(ti, device))
        counts.index_put_(index, torch.ones(len(extra), device=device), accumulate=True)
        seen[index] = True

    def per_row(name: str) -> torch.Tensor:
        return torch.tensor([getattr(r.params, name) for r in rows], device=device)[:, None]

    rep = per_row("repetition_penalty")
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    return x - (
        counts * per_row("frequency_penalty") + (counts > 0).float() * per_row("presence_penalty")
    )
