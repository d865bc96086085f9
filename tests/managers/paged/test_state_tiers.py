"""Recurrent-state checkpoints in the host tier (`groups/state_host.py`): a checkpoint
evicted from its device slot is kept there, bit for bit, and a joint hit -- its
attention pages on the device or loaded from the host tier -- resumes from it to the
outputs and state of a run from scratch (the numpy float64 linear-attention stack);
the hit never passes the checkpoint; a fault at any inner call of the resume or of the
eviction leaves the old state."""

from __future__ import annotations

import mokv
import numpy as np
import pytest
from mokv import CacheGroupConfig, RecurrentStateConfig, TextContext
from mokv.managers.paged.group_tiers import host_checkpoint_capacity, host_shares

from ..conftest import NUM_LAYERS, make_paged, small_params
from ..faults import Faults, Injected
from .test_state_group import PAGE, SHARED, STACK, live_state, memory, prefill, reference, skipped

HOST_GB = 2**16 / 2**30


def hybrid(session, every=1, checkpoints=1, num_pages=24, max_seq_len=64, tiers=None):
    """One device checkpoint slot (the second one taken evicts the first to the host)."""
    state = RecurrentStateConfig(
        "linear_attention", STACK.regions(), checkpoint_every=every, num_checkpoints=checkpoints
    )
    return make_paged(
        session,
        num_pages=num_pages,
        max_seq_len=max_seq_len,
        groups=(CacheGroupConfig("full_attention", NUM_LAYERS),),
        recurrent=state,
        tiers=(mokv.HostTierConfig(HOST_GB),) if tiers is None else tiers,
    )


def checkpoint_memory(states):
    """A copy of the checkpoint blocks of the state group (past the live blocks)."""
    return [
        block[states.max_requests * region.num_layers :]
        for block, region in zip(memory(states), states.config.regions)
    ]


def until_it_runs(faults, mode, call, check) -> int:
    """Runs `call` with a fault at its first inner call, then its second, ..., `check`ing
    the state after each failure, until it runs through; returns the failures."""
    for fault_at in range(1, 10):
        faults.arm(fault_at, mode)
        try:
            call()
        except Injected:
            check()
            continue
        finally:
            faults.disarm()
        return fault_at - 1
    raise AssertionError("a fault at each of 9 inner calls")


def test_an_evicted_checkpoint_resumes_from_the_host_bit_for_bit(session):
    """A's checkpoints at pages 1 and 2 share one device slot: the one at page 1 goes to
    the host. B, sharing A's first page only, resumes there from the host's copy: its
    state after the hit is the state of A's first page, and its outputs are those from
    scratch."""
    m = hybrid(session)
    states = m.replicas[0].states
    prefill(m, "A", SHARED + [5, 5])
    assert states.checkpoints_taken == 2 and len(states.host) == 1
    m.release("A")
    prompt = SHARED[:4] + [60, 61]
    ctx = TextContext(np.array(prompt), "B")
    m.external_claim("B")
    ctx.chunk(PAGE)
    m.fetch([ctx])
    assert ctx.start_idx == 4  # resumed from the host at page 1
    for ours, theirs in zip(live_state(m, ctx), reference(prompt[:4])[1]):
        np.testing.assert_array_equal(ours, theirs)
    m.release("B")
    _, out = prefill(m, "B2", prompt)
    assert skipped(out) == 4
    np.testing.assert_array_equal(np.array(out[4:]), reference(prompt)[0][4:])
    m.replicas[0].check_invariants()


def test_attention_pages_from_the_host_tier_resume_from_a_host_checkpoint(session):
    """Checkpoints every 2 pages, six device pages: C's prompt evicts A's attention pages
    (kept by the host tier) and its checkpoints take A's slot (A's goes to the host). B,
    with A's three pages, finds all three in the host tier only and resumes at page 2
    from the host's checkpoint: never past it, though the tier has page 3."""
    m = hybrid(session, every=2, num_pages=6, max_seq_len=24)
    replica = m.replicas[0]
    prompt = SHARED + [5, 5, 5, 1, 2]
    prefill(m, "A", prompt[:13])  # checkpoint at page 2 only
    m.release("A")
    prefill(m, "C", [30 + i for i in range(21)])  # checkpoints at pages 2 and 4
    m.release("C")
    assert len(replica.states.host) == 2  # A's and C's page 2
    ctx = TextContext(np.array(prompt), "B")
    m.external_claim("B")
    ctx.chunk(PAGE)
    req = replica._request("B")
    chain, _ = replica.chains.pages(ctx, req, 3)
    (host_tier,) = replica.group_tiers[0]
    assert len(host_tier.lookup(iter(chain))) == 3  # the attention pages reach page 3
    assert replica.joint.hit_pages(ctx, req) == (0, 2)  # the state's, page 2
    m.release("B")
    _, out = prefill(m, "B", prompt)
    assert skipped(out) == 8
    np.testing.assert_array_equal(np.array(out[8:]), reference(prompt)[0][8:])
    replica.check_invariants()


def test_the_host_tier_splits_its_memory_with_the_checkpoints():
    """The host tier's memory goes to pages and checkpoints in proportion to what each
    keeps per page of prefix; without a host tier no checkpoint is kept there."""
    state = RecurrentStateConfig("s", STACK.regions(), checkpoint_every=2, num_checkpoints=4)
    groups = (CacheGroupConfig("full_attention", NUM_LAYERS),)
    params = small_params(groups=groups, recurrent=state, tiers=(mokv.HostTierConfig(HOST_GB),))
    page = params.bytes_per_page(NUM_LAYERS)
    per_page = state.bytes_per_state / 2
    (pages,), checkpoints = host_shares(params, NUM_LAYERS)
    assert (pages, checkpoints) == (page / (page + per_page), per_page / (page + per_page))
    assert host_checkpoint_capacity(params, NUM_LAYERS) == int(
        2**16 * checkpoints // state.bytes_per_state
    )
    bare = small_params(groups=groups, recurrent=state)
    assert host_checkpoint_capacity(bare, NUM_LAYERS) == 0
    shared = small_params(  # the shared tier keeps checkpoints too (tests/tiers/)
        groups=groups, recurrent=state, tiers=(mokv.RemoteTierConfig("redis://127.0.0.1:1", "m"),)
    )
    assert host_checkpoint_capacity(shared, NUM_LAYERS) == 0


@pytest.mark.parametrize("mode", ["instead", "after"])
def test_a_fault_in_an_eviction_to_the_host_or_a_resume_from_it_leaves_the_old_state(
    session, monkeypatch, mode
):
    """A fault at every inner call of the step that evicts A's first checkpoint to the
    host, then of B's fetch that resumes from it: the device states, the host's
    checkpoints and the start of B are as before each failed call; then both go on to
    the outputs from scratch."""
    from mokv.managers.paged.groups.state import RecurrentStateGroup
    from mokv.managers.paged.groups.state_host import HostCheckpoints

    m = hybrid(session)
    states = m.replicas[0].states
    faults = Faults(
        monkeypatch,
        [
            (RecurrentStateGroup, "_copy"),
            (RecurrentStateGroup, "_host_copy"),
            (HostCheckpoints, "store"),
            (HostCheckpoints, "touch"),
            (states.pool.__class__, "take"),
        ],
    )
    ctx = TextContext(np.array(SHARED[:8] + [5]), "A")
    m.external_claim("A")
    for page in range(2):  # the checkpoint of page 2 evicts page 1's
        ctx.chunk(PAGE)
        m.fetch([ctx])
        (inputs,) = m.state_inputs([ctx])
        STACK.run(inputs.leaves, [ctx.tokens[ctx.start_idx : ctx.active_idx]])
        ctx.update(0)
        if not page:  # a free slot's bytes are no state to keep
            m.step([ctx])
            continue
        saved, hosted = memory(states), list(states.host._lru)

        def unchanged(saved=saved, hosted=hosted):
            assert list(states.host._lru) == hosted
            for ours, old in zip(memory(states), saved):
                np.testing.assert_array_equal(ours, old)

        failed = until_it_runs(faults, mode, lambda: m.step([ctx]), unchanged)
    assert failed >= 3 and len(states.host) == 1
    m.release("A")
    prompt = SHARED[:4] + [60, 61]
    ctx = TextContext(np.array(prompt), "B")
    m.external_claim("B")
    saved = checkpoint_memory(states)  # a fresh request's live block holds nothing yet

    def fetch():
        ctx.chunk(PAGE)
        m.fetch([ctx])

    def untouched():
        assert ctx.start_idx == 0 and len(states.host) == 1
        for ours, old in zip(checkpoint_memory(states), saved):
            np.testing.assert_array_equal(ours, old)

    failed = until_it_runs(faults, mode, fetch, untouched)
    assert failed >= 1 and ctx.start_idx == 4
    for ours, theirs in zip(live_state(m, ctx), reference(prompt[:4])[1]):
        np.testing.assert_array_equal(ours, theirs)
    m.replicas[0].check_invariants()


@pytest.mark.parametrize("tiers", [(), (mokv.HostTierConfig(HOST_GB),)], ids=["none", "host"])
def test_a_checkpoint_leaves_its_slot_with_its_boundary_page(session, tiers):
    """Six device pages, eight checkpoint slots: C's prompt evicts A's pages, and A's
    checkpoints leave their slots with them (their own LRU would keep them: C's six
    fill the rest), dropped, or kept by the host tier when there is one."""
    m = hybrid(session, checkpoints=8, num_pages=6, max_seq_len=24, tiers=tiers)
    states = m.replicas[0].states
    prefill(m, "A", SHARED + [5])
    m.release("A")
    of_a = states.pool.indexed_hashes()
    assert len(of_a) == 2
    prefill(m, "C", [30 + i for i in range(24)])
    assert not of_a & states.pool.indexed_hashes()
    assert states.pool.num_blank == 8 - len(states.pool.indexed_hashes())  # theirs freed
    if tiers:
        assert of_a <= set(states.host._lru)
    m.replicas[0].check_invariants()


@pytest.mark.parametrize("mode", ["instead", "after"])
def test_a_fault_as_a_checkpoint_leaves_with_its_page_leaves_the_old_state(
    session, monkeypatch, mode
):
    """A fault at every inner call of C's fetch that evicts A's first page: A's
    checkpoint there stays in its slot and out of the host tier."""
    from mokv.cache.page_pool import PagePool
    from mokv.managers.paged.groups.state import RecurrentStateGroup
    from mokv.managers.paged.groups.state_host import HostCheckpoints

    m = hybrid(session, checkpoints=8, num_pages=6, max_seq_len=24)
    replica = m.replicas[0]
    states = replica.states
    prefill(m, "A", SHARED + [5])
    m.release("A")
    faults = Faults(
        monkeypatch,
        [
            (RecurrentStateGroup, "_host_copy"),
            (HostCheckpoints, "store"),
            (PagePool, "drop"),
            (PagePool, "take"),
        ],
    )
    ctx = TextContext(np.array([30 + i for i in range(24)]), "C")
    m.external_claim("C")
    failed = 0
    while ctx.start_idx < 24:  # each fetch with faults: those that evict A's pages fail
        indexed, hosted = states.pool.indexed_hashes(), list(states.host._lru)

        def fetch():
            ctx.chunk(PAGE)
            m.fetch([ctx])

        def unchanged(indexed=indexed, hosted=hosted):
            assert states.pool.indexed_hashes() == indexed
            assert list(states.host._lru) == hosted

        failed += until_it_runs(faults, mode, fetch, unchanged)
        ctx.update(0)
        m.step([ctx])
    assert failed >= 2 * 4  # A's two checkpoints: take, copy, store, drop
    assert len(states.host) == 2
    replica.check_invariants()
