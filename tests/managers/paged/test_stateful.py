"""Random operation sequences against the paged manager, with the pages' contents checked.

Each token's "KV" written into the real page buffer is a hash of the whole token prefix
up to it, as a real model's keys and values would be. Before every step, a request's
cached tokens must read back exactly those values: so a prefix hit is only ever between
identical prefixes, reused pages hold what the first request wrote, and no request
writes into another's pages. The manager runs with `enable_runtime_checks`, so the pool's
invariants are verified after every operation.
"""

import mokv
import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from max.dtype import DType
from mokv import TextContext
from mokv.events import PrefixRouterIndex
from mokv.managers.paged.window_tails import checkpoint_tail

from ..conftest import NUM_LAYERS, make_paged, small_params

MAX_SEQ_LEN = 24
SHARED_PREFIXES = [[1, 2, 1, 2, 1, 2, 1, 2, 0], [2, 2, 2, 2, 2]]
MODULUS = 2**23 - 15  # values below 2**23 are exact in float32


def prefix_values(tokens: np.ndarray) -> np.ndarray:
    """value[i] = rolling hash of tokens[: i + 1]."""
    out, h = np.empty(len(tokens), dtype=np.float32), 7
    for i, t in enumerate(tokens.tolist()):
        h = (h * 1000003 + int(t) + 1) % MODULUS
        out[i] = h
    return out


prompts = st.builds(
    lambda prefix, suffix: np.array(prefix + suffix),
    st.sampled_from([[]] + SHARED_PREFIXES),
    st.lists(st.integers(0, 2), min_size=1, max_size=8),
)


class PagedManagerMachine(RuleBasedStateMachine):
    num_pages = 12

    def options(self) -> dict:
        return {}

    def __init__(self):
        super().__init__()
        self.m = make_paged(SESSION, num_pages=self.num_pages, max_batch_size=4,
                            max_seq_len=MAX_SEQ_LEN, **self.options())
        self.blocks = self.written(self.m.replicas[0].group)  # aliases the device buffer
        self.running: dict[mokv.RequestID, TextContext] = {}
        self.preempted: list[TextContext] = []

    @staticmethod
    def written(group):
        """The numpy view of a group's buffer the values read back are written to."""
        return group.blocks[0].to_numpy()

    def cached_values(self, ctx):
        page_size = self.m.page_size
        pages = self.m.get_req_blocks(ctx.request_id)
        pos = np.arange(ctx.start_idx)
        return self.blocks[np.array(pages)[pos // page_size], 0, 0, pos % page_size, 0, 0]

    @precondition(lambda self: len(self.running) < 4)
    @rule(prompt=prompts, resume=st.booleans())
    def claim(self, prompt, resume):
        # Request ids in claim order, so that sorted choices replay alike (hypothesis).
        self.claims = getattr(self, "claims", 0) + 1
        ctx = (self.preempted.pop() if resume and self.preempted
               else TextContext(prompt, request_id=f"r{self.claims:04d}"))
        self.m.claim(ctx.request_id)
        self.running[ctx.request_id] = ctx

    @precondition(lambda self: self.running)
    @rule(data=st.data(), num_steps=st.integers(1, 3))
    def reserve(self, data, num_steps):
        ctx = data.draw(st.sampled_from(sorted(self.running.values(), key=lambda c: c.request_id)))
        if ctx.active_idx + num_steps - 1 > MAX_SEQ_LEN:
            return
        free_before = self.m.num_free_blocks
        start_before = ctx.start_idx
        if not self.m.maybe_reserve(ctx, num_steps):
            assert (self.m.num_free_blocks, ctx.start_idx) == (free_before, start_before)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), chunk=st.integers(1, 6), token=st.integers(0, 2))
    def run_step(self, data, chunk, token):
        ids = sorted(self.running)
        batch = [self.running[i] for i in data.draw(st.sets(st.sampled_from(ids), min_size=1))]
        batch.sort(key=lambda c: c.request_id)
        for ctx in batch:
            if data.draw(st.booleans()):
                ctx.chunk(chunk)
        batch = [c for c in batch if c.active_idx < MAX_SEQ_LEN]
        try:
            self.m.fetch(batch)
        except mokv.InsufficientPagesError:
            return
        for ctx in batch:
            self.read_back_and_write(ctx)
            ctx.update(token)
        self.m.step(batch)
        for ctx in batch:  # finished: a prefix hit can move a window to max_seq_len, and
            if ctx.end_idx > MAX_SEQ_LEN:  # its step's token then goes past it
                del self.running[ctx.request_id]
                self.m.release(ctx.request_id)

    def read_back_and_write(self, ctx):
        """Checks the request's cached tokens hold their values, then writes the values of
        the tokens its step processes."""
        expected = prefix_values(ctx.tokens)
        np.testing.assert_array_equal(self.cached_values(ctx), expected[: ctx.start_idx])
        pages = np.array(self.m.get_req_blocks(ctx.request_id))
        pos = np.arange(ctx.start_idx, ctx.active_idx)
        page_size = self.m.page_size
        self.blocks[pages[pos // page_size], 0, 0, pos % page_size, 0, 0] = expected[pos]

    @precondition(lambda self: self.running)
    @rule(data=st.data(), preempt=st.booleans())
    def release(self, data, preempt):
        rid = data.draw(st.sampled_from(sorted(self.running)))
        ctx = self.running.pop(rid)
        self.m.release(rid)
        if preempt:
            ctx.reset()
            self.preempted.append(ctx)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def duplicate_in_batch(self, data):
        ctx = data.draw(st.sampled_from(sorted(self.running.values(), key=lambda c: c.request_id)))
        self.assert_rejected(lambda: self.m.fetch([ctx, ctx]), ValueError)
        self.assert_rejected(lambda: self.m.step([ctx, ctx]), ValueError)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), call=st.sampled_from(["release", "fetch", "step", "reserve", "claim"]))
    def bad_call(self, data, call):
        """A call with one bad argument among good ones raises and changes nothing."""
        ctx = data.draw(st.sampled_from(sorted(self.running.values(), key=lambda c: c.request_id)))
        stranger = TextContext([1, 2, 3], request_id="stranger")
        bad = {
            "release": (lambda: self.m.release(stranger.request_id), mokv.UnknownRequestError),
            "fetch": (lambda: self.m.fetch([ctx, stranger]), mokv.UnknownRequestError),
            "step": (lambda: self.m.step([ctx, stranger]), mokv.UnknownRequestError),
            "reserve": (lambda: self.m.maybe_reserve(ctx, 0), ValueError),
            "claim": (lambda: self.m.claim(ctx.request_id), mokv.AlreadyClaimedError),
        }
        self.assert_rejected(*bad[call])

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def reset_while_claimed(self, data):
        """`ctx.reset()` without a release: writing from token 0 would overwrite committed
        pages that other requests may share, so the manager refuses; the caller then
        releases the request (as a preemption does)."""
        rid = data.draw(st.sampled_from(sorted(self.running)))
        ctx = self.running[rid]
        ctx.reset()
        before = self.held()
        try:
            self.m.maybe_reserve(ctx)
        except mokv.StaleContextError:
            assert self.held() == before
        else:
            return  # nothing committed yet: the pages are its own to rewrite
        del self.running[rid]
        self.m.release(rid)
        self.preempted.append(ctx)

    def held(self):
        """Free pages, each running request's pages and window."""
        return (self.m.num_free_blocks, {r: self.m.get_req_blocks(r) for r in self.running},
                [(c.start_idx, c.active_idx) for c in self.running.values()])

    def assert_rejected(self, call, error):
        before = self.held()
        try:
            call()
        except error:
            pass
        else:
            raise AssertionError(f"{call} did not raise {error.__name__}")
        assert self.held() == before

    @rule()
    def reset_prefix_cache(self):
        """vLLM's rule: refused (False, nothing changed) while any request holds pages."""
        holding = any(self.m.get_req_blocks(rid) for rid in self.running)
        before = [(r.pool.indexed_hashes(), self.host_hashes(r)) for r in self.m.replicas]
        free = self.m.num_free_blocks
        assert self.m.reset_prefix_cache() is not holding
        after = [(r.pool.indexed_hashes(), self.host_hashes(r)) for r in self.m.replicas]
        if holding:
            assert after == before and self.m.num_free_blocks == free
        else:  # both tiers forget every prefix
            assert all(not device and not host for device, host in after)

    @staticmethod
    def host_hashes(replica):
        host = replica.tiers.named("host")
        return set() if host is None else host.pool.indexed_hashes()

    @invariant()
    def pages_add_up(self):
        held = {p for rid in self.running for p in self.m.get_req_blocks(rid)}
        assert self.m.num_free_blocks + len(held) == self.num_pages

    def stuck_pages(self) -> int:
        """Pages that no request holds and that are not room (live pins' pages that no
        tier can take)."""
        return 0

    def teardown(self):
        for rid in list(self.running):
            self.m.release(rid)
        assert self.m.num_free_blocks + self.stuck_pages() == self.num_pages
        hosts = [r.tiers.named("host") for r in self.m.replicas]
        assert not any(h.pinned for h in hosts if h is not None)  # no host page left pinned
        self.m.check_invariants()


class HostTierMachine(PagedManagerMachine):
    """The same rules on 7 device pages with a 16-page host tier: prefixes cycle device ->
    host -> device,
    the host tier evicts all the time, and every cached token read back (from pages
    loaded from the host tier too) must hold exactly its prefix's value."""

    num_pages = 7
    host_tokens_loaded = 0  # over every example: the host tier was really exercised

    def options(self) -> dict:
        bytes_per_page = small_params().bytes_per_page(NUM_LAYERS)
        return dict(tiers=(mokv.HostTierConfig(swap_space_gb=16 * bytes_per_page / 2**30),))

    def teardown(self):
        HostTierMachine.host_tokens_loaded += self.m.metrics.host_cache_tokens
        super().teardown()

    @precondition(lambda self: len(self.running) < 4)
    @rule(prefix=st.sampled_from(SHARED_PREFIXES), token=st.integers(0, 2))
    def short_request(self, prefix, token):
        """A whole request on a shared prefix (a new turn of a known conversation): its
        cached tokens, from either tier, must read back their values."""
        self.shorts = getattr(self, "shorts", 0) + 1
        ctx = TextContext(np.array(prefix + [token]), request_id=f"short{self.shorts}")
        self.serve_whole(ctx)

    def serve_whole(self, ctx, check=None) -> bool:
        """Claims, fetches (if its pages fit), calls `check(ctx)`, writes, steps and
        releases one request; False if its pages did not fit."""
        self.m.claim(ctx.request_id)
        try:
            self.m.fetch([ctx])
        except mokv.InsufficientPagesError:
            self.m.release(ctx.request_id)
            return False
        if check is not None:
            check(ctx)
        self.write_and_step(ctx, 0)
        self.m.release(ctx.request_id)
        return True

    def write_and_step(self, ctx, token):
        self.read_back_and_write(ctx)
        ctx.update(token)
        self.m.step([ctx])

    @precondition(lambda self: len(self.running) < 4)
    @rule()
    def eviction_storm(self):
        """A request of fresh tokens takes every page it can: cached device pages go."""
        self.storms = getattr(self, "storms", 0) + 1
        ctx = TextContext(np.full(MAX_SEQ_LEN, 2 + self.storms), request_id=f"storm{self.storms}")
        self.serve_whole(ctx)


class Clock:
    """The sessions' injected clock."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


SESSION_IDS = ("s0", "s1", "s2")
TTL_S = 20.0


class SessionMachine(HostTierMachine):
    """The host tier's rules with sessions: three agent sessions take turns on their
    growing context (each turn a whole request, released: the session pauses while
    other rules run), end, and expire on an injected clock; 8 device and 16 host pages
    with a share of 0.15 (3 pages), so the cap drops sessions too. Besides the pages'
    values read back and the pools' invariants (runtime checks):

    - a retained page is never in a request's write window (nor owned by one while kept);
    - the sessions never retain more than the cap;
    - ending a session stops retaining exactly the hashes no other open session retains;
    - a session past its time-to-live is ended by the next reservation;
    - a turn whose session's retained pages are all still cached (device or host) finds
      at least them."""

    num_pages = 8
    session_turns_hit = 0  # over every example: retention was really exercised
    totals = mokv.SessionMetrics()  # ... and the cap, the TTL, ends and evictions

    def teardown(self):
        SessionMachine.totals += self.m.metrics.sessions
        super().teardown()

    def options(self) -> dict:
        self.clock = Clock()
        self.context: dict[str, list] = {sid: [] for sid in SESSION_IDS}
        return dict(
            super().options(),
            sessions=mokv.SessionConfig(ttl_s=TTL_S, max_share=0.15, clock=self.clock),
        )

    @property
    def table(self):
        return self.m.replicas[0].sessions

    @precondition(lambda self: len(self.running) < 4)
    @rule(sid=st.sampled_from(SESSION_IDS), new=st.lists(st.integers(0, 2), min_size=1,
                                                         max_size=6))
    def session_turn(self, sid, new):
        """The session's next turn: its context so far plus new tokens (a tool's output),
        as one whole request; released after one token (the session pauses)."""
        context = self.context[sid]
        if len(context) + len(new) >= MAX_SEQ_LEN - 1:
            context = self.context[sid] = []  # a new conversation under the same session
        chain = self.table.retained(sid)
        replica = self.m.replicas[0]
        host = replica.tiers.named("host").pool.indexed_hashes()
        present = all(h in replica.pool.indexed_hashes() or h in host for h in chain)
        self.turns = getattr(self, "turns", 0) + 1
        ctx = TextContext(np.array(context + new), request_id=f"{sid}-t{self.turns}",
                          session_id=sid)

        def finds_the_retained_pages(ctx):
            # The leading pages of the prompt that the session retains (all, unless the
            # conversation started over: then a prefix of the retained chain may match).
            ours = PrefixRouterIndex(page_size=4).page_hashes(ctx.tokens)
            n = next((i for i, (a, b) in enumerate(zip(ours, chain)) if a != b),
                     min(len(ours), len(chain)))
            if present and n:
                assert ctx.start_idx >= min(n, (ctx.end_idx - 1) // 4) * 4
                SessionMachine.session_turns_hit += 1

        if self.serve_whole(ctx, finds_the_retained_pages):
            self.context[sid] = ctx.tokens.tolist()

    @rule(sid=st.sampled_from(SESSION_IDS))
    def end_session(self, sid):
        """Ends `sid` (and, first, the sessions past their time-to-live)."""
        due = {o for o, s in self.table.sessions.items()
               if not s.running and s.deadline <= self.clock.now}
        others = set().union(*(self.table.retained(o) for o in SESSION_IDS
                               if o != sid and o not in due))
        ending = set().union(*(self.table.retained(o) for o in due | {sid}))
        before = self.held()
        assert self.m.end_session(sid) == len(ending - others)
        assert self.table.retained(sid) == () and not due & set(self.table.sessions)
        assert self.table.retained_hashes == others == self.m.replicas[0].pool.retained_hashes
        assert self.held() == before  # no page changes owner
        self.context[sid] = []

    @precondition(lambda self: len(self.running) < 4)
    @rule(seconds=st.sampled_from([1.0, 5.0, TTL_S + 1]))
    def pause(self, seconds):
        """Time passes (a tool runs); then a reservation ends the sessions past their TTL."""
        self.clock.now += seconds
        due = [sid for sid, s in self.table.sessions.items()
               if not s.running and s.deadline <= self.clock.now]
        self.pauses = getattr(self, "pauses", 0) + 1
        ctx = TextContext(np.array([2, 1, 0, 2, 1]), request_id=f"pause{self.pauses}")
        self.m.claim(ctx.request_id)
        if self.m.maybe_reserve(ctx):
            assert not set(due) & set(self.table.sessions)
        self.m.release(ctx.request_id)

    @invariant()
    def retained_pages_stay_out_of_write_windows(self):
        pool = self.m.replicas[0].pool
        retained = self.table.retained_hashes
        assert len(retained) <= self.table.cap
        for rid in self.running:
            pages = self.m.get_req_blocks(rid)
            committed = len(self.m.replicas[0].committed_hashes(rid))
            for page in pages[committed:]:  # the pages it may still write
                assert pool.page_hash(page) is None and not pool.is_retained(page)
        for page in range(pool.num_pages):
            if pool.is_cached(page) and pool.is_retained(page):
                assert pool.ref_count(page) == 0


WINDOW = 6  # two pages of 4 before the one a step writes


class GroupMachine(PagedManagerMachine):
    """The same rules on a cache of two groups: a sliding window of 6 tokens (one layer)
    and a full group (one layer), 24 pages in all. Every group's pages are written, and
    before every step a request reads back, in every group, exactly the tokens a step
    reads there: the full group every cached token, the sliding group those of its
    window. Between calls the sliding group holds each request's pages from its
    window's start on, and no fewer; the pages of every group add up."""

    hit_tokens = slid_windows = 0  # over every example: hits and slides really happened

    def options(self) -> dict:
        return dict(groups=(mokv.CacheGroupConfig("sliding", 1, window_size=WINDOW),
                            mokv.CacheGroupConfig("full", 1)))

    def __init__(self):
        super().__init__()
        self.num_pages = self.m.total_num_pages
        self.group_blocks = {g.name: self.written(g) for g in self.m.replicas[0].groups}

    def window(self, name, start):
        """The first token a step from `start` reads in group `name`."""
        return max(0, start - WINDOW + 1) if name == "sliding" else 0

    def cached_values(self, ctx):
        expected = prefix_values(ctx.tokens)
        for name, (first, pages) in self.m.get_req_blocks_per_group(ctx.request_id).items():
            pos = np.arange(self.window(name, ctx.start_idx), ctx.start_idx)
            page_idx = pos // self.m.page_size - first
            assert (page_idx >= 0).all(), (name, first, ctx.start_idx)
            values = self.group_blocks[name][np.array(pages, dtype=np.int64)[page_idx], 0, 0,
                                             pos % self.m.page_size, 0, 0]
            np.testing.assert_array_equal(values, expected[pos])
        return expected[: ctx.start_idx]

    def read_back_and_write(self, ctx):
        self.cached_values(ctx)
        expected = prefix_values(ctx.tokens)
        pos = np.arange(ctx.start_idx, ctx.active_idx)
        for name, (first, pages) in self.m.get_req_blocks_per_group(ctx.request_id).items():
            page_idx = pos // self.m.page_size - first
            self.group_blocks[name][np.array(pages)[page_idx], 0, 0,
                                    pos % self.m.page_size, 0, 0] = expected[pos]

    def held(self):
        return (self.m.num_free_blocks,
                {r: self.m.get_req_blocks_per_group(r) for r in self.running},
                [(c.start_idx, c.active_idx) for c in self.running.values()])

    @invariant()
    def pages_add_up(self):
        held = sum(len(pages) for rid in self.running
                   for _, pages in self.m.get_req_blocks_per_group(rid).values())
        shared = {(name, p) for rid in self.running
                  for name, (_, pages) in self.m.get_req_blocks_per_group(rid).items() for p in pages}
        assert len(shared) <= held
        assert self.m.num_free_blocks + len(shared) == self.num_pages

    @invariant()
    def a_window_holds_its_pages_and_no_more(self):
        for ctx in self.running.values():
            first, _ = self.m.get_req_blocks_per_group(ctx.request_id)["sliding"]
            assert first == self.window("sliding", ctx.start_idx) // self.m.page_size
            GroupMachine.slid_windows += first > 0

    def teardown(self):
        type(self).hit_tokens += self.m.metrics.cache_tokens
        super().teardown()


class GroupHostMachine(GroupMachine, HostTierMachine):
    """The groups' rules with a host tier per group (16 host pages of the two-layer
    page's bytes, split between the groups) on few device pages: each group's prefixes
    cycle device -> its host tier -> device, and every token read back in every group
    (from pages loaded from a host tier too) must hold exactly its prefix's value."""

    num_pages = 7
    group_tokens_loaded = 0  # over every example: the groups' host tiers were exercised

    def options(self) -> dict:
        return dict(GroupMachine.options(self), **HostTierMachine.options(self))

    def teardown(self):
        GroupHostMachine.group_tokens_loaded += self.m.metrics.host_cache_tokens


class StateMachine(PagedManagerMachine):
    """The same rules on a cache with recurrent-state layers beside a full group: the
    state (one float64 per request) is the rolling hash of the tokens it absorbed. Before
    every step a request's live state must be the hash of exactly its cached tokens (0
    before any): a fresh request starts from zeros, a prefix hit resumes from a
    checkpoint of the same tokens, and no request runs on another's state. Checkpoints
    land where steps end on a page boundary (random chunks), at most 3 kept."""

    resumed_tokens = 0  # over every example: resumes from checkpoints really happened

    def options(self) -> dict:
        state = mokv.RecurrentStateConfig(
            "state", (mokv.StateRegion("h", 1, (1,), DType.float64),), num_checkpoints=3)
        return dict(groups=(mokv.CacheGroupConfig("full", NUM_LAYERS),), recurrent=state)

    def read_back_and_write(self, ctx):
        super().read_back_and_write(ctx)
        (inputs,) = self.m.state_inputs([ctx])
        (leaf,) = inputs.leaves
        row = leaf.live_row_ids.to_numpy()[0, 0]
        pool = leaf.pool.to_numpy()
        expected = prefix_values(ctx.tokens)
        start, end = ctx.start_idx, ctx.active_idx
        assert pool[row, 0] == (expected[start - 1] if start else 0), (ctx.request_id, start)
        pool[row, 0] = expected[end - 1]

    @precondition(lambda self: len(self.running) < 4)
    @rule(tokens=st.lists(st.integers(0, 2), min_size=2, max_size=2))
    def repeat_a_prompt(self, tokens):
        """A prompt of two whole pages served twice, each time in one step: the first
        leaves a checkpoint at its end, and the second resumes from it unless the pages
        or the checkpoint were evicted between (the coverage check counts the resumes;
        random chunks line this up only sometimes)."""
        prompt = [3] * (2 * self.m.page_size)
        for turn, token in enumerate(tokens):
            rid = f"repeat{getattr(self, 'claims', 0)}.{turn}"
            ctx = TextContext(np.array(prompt + [token] * turn), request_id=rid)
            self.m.claim(rid)
            try:
                self.m.fetch([ctx])
            except mokv.InsufficientPagesError:
                self.m.release(rid)
                return
            self.read_back_and_write(ctx)  # a resumed state must be the prompt's
            ctx.update(token)
            self.m.step([ctx])
            self.m.release(rid)

    def teardown(self):
        StateMachine.resumed_tokens += self.m.metrics.cache_tokens
        super().teardown()


class StateSessionMachine(StateMachine):
    """StateMachine's rules with sessions and pins on an injected clock: session turns
    (whole requests on a growing context, released, pinning their prefix or not), ends,
    and pauses past the time to live. Besides StateMachine's checks (a live state is the
    hash of exactly its cached tokens, however a hit resumed it), the checkpoint pool
    retains exactly each open session's last checkpoint boundary and pins exactly each
    live pin's (`window_tails.checkpoint_tail`)."""

    held_checkpoints = resumed = 0  # over every example: checkpoints kept, and resumed

    def options(self) -> dict:
        self.clock = Clock()
        self.context: dict[str, list] = {sid: [] for sid in SESSION_IDS}
        return dict(super().options(), sessions=mokv.SessionConfig(ttl_s=TTL_S, clock=self.clock),
                    pins=mokv.PinConfig(max_share=1.0, clock=self.clock))

    @precondition(lambda self: len(self.running) < 4)
    @rule(sid=st.sampled_from(SESSION_IDS), new=st.lists(st.integers(0, 2), min_size=1,
                                                         max_size=6), pin=st.booleans())
    def session_turn(self, sid, new, pin):
        context = self.context[sid]
        if len(context) + len(new) >= MAX_SEQ_LEN - 1:
            context = []  # a new conversation under the same session
        self.turns = getattr(self, "turns", 0) + 1
        ctx = TextContext(np.array(context + new), request_id=f"{sid}-t{self.turns}",
                          session_id=sid,
                          cache_control=mokv.CacheControl(pin_ttl_s=TTL_S) if pin else None)
        self.m.claim(ctx.request_id)
        try:
            self.m.fetch([ctx])
        except mokv.InsufficientPagesError:
            self.m.release(ctx.request_id)
            return
        self.read_back_and_write(ctx)
        ctx.update(0)
        self.m.step([ctx])
        self.m.release(ctx.request_id)
        self.context[sid] = ctx.tokens.tolist()

    @rule(sid=st.sampled_from(SESSION_IDS))
    def end_session(self, sid):
        self.m.end_session(sid)
        self.context[sid] = []

    @precondition(lambda self: len(self.running) < 4)
    @rule(seconds=st.sampled_from([1.0, TTL_S + 1]))
    def pause(self, seconds):
        """Time passes; a reservation then ends the sessions and pins past their time."""
        self.clock.now += seconds
        self.pauses = getattr(self, "pauses", 0) + 1
        ctx = TextContext(np.array([2, 1, 0, 2, 1]), request_id=f"pause{self.pauses}")
        self.m.claim(ctx.request_id)
        self.m.maybe_reserve(ctx)
        self.m.release(ctx.request_id)

    def stuck_pages(self) -> int:
        return self.m.replicas[0].pool.num_pinned  # no tier takes them: not room

    @invariant()
    def pages_add_up(self):
        held = {p for rid in self.running for p in self.m.get_req_blocks(rid)}
        assert self.m.num_free_blocks + len(held) + self.stuck_pages() == self.num_pages

    def teardown(self):
        StateSessionMachine.resumed += self.m.metrics.cache_tokens
        super().teardown()

    @invariant()
    def each_chain_holds_its_last_checkpoint(self):
        replica = self.m.replicas[0]
        pool = replica.states.pool
        retained = {h for sid in SESSION_IDS for h in checkpoint_tail(1, replica.sessions.retained(sid))}
        pinned = {h for pin in replica.pins.pins.values() for h in checkpoint_tail(1, pin.chain)}
        assert (pool.retained_hashes, pool.pinned_hashes) == (retained, pinned)
        StateSessionMachine.held_checkpoints += len(pool.indexed_hashes() & (retained | pinned))


class WideGroupMachine(GroupMachine):
    """GroupMachine's rules on groups of different page sizes in one shared budget: a
    sliding page (two heads) is twice a full one (one head), so a slot holds one sliding
    page or two full ones, 10 slots in all (a request of 24 tokens takes 9 in its
    step), and slots move between the groups (evicting the cached pages of the group
    they leave) as requests come, decode (`decode`: the full group grows, the window
    slides) and go. The values read back prove that no group's page is written through
    another's view of a slot. Between calls: each group's free pages and the pages its
    requests hold are the pages of its slots; every slot is free or one group's."""

    num_pages = 5
    moved_slots = 0  # over every example: a slot went from one group to the other

    def options(self) -> dict:
        return dict(groups=(mokv.CacheGroupConfig("sliding", 1, window_size=WINDOW),
                            mokv.CacheGroupConfig("full", 1, n_kv_heads=1)))

    @precondition(lambda self: self.running)
    @rule(data=st.data(), num_steps=st.integers(4, 16), token=st.integers(0, 2))
    def decode(self, data, num_steps, token):
        """One request decodes token by token: its full group's pages grow while its
        window's slide back, so the full group comes to need the sliding group's slots."""
        ctx = data.draw(st.sampled_from(sorted(self.running.values(), key=lambda c: c.request_id)))
        for _ in range(num_steps):
            if ctx.active_idx >= MAX_SEQ_LEN:
                return
            try:
                self.m.fetch([ctx])
            except mokv.InsufficientPagesError:
                return
            self.read_back_and_write(ctx)
            ctx.update(token)
            self.m.step([ctx])

    @invariant()
    def pages_add_up(self):
        replica = self.m.replicas[0]
        budget = replica.budget
        assert budget.ratios == [1, 2] and budget.num_slots == 10
        for g, group in enumerate(replica.groups):
            held = {p for rid in self.running
                    for p in self.m.get_req_blocks_per_group(rid)[group.name][1]}
            assert group.pool.num_free + len(held) == budget.present(g)
        assert len(budget.free_slots) + sum(budget.num_owned) == budget.num_slots
        budget.check_invariants()
        owners = getattr(self, "owners", budget.owner)
        WideGroupMachine.moved_slots += sum(0 <= a != b >= 0 for a, b in zip(owners, budget.owner))
        self.owners = list(budget.owner)


class ScaledWideGroupMachine(WideGroupMachine):
    """WideGroupMachine's rules on scaled FP8 pages (a float32 scale per 4 values): a
    slot holds its pages' scales beside their values (groups/budget.py), and the values
    read back are written to and read from each group's scales, so no group's scales
    are written through another's view of a slot's scales either."""

    def options(self) -> dict:
        fp8 = dict(dtype=DType.float8_e4m3fn, quantization=mokv.KVCacheQuantization(granularity=4))
        return super().options() | fp8

    @staticmethod
    def written(group):
        return group.scales[0].to_numpy()


PIN_TTL_S = (5.0, 30.0)


class PinMachine(SessionMachine):
    """The sessions' rules with pins (a budget of 4 of the 8 device pages, the host tier
    keeping what spills): turns that pin their prefix at release, sessions pinning
    their context, write policies, and time passing on the same clock. Besides the
    above:

    - every hash of a live pin is held by the device or the host tier (never lost);
    - pins hold at most the budget, and the pool pins exactly their hashes (checks);
    - the pages add up: free + owned + pinned pages that cannot spill = all;
    - a pin past its deadline is ended by the next reservation, one that does not fit
      included (an overdue pin's pages are room: hypothesis found a refusal that left
      it)."""

    totals_pins = mokv.CacheControlMetrics()

    def options(self) -> dict:
        options = super().options()
        return dict(options, pins=mokv.PinConfig(max_share=0.5, clock=self.clock))

    def teardown(self):
        PinMachine.totals_pins += self.m.metrics.cache_control
        super().teardown()

    @property
    def pins(self):
        return self.m.replicas[0].pins

    @precondition(lambda self: len(self.running) < 4)
    @rule(prompt=prompts, ttl=st.sampled_from(PIN_TTL_S),
          write=st.sampled_from(["all", "read_only", "prefix"]))
    def pinned_turn(self, prompt, ttl, write):
        """A whole request that pins its prefix at release, under a write policy."""
        self.pinned_turns = getattr(self, "pinned_turns", 0) + 1
        control = mokv.CacheControl(pin_ttl_s=ttl, write=write,
                                    write_limit_tokens=4 if write == "prefix" else None)
        ctx = TextContext(prompt, request_id=f"pin{self.pinned_turns}", cache_control=control)
        self.serve_whole(ctx)

    @precondition(lambda self: not self.running)
    @rule(prefix=st.sampled_from(SHARED_PREFIXES))
    def a_pin_lives_and_ends(self, prefix):
        """A turn asks to pin five pages of a shared prefix, one more than the budget
        (partial grant); a storm of fresh tokens wants six of the eight pages, so it fits
        only by spilling pinned pages to the host tier that holds them; then time passes
        the pin's deadline and the next reservation ends it. Random rules alone rarely
        line these up: runs without a spill, an expiry or a partial grant failed the
        coverage checks below."""
        ttl = PIN_TTL_S[0]
        self.pinned_turn(np.array((prefix + [0, 1, 2] * 5)[:20]), ttl=ttl, write="all")
        self.eviction_storm()
        self.pause(ttl + 1)

    @rule(sid=st.sampled_from(SESSION_IDS), ttl=st.sampled_from(PIN_TTL_S))
    def pin_session(self, sid, ttl):
        chain = self.table.retained(sid)
        grant = self.m.pin_session(sid, ttl)
        assert grant.requested_tokens == 4 * len(chain) >= grant.pinned_tokens

    @invariant()
    def live_pins_are_never_lost(self):
        replica = self.m.replicas[0]
        held = replica.pool.indexed_hashes() | self.host_hashes(replica)
        for pin in self.pins.pins.values():
            if pin.deadline > self.clock.now:
                assert set(pin.chain) <= held
        assert len(self.pins.pinned_hashes) <= self.pins.cap

    def stuck_pages(self) -> int:
        pool = self.m.replicas[0].pool
        return pool.num_pinned - len(pool._spillable(()))

    @invariant()
    def pages_add_up(self):
        held = {p for rid in self.running for p in self.m.get_req_blocks(rid)}
        assert self.m.num_free_blocks + len(held) + self.stuck_pages() == self.num_pages

    @precondition(lambda self: len(self.running) < 4)
    @rule(seconds=st.sampled_from([1.0, 5.0, TTL_S + 1]))
    def pause(self, seconds):
        due = [key for key, pin in self.pins.pins.items()
               if pin.deadline <= self.clock.now + seconds]
        super().pause(seconds)
        assert not set(due) & set(self.pins.pins)


SESSION = None


def run_machine(session, machine, max_examples: int) -> None:
    """Runs `machine`'s random operation sequences on `session`."""
    global SESSION
    SESSION = session
    run = machine.TestCase
    run.settings = settings(max_examples=max_examples, stateful_step_count=50, deadline=None)
    run().runTest()


def test_random_operations_keep_the_cache_consistent(session):
    run_machine(session, PagedManagerMachine, 120)


def test_random_operations_with_the_host_tier(session):
    run_machine(session, HostTierMachine, 100)
    assert HostTierMachine.host_tokens_loaded > 0


def test_random_operations_with_sessions(session):
    run_machine(session, SessionMachine, 100)
    totals = SessionMachine.totals
    assert SessionMachine.session_turns_hit > 0 and totals.turn_cache_tokens > 0
    assert min(totals.dropped, totals.expired, totals.ended, totals.evicted_pages) > 0, totals


def test_random_operations_on_a_cache_of_two_groups(session):
    run_machine(session, GroupMachine, 120)
    assert GroupMachine.hit_tokens > 0 and GroupMachine.slid_windows > 0


def test_random_operations_on_groups_with_host_tiers(session):
    run_machine(session, GroupHostMachine, 100)
    assert GroupHostMachine.group_tokens_loaded > 0


def test_random_operations_with_recurrent_state(session):
    run_machine(session, StateMachine, 80)
    assert StateMachine.resumed_tokens > 0


def test_random_operations_with_recurrent_state_sessions_and_pins(session):
    run_machine(session, StateSessionMachine, 30)
    assert StateSessionMachine.resumed > 0 and StateSessionMachine.held_checkpoints > 0


def test_random_operations_on_groups_sharing_one_budget(session):
    run_machine(session, WideGroupMachine, 120)
    assert WideGroupMachine.hit_tokens > 0 and WideGroupMachine.moved_slots > 0


def test_random_operations_on_scaled_fp8_groups_sharing_one_budget(session):
    moved = WideGroupMachine.moved_slots
    run_machine(session, ScaledWideGroupMachine, 60)
    assert ScaledWideGroupMachine.hit_tokens > 0 and WideGroupMachine.moved_slots > moved


def test_random_operations_with_pins(session):
    run_machine(session, PinMachine, 60)
    totals = PinMachine.totals_pins
    assert min(totals.granted, totals.expired, totals.refreshed, totals.withheld_pages) > 0, totals
    assert totals.spilled_pages > 0 and totals.partial > 0, totals
