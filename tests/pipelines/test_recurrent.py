"""MAX's recurrent-state trees through mokv.pipelines: a `MultiKVCacheParams` of an
attention child and a `RecurrentStateParams` child (Qwen3.5's tree, small), served by a
mokv cache and by MAX's own manager (its Jenga manager on the CPU) on the same trace:
the same prefix hits (checkpoints where a forward ends on a page boundary), and inputs
of MAX's types in MAX's tree order."""

from __future__ import annotations

import numpy as np
import pytest
from max import tree
from max.dtype import DType
from max.graph import DeviceRef
from max.nn.kv_cache import (
    KVCacheInputsPerDevice,
    MultiKVCacheParams,
    RecurrentStateInputsPerDevice,
    RecurrentStateParams,
    RecurrentStateRegion,
)
from max.pipelines.context import TextContext, TokenBuffer
from mokv import (
    CacheGroupConfig,
    InsufficientMemoryError,
    RecurrentStateConfig,
    StateRegion,
    max_kv_params,
)
from mokv.pipelines import MokvOptions, UnsupportedMaxParamsError, mokv_params
from mokv.pipelines import load_kv_manager as mokv_loader
from mokv.pipelines.options import MokvConfigError

from .conftest import PAGE_SIZE, loader_args, max_params

REGIONS = (
    RecurrentStateRegion("conv", 3, (24, 3), DType.float32),
    RecurrentStateRegion("ssm", 3, (2, 4, 4), DType.float32),
)


def qwen_like(**state_fields) -> MultiKVCacheParams:
    """Qwen3.5's tree, small: one full-attention layer, three linear-attention layers."""
    state = RecurrentStateParams(regions=REGIONS, devices=[DeviceRef.CPU()], **state_fields)
    return MultiKVCacheParams.from_params({"attn": max_params(num_layers=1), "state": state})


@pytest.fixture
def managers(session):
    """MAX's own manager and mokv's for `qwen_like()`, 4 MiB of cache each."""
    from max.pipelines.kv_cache import load_kv_manager

    args = loader_args(session) | dict(params=qwen_like(), max_seq_len=1024,
                                       available_cache_memory=4 << 20)
    both = load_kv_manager(**args), mokv_loader(**args)
    yield both
    for manager in both:
        manager.shutdown()


def served(manager, prompt, chunk) -> int:
    """Runs `prompt`'s prefill through `manager` in forwards of at most `chunk` tokens
    (MAX's scheduler chunks after `alloc`) and one decode step; returns its cached
    prefix length."""
    ctx = TextContext(max_length=1024, tokens=TokenBuffer(np.array(prompt, np.int64)))
    manager.claim(ctx)
    manager.alloc(ctx)
    hit = ctx.cached_prefix_length
    for _ in range(len(prompt)):  # the forwards, then one decode step
        if ctx.tokens.active_length > chunk:  # MAX chunks only a longer window
            ctx.tokens.chunk(chunk)
        manager.runtime_inputs([[ctx]])
        ctx.update(5)
        manager.step(ctx)
        if len(ctx.tokens) > len(prompt):
            break
        manager.alloc(ctx)
    manager.release(ctx)
    return hit


def test_a_state_trace_finds_the_prefixes_max_s_own_manager_finds(managers):
    """Prompts chunked at page boundaries leave a checkpoint at each (a later prompt
    resumes at the last one it shares: 256, then 128 tokens), a prompt run in one
    forward leaves none (its prefix's pages are cached, yet nothing resumes), on MAX's
    own manager and on mokv's alike."""
    prompt = [int(t) for t in np.random.default_rng(3).integers(3, 250, 300)]
    page = PAGE_SIZE
    trace = [(prompt, page), (prompt[:256] + [7] * 20, page), (prompt[:200] + [9] * 3, page),
             ([1] * 150 + prompt, 512), ([1] * 150 + prompt[:140], 512)]
    hits = [[served(manager, p, chunk) for p, chunk in trace] for manager in managers]
    assert hits[0] == hits[1] == [0, 256, 128, 0, 0]


def test_the_inputs_are_max_s_types_in_its_tree_order(managers):
    theirs, ours = managers
    inputs = []
    for manager in (theirs, ours):
        ctx = TextContext(max_length=1024, tokens=TokenBuffer(np.arange(3, 40)))
        manager.claim(ctx)
        manager.alloc(ctx)
        inputs.append(manager.runtime_inputs([[ctx]]))
    assert list(inputs[0]) == list(inputs[1]) == ["attn", "state"]
    assert [type(d) for d in inputs[1]["attn"]] == [KVCacheInputsPerDevice]
    (mine,), (max_own,) = inputs[1]["state"], inputs[0]["state"]
    assert type(mine) is type(max_own) is RecurrentStateInputsPerDevice
    for leaf, other, region in zip(mine.leaves, max_own.leaves, REGIONS, strict=True):
        assert leaf.pool.dtype == other.pool.dtype == region.dtype
        assert leaf.pool.shape[1:] == other.pool.shape[1:] == region.row_shape
        assert leaf.live_row_ids.dtype == other.live_row_ids.dtype == DType.uint32
        assert leaf.live_row_ids.shape == other.live_row_ids.shape == (3, 1)
        rows = leaf.live_row_ids.to_numpy()[:, 0]  # one block's consecutive layer rows
        assert rows[0] % 3 == 0 and list(rows) == [rows[0], rows[0] + 1, rows[0] + 2]
    state = ours.get_device_buffer(0).children["state"]  # MAX's view: rows of bytes
    assert list(ours.get_device_buffer(0).children) == ["attn", "state"]
    assert [(k, v[0].shape[1], v[0].dtype) for k, v in state.pages.items()] == [
        (r.leaf_id, r.bytes_per_page, DType.uint8) for r in REGIONS]
    buffers = tree.leaves(inputs[1])
    symbols = tree.leaves(qwen_like().get_symbolic_inputs())
    assert len(buffers) == len(symbols) == len(tree.leaves(inputs[0]))
    for buffer, symbol in zip(buffers, symbols):
        assert buffer.dtype == symbol.dtype and len(buffer.shape) == len(symbol.shape)
        for size, dim in zip(buffer.shape, symbol.shape):
            assert not str(dim).isdigit() or int(str(dim)) == size, (buffer.shape, symbol.shape)


def test_max_s_state_tree_becomes_mokv_s_params():
    ours = mokv_params(qwen_like(), MokvOptions.from_mapping(
        {"state_checkpoints": {"checkpoint_every": 2, "num_checkpoints": 5}}))
    assert ours.groups == (CacheGroupConfig("attn", 1, None, 2, 16),)
    assert ours.recurrent == RecurrentStateConfig(
        "state",
        (StateRegion("conv", 3, (24, 3), DType.float32),
         StateRegion("ssm", 3, (2, 4, 4), DType.float32)),
        checkpoint_every=2, num_checkpoints=5,
    )
    back = max_kv_params(ours, 1, [DeviceRef.CPU()])  # and back: MAX's tree again
    assert list(back.children) == ["attn", "state"]
    assert back.children["state"].regions == REGIONS
    without = mokv_params(MultiKVCacheParams.from_params({
        "attn": max_params(num_layers=1, enable_prefix_caching=False),
        "state": qwen_like().children["state"]}))
    assert without.recurrent is not None and without.recurrent.num_checkpoints == 0
    with pytest.raises(UnsupportedMaxParamsError, match="state_checkpoints=.* no recurrent state"):
        mokv_params(max_params(), MokvOptions.from_mapping({"state_checkpoints": {}}))
    with pytest.raises(MokvConfigError, match="checkpoint_every must be an int >= 1, got 0"):
        MokvOptions.from_mapping({"state_checkpoints": {"checkpoint_every": 0}})


def test_what_mokv_does_not_hold_of_a_state_is_refused_naming_it(session):
    scratch = RecurrentStateRegion("ring", 3, (2, 8), DType.float32, scratch=True)
    state = qwen_like().children["state"]
    cases = {
        "scratch state regions": MultiKVCacheParams.from_params({
            "attn": max_params(num_layers=1),
            "state": RecurrentStateParams(regions=(*REGIONS, scratch), devices=[DeviceRef.CPU()]),
        }),
        "two RecurrentStateParams": MultiKVCacheParams.from_params(
            {"attn": max_params(num_layers=1), "a": state, "b": RecurrentStateParams(
                regions=(scratch,), devices=[DeviceRef.CPU()])}),
        "no attention cache": MultiKVCacheParams.from_params({"state": RecurrentStateParams(
            regions=REGIONS, devices=[DeviceRef.CPU()], page_size=PAGE_SIZE)}),
        "draft tokens": qwen_like(num_draft_tokens=2),
    }
    for what, params in cases.items():
        with pytest.raises(UnsupportedMaxParamsError, match=what):
            mokv_loader(**loader_args(session) | {"params": params})
    with pytest.raises(InsufficientMemoryError, match="leaving none"):
        mokv_loader(**loader_args(session) | {"params": qwen_like(),
                                               "available_cache_memory": 80_000})
