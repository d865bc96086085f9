"""The chain memo changes no answer: random scheduler-like operations on two paged
managers, one with the memo and one without (capacity 0), must give the same results,
the same pages and the same windows at every step.

The operations are the ones the memo serves: prompts retried until they fit (claimed,
tried and released every time, for one step or two; refused again without a plan,
`PrefixChains.refused_again`), waiting prompts whose tokens or window change between
tries, request ids reused with other tokens or another salt, prefixes shared, pages
committed, freed and evicted under a tight budget, preemptions and resets of the prefix
cache."""

import mokv
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from mokv import TextContext
from mokv.managers.paged.chain_memo import ChainMemo
from mokv.managers.paged.prefix import PrefixChains

from ..conftest import make_paged

MAX_SEQ_LEN = 28
PREFIXES = [[], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9, 9]]
IDS = ["a", "b", "c", "d", "e"]

prompts = st.builds(
    lambda prefix, suffix: prefix + suffix,
    st.sampled_from(PREFIXES),
    st.lists(st.integers(0, 3), min_size=1, max_size=14),
)


def tables(inputs):
    """What `fetch` handed the graph, as lists."""
    return [[t.to_numpy().tolist() for t in device[1:]] for device in inputs]


class TwinMachine(RuleBasedStateMachine):
    session = None  # set by the test

    def __init__(self):
        super().__init__()
        self.twins = [make_paged(self.session, num_pages=9, max_batch_size=4,
                                 max_seq_len=MAX_SEQ_LEN) for _ in range(2)]
        for replica in self.twins[1].replicas:
            replica.chains.memo = ChainMemo(0)
        self.running: dict[str, list[TextContext]] = {}  # id -> the twins' contexts
        self.waiting: dict[str, list[TextContext]] = {}

    def both(self, call):
        """`call(manager, ctx-index)` on both twins: the same result or the same error."""
        out = []
        for i, m in enumerate(self.twins):
            try:
                out.append(("ok", call(m, i)))
            except mokv.MokvError as e:
                out.append((type(e).__name__, None))
        assert out[0] == out[1]
        return out[0]

    def admit(self, rid, contexts, num_steps=1):
        """The scheduler's admission: claim, try, release when it does not fit."""
        self.both(lambda m, i: m.external_claim(rid))
        kind, fits = self.both(lambda m, i: m.maybe_reserve(contexts[i], num_steps))
        if kind == "ok" and fits:
            self.running[rid] = contexts
        else:
            self.both(lambda m, i: m.release(rid))
            self.waiting[rid] = contexts

    @precondition(lambda self: len(self.running) < 4)
    @rule(rid=st.sampled_from(IDS), prompt=prompts, salt=st.sampled_from([None, "t"]))
    def new_request(self, rid, prompt, salt):
        if rid in self.running:
            return
        self.waiting.pop(rid, None)
        self.admit(rid, [TextContext(prompt, request_id=rid, cache_salt=salt) for _ in self.twins])

    @precondition(lambda self: self.waiting and len(self.running) < 4)
    @rule(data=st.data(), num_steps=st.sampled_from([1, 1, 1, 2]))
    def retry(self, data, num_steps):
        rid = data.draw(st.sampled_from(sorted(self.waiting)))
        self.admit(rid, self.waiting.pop(rid), num_steps)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), token=st.integers(0, 9), chunk=st.integers(0, 9))
    def edit_waiting(self, data, token, chunk):
        """A waiting prompt's token changed in place, or its window chunked (0: neither,
        and the token is written over itself)."""
        contexts = self.waiting[data.draw(st.sampled_from(sorted(self.waiting)))]
        position = data.draw(st.integers(0, contexts[0].end_idx - 1))
        for ctx in contexts:
            if chunk:
                ctx.chunk(chunk)
            else:
                ctx.tokens[position] = token

    @precondition(lambda self: self.running)
    @rule(data=st.data(), chunk=st.integers(1, 9), token=st.integers(0, 3))
    def run_step(self, data, chunk, token):
        ids = data.draw(st.sets(st.sampled_from(sorted(self.running)), min_size=1))
        batch = [rid for rid in sorted(ids) if self.running[rid][0].active_idx < MAX_SEQ_LEN]
        if data.draw(st.booleans()):
            for rid in batch:
                for ctx in self.running[rid]:
                    ctx.chunk(chunk)
        kind, _ = self.both(lambda m, i: tables(m.fetch([self.running[r][i] for r in batch])))
        if kind != "ok":
            return
        for rid in batch:
            for ctx in self.running[rid]:
                ctx.update(token)
        self.both(lambda m, i: m.step([self.running[r][i] for r in batch]))

    @precondition(lambda self: self.running)
    @rule(data=st.data(), preempt=st.booleans())
    def release(self, data, preempt):
        rid = data.draw(st.sampled_from(sorted(self.running)))
        contexts = self.running.pop(rid)
        self.both(lambda m, i: m.release(rid))
        if preempt:
            for ctx in contexts:
                ctx.reset()
            self.waiting[rid] = contexts

    @rule()
    def reset_prefix_cache(self):
        self.both(lambda m, i: m.reset_prefix_cache())

    @invariant()
    def twins_agree(self):
        a, b = self.twins
        assert a.num_free_blocks == b.num_free_blocks
        for rid, (x, y) in self.running.items():
            assert a.get_req_blocks(rid) == b.get_req_blocks(rid)
            assert a.replicas[0].committed_hashes(rid) == b.replicas[0].committed_hashes(rid)
            assert (x.start_idx, x.active_idx, x.end_idx) == (y.start_idx, y.active_idx, y.end_idx)
        pa, pb = a.replicas[0].pool, b.replicas[0].pool
        assert [pa.page_hash(p) for p in range(9)] == [pb.page_hash(p) for p in range(9)]

    def teardown(self):
        for m in self.twins:
            m.check_invariants()


def test_the_memo_changes_no_answer(session, monkeypatch):
    refused_again = PrefixChains.refused_again
    answers = []  # whether refused_again refused, to know that it was put to the test

    def counted(self, ctx, req, num_steps):
        refused = refused_again(self, ctx, req, num_steps)
        answers.append(refused is not None)
        return refused

    monkeypatch.setattr(PrefixChains, "refused_again", counted)
    TwinMachine.session = session
    TwinMachine.TestCase.settings = settings(
        max_examples=150, stateful_step_count=60, deadline=None
    )
    TwinMachine.TestCase().runTest()
    assert answers.count(True) > 10 and answers.count(False) > 10
