from __future__ import annotations

import pytest

from specserve.cache.block_pool import BlockPool


def test_allocate_and_release() -> None:
    pool = BlockPool(4, page_size=16)
    assert pool.total_pages() == 4 and pool.free_pages() == 4
    assert pool.pages_for(1) == 1 and pool.pages_for(16) == 1 and pool.pages_for(17) == 2
    a = pool.allocate(3)
    assert a is not None and len(set(a)) == 3 and pool.free_pages() == 1
    assert pool.allocate(2) is None and pool.free_pages() == 1  # all or nothing
    pool.release(a[1:])
    assert pool.free_pages() == 3
    pool.release(a[:1])
    assert pool.free_pages() == 4
    with pytest.raises(AssertionError):
        pool.release(a[:1])


def test_empty_pool_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least one page"):
        BlockPool(0, 16)


def test_released_pages_come_back_as_one_ascending_run() -> None:
    """A lone request reallocated after another keeps one contiguous run of
    pages (the torch attention backend reads such a run as a view)."""
    pool = BlockPool(16, 4)
    first = [p for _ in range(5) for p in pool.allocate(1)]  # grown a page at a time
    assert first == list(range(5))
    pool.release(first)
    again = [p for _ in range(7) for p in pool.allocate(1)]
    assert again == list(range(7))
