"""PageAllocator: exact page ids, reference counts, the null page, the LRU prefix cache."""

import pytest

from jpaged.core.page_allocator import NULL_PAGE, PageAllocator, page_hash


def test_allocates_in_free_list_order_and_never_the_null_page():
    a = PageAllocator(6)
    assert a.free_pages() == [1, 2, 3, 4, 5]
    assert a.allocate(2) == [1, 2]
    assert a.allocate(3) == [3, 4, 5]
    assert NULL_PAGE not in a.free_pages()
    assert a.num_free() == 0 and a.num_used() == 5
    assert not a.can_allocate(1)
    with pytest.raises(RuntimeError, match="cannot allocate 1 pages"):
        a.allocate(1)


def test_free_order_is_reuse_order_and_counts_return():
    a = PageAllocator(5)
    pages = a.allocate(4)
    a.free(pages[::-1])  # tail first
    assert a.free_pages() == [4, 3, 2, 1]
    assert a.allocate(1) == [4]
    assert a.ref_counts.tolist() == [0, 0, 0, 0, 1]


def test_shared_page_is_freed_only_by_its_last_holder():
    a = PageAllocator(4)
    (p,) = a.allocate(1)
    a.share(p)
    assert a.ref_counts[p] == 2
    a.free([p])
    assert a.ref_counts[p] == 1 and p not in a.free_pages()
    a.free([p])
    assert a.ref_counts[p] == 0 and a.free_pages() == [2, 3, 1]


def test_double_free_and_null_page_errors():
    a = PageAllocator(4)
    with pytest.raises(RuntimeError, match="free of page 0"):
        a.free([NULL_PAGE])
    (p,) = a.allocate(1)
    a.free([p])
    with pytest.raises(RuntimeError, match=f"free of page {p}"):
        a.free([p])
    with pytest.raises(RuntimeError, match="share of page"):
        a.share(p)
    with pytest.raises(ValueError, match="num_pages must be >= 2"):
        PageAllocator(1)


def test_cached_free_page_is_revived_by_lookup_and_evicted_lru():
    a = PageAllocator(4)
    p1, p2 = a.allocate(2)
    h1 = page_hash(None, (1, 2), None)
    h2 = page_hash(h1, (3, 4), None)
    a.cache_page(p1, h1, (1, 2))
    a.cache_page(p2, h2, (3, 4))
    a.free([p2, p1])
    assert a.num_cached() == 2 and a.free_pages() == [3, 2, 1]
    assert a.lookup(h1, (1, 2)) == p1
    assert a.lookup(h1, (9, 9)) is None  # hash hit verified against tokens
    a.take_cached(p1)
    assert a.ref_counts[p1] == 1 and a.free_pages() == [3, 2]
    # The next allocations take page 3 (uncached) then 2, evicting its cache entry.
    assert a.allocate(2) == [3, 2]
    assert a.lookup(h2, (3, 4)) is None and a.num_evictions == 1
    assert a.num_cached() == 1


def test_salt_separates_tenants():
    assert page_hash(None, (1, 2), "a") != page_hash(None, (1, 2), "b")


def test_prefix_caching_off_caches_nothing():
    a = PageAllocator(4, enable_prefix_caching=False)
    (p,) = a.allocate(1)
    a.cache_page(p, 123, (1,))
    assert a.num_cached() == 0 and a.lookup(123, (1,)) is None
