"""MAX's cache groups through mokv.pipelines: a `MultiKVCacheParams` of a sliding-window
and a full-attention child (Gemma 3's tree), and a single windowed cache, served by a
mokv cache and by MAX's own manager (its Jenga manager on the CPU) on the same trace;
the inputs have the tree, order and types of MAX's own."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
from max import tree
from max.dtype import DType
from max.graph import DeviceRef
from max.nn.kv_cache import KVCacheInputsPerDevice, MultiKVCacheParams
from mokv import CacheGroupConfig, max_kv_params
from mokv.pipelines import UnsupportedMaxParamsError, mokv_params
from mokv.pipelines import load_kv_manager as mokv_loader

from .conftest import PAGE_SIZE, loader_args, max_context, max_params

WINDOW = 200  # two pages of 128 before the one a step writes
LAYER_BYTES = 2 * PAGE_SIZE * 2 * 16 * 4  # one layer's page: K and V, 2 heads of 16 floats


def gemma_like(window: int = WINDOW) -> MultiKVCacheParams:
    """Gemma 3's tree, small: three sliding-window layers, one full-attention layer."""
    return MultiKVCacheParams.from_params({
        "sliding_attention": max_params(num_layers=3, window_size=window),
        "full_attention": max_params(num_layers=1),
    })


def loaders(session, params, pages: int = 60):
    """MAX's own manager and mokv's, for `params`, on `pages` one-layer pages' bytes."""
    from max.pipelines.kv_cache import load_kv_manager

    args = loader_args(session) | dict(params=params, max_seq_len=1024,
                                       available_cache_memory=pages * LAYER_BYTES)
    return load_kv_manager(**args), mokv_loader(**args)


def observe(inputs) -> list:
    """What a graph reads of MAX's tree besides page ids and pool sizes: its keys, and
    per leaf and device the scalars, the table's shape and a page's shape."""
    keys = list(inputs) if isinstance(inputs, dict) else None
    leaves = tree.leaves(inputs, leaf=KVCacheInputsPerDevice)
    return [keys] + [
        [getattr(d, f).to_numpy().tolist() for f in
         ("cache_lengths", "max_prompt_length", "max_cache_length", "attention_dispatch_metadata",
          "page_stride")]
        + [d.lookup_table.shape, d.kv_blocks.shape[1:], d.kv_blocks.dtype]
        for d in leaves
    ]


def trace(manager) -> list:
    """Two prompts sharing a page, a decode past the window, a release, the first again."""
    a, b = max_context(range(200, 400)), max_context([70, 71])
    for ctx in (a, b):
        manager.claim(ctx)
    manager.alloc(a)
    seen = [a.cached_prefix_length, observe(manager.runtime_inputs([[a]]))]
    a.update(5)
    manager.step(a)  # commits a's pages: b's first page among them
    seen.append(manager.get_prefix_cache_hit_counts(b))
    manager.alloc(b)
    seen += [b.cached_prefix_length, manager.num_req_blocks(b)]
    seen.append(observe(manager.runtime_inputs([[a, b]])))
    for step in range(140):  # a reaches 480 tokens: its window slides off two pages
        for ctx in (a, b):
            ctx.update(step % 7)
            manager.step(ctx)
            manager.alloc(ctx)
    seen.append(observe(manager.runtime_inputs([[a, b]])))
    seen.append([sorted(manager.get_req_blocks_per_leaf(ctx)) for ctx in (a, b)])
    for ctx in (a, b):
        manager.release(ctx)
    again = max_context(range(200, 400))
    manager.claim(again)
    manager.alloc(again)
    seen.append(again.cached_prefix_length)
    manager.release(again)
    return seen


@pytest.mark.parametrize("kind", ["tree", "window alone"])
def test_a_hybrid_trace_reads_as_on_max_s_own_manager(session, kind):
    params = gemma_like() if kind == "tree" else max_params(window_size=WINDOW)
    theirs, ours = loaders(session, params)
    assert trace(ours) == trace(theirs)
    for manager in (theirs, ours):
        manager.shutdown()


def test_the_inputs_are_max_s_graph_inputs_in_its_order(session):
    """Every runtime buffer has the dtype, rank and static dims of the symbol MAX's params
    declare at its place in the flattened tree (MAX's graph takes them as they come)."""
    params = gemma_like()
    _, ours = loaders(session, params)
    ctx = max_context([1, 2])
    ours.claim(ctx)
    ours.alloc(ctx)
    buffers = tree.leaves(ours.runtime_inputs([[ctx]]))
    symbols = tree.leaves(params.get_symbolic_inputs())
    assert len(buffers) == len(symbols) == 14
    for buffer, symbol in zip(buffers, symbols):
        assert buffer.dtype == symbol.dtype and len(buffer.shape) == len(symbol.shape)
        for size, dim in zip(buffer.shape, symbol.shape):
            assert not str(dim).isdigit() or int(str(dim)) == size, (buffer.shape, symbol.shape)
    assert [type(b) for b in ours.runtime_inputs_for_leaf([[ctx]])] == [KVCacheInputsPerDevice] * 2
    ours.shutdown()


def test_a_window_holds_at_most_one_page_fewer_than_max_s(session):
    """MAX frees the pages below `processed // page_size - pages_in_window`; mokv those
    below the window's first token's page: the same, or one page more released."""
    theirs, ours = loaders(session, gemma_like())
    contexts = []
    for manager in (theirs, ours):
        ctx = max_context(range(100))
        manager.claim(ctx)
        manager.alloc(ctx)
        contexts.append(ctx)
    differ = 0
    for step in range(600):
        for manager, ctx in zip((theirs, ours), contexts):
            ctx.update(step % 5)
            manager.step(ctx)
            manager.alloc(ctx)
        # MAX's null block is its block 0 (no page of a leaf is); mokv's page 0 is a page.
        row = theirs.get_req_blocks_per_leaf(contexts[0])["sliding_attention.sliding_window_group(200)"]
        rid = ours._view(contexts[1]).request_id
        nulls = [next((i for i, page in enumerate(row) if page), len(row)),
                 ours.manager.get_req_blocks_per_group(rid)["sliding_attention"][0]]
        start = contexts[1].tokens.processed_length
        assert nulls[1] == max(0, start - WINDOW + 1) // PAGE_SIZE
        assert nulls[1] - nulls[0] in (0, 1)
        differ += nulls[1] != nulls[0]
    assert differ > 0
    assert ours.pressure_pct() > 0 and ours.effective_max_seq_length is not None
    for manager in (theirs, ours):
        manager.shutdown()


def test_max_s_tree_becomes_mokv_s_groups_and_back():
    params = MultiKVCacheParams.from_params({
        "sliding_attention": max_params(num_layers=5, window_size=1024, head_dim=32),
        "full_attention": max_params(num_layers=1),
    })
    ours = mokv_params(params)
    assert ours.groups == (
        CacheGroupConfig("sliding_attention", 5, 1024, 2, 32),
        CacheGroupConfig("full_attention", 1, None, 2, 16),
    )
    back = max_kv_params(ours, 6, [DeviceRef.CPU()])
    assert list(back.children) == list(params.children)
    for key, child in params.children.items():
        mine = back.children[key]
        assert (mine.num_layers, mine.window_size, mine.head_dim, mine.n_kv_heads, mine.dtype) == (
            child.num_layers, child.window_size, child.head_dim, child.n_kv_heads, child.dtype)
    alone = mokv_params(max_params(window_size=300))
    assert alone.groups == (CacheGroupConfig("sliding_attention", 2, 300),)


def test_what_mokv_does_not_hold_in_a_tree_is_refused_naming_it(session):
    cases = {  # a RecurrentStateParams child: tests/pipelines/test_recurrent.py
        "nested": MultiKVCacheParams.from_params({"a": gemma_like(), "b": max_params()}),
        "different dtypes": MultiKVCacheParams.from_params(
            {"a": max_params(), "b": max_params(dtype=DType.bfloat16)}),
        "named 'full-attention'": MultiKVCacheParams.from_params(
            {"full-attention": max_params(), "b": max_params(window_size=300)}),
        "draft": MultiKVCacheParams.from_params(
            {"a": max_params(num_draft_tokens=2), "b": max_params(num_draft_tokens=2)}),
    }
    for what, params in cases.items():
        match = "MultiKVCacheParams" if what == "nested" else what.split()[-1]
        with pytest.raises(UnsupportedMaxParamsError, match=match):
            mokv_loader(**loader_args(session) | {"params": params})


def test_the_trees_order_is_mokv_s_group_order(session):
    reverse = MultiKVCacheParams.from_params(
        OrderedDict([("full_attention", max_params(num_layers=1)),
                     ("sliding_attention", max_params(num_layers=3, window_size=WINDOW))]))
    _, ours = loaders(session, reverse)
    ctx = max_context([1])
    ours.claim(ctx)
    ours.alloc(ctx)
    inputs = ours.runtime_inputs([[ctx]])
    assert list(inputs) == ["full_attention", "sliding_attention"]
    assert [d.kv_blocks.shape[2] for d in ours.runtime_inputs_for_leaf([[ctx]])] == [1, 3]
    assert np.array_equal(inputs["full_attention"][0].cache_lengths.to_numpy(), [0])
    ours.shutdown()
