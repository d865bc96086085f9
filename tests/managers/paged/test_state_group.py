"""Recurrent-state layers beside a full-attention group (`KVCacheParams.recurrent`):
exact states through checkpoints, against a numpy float64 linear-attention stack run
from each request's first token (`mokv_graphs.linear_attention`), the joint hit never
past a checkpoint, checkpoint eviction, all-or-nothing calls, MAX's input types, and
what a cache with state layers refuses."""

from __future__ import annotations

import mokv
import numpy as np
import pytest
from max.dtype import DType
from max.graph import DeviceRef
from max.nn.kv_cache import RecurrentStateParams, RecurrentStateRegion
from mokv import CacheGroupConfig, RecurrentStateConfig, StateRegion, TextContext
from mokv_graphs.linear_attention import LinearAttentionStack

from ..conftest import NUM_LAYERS, make_paged, small_params
from ..faults import Faults, Injected

PAGE = 4
STACK = LinearAttentionStack(vocab_size=64, num_layers=2, heads=2, head_dim=3, seed=5)
SHARED = [7, 3, 9, 1, 4, 4, 8, 2, 6]  # two pages and a token


def hybrid(session, every=1, checkpoints=8, num_pages=24, **features):
    state = RecurrentStateConfig(
        "linear_attention", STACK.regions(), checkpoint_every=every, num_checkpoints=checkpoints
    )
    return make_paged(
        session, num_pages=num_pages, max_seq_len=64,
        groups=(CacheGroupConfig("full_attention", NUM_LAYERS),), recurrent=state, **features,
    )


def prefill(m, rid, prompt, chunk=PAGE, **fields):
    """Claims `rid` and runs its prompt (a context with `fields`) in chunks of `chunk`
    tokens through the stack on the manager's state inputs; returns the context and
    every output it computed, by position (None where a prefix hit skipped it)."""
    ctx = TextContext(np.array(prompt), rid, **fields)
    m.external_claim(rid)
    outputs: list = [None] * len(prompt)
    while ctx.start_idx < len(prompt):
        ctx.chunk(chunk)
        m.fetch([ctx])  # a hit moves start_idx
        start, end = ctx.start_idx, ctx.active_idx
        (inputs,) = m.state_inputs([ctx])
        (out,) = STACK.run(inputs.leaves, [ctx.tokens[start:end]])
        outputs[start:end] = list(out)
        ctx.update(0)
        m.step([ctx])
    return ctx, outputs


def skipped(outputs) -> int:
    """Tokens a prefix hit skipped (no output computed) at the start of a prompt."""
    return next((i for i, o in enumerate(outputs) if o is not None), len(outputs))


def live_state(m, ctx):
    (inputs,) = m.state_inputs([ctx])
    return [leaf.pool.to_numpy()[leaf.live_row_ids.to_numpy()[:, 0]] for leaf in inputs.leaves]


def memory(states):
    """A copy of every block of the state group (live blocks and checkpoints)."""
    return [buffer.to_numpy().copy() for buffers in states.states for buffer in buffers]


def reference(prompt):
    conv, ssm = STACK.zero_state()
    return STACK.step(conv, ssm, prompt), [conv, ssm]


def test_a_prompt_resumed_from_a_checkpoint_equals_one_computed_from_scratch(session):
    m = hybrid(session)
    _, out_a = prefill(m, "A", SHARED + [5, 5])
    expected_a, _ = reference(SHARED + [5, 5])
    np.testing.assert_array_equal(np.array(out_a), expected_a)
    assert m.replicas[0].states.checkpoints_taken == 2  # after pages 1 and 2 (token 8)
    prompt = SHARED + [11, 12, 13, 14]
    ctx, out_b = prefill(m, "B", prompt)
    assert skipped(out_b) == 8  # resumed at the checkpoint of page 2
    expected, state = reference(prompt)
    np.testing.assert_array_equal(np.array(out_b[8:]), expected[8:])
    for ours, theirs in zip(live_state(m, ctx), state):
        np.testing.assert_array_equal(ours, theirs)
    m.release("A")
    m.release("B")
    m.replicas[0].check_invariants()


def test_the_hit_stops_at_the_last_checkpoint_and_never_past_it(session):
    """Checkpoints every 2 pages: A's prompt of 3 pages and a token leaves one at page 2
    and its attention pages reach page 3; B of the same prompt resumes at page 2."""
    m = hybrid(session, every=2)
    prefill(m, "A", SHARED + [5, 5, 5, 5])
    assert m.replicas[0].states.checkpoints_taken == 1
    ctx, out = prefill(m, "B", SHARED + [5, 5, 5, 5, 1])
    assert skipped(out) == 8
    expected, _ = reference(SHARED + [5, 5, 5, 5, 1])
    np.testing.assert_array_equal(np.array(out[8:]), expected[8:])


def test_a_prompt_run_in_one_step_leaves_no_checkpoint_to_resume(session):
    """The state is only known where a step ends: a prompt run at once leaves none, and a
    later request with its prefix recomputes it though the attention pages are cached."""
    m = hybrid(session)
    prefill(m, "A", SHARED + [5], chunk=64)
    assert m.replicas[0].states.checkpoints_taken == 0
    _, out = prefill(m, "B", SHARED + [6], chunk=64)
    assert skipped(out) == 0
    assert m.replicas[0].cache_tokens == 0


def test_the_oldest_checkpoint_gives_its_slot(session):
    """One checkpoint slot: A's checkpoint at page 2 replaces the one at page 1, so B,
    sharing only A's first page, finds its attention page but no state there; B's own
    checkpoint at page 1 then replaces A's at page 2, so C, sharing two pages, resumes
    at page 1."""
    m = hybrid(session, checkpoints=1)
    prefill(m, "A", SHARED)
    _, out = prefill(m, "B", SHARED[:4] + [60, 61])
    assert skipped(out) == 0
    _, out = prefill(m, "C", SHARED[:8] + [60])
    assert skipped(out) == 4
    np.testing.assert_array_equal(np.array(out[4:]), reference(SHARED[:8] + [60])[0][4:])


def test_a_context_moved_back_without_a_release_is_refused(session):
    """A context reset inside its last, uncommitted page would run from a state past its
    tokens: StaleContextError, naming the state; after a release it starts afresh."""
    m = hybrid(session)
    ctx, _ = prefill(m, "A", SHARED[:6])  # one committed page and two tokens
    ctx.reset()
    ctx.skip_cached_prefix(4)  # back to the page boundary: the pages allow it
    with pytest.raises(mokv.StaleContextError, match="its state in 'linear_attention' holds 6"):
        m.fetch([ctx])
    m.release("A")
    _, out = prefill(m, "A", SHARED[:6])
    assert skipped(out) == 4  # the checkpoint at page 1


def test_a_bfloat16_state_starts_from_zeros_and_resumes(session):
    """MAX's Qwen3.5 keeps its state in bfloat16 (no numpy dtype): the zero block and
    the copies take any dtype."""
    state = RecurrentStateConfig(
        "s", (StateRegion("h", 1, (2, 8), DType.bfloat16),), num_checkpoints=2)
    m = make_paged(session, max_seq_len=64, recurrent=state,
                   groups=(CacheGroupConfig("full_attention", NUM_LAYERS),))

    def step(ctx, fill):
        m.fetch([ctx])
        (leaf,) = m.state_inputs([ctx])[0].leaves
        row = int(leaf.live_row_ids.to_numpy()[0, 0])
        words = leaf.pool.view(DType.uint16, [leaf.pool.shape[0], 16]).to_numpy()
        before = words[row].copy()
        words[row] = fill
        ctx.update(0)
        m.step([ctx])
        return before

    a = TextContext(np.array(SHARED[:4] + [1]), "A")
    m.external_claim("A")
    a.chunk(PAGE)
    assert not step(a, 0x3F80).any()  # zeros; then bfloat16 1.0 at the page boundary
    b = TextContext(np.array(SHARED[:4] + [2]), "B")
    m.external_claim("B")
    assert (step(b, 0) == 0x3F80).all() and b.start_idx == 5


def test_without_checkpoints_no_prefix_is_resumed(session):
    m = hybrid(session, checkpoints=0)
    prefill(m, "A", SHARED)
    _, out = prefill(m, "B", SHARED)
    assert skipped(out) == 0 and m.replicas[0].states.checkpoints_taken == 0


@pytest.mark.parametrize("mode", ["instead", "after"])
def test_a_failed_fetch_or_step_leaves_the_states_and_checkpoints_as_they_were(
    session, monkeypatch, mode
):
    """A fault at every inner call of B's fetch (a resume) and of its step (a
    checkpoint): the live state, the checkpoints and the hit B finds after are as
    before the call; then B runs to the same outputs as from scratch."""
    from mokv.managers.paged.groups.state import RecurrentStateGroup

    m = hybrid(session, checkpoints=2)
    prefill(m, "A", SHARED + [5, 5])
    states = m.replicas[0].states
    faults = Faults(monkeypatch, [(RecurrentStateGroup, "_copy"),
                                  (states.pool.__class__, "take"),
                                  (states.pool.__class__, "commit_pages")])
    prompt = SHARED[:8] + [20, 21, 22, 23, 24]
    ctx = TextContext(np.array(prompt), "B")
    m.external_claim("B")
    before = [states.pool.indexed_hashes()]
    failed: list[int] = []
    for fault_at in range(1, 8):
        faults.arm(fault_at, mode)
        try:
            ctx.chunk(PAGE)
            m.fetch([ctx])
        except Injected:
            assert ctx.start_idx == 0 and states.pool.indexed_hashes() == before[0]
            failed.append(fault_at)
            continue
        finally:
            faults.disarm()
        break
    assert ctx.start_idx == 8  # resumed
    (inputs,) = m.state_inputs([ctx])
    expected, _ = reference(prompt)
    (out,) = STACK.run(inputs.leaves, [ctx.tokens[8:12]])
    np.testing.assert_array_equal(out, expected[8:12])
    ctx.update(0)
    saved = memory(states)
    for fault_at in range(1, 8):  # the step that takes the checkpoint at page 3
        faults.arm(fault_at, mode)
        try:
            m.step([ctx])
        except Injected:
            failed.append(fault_at)
            assert states.checkpoints_taken == 2
            for ours, old in zip(memory(states), saved):  # the evicted checkpoint's too
                np.testing.assert_array_equal(ours, old)
            continue
        finally:
            faults.disarm()
        break
    assert states.checkpoints_taken == 3
    assert len(failed) >= 4  # faults in both calls
    m.replicas[0].check_invariants()


def test_the_inputs_are_maxs_types_in_its_order(session):
    """`state_inputs` gives MAX's `RecurrentStateInputsPerDevice`: one leaf per region in
    region order, the pool of MAX's declared shape and dtype, `[num_layers, batch]`
    uint32 live rows, each the row `block * num_layers + layer` of its request."""
    m = hybrid(session)
    ctx = TextContext(np.array(SHARED), "A")
    m.external_claim("A")
    m.fetch([ctx])
    (ours,) = m.state_inputs([ctx])
    theirs = RecurrentStateParams(
        regions=tuple(RecurrentStateRegion(r.leaf_id, r.num_layers, r.row_shape, r.dtype)
                      for r in STACK.regions()),
        devices=[DeviceRef.CPU()],
    ).get_symbolic_inputs()[0]
    assert type(ours) is type(theirs) and len(ours.leaves) == len(theirs.leaves)
    for leaf, spec in zip(ours.leaves, theirs.leaves):
        assert leaf.pool.dtype == spec.pool.dtype
        assert list(leaf.pool.shape[1:]) == [int(d) for d in spec.pool.shape[1:]]
        assert leaf.live_row_ids.dtype == spec.live_row_ids.dtype == DType.uint32
        assert leaf.live_row_ids.shape == (int(spec.live_row_ids.shape[0]), 1)
    slot = m.replicas[0]._request("A").slot
    np.testing.assert_array_equal(ours.leaves[1].live_row_ids.to_numpy()[:, 0],
                                  [slot * 2, slot * 2 + 1])


def test_what_a_cache_with_state_layers_refuses():
    state = RecurrentStateConfig("linear_attention", STACK.regions(), num_checkpoints=4)
    groups = (CacheGroupConfig("full_attention", NUM_LAYERS),)
    with pytest.raises(ValueError, match="num_checkpoints=4 needs enable_prefix_caching"):
        small_params(groups=groups, recurrent=state, enable_prefix_caching=False)
    bad = RecurrentStateConfig("s", (StateRegion("conv.x", 1, (2,), DType.float32),))
    with pytest.raises(ValueError, match="state region 'conv.x' with the shared tier"):
        small_params(groups=groups, recurrent=bad, tiers=(mokv.RemoteTierConfig("redis://127.0.0.1:1", "m"),))
    with pytest.raises(ValueError, match="checkpoint_every must be an int >= 1, got 0"):
        RecurrentStateConfig("s", STACK.regions(), checkpoint_every=0)
    with pytest.raises(ValueError, match="row_shape must be a non-empty tuple"):
        StateRegion("conv", 1, (), DType.float32)
    with pytest.raises(ValueError, match="region ids repeat"):
        RecurrentStateConfig("s", (STACK.regions()[0],) * 2)
    with pytest.raises(TypeError, match="recurrent must be a mokv.RecurrentStateConfig"):
        small_params(groups=groups, recurrent="linear")


def test_the_managers_without_state_refuse_it(session):
    from max.driver import CPU

    params = small_params(recurrent=RecurrentStateConfig("s", STACK.regions()))
    with pytest.raises(ValueError, match="cannot honour recurrent='s'"):
        mokv.ContinuousBatchingKVCacheManager(params, 2, 32, NUM_LAYERS, [CPU()], session)
    with pytest.raises(ValueError, match="no recurrent-state symbols"):
        mokv.NullKVCacheManager(params, 2, 32, NUM_LAYERS, [CPU()], session, 1 << 20)
