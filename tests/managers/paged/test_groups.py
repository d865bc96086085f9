"""Cache groups in the paged manager: a sliding-window group beside a full one, the joint
prefix hit (against MAX 26.7's own rule), exact page states as windows slide, and what
a cache of groups refuses."""

from __future__ import annotations

import random

import mokv
import numpy as np
import pytest
from max._kv_core import LeafShape, longest_joint_prefix_hit
from max.driver import CPU
from mokv import CacheGroupConfig, TextContext
from mokv.managers.paged.groups.full import run_hit
from mokv.managers.paged.groups.joint import longest_joint_hit
from mokv.managers.paged.groups.sliding import window_hit
from mokv.managers.paged.sizing import (
    SlotGeometry,
    estimated_memory_size,
    group_slots,
    infer_optimal_batch_size,
    max_supported_sequence_length,
)

from ..conftest import NUM_LAYERS, make_paged, small_params

PAGE = 4


def hybrid(window: int, full: bool = True) -> tuple[CacheGroupConfig, ...]:
    """A sliding group of one layer (and a full one of one layer: NUM_LAYERS in all)."""
    if not full:
        return (CacheGroupConfig("sliding", NUM_LAYERS, window_size=window),)
    return (CacheGroupConfig("sliding", 1, window_size=window), CacheGroupConfig("full", 1))


def served(m, ctx: TextContext, token: int = 1) -> None:
    """Claims `ctx` and runs one step of it (its full pages committed, its window slid)."""
    m.external_claim(ctx.request_id)
    m.fetch([ctx])
    ctx.update(token)
    m.step([ctx])


def held(m, rid: str) -> dict[str, tuple[int, list[int]]]:
    return m.get_req_blocks_per_group(rid)


def pools(m):
    return {g.name: g.pool for g in m.replicas[0].groups}


# --- the rules, against MAX's ----------------------------------------------------------


def found(mask):
    return [1 if r else None for r in mask]


def test_each_groups_rule_is_maxs():
    """A full group's hit is the run from the first page; a window's the longest prefix
    whose last `pages_in_window` pages are held: on every mask of up to 9 pages, as MAX's
    `LeafShape.longest_hit` answers."""
    for length in range(10):
        for bits in range(2**length):
            mask = [bool(bits >> i & 1) for i in range(length)]
            assert run_hit(found(mask), length) == LeafShape.full().longest_hit(mask)
            for window in (1, 2, 3, 5):
                ours = window_hit(found(mask), length, window)
                assert ours == LeafShape.sliding_window(window).longest_hit(mask), (mask, window)


def rule(window, mask):
    """A group's rule over `mask`: a full group's (window None) or a window's."""
    pages = found(mask)
    return lambda m: run_hit(pages, m) if window is None else window_hit(pages, m, window)


def test_the_joint_hit_is_maxs_and_not_a_minimum():
    rng = random.Random(52)
    for _ in range(3000):
        length = rng.randrange(0, 12)
        shapes = [rng.choice([None, 1, 2, 3, 4]) for _ in range(rng.randrange(1, 4))]
        masks = [[rng.random() < 0.8 for _ in range(length)] for _ in shapes]
        rules = [rule(w, mask) for w, mask in zip(shapes, masks)]
        theirs = longest_joint_prefix_hit(
            [(LeafShape.full() if w is None else LeafShape.sliding_window(w), mask)
             for w, mask in zip(shapes, masks)]
        )
        assert longest_joint_hit(rules, length) == theirs, (shapes, masks)
    # The full group holds pages 0-3, the window of two pages every page but 2: alone it
    # would serve 6 pages, and at 4 (the full group's) its window reads page 2.
    full, window = found([1, 1, 1, 1, 0, 1]), found([1, 1, 0, 1, 1, 1])
    rules = [lambda m: run_hit(full, m), lambda m: window_hit(window, m, 2)]
    assert min(rule(6) for rule in rules) == 4 and longest_joint_hit(rules, 6) == 2


# --- windows sliding --------------------------------------------------------------------


def test_decoding_past_many_windows_holds_one_window(session):
    """Window 6 (two pages before the one written): after every step the sliding group
    holds exactly the pages from its window's start; each page it released is a cached
    page under the same hash and tokens as the full group's page; the full group holds
    every page."""
    m = make_paged(session, num_pages=16, max_seq_len=64, groups=hybrid(6))
    ctx = TextContext(np.arange(5), "A")
    m.external_claim("A")
    for t in range(50):
        m.fetch([ctx])
        ctx.update(t % 3)
        m.step([ctx])
        rows = held(m, "A")
        (first, pages), (full_first, full_pages) = rows["sliding"], rows["full"]
        start = ctx.start_idx
        assert first == max(0, start - 6 + 1) // PAGE
        assert first + len(pages) == len(full_pages) == -(-start // PAGE)
        assert len(pages) <= 3 and full_first == 0
    assert first == 12
    sliding, full = pools(m)["sliding"], pools(m)["full"]
    hashes = m.replicas[0].committed_hashes("A")
    for page_idx in range(first):
        data = full.page_tokens(full_pages[page_idx])
        cached = sliding.lookup(hashes[page_idx], data)
        assert cached is not None and sliding.is_cached(cached)
    m.release("A")
    assert m.num_free_blocks == m.total_num_pages
    m.check_invariants()


def test_without_prefix_caching_a_window_frees_its_pages(session):
    m = make_paged(session, num_pages=16, max_seq_len=64, groups=hybrid(5),
                   enable_prefix_caching=False)
    ctx = TextContext(np.arange(30), "A")
    served(m, ctx, 1)
    first, pages = held(m, "A")["sliding"]
    assert (first, len(pages)) == (6, 2)  # window_start(30) = 26 // 4
    sliding, budget = pools(m)["sliding"], m.replicas[0].budget
    # each group took 8 of the 32 slots for the step; the window gave 6 back, free
    assert budget.num_owned == [8, 8] and len(budget.free_slots) == 16
    assert sliding.num_cached == 0 and sliding.num_free == budget.present(0) - 2


def test_a_released_window_goes_back_head_first(session):
    """The full group hands its pages back tail first (the shared prefix is evicted
    last); the sliding group head first (a later hit reads the window before its end),
    after the pages its window left, which no joint hit ends after: those at the old end
    of the LRU, tail first."""
    m = make_paged(session, num_pages=16, max_seq_len=64, groups=hybrid(9))
    ctx = TextContext(np.arange(17), "A")  # four full pages and one token
    m.external_claim("A")
    m.fetch([ctx])
    rows = held(m, "A")
    ctx.update(1)
    m.step([ctx])  # the window from token 17 reads from 9: pages 0 and 1 go back
    assert held(m, "A")["sliding"][0] == 2
    m.release("A")
    sliding, full = pools(m)["sliding"], pools(m)["full"]
    pages = rows["sliding"][1]
    assert list(sliding._cached) == [pages[1], pages[0], pages[2], pages[3]]  # 4: free
    assert list(full._cached) == rows["full"][1][3::-1]


def test_a_hit_takes_only_the_window_before_its_end(session):
    m = make_paged(session, num_pages=16, max_seq_len=64, groups=hybrid(6))
    a = TextContext(np.arange(25), "A")  # six full pages
    served(m, a, 7)
    m.release("A")
    b = TextContext(np.arange(25), "B")
    m.external_claim("B")
    assert m.maybe_reserve(b) and b.start_idx == 24
    rows = held(m, "B")
    assert rows["sliding"][0] == 4 and len(rows["sliding"][1]) == 3  # pages 4, 5 and a fresh one
    assert len(rows["full"][1]) == 7
    m.release("B")
    m.check_invariants()


def test_the_joint_hit_narrows_until_the_groups_agree(session):
    """The full group lost page 4, the sliding group (two pages of window) page 2: the
    hit is 2 pages, not the minimum of the groups' own answers (4), as MAX computes it."""
    m = make_paged(session, num_pages=16, max_seq_len=64, groups=hybrid(6))
    a = TextContext(np.arange(26), "A")  # six full pages and two tokens
    served(m, a, 7)
    rows = held(m, "A")
    full_pages = rows["full"][1]
    m.release("A")
    sliding, full = pools(m)["sliding"], pools(m)["full"]
    hashes = [full.page_hash(p) for p in full_pages[:6]]
    datas = [full.page_tokens(p) for p in full_pages[:6]]
    page_of = {name: [pool.lookup(h, d) for h, d in zip(hashes, datas)]
               for name, pool in (("sliding", sliding), ("full", full))}
    _evict(full, page_of["full"][4])
    _evict(sliding, page_of["sliding"][2])
    masks = {name: [pool.lookup(h, d) is not None for h, d in zip(hashes, datas)]
             for name, pool in (("sliding", sliding), ("full", full))}
    assert masks == {"sliding": [True, True, False, True, True, True],
                     "full": [True, True, True, True, False, True]}
    theirs = longest_joint_prefix_hit([(LeafShape.sliding_window(2), masks["sliding"]),
                                       (LeafShape.full(), masks["full"])])
    b = TextContext(np.arange(30), "B")
    m.external_claim("B")
    assert m.maybe_reserve(b)
    assert b.start_idx == 2 * PAGE == theirs * PAGE
    assert m.replicas[0].prefix_hit_pages(TextContext(np.arange(30), "C")) == (2, 0)
    m.release("B")
    m.check_invariants()


def _evict(pool, page_id: int) -> None:
    """Makes `page_id` (cached) the oldest cached page, then takes one page: it."""
    for other in [p for p in list(pool._cached) if p != page_id]:
        pool.acquire(other)
        pool.release([other])
    free = pool._free[:]
    pool._free.clear()
    (taken,) = pool.take((), 1)
    assert taken == page_id and pool.page_hash(page_id) is None
    pool.release([taken])
    pool._free[:0] = free


def test_a_context_moved_back_past_its_window_is_stale(session):
    m = make_paged(session, num_pages=16, max_seq_len=64, groups=hybrid(5),
                   enable_prefix_caching=False)
    a = TextContext(np.arange(21), "A")
    served(m, a, 1)
    before = held(m, "A"), m.num_free_blocks
    a.reset()
    with pytest.raises(mokv.StaleContextError, match="'sliding'.*released"):
        m.maybe_reserve(a)
    with pytest.raises(mokv.StaleContextError):
        m.fetch([a])
    assert (held(m, "A"), m.num_free_blocks) == before


def test_fetch_hands_out_every_groups_inputs_as_input_symbols_names_them(session):
    groups = (CacheGroupConfig("sliding", 1, window_size=5, head_dim=16),
              CacheGroupConfig("full", 1, n_kv_heads=1))
    m = make_paged(session, num_pages=48, max_seq_len=64, groups=groups)
    a = TextContext(np.arange(21), "A")
    m.external_claim("A")
    inputs = m.fetch([a])
    symbols = m.input_symbols()
    assert len(inputs) == len(symbols) == 2
    for buffers, types, (heads, head_dim), name in zip(
            inputs, symbols, [(2, 16), (1, 8)], ["sliding", "full"]):
        assert list(buffers.blocks.shape[1:]) == [2, 1, PAGE, heads, head_dim]
        assert str(types.blocks.shape[0]) == f"{name}_total_num_pages"
        assert [int(d) for d in types.blocks.shape[1:]] == [2, 1, PAGE, heads, head_dim]
        assert str(types.cache_lengths.shape[0]) == f"{name}_batch_size"
    a.update(1)
    m.step([a])
    tables = [i.lookup_table.to_numpy()[0] for i in m.fetch([a])]
    rows = held(m, "A")
    assert tables[0][:6].tolist() == [0, 0, 0, 0] + rows["sliding"][1]  # the pad page below
    assert tables[1][:6].tolist() == rows["full"][1]


# --- sizing and what a cache of groups refuses ------------------------------------------


def test_one_budget_of_slots_holds_what_requests_hold_in_every_group():
    params = small_params(groups=hybrid(5))  # 512-byte pages; a window of one page
    per_layer = small_params().bytes_per_page(1)
    memory = 40 * per_layer + per_layer // 2  # 40 slots of one page of either group
    assert group_slots(params, NUM_LAYERS, memory) == SlotGeometry(per_layer, (1, 1), 40)
    # one request of 24 tokens: 6 pages each in its step; between steps 6 full pages
    # and 2 windowed ones, so 5 of them fit (40 slots), not 6
    assert infer_optimal_batch_size(params, 24, NUM_LAYERS, memory) == 5
    assert estimated_memory_size(params, 2, 24, NUM_LAYERS, memory) == 16 * per_layer
    assert estimated_memory_size(params, 9, 24, NUM_LAYERS, memory) == 40 * per_layer
    # the longest request whose step's pages (as many in each group) the 40 slots hold
    assert max_supported_sequence_length(params, NUM_LAYERS, memory) == 20 * PAGE
    wide = small_params(groups=(CacheGroupConfig("sliding", 1, window_size=5, head_dim=16),
                                CacheGroupConfig("full", 1, n_kv_heads=1)))
    assert group_slots(wide, NUM_LAYERS, 10 * 1024).ratios == (1, 4)  # 1024 : 256 bytes


def test_a_budget_short_of_one_request_names_the_group(session):
    with pytest.raises(mokv.InsufficientMemoryError, match=r"4 slot.*groups \['sliding', 'full'\].*needs 32"):
        make_paged(session, num_pages=2, max_seq_len=64, groups=hybrid(5))


def test_groups_that_do_not_add_up_are_refused(session):
    with pytest.raises(ValueError, match="hold 3 layers, but num_layers=2"):
        make_paged(session, groups=(CacheGroupConfig("a", 2, window_size=4),
                                    CacheGroupConfig("b", 1)))
    for bad, match in [
        (dict(name="two words", num_layers=1), "identifier"),
        (dict(name="a", num_layers=0), "num_layers"),
        (dict(name="a", num_layers=1, window_size=1), "window of 1"),
        (dict(name="a", num_layers=1, head_dim=0), "head_dim"),
    ]:
        with pytest.raises(ValueError, match=match):
            CacheGroupConfig(**bad)
    with pytest.raises(ValueError, match="two groups named 'a'"):
        small_params(groups=(CacheGroupConfig("a", 1), CacheGroupConfig("a", 1)))
    with pytest.raises(ValueError, match="n_kv_heads=3 cannot be split"):
        small_params(n_devices=2, groups=(CacheGroupConfig("a", 1, n_kv_heads=3),))


def test_a_sliding_window_alone_is_a_cache_of_one_group(session):
    """Every layer windowed (Mistral's form, MAX's KVCacheParams with a window_size)."""
    m = make_paged(session, num_pages=16, max_seq_len=48, groups=hybrid(5, full=False))
    a = TextContext(np.arange(40), "A")
    served(m, a, 1)
    first, pages = held(m, "A")["sliding"]
    assert (first, m.get_req_blocks("A")) == (9, pages) and len(pages) == 1  # token 40: page 10 is not reserved yet
    m.release("A")
    b = TextContext(np.arange(40), "B")
    m.external_claim("B")
    assert m.maybe_reserve(b) and b.start_idx == 36
    assert held(m, "B")["sliding"][0] == 8  # page 8 (tokens 32-35), page 9 fresh
    m.release("B")
    m.check_invariants()


def test_the_continuous_manager_refuses_groups(session):
    with pytest.raises(ValueError, match="groups"):
        mokv.ContinuousKVCacheManager(small_params(cache_strategy="continuous", groups=hybrid(5)),
                                      2, 16, NUM_LAYERS, [CPU()], session)


def test_the_null_manager_names_every_groups_inputs(session):
    params = small_params(groups=hybrid(5))
    null = mokv.NullKVCacheManager(params, 2, 16, NUM_LAYERS, [CPU()], session, 0)
    paged = make_paged(session, num_pages=16, max_seq_len=16, groups=hybrid(5))
    assert null.input_symbols() == paged.input_symbols()
    null.external_claim("A")
    inputs = null.fetch([TextContext([1, 2], "A")])
    assert [list(i.blocks.shape) for i in inputs] == [[0, 2, 1, PAGE, 2, 8]] * 2
    with pytest.raises(ValueError, match="hold 2 layers, but num_layers=3"):
        mokv.NullKVCacheManager(params, 2, 16, 3, [CPU()], session, 0)


def test_a_cache_of_groups_honours_a_requests_cache_control(session):
    """A write policy caps what every group indexes; a pin, which a cache of groups cannot
    hold (`pins` is refused), is refused naming it at the first reservation, not ignored."""
    m = make_paged(session, num_pages=16, max_seq_len=32, groups=hybrid(6))
    ctx = TextContext(np.arange(17), "A", cache_control=mokv.CacheControl(write="read_only"))
    served(m, ctx)
    assert m.replicas[0].committed_hashes("A") == []
    assert all(not pool.indexed_hashes() for pool in pools(m).values())
    assert m.metrics.cache_control.withheld_pages == 4
    pinned = TextContext(np.arange(17), "B", cache_control=mokv.CacheControl(pin_ttl_s=5.0))
    m.external_claim("B")
    with pytest.raises(ValueError, match="asks for a pin .* KVCacheParams.pins is None"):
        m.maybe_reserve(pinned)
    assert pinned.start_idx == 0 and m.get_req_blocks_per_group("B") == {
        "sliding": (0, []), "full": (0, [])}
