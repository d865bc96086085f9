"""HostPagePool, the host tier's index: leaf-LRU eviction, pinned pages, refreshes and
events."""

from mokv.events.publisher import EventRecorder, build_events
from mokv.tiers.host_pool import HostPagePool

# --- the host pool --------------------------------------------------------------------


def stored(pool: HostPagePool, chain: list[int], parent=None) -> list[int]:
    plan = pool.plan_store(chain, ())
    pool.evict(plan.victims)
    tokens = [h.to_bytes(8, "little") for h in chain]  # one int64 token per page
    pool.insert(plan.targets, chain, tokens, [parent, *chain[:-1]])
    pool.check_invariants()
    return plan.targets


def test_eviction_is_lru_over_leaves():
    pool = HostPagePool(5)
    stored(pool, [1, 2, 3])  # chain 1 <- 2 <- 3
    stored(pool, [7, 8])
    pool.touch_hashes([1])  # the oldest page is now a young prefix, yet not a leaf
    plan = pool.plan_store([20, 21, 22, 23], ())
    # Leaves oldest first: 3, then its parent 2 (now a leaf), then 8, 7; never 1 before 2.
    assert [pool.page_hash(p) for p in plan.victims] == [3, 2, 8, 7]
    assert len(plan.entries) == 4


def test_pinned_pages_are_never_evicted_or_reused():
    pool = HostPagePool(3)
    a, b, c = stored(pool, [1, 2, 3])
    plan = pool.plan_store([9, 10, 11], protected={c})
    assert plan.entries == []  # the only leaf, 3, is pinned; its ancestors are no leaves
    pool.reset_prefix_cache()  # every page free, but the pinned one still not reusable
    plan = pool.plan_store([9, 10, 11], protected={c})
    assert sorted(plan.targets) == sorted([a, b]) and plan.entries == [0, 1]
    pool.check_invariants()


def test_host_events_carry_medium_cpu():
    recorder = EventRecorder()
    pool = HostPagePool(2)
    pool.events = recorder.medium_sink("CPU")
    recorder.stored(1, None, (5).to_bytes(8, "little"), None)  # the device tier's store
    stored(pool, [1])
    stored(pool, [2, 3])  # evicts 1
    events = build_events(recorder.take(), 1, "GPU")
    kinds = [(type(e).__name__, e.medium) for e in events]
    assert kinds == [("BlockStored", "GPU"), ("BlockStored", "CPU"), ("BlockRemoved", "CPU"),
                     ("BlockStored", "CPU")]
    assert events[3].block_hashes == [2, 3]


def test_a_store_never_evicts_the_pages_it_refreshes():
    pool = HostPagePool(2)
    stored(pool, [1])
    stored(pool, [5])  # 1 is the oldest leaf
    plan = pool.plan_store([1, 2], ())  # refreshes 1, stores 2: evicts 5, not 1
    assert plan.present == [pool.lookup(1, (1).to_bytes(8, "little"))]
    assert [pool.page_hash(p) for p in plan.victims] == [5]
