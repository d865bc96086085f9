"""Sessions and pins on a cache with recurrent-state layers: a session's retained chain,
or a pinned prefix, also keeps the checkpoint at its last boundary, so a next turn
resumes there after other traffic took every other checkpoint slot, to the outputs of
a run from scratch (the numpy float64 linear-attention stack); ending the session, or
the pin's expiry, lets it go."""

from __future__ import annotations

import numpy as np
import pytest
from mokv import (
    CacheControl,
    CacheGroupConfig,
    PinConfig,
    RecurrentStateConfig,
    SessionConfig,
)

from ..conftest import NUM_LAYERS, make_paged
from .test_sessions import Clock
from .test_state_group import SHARED, STACK, prefill, reference, skipped
from .test_state_group import hybrid as state_hybrid

AGENT = SHARED[:8]  # two pages: checkpoints at pages 1 and 2
NEXT = AGENT + [5, 60, 61]


def hybrid(session, **features):
    return state_hybrid(session, every=2, checkpoints=2, num_pages=32, **features)


def turn(m, rid, prompt, **fields):
    """One request run in chunks of a page through the stack, then released; returns
    every output it computed, by position (None where a prefix hit skipped it)."""
    _, outputs = prefill(m, rid, prompt, **fields)
    m.release(rid)
    return outputs


def traffic(m, first):
    """Two requests of other tokens, each leaving a checkpoint at page 2: together they
    take both checkpoint slots from anything not held."""
    for i in range(2):
        turn(m, f"x{first + i}", [40 + first + i] * 9)


@pytest.mark.parametrize("held", ["session", "pin", "neither"])
def test_a_session_or_a_pin_keeps_the_checkpoint_at_its_end(session, held):
    clock = Clock()
    if held == "session":
        m = hybrid(session, sessions=SessionConfig(ttl_s=60, clock=clock))
        first = turn(m, "A", AGENT, session_id="agent")
    elif held == "pin":
        m = hybrid(session, pins=PinConfig(clock=clock))
        first = turn(m, "A", AGENT, cache_control=CacheControl(pin_ttl_s=60))
    else:
        m = hybrid(session)
        first = turn(m, "A", AGENT)
    np.testing.assert_array_equal(np.array(first), reference(AGENT)[0])
    states = m.replicas[0].states
    (h2,) = states.pool.indexed_hashes()  # every 2 pages: page 2's only
    holding = states.pool.retained_hashes if held == "session" else states.pool.pinned_hashes
    assert holding == ({h2} if held != "neither" else frozenset())
    traffic(m, 0)
    m.check_invariants()
    assert (h2 in states.pool.indexed_hashes()) == (held != "neither")
    out = turn(m, "B", NEXT, session_id="agent" if held == "session" else None)
    assert skipped(out) == (8 if held != "neither" else 0)
    np.testing.assert_array_equal(np.array(out[skipped(out) :]), reference(NEXT)[0][skipped(out) :])
    if held == "neither":
        return
    # The session's next turn retains its longer chain (no boundary past page 2: the same
    # checkpoint); then the session ends, or the pin expires, and traffic takes it.
    if held == "session":
        assert states.pool.retained_hashes == {h2}
        m.end_session("agent")
        assert states.pool.retained_hashes == frozenset()
    else:
        clock.now = 61.0
        traffic(m, 10)  # its reservations end the pin first
        assert states.pool.pinned_hashes == frozenset()
    traffic(m, 20)
    assert h2 not in states.pool.indexed_hashes()
    m.check_invariants()


def test_a_session_expiry_lets_its_checkpoint_go(session):
    clock = Clock()
    m = hybrid(session, sessions=SessionConfig(ttl_s=60, clock=clock))
    turn(m, "A", AGENT, session_id="agent")
    states = m.replicas[0].states
    (h2,) = states.pool.retained_hashes
    clock.now = 61.0
    traffic(m, 0)  # its first reservation ends the session
    assert states.pool.retained_hashes == frozenset()
    assert h2 not in states.pool.indexed_hashes()
    m.check_invariants()


def test_a_pin_beside_groups_of_a_shared_budget_holds_its_checkpoint(session):
    """The checkpoint pool is outside the budget the attention groups share (its slots
    are its own), so the pins' budget there is `max_share` of all its slots: of 2
    checkpoints, 1 at the default share of a half. Divided by the 2 groups sharing the
    budget it would be none, and the pin refused."""
    state = RecurrentStateConfig(
        "linear_attention", STACK.regions(), checkpoint_every=2, num_checkpoints=2
    )
    groups = (
        CacheGroupConfig("sliding", 1, window_size=8),
        CacheGroupConfig("full", NUM_LAYERS - 1),
    )
    m = make_paged(
        session,
        num_pages=32,
        max_seq_len=64,
        groups=groups,
        recurrent=state,
        pins=PinConfig(clock=Clock()),
    )
    replica = m.replicas[0]
    assert replica.budget is not None and replica.pins is not None
    first = turn(m, "A", AGENT, cache_control=CacheControl(pin_ttl_s=60))
    np.testing.assert_array_equal(np.array(first), reference(AGENT)[0])
    states = replica.states
    (h2,) = states.pool.indexed_hashes()  # every 2 pages: page 2's only
    assert states.pool.pinned_hashes == {h2}
    assert replica.pins.group_cap(states.pool) == 1
    # the groups' pools are views of one budget: half of it each, then the share
    assert all(
        replica.pins.group_cap(g.pool) == int(0.5 * (g.pool.num_pages // 2)) for g in replica.groups
    )
    m.check_invariants()
