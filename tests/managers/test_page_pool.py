"""PagePool: all-or-nothing allocation, eviction order, the hash index and its invariants."""

import pytest
from mokv import InvariantError
from mokv.cache import unindexed_log
from mokv.cache.page_pool import PagePool
from mokv.undo import UndoLog


def test_allocate_is_all_or_nothing():
    pool = PagePool(4)
    assert pool.take((), 5) is None
    assert pool.num_free == 4 and pool.num_used == 0
    pages = pool.take((), 3)
    assert sorted(pages) == [0, 1, 2] and pool.num_free == 1
    pool.check_invariants([pages])


def test_free_pages_are_used_before_cached_ones_are_evicted():
    pool = PagePool(3)
    a, b, c = pool.take((), 3)
    assert pool.commit(a, 111, b"a")
    pool.release([a, b])  # a becomes cached, b free
    assert pool.is_cached(a) and pool.num_cached == 1
    (page,) = pool.take((), 1)
    assert page == b and pool.lookup(111, b"a") == a
    (page,) = pool.take((), 1)  # no free page left: evicts a
    assert page == a and pool.lookup(111, b"a") is None
    pool.check_invariants([[b, c, a]])


def test_cached_pages_are_evicted_in_release_order():
    pool = PagePool(3)
    pages = pool.take((), 3)
    for i, p in enumerate(pages):
        pool.commit(p, 100 + i, bytes([i]))
    pool.release(reversed(pages))  # tail first, as managers do
    assert pool.take((), 1) == [pages[2]]
    assert pool.take((), 1) == [pages[1]]
    assert pool.lookup(100, bytes([0])) == pages[0]  # the head outlived its suffixes


def test_acquire_takes_a_cached_page_out_of_the_lru():
    pool = PagePool(2)
    (p,) = pool.take((), 1)
    pool.commit(p, 5, b"x")
    pool.release([p])
    pool.acquire(p)
    assert pool.ref_count(p) == 1 and not pool.is_cached(p) and pool.num_free == 1
    pool.acquire(p)
    assert pool.ref_count(p) == 2
    pool.check_invariants([[p], [p]])


def test_lookup_guards_against_hash_collisions():
    pool = PagePool(2)
    (p,) = pool.take((), 1)
    pool.commit(p, 7, b"tokens-a")
    assert pool.lookup(7, b"tokens-a") == p
    assert pool.lookup(7, b"tokens-b") is None


def test_second_copy_of_a_prefix_is_not_indexed():
    pool = PagePool(2)
    p, q = pool.take((), 2)
    assert pool.commit(p, 9, b"t")
    assert not pool.commit(q, 9, b"t")
    assert pool.page_hash(q) is None
    pool.release([q])
    assert pool.num_cached == 0  # an unhashed copy goes straight back to the free list


def test_reset_prefix_cache_frees_cached_pages_and_forgets_hashes():
    pool = PagePool(3)
    p, q = pool.take((), 2)
    pool.commit(p, 1, b"p")
    pool.commit(q, 2, b"q")
    pool.release([p])
    pool.reset_prefix_cache()
    assert pool.num_cached == 0 and pool.num_free == 2
    assert pool.lookup(1, b"p") is None and pool.page_hash(q) is None
    pool.check_invariants([[q]])


def test_check_invariants_reports_broken_ref_counts():
    pool = PagePool(2)
    pages = pool.take((), 1)
    with pytest.raises(InvariantError, match="ref count 1 but 0 owners"):
        pool.check_invariants([])
    with pytest.raises(InvariantError, match="released more often"):
        pool.release(pages * 2)


def test_pool_needs_a_page():
    with pytest.raises(ValueError, match="num_pages=0"):
        PagePool(0)


def test_counters_count_freed_pages_and_removed_index_entries():
    pool = PagePool(4)
    a, b, c = pool.take((), 3)
    pool.acquire(a)  # two owners
    assert pool.commit_pages([a, b], [1, 2], [b"a", b"b"]) == [True, True]
    assert (pool.num_freed, pool.num_unindexed) == (0, 0)
    pool.release([a, b, c])  # a keeps an owner; b is cached, c free
    assert (pool.num_freed, pool.num_unindexed) == (2, 0)
    pool.take((), 3)  # the free pages 3 and c, then b evicted
    assert (pool.num_freed, pool.num_unindexed) == (2, 1)
    pool.release([a])
    pool.reset_prefix_cache()  # a's entry removed
    assert (pool.num_freed, pool.num_unindexed) == (3, 2)


def test_undone_changes_count_what_they_free_and_unindex():
    """Rolling back a take frees its pages again and rolling back a commit removes its
    entries: both count, so that a memo reading taken inside the rolled-back call is
    read again (`chain_memo`)."""
    pool = PagePool(2)
    pool.undo = UndoLog()
    a, b = pool.take((), 2)
    pool.commit_pages([a], [1], [b"a"])
    pool.release([a])
    pool.undo.commit()
    freed = pool.num_freed
    pool.take((), 1)  # evicts a
    pool.undo.rollback()
    assert pool.num_freed > freed and pool.lookup(1, b"a") == a
    unindexed = pool.num_unindexed
    pool.commit_pages([b], [2], [b"b"])
    pool.undo.rollback()
    assert pool.num_unindexed > unindexed and pool.lookup(2, b"b") is None


def test_claim_takes_given_unowned_pages_evicting_the_hashed_ones_all_or_nothing():
    """What a shared budget does to move a slot's pages to another group's pool: the
    pages, free or cached, get the budget as owner; cached ones leave the index; a page
    owned (or given twice) refuses the whole call; an undo restores every page."""
    pool = PagePool(5)
    pool.undo = UndoLog()
    a, b, c = pool.take((), 3)
    pool.commit_pages([a, b], [1, 2], [b"a", b"b"])
    pool.release([a, b])  # cached; c stays owned, 3 and 4 free
    pool.undo.commit()
    for bad in ([c, 3], [3, 3]):
        with pytest.raises(InvariantError):
            pool.claim(bad)
        assert (pool.num_free, pool.num_blank, pool.num_cached) == (4, 2, 2)
    pool.claim([3, a])
    assert (pool.num_free, pool.num_blank, pool.num_cached, pool.num_unindexed) == (2, 1, 1, 1)
    assert pool.ref_count(3) == pool.ref_count(a) == 1 and pool.lookup(1, b"a") is None
    assert pool.eviction_rank() == {b: 0}
    pool.check_invariants([[c], [3, a]])
    pool.undo.rollback()
    assert pool.lookup(1, b"a") == a and (pool.num_free, pool.num_blank) == (4, 2)
    pool.check_invariants([[c]])


def test_release_cold_puts_its_pages_at_the_old_end_of_the_lru():
    pool = PagePool(4)
    pages = pool.take((), 4)
    pool.commit_pages(pages, [1, 2, 3, 4], [b"1", b"2", b"3", b"4"])
    pool.release(pages[:2])
    pool.release_cold(pages[2:])  # evicted before the pages released the usual way
    assert pool.eviction_rank() == {pages[2]: 0, pages[3]: 1, pages[0]: 2, pages[1]: 3}
    assert pool.take((), 1) == [pages[2]]


def test_num_still_indexed_counts_the_leading_pages_that_keep_their_hash_and_tokens():
    pool = PagePool(3)
    a, b, c = pool.take((), 3)
    pool.commit_pages([a, b], [1, 2], [b"a", b"b"])
    tokens = [pool.page_tokens(a), pool.page_tokens(b)]
    assert pool.num_still_indexed([a, b], [1, 2], tokens) == 2
    assert pool.num_still_indexed([a, b], [1, 2], [b"a", b"b"]) == 2  # equal bytes, other objects
    assert pool.num_still_indexed([a, b], [1, 3], tokens) == 1
    assert pool.num_still_indexed([a, b], [1, 2], [b"a", b"x"]) == 1
    assert pool.num_still_indexed([a, b], [5, 2], tokens) == 0
    pool.release([b, c])
    pool.take((), 2)  # c, then b evicted
    assert pool.num_still_indexed([a, b], [1, 2], tokens) == 1
    assert pool.num_still_indexed([b, a], [2, 1], tokens[::-1]) == 0
    assert pool.num_still_indexed([a], [1], tokens[:1]) == 1


def test_unindexed_since_names_every_entry_removed_until_the_log_or_a_reset_loses_them(
    monkeypatch,
):
    monkeypatch.setattr(unindexed_log, "UNINDEXED_LOG", 4)
    pool = PagePool(4)
    pool.undo = UndoLog()
    pages = pool.take((), 4)
    pool.commit_pages(pages, [1, 2, 3, 4], [b"a", b"b", b"c", b"d"])
    pool.release(pages)  # cached, oldest first: 1, 2, 3, 4
    start = pool.num_unindexed
    assert pool.unindexed_since(start) == []
    pool.take((), 2)  # evicts 1 and 2
    assert pool.unindexed_since(start) == [1, 2]
    mark = pool.undo.begin()
    pool.take((), 1)  # evicts 3
    assert pool.unindexed_since(start) == [1, 2, 3]
    pool.undo.rollback(mark)  # 3 is indexed again; its removal stays counted and logged
    pool.undo.end()
    assert pool.lookup(3, b"c") is not None and pool.unindexed_since(start) == [1, 2, 3]
    owned = pool.take((), 2)  # evicts 3 and 4: the log keeps the last 2 once past 4
    assert pool.unindexed_since(start) is None
    assert pool.unindexed_since(pool.num_unindexed - 2) == [3, 4]
    pool.commit_pages(owned, [5, 6], [b"e", b"f"])
    reading = pool.num_unindexed
    pool.undo.begin()
    pool.commit_pages([p for p in pages if p not in owned][:1], [7], [b"g"])
    pool.undo.rollback()  # an undone commit removes its entry: logged
    pool.undo.end()
    assert pool.unindexed_since(reading) == [7]
    pool.release(owned)
    reading = pool.num_unindexed
    pool.reset_prefix_cache()
    assert pool.unindexed_since(reading) is None
    assert pool.unindexed_since(pool.num_unindexed) == []
