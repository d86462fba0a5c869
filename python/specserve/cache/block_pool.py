"""Page allocator for the paged KV cache."""

from __future__ import annotations


class BlockPool:
    """Hands out fixed-size KV pages; a page returns to the free list when its
    reference count drops to zero (prefix sharing takes extra references)."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1:
            raise ValueError(f"the KV pool needs at least one page, got {num_pages}")
        self.page_size = page_size
        self._num_pages = num_pages
        self._refcount = [0] * num_pages
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
            self._refcount[p] = 1
        return pages

    def incref(self, pages: list[int]) -> None:
        for p in pages:
            assert self._refcount[p] > 0, f"page {p} is not allocated"
            self._refcount[p] += 1

    def release(self, pages: list[int]) -> None:
        for p in pages:
            assert self._refcount[p] > 0, f"page {p} released twice"
            self._refcount[p] -= 1
            if self._refcount[p] == 0:
                self._free.append(p)
