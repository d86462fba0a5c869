"""Logit processing before sampling: logit bias, repetition / frequency /
presence penalties and the min-new-tokens stop suppression.

The per-request state (token counts) lives in the request's ``PenaltyState``
and is updated on every commit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

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


def process_logits(logits: torch.Tensor, rows: Sequence[RowControls]) -> torch.Tensor:
    """Applies bias, penalties and min-token suppression to ``logits [N, V]`` in place."""
    vocab = logits.shape[1]
    for i, row in enumerate(rows):
        p = row.params
        if p.logit_bias:
            apply_logit_bias(logits[i : i + 1], p.logit_bias)
        if row.penalty is not None:
            _apply_penalties(logits[i], p, row.penalty, row.extra_tokens)
        if row.num_output_tokens < p.min_new_tokens and row.stop_ids:
            logits[i, [t for t in row.stop_ids if t < vocab]] = float("-inf")
    return logits


def apply_logit_bias(logits: torch.Tensor, bias: dict[int, float]) -> torch.Tensor:
    """Adds ``bias`` to every row of ``logits [n, V]`` in place (ids past V ignored)."""
    ids = [t for t in bias if t < logits.shape[1]]
    if ids:
        values = torch.tensor([bias[t] for t in ids], dtype=logits.dtype, device=logits.device)
        logits[:, ids] += values
    return logits


def _apply_penalties(
    row: torch.Tensor, p: SamplingParams, state: PenaltyState, extra: tuple[int, ...]
) -> None:
    seen, counts = state.seen, state.output_counts
    if extra:
        ids = torch.tensor(extra, dtype=torch.int64, device=row.device)
        seen = seen.clone()
        seen[ids] = True
        counts = counts.index_add(0, ids, torch.ones(len(extra), device=row.device))
    if p.repetition_penalty != 1.0:
        # Positive logits shrink, negative ones grow more negative (CTRL / HF rule).
        penalised = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
        row.copy_(torch.where(seen, penalised, row))
    if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
        row.sub_(counts * p.frequency_penalty + (counts > 0).float() * p.presence_penalty)
