"""Recurrent-state checkpoints in the shared tier (`groups/state_shared.py`) on a real
redis-server: a checkpoint taken by one manager is stored under its boundary's chain
hash and a key space naming the state's regions, and another manager's joint hit --
its attention pages loaded from the shared tier -- resumes from it, bit for bit, to
the outputs of a run from scratch (the numpy float64 linear-attention stack); only the
chosen checkpoint is fetched; the hit never passes the attention hit; a refused value,
a dead server or a fault at any inner call is a miss or the old state."""

from __future__ import annotations

import threading

import mokv
import numpy as np
import pytest
from max.dtype import DType
from mokv import StateRegion, TextContext
from mokv.remote import PageCodec, Rejection, StateLayout

from ..managers.faults import Faults, Injected
from ..managers.paged.test_state_group import (
    PAGE,
    SHARED,
    STACK,
    live_state,
    memory,
    prefill,
    reference,
)
from ..managers.paged.test_state_group import hybrid as state_hybrid
from ..managers.paged.test_state_group import skipped as skipped_tokens
from ..managers.paged.test_state_tiers import checkpoint_memory, until_it_runs
from .test_remote import fresh_namespace


def hybrid(session, url, namespace, checkpoints=8):
    tier = mokv.RemoteTierConfig(url=url, namespace=namespace)
    return state_hybrid(session, checkpoints=checkpoints, tiers=(tier,))


def flush(m) -> None:
    replica = m.replicas[0]
    for store in replica.group_tiers[0].named("remote").stores:
        assert store.flush(10)
    assert replica.states.shared.flush(10)


def checkpoint_keys(server, namespace) -> list[bytes]:
    return server.client().keys(f"mokv:v4:{namespace}:state.*")


def resume_from_shared(m, prompt, rid="B"):
    """Claims `rid` and fetches its first chunk; returns the context."""
    ctx = TextContext(np.array(prompt), rid)
    m.external_claim(rid)
    ctx.chunk(PAGE)
    m.fetch([ctx])
    return ctx


def assert_state_after(m, ctx, tokens) -> None:
    for ours, theirs in zip(live_state(m, ctx), reference(tokens)[1]):
        np.testing.assert_array_equal(ours, theirs)


def test_another_manager_resumes_from_the_shared_checkpoint_bit_for_bit(session, redis_server):
    """A's checkpoints at pages 1 and 2 go to the store beside its pages. B, a manager
    with nothing on its device, loads the two attention pages and the checkpoint at
    page 2 -- one GET of one value per shard -- and goes on to A's outputs."""
    ns = fresh_namespace()
    a = hybrid(session, redis_server.url, ns)
    prefill(a, "A", SHARED + [5, 5])
    flush(a)
    keys = checkpoint_keys(redis_server, ns)
    layout = a.replicas[0].states.shared.layouts[0]
    assert len(keys) == 2 and layout.fingerprint == (
        "state.p4.conv-l2-6x3-float64+ssm-l2-2x3x3-float64.tp0-1.xxh3"
    )
    b = hybrid(session, redis_server.url, ns)
    prompt = SHARED[:8] + [60, 61]
    ctx = resume_from_shared(b, prompt)
    assert ctx.start_idx == 8
    assert_state_after(b, ctx, prompt[:8])
    shared = b.replicas[0].states.shared
    value = PageCodec(layout, ns).value_nbytes
    assert (shared.metrics().lookups, shared.metrics().bytes_read) == (1, value)
    assert b.remote_metrics.hits == 2 + 1  # the attention pages, and the checkpoint
    b.release("B")
    _, out = prefill(b, "B2", prompt)
    assert skipped_tokens(out) == 8
    np.testing.assert_array_equal(np.array(out[8:]), reference(prompt)[0][8:])
    b.replicas[0].check_invariants()
    a.close()
    b.close()


@pytest.mark.parametrize("lose", ["attention_page", "checkpoint_value"])
def test_a_hit_resumes_no_further_than_the_pages_and_values_the_store_serves(
    session, redis_server, lose
):
    """With A's second attention page gone from the store, B's hit stops at page 1 and
    resumes from the checkpoint there, though page 2's stands; with that checkpoint's
    value corrupted, B's hit moves down to page 1's (two GETs, one refused)."""
    ns = fresh_namespace()
    a = hybrid(session, redis_server.url, ns)
    prefill(a, "A", SHARED + [5, 5])
    flush(a)
    second = a.replicas[0].committed_hashes("A")[1]
    client = redis_server.client()
    if lose == "attention_page":
        (key,) = client.keys(f"mokv:v4:{ns}:float32.*:{second:016x}")
    else:
        (key,) = client.keys(f"mokv:v4:{ns}:state.*:{second:016x}")
    client.set(key, b"not a value") if lose == "checkpoint_value" else client.delete(key)
    b = hybrid(session, redis_server.url, ns)
    prompt = SHARED[:8] + [60, 61]
    ctx = resume_from_shared(b, prompt)
    assert ctx.start_idx == 4
    assert_state_after(b, ctx, prompt[:4])
    metrics = b.replicas[0].states.shared.metrics()
    assert (metrics.lookups, metrics.hits) == ((1, 1) if lose == "attention_page" else (2, 1))
    assert metrics.rejected_corrupt == (lose == "checkpoint_value")
    b.replicas[0].check_invariants()
    a.close()
    b.close()


def test_a_checkpoint_the_device_evicted_comes_back_from_the_store_or_a_dead_one_misses(
    session, own_redis_server
):
    """One device slot: A's checkpoint at page 1 gives its slot to page 2's, and the
    store keeps it. B on the same manager (the attention page on the device) resumes
    from it at page 1; once the server is dead, C starts from zeros and still computes
    A's outputs: a miss, never an error."""
    ns = fresh_namespace()
    m = hybrid(session, own_redis_server.url, ns, checkpoints=1)
    prefill(m, "A", SHARED + [5, 5])
    flush(m)
    m.release("A")
    prompt = SHARED[:4] + [60, 61]
    ctx = resume_from_shared(m, prompt)
    assert ctx.start_idx == 4
    assert_state_after(m, ctx, prompt[:4])
    m.release("B")
    own_redis_server.kill()
    _, out = prefill(m, "C", prompt)
    assert skipped_tokens(out) == 0
    np.testing.assert_array_equal(np.array(out), reference(prompt)[0])
    assert m.replicas[0].states.shared.metrics().errors > 0
    m.replicas[0].check_invariants()
    m.close()


@pytest.mark.parametrize("mode", ["instead", "after"])
def test_a_fault_in_a_step_that_writes_a_checkpoint_through_leaves_the_old_state(
    session, redis_server, monkeypatch, mode
):
    """A fault at every inner call of the step that takes A's checkpoint at page 2 and
    queues it to the store (taking page 1's slot: one slot, so no free slot's bytes
    change): the state memory and the checkpoint index are as before; then the step
    runs, and another manager resumes from what it stored."""
    from mokv.managers.paged.groups.state import RecurrentStateGroup
    from mokv.managers.paged.groups.state_shared import SharedCheckpoints

    ns = fresh_namespace()
    a = hybrid(session, redis_server.url, ns, checkpoints=1)
    states = a.replicas[0].states
    calls = {
        SharedCheckpoints: ("store",),
        RecurrentStateGroup: ("_copy", "_host_copy"),
        states.pool.__class__: ("take", "commit_pages"),
    }
    faults = Faults(
        monkeypatch, [(owner, name) for owner, names in calls.items() for name in names]
    )
    ctx = TextContext(np.array(SHARED), "A")
    a.external_claim("A")
    for page in range(2):
        ctx.chunk(PAGE)
        a.fetch([ctx])
        (inputs,) = a.state_inputs([ctx])
        STACK.run(inputs.leaves, [ctx.tokens[ctx.start_idx : ctx.active_idx]])
        ctx.update(0)
        if not page:
            a.step([ctx])
            continue
        saved, indexed = memory(states), states.pool.indexed_hashes()

        def unchanged(saved=saved, indexed=indexed):
            assert states.pool.indexed_hashes() == indexed
            for ours, old in zip(memory(states), saved):
                np.testing.assert_array_equal(ours, old)

        failed = until_it_runs(faults, mode, lambda: a.step([ctx]), unchanged)
    assert failed >= 4 and len(states.pool.indexed_hashes()) == 1
    flush(a)
    b = hybrid(session, redis_server.url, ns)
    prompt = SHARED[:8] + [60, 61]
    ctx = resume_from_shared(b, prompt)
    assert ctx.start_idx == 8
    assert_state_after(b, ctx, prompt[:8])
    a.close()
    b.close()


@pytest.mark.parametrize("mode", ["instead", "after"])
def test_a_fault_in_a_resume_from_the_store_leaves_the_old_state(
    session, redis_server, monkeypatch, mode
):
    """A fault at every inner call of B's fetch that probes, loads and resumes from the
    store: B has not moved and the state memory is as before; then it resumes."""
    from mokv.managers.paged.groups.state import RecurrentStateGroup
    from mokv.managers.paged.groups.state_shared import SharedCheckpoints
    from mokv.remote import RemotePageStore

    ns = fresh_namespace()
    a = hybrid(session, redis_server.url, ns)
    prefill(a, "A", SHARED + [5, 5])
    flush(a)
    b = hybrid(session, redis_server.url, ns)
    states = b.replicas[0].states
    calls = {
        SharedCheckpoints: ("probe", "load"),
        RemotePageStore: ("get",),
        RecurrentStateGroup: ("_restore", "_copy"),
    }
    faults = Faults(
        monkeypatch, [(owner, name) for owner, names in calls.items() for name in names]
    )
    prompt = SHARED[:8] + [60, 61]
    ctx = TextContext(np.array(prompt), "B")
    b.external_claim("B")
    ctx.chunk(PAGE)  # the chunk stays as it is when a fetch fails
    saved = [ctx.start_idx, *checkpoint_memory(states)]

    def untouched():
        now = [ctx.start_idx, *checkpoint_memory(states)]
        assert now[0] == saved[0]
        for ours, old in zip(now[1:], saved[1:]):
            np.testing.assert_array_equal(ours, old)

    failed = until_it_runs(faults, mode, lambda: b.fetch([ctx]), untouched)
    assert failed >= 4 and ctx.start_idx == 8
    assert_state_after(b, ctx, prompt[:8])
    b.replicas[0].check_invariants()
    a.close()
    b.close()


def test_caches_of_other_state_layouts_share_no_keys():
    """The key space names every region's id, layers, row shape and dtype: a value of
    one layout copied under another's key is refused."""
    conv = StateRegion("conv", 2, (6, 3), DType.float32)
    ssm = StateRegion("ssm", 2, (2, 3, 3), DType.float32)
    layouts = [
        StateLayout((conv, ssm), 4),
        StateLayout((conv, StateRegion("ssm", 2, (2, 3, 3), DType.bfloat16)), 4),
        StateLayout((conv, StateRegion("ssm", 2, (3, 3, 3), DType.float32)), 4),
        StateLayout((conv, StateRegion("ssm", 3, (2, 3, 3), DType.float32)), 4),
        StateLayout((conv, StateRegion("rec", 2, (2, 3, 3), DType.float32)), 4),
        StateLayout((conv,), 4),
        StateLayout((conv, ssm), 8),
        StateLayout((conv, ssm), 4, tp_rank=1, tp_degree=2),
    ]
    prefixes = {layout.key_prefix("m") for layout in layouts}
    assert len(prefixes) == len(layouts)
    tokens = np.arange(4, dtype=np.int64).tobytes()
    ours = PageCodec(layouts[0], "m")
    state = (np.arange(layouts[0].page_nbytes) % 251).astype(np.uint8)
    value = ours.encode(9, tokens, state)
    assert bytes(ours.decode(value, 9, tokens)) == state.tobytes()
    assert PageCodec(layouts[2], "m").decode(value, 9, tokens) is Rejection.LAYOUT
    assert PageCodec(layouts[4], "m").decode(value, 9, tokens) is Rejection.KEYSPACE


def prefill_two_shards(m, rid, prompt):
    """`prefill` on a replica of two devices: the stack runs on shard 0's state, and
    shard 1's state is kept at twice it (another shard's heads), before each step."""
    ctx = TextContext(np.array(prompt), rid)
    m.external_claim(rid)
    while ctx.start_idx < len(prompt):
        ctx.chunk(PAGE)
        m.fetch([ctx])
        ours, other = m.state_inputs([ctx])
        STACK.run(ours.leaves, [ctx.tokens[ctx.start_idx : ctx.active_idx]])
        for leaf, twin in zip(ours.leaves, other.leaves):
            rows = leaf.live_row_ids.to_numpy()[:, 0]
            twin.pool.to_numpy()[rows] = 2 * leaf.pool.to_numpy()[rows]
        ctx.update(0)
        m.step([ctx])
    return ctx


def test_each_device_shard_stores_and_loads_its_own_state(session, redis_server):
    """Two devices (tensor parallel): a checkpoint is one value per shard, under each
    shard's key space, and a resume restores both, each bit for bit."""
    ns = fresh_namespace()
    tier = mokv.RemoteTierConfig(url=redis_server.url, namespace=ns)
    a = state_hybrid(session, n_devices=2, n_kv_heads=2, tiers=(tier,))
    prefill_two_shards(a, "A", SHARED + [5, 5])
    flush(a)
    keys = checkpoint_keys(redis_server, ns)
    assert sorted(key.decode().split(":")[3].split(".")[-2] for key in keys) == [
        "tp0-2",
        "tp0-2",
        "tp1-2",
        "tp1-2",
    ]
    b = state_hybrid(session, n_devices=2, n_kv_heads=2, tiers=(tier,))
    prompt = SHARED[:8] + [60, 61]
    ctx = resume_from_shared(b, prompt)
    assert ctx.start_idx == 8
    expected = reference(prompt[:8])[1]
    for shard, scale in enumerate((1, 2)):
        for leaf, theirs in zip(b.state_inputs([ctx])[shard].leaves, expected):
            rows = leaf.live_row_ids.to_numpy()[:, 0]
            np.testing.assert_array_equal(leaf.pool.to_numpy()[rows], scale * theirs)
    a.close()
    b.close()


def test_a_replica_that_fails_after_opening_its_stores_closes_them(
    session, redis_server, monkeypatch
):
    """A fault at each call that builds a replica's parts after its shared checkpoint
    stores opened (each runs a writer thread) -- its tiers, which open the page stores,
    the join of its groups, the last one: the constructor raises, and no thread it started
    outlives it; then a constructor without a fault builds."""
    from mokv.managers.paged.groups import JointGroups
    from mokv.tiers.stack import TierStack

    ns = fresh_namespace()
    hybrid(session, redis_server.url, ns).close()  # threads started once per process
    before = set(threading.enumerate())
    faults = Faults(monkeypatch, [(TierStack, "__init__"), (JointGroups, "__init__")])
    failed = 0
    while True:
        faults.arm(failed + 1)
        try:
            m = hybrid(session, redis_server.url, ns)
        except Injected:
            failed += 1
            assert set(threading.enumerate()) <= before, f"threads left after fault {failed}"
            continue
        break
    # the group's tiers, the join, the checkpoints' (empty) stack that pins would hold
    assert failed == 3 and faults.calls == 3
    assert len(set(threading.enumerate()) - before) == 2  # a checkpoint and a page store
    m.close()
    assert set(threading.enumerate()) <= before
