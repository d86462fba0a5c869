"""Page allocator for the paged KV cache, and where a position's K/V lives."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.config import ModelConfig


def page_slots(page_table: Sequence[int], start: int, end: int, page_size: int) -> list[int]:
    """KV pool slots of positions ``start .. end - 1`` of a request with
    ``page_table``: position p is row ``p % page_size`` of page ``p // page_size``."""
    return [page_table[p // page_size] * page_size + p % page_size for p in range(start, end)]


def table_slots(
    tables: torch.Tensor, req: torch.Tensor, pos: torch.Tensor, page_size: int
) -> torch.Tensor:
    """``page_slots`` over tensors: slots of positions ``pos`` (clamped at 0)
    of requests ``req`` through page tables padded into ``[B, P]``."""
    pos = pos.clamp(min=0)
    return tables[req, pos // page_size] * page_size + pos % page_size


@dataclass(frozen=True)
class CacheGroup:
    """Positions per slot (``rate``) and, for group 0, the positions behind a
    step's first new token that must stay (``retain``; None: all)."""

    rate: int
    retain: int | None = None


def cache_groups(mc: ModelConfig) -> tuple[CacheGroup, ...]:
    """The cache groups of a model: one slot per position (group 0) and,
    for DeepSeek-V4, one group per compression rate (one slot per entry)."""
    v4 = mc.deepseek_v4
    if v4 is None:
        return (CacheGroup(1),)
    return (CacheGroup(1, v4.retain),) + tuple(CacheGroup(v4.rate(k)) for k in v4.compressed_kinds)


def release_behind(pages: list[int], position: int, pool: BlockPool) -> None:
    """Returns to ``pool`` the pages wholly before ``position`` (marked -1 in
    ``pages``: positions keep their pages), as a sliding window leaves them."""
    i = min(max(0, position) // pool.page_size, len(pages)) - 1
    freed = []
    while i >= 0 and pages[i] >= 0:
        freed.append(pages[i])
        pages[i] = -1
        i -= 1
    pool.release(freed)


class BlockPool:
    """Hands out fixed-size KV pages, each to one owner until it is released."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1:
            raise ValueError(f"the KV pool needs at least one page, got {num_pages}")
        self.page_size = page_size
        self._num_pages = num_pages
        self._taken = [False] * num_pages
        # Pop from the end: low page ids are handed out first.
        self._free = list(range(num_pages - 1, -1, -1))

    def total_pages(self) -> int:
        return self._num_pages

    def free_pages(self) -> int:
        return len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh pages, or None (and nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._taken[p] = True
        return pages

    def release(self, pages: list[int]) -> None:
        # Back in reverse, so that the next allocations pop them in their old
        # order: a lone request's pages stay one contiguous run (which the
        # torch attention backend reads as a view instead of a gather).
        for p in reversed(pages):
            assert self._taken[p], f"page {p} released twice"
            self._taken[p] = False
            self._free.append(p)
