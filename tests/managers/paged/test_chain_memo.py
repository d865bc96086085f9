"""The chain memo (`mokv.managers.paged.chain_memo`): a request's page-hash chain is
hashed once across its calls, and what the device index answered is reused only while
it still holds. Every answer must equal the one a replica without the memo gives."""

import numpy as np
import pytest
from mokv import MultimodalInput, TextContext
from mokv.cache.extra_keys import HashInputs
from mokv.cache.hashing import hash_pages, page_hash_fn, root_hash, salted_root
from mokv.cache.page_pool import PagePool
from mokv.managers.paged import prefix
from mokv.managers.paged.chain_memo import ChainEntry, ChainMemo
from mokv.managers.paged.plans import RequestState
from mokv.managers.paged.prefix import PrefixChains

from ..conftest import make_paged, small_params

PS = 4  # small_params' page size


def make_chains(num_pages=8, hash_fn=None, capacity=None):
    params = small_params()
    chains = PrefixChains(params, PagePool(num_pages), hash_fn or page_hash_fn("xxh3"),
                          root_hash("xxh3", 0), max_seq_len=64)
    if capacity is not None:
        chains.memo = ChainMemo(capacity)
    return chains


def expected(tokens, salt=None, first=0, end=None):
    """(hash, bytes) of pages [first, end) computed from scratch."""
    pages = hash_pages(np.asarray(tokens), PS, salted_root("xxh3", 0, salt), page_hash_fn("xxh3"))
    return pages[first:end]


def commit(chains, tokens, num_pages):
    """Indexes the first `num_pages` pages of `tokens` on fresh pool pages, owned."""
    pages = expected(tokens, end=num_pages)
    page_ids = chains.pool.take((), num_pages)
    chains.pool.commit_pages(page_ids, [h for h, _ in pages], [d for _, d in pages])
    return page_ids


@pytest.fixture
def hash_calls(monkeypatch):
    """Pages hashed through `prefix.iter_page_hashes`, counted."""
    counted = {"pages": 0}
    real = prefix.iter_page_hashes

    def counting(tokens, page_size, parent, hash_fn, first_page=0, end_page=None, keys=None):
        for page in real(tokens, page_size, parent, hash_fn, first_page, end_page, keys):
            counted["pages"] += 1
            yield page

    monkeypatch.setattr(prefix, "iter_page_hashes", counting)
    return counted


def test_a_chain_is_hashed_once_and_then_read_from_the_memo(hash_calls):
    chains = make_chains()
    ctx = TextContext(np.arange(18), request_id="a")
    pages, entry = chains.pages(ctx, RequestState(0), 4)
    assert pages == expected(np.arange(18), end=4) and hash_calls["pages"] == 4
    again, same = chains.pages(ctx, RequestState(1), 4)  # a new claim of the same request
    assert again == pages and same is entry and hash_calls["pages"] == 4
    # A commit from page 2 on (after two hits) continues from the remembered chain.
    req = RequestState(1, pages=[5, 6], hashes=[pages[0][0], pages[1][0]])
    assert chains.pages(ctx, req, 4) == (pages[2:], entry) and hash_calls["pages"] == 4
    # Pages past the remembered ones are hashed, from the last remembered page on.
    longer = TextContext(np.arange(30), request_id="a")
    assert chains.pages(longer, RequestState(2), 7)[0] == expected(np.arange(30), end=7)
    assert hash_calls["pages"] == 4 + 3


@pytest.mark.parametrize("change", ["one token", "salt", "adapter", "image", "request id"])
def test_a_remembered_chain_is_not_used_for_other_tokens_or_keys(change, hash_calls):
    chains = make_chains()
    tokens = np.arange(18)
    chains.pages(TextContext(tokens, request_id="a"), RequestState(0), 4)
    other, rid, keys = tokens.copy(), "a", {}
    if change == "one token":
        other[9] = 99  # page 2
    elif change == "salt":
        keys = {"cache_salt": "tenant"}
    elif change == "adapter":
        keys = {"lora_name": "adapter"}
    elif change == "image":
        keys = {"mm_inputs": [MultimodalInput("img", 5, 2)]}  # page 1
    else:
        rid = "b"
    ctx = TextContext(other, request_id=rid, **keys)
    pages = chains.pages(ctx, RequestState(0), 4)[0]
    assert hash_calls["pages"] == 8  # all four hashed again
    assert pages == make_chains(capacity=0).pages(ctx, RequestState(0), 4)[0]  # no memo
    if change in ("one token", "request id"):
        assert pages == expected(other, end=4)
    else:
        assert pages != expected(other, end=4)


def test_a_chain_continues_only_from_its_own_parent(hash_calls):
    """Tokens equal past the committed pages but different before them: the pages after
    chain from a different parent, so the remembered hashes do not apply."""
    chains = make_chains()
    tokens = np.arange(18)
    chains.pages(TextContext(tokens, request_id="a"), RequestState(0), 4)
    other = tokens.copy()
    other[0] = 99  # page 0 only
    first = expected(other, end=1)
    req = RequestState(1, pages=[3], hashes=[first[0][0]])
    pages, entry = chains.pages(TextContext(other, request_id="a"), req, 4)
    assert pages == expected(other, first=1, end=4) and entry is None
    assert hash_calls["pages"] == 4 + 3


def test_an_entry_matches_only_its_own_key():
    """The key (`hash_inputs` of the context) is compared whole: another image alone
    (same salt, adapter and tokens) is another chain."""
    tokens = np.arange(9)
    pages = expected(tokens, end=2)
    key = HashInputs(None, None, (MultimodalInput("img", 0, 2),))
    entry = ChainEntry(key, 5, b"".join(d for _, d in pages), pages)
    assert entry.matching_pages(key, 5, tokens, PS, 0, 2) == 2
    other = HashInputs(None, None, (MultimodalInput("img2", 0, 2),))
    assert entry.matching_pages(other, 5, tokens, PS, 0, 2) == 0
    assert entry.matching_pages(None, 5, tokens, PS, 0, 2) == 0
    assert entry.matching_pages(key, 6, tokens, PS, 0, 2) == 0  # another root
    assert entry.matching_pages(key, pages[0][0], tokens, PS, 1, 2) == 1
    assert entry.matching_pages(key, 5, tokens, PS, 1, 2) == 0  # another parent


@pytest.mark.parametrize("form", ["int32", "big-endian", "strided", "uint64"])
def test_an_entry_compares_token_values_whatever_the_array(form):
    """Tokens given as another integer type, byte order or a strided view are compared
    by value, as their int64 bytes (an int32 array's own bytes would be half as long)."""
    tokens = np.arange(9)
    pages = expected(tokens, end=2)
    entry = ChainEntry(None, 5, b"".join(d for _, d in pages), pages)
    given = {
        "int32": tokens.astype(np.int32),
        "big-endian": tokens.astype(">i8"),
        "strided": np.repeat(tokens, 2)[::2],
        "uint64": tokens.astype(np.uint64),
    }[form]
    assert entry.matching_pages(None, 5, given, PS, 0, 2) == 2
    given[6] = 0
    assert entry.matching_pages(None, 5, given, PS, 0, 2) == 0
    # An int32 array whose bytes equal the int64 bytes of other tokens: [1, 0, 2, 0].
    halves = np.zeros(18, np.int32)
    halves[::2] = np.arange(9)
    assert entry.matching_pages(None, 5, halves, PS, 0, 1) == 0


def test_equal_hashes_never_stand_for_different_tokens():
    """Safety does not rest on the hash: with a hash function that maps every page to
    the same value, the memo still hands back each request's own token bytes, and a
    page indexed under that hash is not a hit for other tokens."""
    chains = make_chains(hash_fn=lambda parent, data: 7)
    a = TextContext(np.arange(9), request_id="x")
    b = TextContext(np.arange(100, 109), request_id="x")
    pages_a, _ = chains.pages(a, RequestState(0), 2)
    pages_b, _ = chains.pages(b, RequestState(0), 2)
    assert [h for h, _ in pages_a] == [h for h, _ in pages_b] == [7, 7]
    assert [np.frombuffer(d, np.int64).tolist() for _, d in pages_b] == [
        [100, 101, 102, 103],
        [104, 105, 106, 107],
    ]
    page_ids = chains.pool.take((), 2)
    chains.pool.commit_pages(page_ids[:1], [7], [pages_a[0][1]])
    assert chains.device_hits(a, RequestState(0), False)[0] == [(page_ids[0], 7)]
    assert chains.device_hits(b, RequestState(0), False)[0] == []


def test_hits_are_reused_only_while_every_page_still_holds():
    chains = make_chains(num_pages=6)
    tokens = np.arange(14)  # 3 pages that can match (the last token is never matched)
    ctx = TextContext(tokens, request_id="a")
    page_ids = commit(chains, tokens, 2)
    pool = chains.pool
    pool.release(reversed(page_ids))  # cached, evictable: page_ids[1] first
    hits, _ = chains.device_hits(ctx, RequestState(0), False)
    assert hits == [(page_ids[0], expected(tokens)[0][0]), (page_ids[1], expected(tokens)[1][0])]
    assert chains.device_hits(ctx, RequestState(1), False)[0] is hits  # nothing changed
    # Evicting a hit: the second page is gone, and is not reported again.
    taken = pool.take((), pool.num_free - 1)  # every free page, then the oldest cached
    assert page_ids[1] in taken and pool.page_hash(page_ids[1]) is None
    assert chains.device_hits(ctx, RequestState(2), False)[0] == hits[:1]
    # The page that missed is committed again (owned, on another page): found.
    pool.release(taken)
    again = commit(chains, tokens, 2)
    found = chains.device_hits(ctx, RequestState(3), False)[0]
    assert found == [(page_ids[0], hits[0][1]), (again[1], hits[1][1])]
    pool.release(again)
    # A reset unindexes everything.
    pool.reset_prefix_cache()
    assert chains.device_hits(ctx, RequestState(4), False)[0] == []


def test_hits_cut_by_evictions_are_not_looked_up_again(monkeypatch):
    chains = make_chains(num_pages=8)
    tokens = np.arange(18)  # 4 pages that can match
    ctx = TextContext(tokens, request_id="a")
    pool = chains.pool
    page_ids = commit(chains, tokens, 4)
    pool.release(reversed(page_ids))  # cached; evicted last page first
    hits, _ = chains.device_hits(ctx, RequestState(0), False)
    assert len(hits) == 4
    lookups = []
    monkeypatch.setattr(pool, "lookup_run", lambda pages: lookups.append(pages))
    for n in (3, 2):  # each allocation evicts the oldest cached page: the run's last
        pool.take((), pool.num_free - n)
        cut, _ = chains.device_hits(ctx, RequestState(0), False)
        assert cut == hits[:n] and lookups == []
        assert chains.room("a", cut, 1) == pool.room([p for p, _ in cut]) == pool.num_free - n
        assert chains.room("a", cut, 9) == pool.num_free  # more than free: a bound
    fresh = make_chains(num_pages=8)
    fresh.pool = pool
    monkeypatch.undo()
    assert fresh.device_hits(ctx, RequestState(0), False)[0] == cut


def test_memo_hits_compare_only_the_pages_that_decide_the_run(monkeypatch):
    chains = make_chains(num_pages=8)
    tokens = np.arange(22)  # 5 pages that can match; the first 2 committed
    ctx = TextContext(tokens, request_id="a")
    pool = chains.pool
    commit(chains, tokens, 2)
    hits, _ = chains.device_hits(ctx, RequestState(0), False)
    assert len(hits) == 2
    lookups = []
    real_lookup_run = pool.lookup_run
    monkeypatch.setattr(pool, "lookup_run", lambda pages: lookups.append(1) or real_lookup_run(pages))
    ctx.tokens[13] = 99  # page 3, after the page that misses (2): decides nothing
    assert chains.device_hits(ctx, RequestState(0), False)[0] is hits and lookups == []
    ctx.tokens[9] = 99  # page 2, the first miss: compared, and the run is looked up
    again, _ = chains.device_hits(ctx, RequestState(0), False)
    assert again == hits and lookups == [1]
    ctx.tokens[1] = 99  # page 0, a hit: no longer a hit
    assert chains.device_hits(ctx, RequestState(0), False)[0] == [] and lookups == [1, 1]
    fresh = make_chains(num_pages=8)
    fresh.pool = pool
    assert fresh.device_hits(ctx, RequestState(0), False)[0] == []


def test_room_is_read_again_once_a_page_is_freed():
    """`room` answers a bound below the need where it can: the free pages, or the room
    read for the same hits with no page freed since; else it reads the room."""
    chains = make_chains(num_pages=8)
    tokens = np.arange(14)
    ctx = TextContext(tokens, request_id="a")
    pool = chains.pool
    pool.release(commit(chains, tokens, 2))  # cached hits: taking them revives them
    held = pool.take((), 4)  # 2 free pages and the 2 cached hits left
    hits, _ = chains.device_hits(ctx, RequestState(0), False)
    assert len(hits) == 2 and chains.room("a", hits, 1) == 2  # read
    other = pool.take((), 1)  # the room is 1 now
    hits, _ = chains.device_hits(ctx, RequestState(0), False)
    assert chains.room("a", hits, 3) == 2  # the earlier reading bounds it: not read again
    assert chains.room("a", hits, 4) == pool.num_free == 3  # more than the free pages
    assert chains.room("a", hits, 1) == 1  # a need a bound would admit: read exactly
    pool.release(other + held[:2])
    hits, _ = chains.device_hits(ctx, RequestState(0), False)
    assert chains.room("a", hits, 4) == 4  # pages freed: read again
    assert chains.room("a", [], 4) == pool.num_free == 6  # no hits: read exactly, always


def test_the_memo_holds_at_most_its_capacity():
    memo = ChainMemo(capacity=3 * PS)

    def entry(num_pages):
        pages = expected(np.arange(num_pages * PS + 1), end=num_pages)
        return ChainEntry(("",), 0, b"".join(d for _, d in pages), pages)

    memo.put("a", entry(2))
    memo.put("b", entry(1))
    assert (len(memo), memo.num_tokens) == (2, 3 * PS)
    memo.get("a")  # now the most recently used
    memo.put("c", entry(1))  # drops "b", the least recently used
    assert (memo.get("b"), len(memo), memo.num_tokens) == (None, 2, 3 * PS)
    memo.put("d", entry(4))  # larger than the whole memo: not kept
    assert (memo.get("d"), len(memo)) == (None, 2)
    memo.put("a", entry(1))  # replaces a's entry
    memo.forget("c")
    assert (len(memo), memo.num_tokens) == (1, PS)


def test_a_failed_admission_fits_once_a_page_is_freed(session, hash_calls):
    m = make_paged(session, num_pages=8, max_seq_len=32)
    a = TextContext(np.arange(20), request_id="A")  # 5 pages
    m.external_claim("A")
    m.fetch([a])
    a.update(1)
    m.step([a])  # commits 5 full pages
    b = TextContext(np.arange(100, 116), request_id="B")  # 4 fresh pages; 3 are free
    for _ in range(3):  # the scheduler's retry: claim, try, release
        m.external_claim("B")
        assert m.maybe_reserve(b) is False
        m.release("B")
    assert hash_calls["pages"] == 5 + 3  # A's commit, B's chain once
    m.release("A")  # 5 pages cached: room for B
    m.external_claim("B")
    assert m.maybe_reserve(b) is True
    assert m.get_req_blocks("B") == [5, 6, 7, 4]  # 3 free pages, then A's last cached
    assert hash_calls["pages"] == 5 + 3
    m.check_invariants()


def test_a_failed_admission_fits_once_its_prefix_is_committed(session):
    """No page freed and no index entry removed, but the page that missed is now
    indexed (another request committed the same prefix): the hits grow, and it fits."""
    m = make_paged(session, num_pages=8, max_seq_len=32)
    a = TextContext(np.arange(16), request_id="A")  # 4 pages, owned
    m.external_claim("A")
    m.fetch([a])
    b = TextContext(np.concatenate([np.arange(16), [7, 7, 7]]), request_id="B")  # 5 pages
    m.external_claim("B")
    assert m.maybe_reserve(b) is False  # nothing to share yet: 5 fresh pages, 4 free
    m.release("B")
    a.update(1)
    m.step([a])  # A commits its 4 pages
    m.external_claim("B")
    assert m.maybe_reserve(b) is True  # 4 hits on A's pages, 1 fresh page
    assert m.get_req_blocks("B") == [0, 1, 2, 3, 4]
    assert b.start_idx == 16
    m.check_invariants()


def _five_pages_held_by_a(session):
    """A manager of 8 pages where request "A" holds 5 committed pages (20 + 1 tokens)."""
    m = make_paged(session, num_pages=8, max_seq_len=32)
    a = TextContext(np.arange(20), request_id="A")
    m.external_claim("A")
    m.fetch([a])
    a.update(1)
    m.step([a])
    return m


def test_a_refused_retry_is_answered_without_a_plan(session, monkeypatch):
    """A waiting prompt retried with the same hits and window is refused without a plan
    (`PrefixChains.refused_again`); it is planned again when a token of a page that
    decides its hits changes, when it asks for other steps, and once it may fit."""
    m = _five_pages_held_by_a(session)
    planner, plans = m.replicas[0].planner, []
    real_plan = planner.plan_hits  # a plan that looks its hits up
    monkeypatch.setattr(
        planner, "plan_hits", lambda ctx, req, n: plans.append(n) or real_plan(ctx, req, n)
    )
    b = TextContext(np.concatenate([np.arange(8), np.arange(100, 116)]), request_id="B")

    def retry(num_steps=1):  # the scheduler's: claim, try, release
        m.external_claim("B")
        fits = m.maybe_reserve(b, num_steps)
        if not fits:
            m.release("B")
        return fits

    assert retry() is False and len(plans) == 1  # 2 hits on A's pages, 4 fresh: 3 free
    assert retry() is False and len(plans) == 1
    b.tokens[5] = 99  # in a hit: planned, with 1 hit
    assert retry() is False and len(plans) == 2
    b.tokens[5] = 5
    assert retry() is False and len(plans) == 3
    assert retry() is False and len(plans) == 3
    assert retry(num_steps=2) is False and len(plans) == 4
    m.release("A")  # 5 cached pages: B fits
    assert retry() is True and len(plans) == 5
    assert m.get_req_blocks("B")[:2] == [0, 1] and b.start_idx == 8
    m.check_invariants()


def test_a_refused_retry_that_nothing_changed_reads_only_the_pages_that_decide(
    session, monkeypatch
):
    """A plain prompt retried while nothing it depends on changed is refused the short
    way (`PrefixChains._hits_stand`): neither `_memo_hits` nor a plan runs. A changed
    token of its hits or of the page after them, an index entry removed, or a salt
    send it the long way; a changed token past that page decides nothing."""
    m = _five_pages_held_by_a(session)
    chains, calls = m.replicas[0].chains, []
    real = chains._memo_hits
    monkeypatch.setattr(chains, "_memo_hits", lambda *args: calls.append(1) or real(*args))

    def retried(ctx) -> int:
        """`_memo_hits` calls of one refused retry (claim, try, release)."""
        calls.clear()
        m.external_claim(ctx.request_id)
        assert m.maybe_reserve(ctx) is False
        m.release(ctx.request_id)
        return len(calls)

    b = TextContext(np.concatenate([np.arange(8), np.arange(100, 116)]), request_id="B")
    retried(b)  # planned: 2 hits on A's pages, 4 fresh pages, 3 free
    assert retried(b) == 0
    b.tokens[20] = 7  # past the page after the hits
    assert retried(b) == 0
    for position in (5, 9):  # in a hit; in the page after the hits
        b.tokens[position] += 1000
        assert retried(b)  # the long way, then a plan
        b.tokens[position] -= 1000
        retried(b)  # planned again, with the hits it had
        assert retried(b) == 0
    c = TextContext(b.tokens.copy(), request_id="C", cache_salt="s")  # no hits: own root
    retried(c)
    assert retried(c)
    m.check_invariants()


@pytest.mark.parametrize("refused_between", [True, False])
def test_a_refused_retry_whose_hits_were_evicted_is_answered_without_a_plan(
    session, monkeypatch, refused_between
):
    """Cached hits of a waiting prompt evicted between its retries: the retry counts the
    fresh pages its fewer hits take, as a plan would, and is still refused unplanned;
    once exactly that many pages are free, it fits. Every answer, page and window is the
    one of a twin manager without the memo."""
    twins = [make_paged(session, num_pages=8, max_seq_len=32) for _ in range(2)]
    twins[1].replicas[0].chains.memo = ChainMemo(0)
    planner, plans = twins[0].replicas[0].planner, []
    real_plan = planner.plan_hits  # a plan that looks its hits up
    monkeypatch.setattr(
        planner,
        "plan_hits",
        lambda ctx, req, n: plans.append(ctx.request_id) or real_plan(ctx, req, n),
    )

    def admit(rid, tokens):
        """Claims, tries and releases what does not fit, on both twins: the same answer
        and pages; the twins' contexts."""
        contexts = [TextContext(tokens, request_id=rid) for _ in twins]
        fits = []
        for m, ctx in zip(twins, contexts):
            m.external_claim(rid)
            fits.append(m.maybe_reserve(ctx))
            if not fits[-1]:
                m.release(rid)
        assert fits[0] == fits[1]
        if fits[0]:
            assert twins[0].get_req_blocks(rid) == twins[1].get_req_blocks(rid)
            assert contexts[0].start_idx == contexts[1].start_idx
        return fits[0], contexts[0]

    for m in twins:  # A: 5 pages, committed, then cached (pages 4, 3, 2, 1, 0 oldest first)
        a = TextContext(np.arange(20), request_id="A")
        m.external_claim("A")
        m.fetch([a])
        a.update(1)
        m.step([a])
        m.release("A")
    assert admit("D", np.arange(200, 212))[0]  # the 3 free pages
    b = np.concatenate([np.arange(12), np.arange(100, 116)])
    assert admit("B", b)[0] is False and plans.count("B") == 1  # 3 hits, 4 fresh; room 5 - 3
    assert admit("B", b)[0] is False and plans.count("B") == 1
    assert admit("E", np.arange(300, 304))[0]
    assert twins[0].get_req_blocks("E") == [4]  # evicted: not a hit of B's
    assert admit("B", b)[0] is False and plans.count("B") == 1
    assert admit("F", np.arange(400, 408))[0]
    assert twins[0].get_req_blocks("F") == [3, 2]  # B's third hit evicted
    if refused_between:
        assert admit("B", b)[0] is False and plans.count("B") == 1  # 2 hits, 5 fresh; room 2 - 2
    for m in twins:
        m.release("D")
        m.release("F")
    fits, ctx = admit("B", b)
    assert fits and plans.count("B") == 2  # room 7 - 2: 5 fresh pages fit
    assert twins[0].get_req_blocks("B")[:2] == [0, 1] and ctx.start_idx == 8
    for m in twins:
        m.check_invariants()
