"""All-or-nothing calls of the continuous managers: both flows over the shared slots
(requests by context, MAX's sequence ids), with an exception raised instead of, and
right after, every inner call of every call in turn."""

from __future__ import annotations

import mokv
import pytest
from max.driver import CPU
from mokv import TextContext

from .conftest import NUM_LAYERS, small_params
from .faults import MODES, Faults, Injected


class World:
    """Three slots; a request A (then B) and MAX's sequence ids beside it."""

    def __init__(self, session):
        self.cont = mokv.ContinuousBatchingKVCacheManager(
            small_params(cache_strategy="continuous"), 3, 16, NUM_LAYERS, [CPU()], session)
        self.requests = self.cont.requests
        self.A = TextContext([1, 2, 3], "A")
        self.B = TextContext([4, 5], "B")
        self.seqs: list[int] = []

    def state(self) -> tuple:
        requests = tuple(
            tuple(self.requests.get_req_blocks(c.request_id))
            if self.requests.contains(c.request_id) else None
            for c in (self.A, self.B)
        )
        return (self.requests.free_slots(), requests, dict(self.cont.cache_lengths),
                tuple(self.seqs), self.requests.metrics.input_tokens)


def _claim(w: World, n: int) -> None:
    w.seqs = w.seqs + w.cont.claim(n)


def _release(w: World, seq_id: int) -> None:
    w.cont.release(seq_id)
    w.seqs = [s for s in w.seqs if s != seq_id]


SCENARIO = [
    lambda w: w.requests.external_claim(w.A.request_id),
    lambda w: _claim(w, 2),
    lambda w: w.requests.maybe_reserve(w.A),
    lambda w: w.requests.fetch([w.A]),
    lambda w: w.cont.step({w.seqs[0]: 3}),
    lambda w: w.cont.fetch(w.seqs),
    lambda w: w.requests.step([w.A]),
    lambda w: _release(w, w.seqs[0]),
    lambda w: w.requests.release(w.A.request_id),
    lambda w: w.requests.external_claim(w.B.request_id),
    lambda w: _claim(w, 1),
    lambda w: w.requests.fetch([w.B]),
    lambda w: _release(w, w.seqs[-1]),
    lambda w: w.requests.release(w.B.request_id),
]

TARGETS = [(mokv.ContinuousKVCacheManager, name)
           for name in ("take_slots", "give_back_slots", "slot_inputs", "free_slots")]


def test_scenario_runs_clean(session):
    w = World(session)
    for call in SCENARIO:
        call(w)
    assert w.state() == ({0, 1}, (None, None), {2: 0}, (2,), 5)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", range(len(SCENARIO)))
def test_an_exception_anywhere_leaves_old_or_new_state(session, monkeypatch, op, mode):
    clean = World(session)
    for call in SCENARIO[: op + 1]:
        call(clean)
    new_state = clean.state()
    faults = Faults(monkeypatch, TARGETS)
    num_faults = 0
    for fault_at in range(1, 20):
        faults.disarm()
        w = World(session)
        for call in SCENARIO[:op]:
            call(w)
        old_state = w.state()
        faults.arm(fault_at, mode)
        try:
            SCENARIO[op](w)
        except Injected:
            num_faults += 1
            faults.disarm()
            state = w.state()
            assert state in (old_state, new_state), f"op {op}, fault {mode} call {fault_at}"
            if state == old_state:
                SCENARIO[op](w)  # the retry succeeds
            assert w.state() == new_state
            for call in SCENARIO[op + 1:]:
                call(w)
            assert w.state() == ({0, 1}, (None, None), {2: 0}, (2,), 5)  # no slot lost
        else:
            num_calls = faults.calls
            faults.disarm()
            assert w.state() == new_state
            break
    assert num_faults == num_calls
