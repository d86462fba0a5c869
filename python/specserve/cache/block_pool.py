"""Page allocator for the paged KV cache, and where a position's K/V lives."""

from __future__ import annotations

from collections.abc import Sequence


def page_slots(page_table: Sequence[int], start: int, end: int, page_size: int) -> list[int]:
    """KV pool slots of positions ``start .. end - 1`` of a request with
    ``page_table``: position p is row ``p % page_size`` of page ``p // page_size``."""
    return [page_table[p // page_size] * page_size + p % page_size for p in range(start, end)]


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
        for p in pages:
            assert self._taken[p], f"page {p} released twice"
            self._taken[p] = False
            self._free.append(p)
