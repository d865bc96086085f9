"""One budget for every cache group (groups/budget.py): memory moves to the group that
needs it, and a sliding group keeps the window a later joint hit reads ahead of the
pages no hit can use. Exact states on small caches (pages of 4 tokens)."""

from __future__ import annotations

import numpy as np
from mokv import CacheGroupConfig, TextContext

from ..conftest import make_paged
from .test_groups import held, pools, served

PAGE = 4


def two_groups(window: int) -> tuple[CacheGroupConfig, ...]:
    """A sliding group and a full group of one layer each: a slot holds one page of
    either."""
    return (CacheGroupConfig("sliding", 1, window_size=window), CacheGroupConfig("full", 1))


def test_memory_moves_to_the_group_that_needs_it(session):
    """32 slots. Fixed shares (the old split: each group one request of 64 tokens, 16
    pages, nothing left to share) gave the full group 16 pages, so B, whose 10 full
    pages come on top of A's 10, was refused; the shared budget admits it, the full
    group taking the slots the sliding group's window gave back."""
    m = make_paged(session, num_pages=16, max_seq_len=64, groups=two_groups(5))
    budget = m.replicas[0].budget
    assert budget.num_slots == 32 and budget.ratios == [1, 1]
    served(m, TextContext(np.arange(40), "A"), 1)  # 10 full pages and 1 token
    assert held(m, "A")["sliding"][0] == 9  # window_start(40) = 36 // 4: pages 0-8 left
    assert budget.num_owned == [10, 10] and len(budget.free_slots) == 12
    sliding = pools(m)["sliding"]
    assert sliding.num_cached == 9  # pages 0-8, cached
    b = TextContext(np.arange(1000, 1040), "B")  # no prefix in common with A
    m.external_claim("B")
    assert m.maybe_reserve(b)
    # the full group: A's 10 and B's 10, more than its fixed share of 16
    assert budget.present(1) == 20 and len(held(m, "B")["full"][1]) == 10
    # the sliding group needed 1 slot past its cache and took the last 2 free ones,
    # so it evicted 8 of its 9 cached pages, not 9
    assert budget.num_owned == [12, 20] and budget.free_slots == []
    assert sliding.num_cached == 1 and sliding.num_free == 1
    c = TextContext(np.arange(2000, 2004), "C")  # one more page in each group: none left
    m.external_claim("C")
    assert not m.maybe_reserve(c)
    m.release("C")
    m.release("B")
    m.release("A")
    assert m.num_free_blocks == m.total_num_pages == 32
    m.check_invariants()


def test_the_window_before_a_shared_prefix_end_outlives_older_pages(session):
    """Window 9 (two pages before the one written), 32 slots. A and B share a prefix of
    4 pages and then part: the sliding group keeps that prefix's last window (pages 2
    and 3) ahead of the pages of their own tokens and of the prefix's head, which no
    joint hit can read (those go to the old end of the LRU, tail first). C, with none of
    those tokens, evicts 6 cached sliding pages: exactly those; D, with the prefix, then
    gets the full joint hit of 4 pages."""
    m = make_paged(session, num_pages=16, max_batch_size=4, max_seq_len=48,
                   groups=two_groups(9))
    budget = m.replicas[0].budget
    prefix = list(range(100, 116))
    a = TextContext(np.array(prefix + list(range(200, 216))), "A")  # 8 pages
    b = TextContext(np.array(prefix + list(range(300, 316))), "B")
    for ctx in (a, b):
        m.external_claim(ctx.request_id)
    m.fetch([a, b])
    for ctx in (a, b):
        ctx.update(1)
    m.step([a, b])  # both commit 8 pages; B's prefix pages become A's
    rows_a, rows_b = held(m, "A"), held(m, "B")
    assert rows_a["full"][1][:4] == rows_b["full"][1][:4]  # the prefix, shared
    assert budget.num_owned == [16, 16] and budget.free_slots == []
    m.release("A")
    m.release("B")
    sliding, full = pools(m)["sliding"], pools(m)["full"]
    hashes = [full.page_hash(p) for p in rows_a["full"][1][:4]]
    datas = [full.page_tokens(p) for p in rows_a["full"][1][:4]]
    window = [sliding.lookup(h, d) for h, d in zip(hashes[2:], datas[2:])]
    # 12 cached sliding pages: the 6 that no hit can read oldest, then the prefix's
    # window, then the windows A and B held at their release
    finals = rows_a["sliding"][1] + rows_b["sliding"][1]
    assert list(sliding._cached)[6:] == window + finals and sliding.num_cached == 12
    c = TextContext(np.arange(1000, 1040), "C")  # 10 pages in each group
    m.external_claim("C")
    assert m.maybe_reserve(c)
    assert list(sliding._cached) == window + finals  # the 6 others evicted
    assert sliding.lookup(hashes[0], datas[0]) is None  # the prefix's head among them
    m.release("C")
    d = TextContext(np.array(prefix + list(range(400, 408))), "D")
    m.external_claim("D")
    assert m.maybe_reserve(d)
    assert d.start_idx == 4 * PAGE  # the full joint hit
    assert held(m, "D")["sliding"][1][:2] == window
    m.release("D")
    m.check_invariants()


def test_a_slot_holds_its_pages_scales_beside_their_values(session):
    """Scaled FP8 pages (granularity 4: a float32 scale per 4 one-byte values, as many
    bytes of scales as of values). A slot is one page of the sliding group (2 heads of
    16) or 4 of the full group (1 head of 8): 256 bytes of values and 256 of scales, in
    one allocation of every slot's values, then every slot's scales. Each group's values
    and scales views alias that memory slot by slot (written through one group, read
    through the other), and the slots of different groups never overlap, in either
    region, as slots move between the groups."""
    from max.dtype import DType
    from mokv import KVCacheQuantization
    from mokv.cache.page_copy import numpy_view
    from mokv.managers.paged.sizing import SlotGeometry, group_slots

    from ..conftest import NUM_LAYERS, small_params

    groups = (CacheGroupConfig("sliding", 1, window_size=5, head_dim=16),
              CacheGroupConfig("full", 1, n_kv_heads=1))
    fp8 = dict(dtype=DType.float8_e4m3fn, quantization=KVCacheQuantization(granularity=4))
    assert group_slots(small_params(groups=groups, **fp8), NUM_LAYERS, 40 * 512 + 511) == (
        SlotGeometry(512, (1, 4), 40, 256))
    m = make_paged(session, num_pages=17, max_seq_len=52, groups=groups, **fp8)
    replica = m.replicas[0]
    budget = replica.budget
    assert budget.num_slots == 17 and budget.ratios == [1, 4]

    def views(g: int) -> list[np.ndarray]:  # a page's bytes per row: values, scales
        group = replica.groups[g]
        return [numpy_view(b).view(np.uint8).reshape(b.shape[0], -1)
                for b in (group.blocks[0], group.scales[0])]

    (sliding_values, sliding_scales), (full_values, full_scales) = views(0), views(1)
    assert sliding_values.shape == sliding_scales.shape == (17, 256)
    assert full_values.shape == full_scales.shape == (68, 64)
    for region, (sliding, full) in enumerate([(sliding_values, full_values),
                                              (sliding_scales, full_scales)]):
        sliding[:] = (np.arange(17, dtype=np.uint8) + 100 * region)[:, None]
        np.testing.assert_array_equal(full, sliding.reshape(68, 64))  # the same bytes
    # A takes every slot: 13 of sliding pages (its window holds 2, 11 are cached) and 4
    # of full pages (13 held, 3 free); B's 5 full pages need one more slot: one of the
    # sliding group's, its cached page evicted.
    served(m, TextContext(np.arange(50), "A"), 1)
    before = budget.owner[:]
    assert before.count(0) == 13 and before.count(1) == 4
    b = TextContext(np.arange(1000, 1020), "B")
    m.external_claim("B")
    assert m.maybe_reserve(b)
    moved = budget.owner[:]
    assert sum(o == 0 and n == 1 for o, n in zip(before, moved)) == 1
    rng = np.random.default_rng(0)
    written = {}
    for g, own in enumerate(views(0) + views(1)):  # sliding values, scales, full ...
        group = g // 2
        pages = [p for s, o in enumerate(moved) if o == group for p in budget.pages(group, s)]
        written[g] = (pages, rng.integers(0, 256, (len(pages), own.shape[1]), np.uint8))
        own[pages] = written[g][1]
    for g, own in enumerate(views(0) + views(1)):
        pages, data = written[g]
        np.testing.assert_array_equal(own[pages], data)  # nothing overwrote another's
    m.check_invariants()
