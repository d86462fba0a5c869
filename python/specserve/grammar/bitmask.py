"""Token bitmasks: plain per-step masks, chain masks for speculation, and the
permanent advance of a matcher over a committed run.

A bitmask row holds ``ceil(V / 32)`` int32 words; bit ``t % 32`` of word
``t // 32`` allows token ``t``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.grammar.base import GrammarMatcher


def bitmask_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """``[rows, words]`` int32 on the CPU, every token allowed."""
    return torch.full((rows, bitmask_words(vocab_size)), -1, dtype=torch.int32)


def is_allowed(bitmask: torch.Tensor, row: int, token_id: int) -> bool:
    return bool((int(bitmask[row, token_id // 32]) >> (token_id % 32)) & 1)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[rows, words]`` -> ``[rows, vocab_size]`` bool (True = allowed)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [rows, words, 32]
    return bits.flatten(1)[:, :vocab_size].bool()


def apply_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """Torch reference: forbidden entries of ``logits[rows[i]]`` become -inf (in place).
    ``bitmask[i]`` is the mask of ``rows[i]``."""
    if not rows:
        return
    vocab = logits.shape[1]
    allowed = unpack_bitmask(bitmask.to(logits.device), vocab)  # [n, V]
    index = torch.tensor(list(rows), device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """Masks ``logits [N, V]`` rows in place with xgrammar's kernels (its CPU
    path for CPU tensors, CUDA/Triton for GPU tensors); the torch reference
    when xgrammar is not installed."""
    if not rows:
        return
    try:
        import xgrammar as xgr
    except ImportError:
        apply_bitmask_ref(logits, bitmask, rows)
        return
    # xgrammar takes one bitmask row per logits row; scatter ours to their rows.
    full = allocate_bitmask(logits.shape[0], logits.shape[1])
    full[list(rows)] = bitmask
    xgr.apply_token_bitmask_inplace(
        logits,
        full.to(logits.device, non_blocking=True),
        vocab_size=logits.shape[1],
        indices=list(rows),
    )


def fill_chain_masks(
    matcher: GrammarMatcher, drafts: Sequence[int], bitmask: torch.Tensor, start_row: int
) -> None:
    """Masks for a verify chain ``[anchor, x_1..x_L]`` of one request.

    The matcher is at the committed state (the anchor accepted). Row
    ``start_row`` gets the mask for the token after the anchor; for each draft
    ``x_j`` that row ``j - 1`` allows, the matcher accepts it and, unless that
    terminates the grammar, fills row ``j``. The walk stops at the first
    illegal draft (verification rejects there, so later rows are unreachable)
    or at termination. Rows not reached keep whatever they held (callers
    allocate them all-allowed). The matcher is rolled back to where it started.
    """
    matcher.fill_mask(bitmask, start_row)
    legal = 0
    try:
        for j, token in enumerate(drafts, start=1):
            if not is_allowed(bitmask, start_row + j - 1, token) or not matcher.accept(token):
                break
            legal += 1
            if matcher.is_terminated():
                break
            matcher.fill_mask(bitmask, start_row + j)
    finally:  # also when a step fails midway: it may be rerun from this state
        matcher.rollback(legal)


@dataclass(frozen=True)
class Advance:
    num_accepted: int  # tokens of the run now permanently accepted
    terminated: bool  # the last accepted token completed the grammar
    rejected: bool  # the run went on with a token the grammar forbids


def advance_committed(matcher: GrammarMatcher, tokens: Sequence[int]) -> Advance:
    """Permanently accepts a committed run, stopping at termination: the output
    processor cuts the run after ``num_accepted`` tokens."""
    for i, token in enumerate(tokens):
        if not matcher.accept(token):
            return Advance(i, False, True)
        if matcher.is_terminated():
            return Advance(i + 1, True, False)
    return Advance(len(tokens), False, False)
