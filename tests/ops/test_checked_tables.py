"""Checked mode and the graph-build checks of the op wrappers.

Graph build (no compile): an int layer_idx past the collection's layers, head sizes and
GQA groups the kernels do not support, checked mode on a GPU cache.

Run time (checked graphs, `Config(checked=True)`): bad tables raise from `execute`
naming the entry, before the kernel touches the cache (the blocks stay byte-identical,
and the model keeps working); valid tables give bit-identical results with and without
checking. A raise from a custom op reaches Python as a ValueError and leaves the process
and the compiled model usable, so these run in-process. Without checking, the page-id
case below is a SIGSEGV and the other two read or write the wrong cache rows.

The table checks themselves, case by case, are tests/mojo/test_checks.mojo.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from max.dtype import DType
from max.graph import DeviceRef, Graph, TensorType
from mokv.config.params import KVCacheParams
from mokv.layouts import CONTINUOUS, PAGED, FetchPagedKVCacheCollection
from mokv.ops import flash_attention, fused_qkv_matmul, rope_freqs_cis, store_kv

from .conftest import MAX_SEQ_LEN, NUM_LAYERS, Config, buffer, make_cache, plan_graphs, row_offsets
from .test_fused_qkv import CASES as QKV_CASES
from .test_store_attention import CONT_F32_MHA, PAGED_F32_GQA4

CPU = DeviceRef.CPU()
PAGED_ROPE = QKV_CASES[0]  # paged f32, RoPE, GQA 4, head 64
assert PAGED_ROPE.rope and PAGED_ROPE.strategy == "paged" and PAGED_ROPE.dtype == DType.float32


def checked(cfg: Config) -> Config:
    return dataclasses.replace(cfg, checked=True)


plan_graphs("store_attention", [checked(PAGED_F32_GQA4), checked(CONT_F32_MHA)])
plan_graphs("qkv_attention", [checked(PAGED_ROPE)])


# ---------------------------------------------------------------- graph build


def _graph(params: KVCacheParams, *extra: TensorType, device: DeviceRef = CPU) -> Graph:
    symbols = PAGED.input_symbols(params, NUM_LAYERS, 0, device)
    return Graph("checks", input_types=[*symbols, *extra])


def test_layer_idx_past_num_layers_fails_at_graph_build() -> None:
    params = KVCacheParams(dtype=DType.float32, n_kv_heads=2, head_dim=64, page_size=16)
    kt = TensorType(DType.float32, ["t", 2, 64], device=CPU)
    ht = TensorType(DType.float32, ["t", 32], device=CPU)
    wt = TensorType(DType.float32, [(8 + 4) * 64, 32], device=CPU)
    qt = TensorType(DType.float32, ["t", 8, 64], device=CPU)
    ot = TensorType(DType.uint32, ["n"], device=CPU)
    with _graph(params, kt, ht, wt, qt, ot) as g:
        k, h, w, q, off = g.inputs[4:]
        # num_layers from the fetcher, or else from the static dim 2 of blocks
        for fetch in (FetchPagedKVCacheCollection(params, num_layers=NUM_LAYERS),
                      FetchPagedKVCacheCollection(params)):
            kv = fetch(*g.inputs[:4])
            assert kv.num_layers == NUM_LAYERS
            match = f"layer_idx={NUM_LAYERS} is out of range: the collection has num_layers=2"
            with pytest.raises(ValueError, match=match):
                store_kv(kv, k, k, off, NUM_LAYERS)
            with pytest.raises(ValueError, match=match):
                fused_qkv_matmul(kv, h, w, off, NUM_LAYERS, 8)
            with pytest.raises(ValueError, match=match):
                flash_attention(kv, q, off, NUM_LAYERS, 0.125)
            store_kv(kv, k, k, off, NUM_LAYERS - 1)  # the last layer is fine


def test_head_dim_the_cpu_kernels_cannot_run_fails_at_graph_build() -> None:
    """head_dim=8 used to pass every check and then fail to compile ("Please file an issue")."""
    params = KVCacheParams(dtype=DType.float32, n_kv_heads=1, head_dim=8, page_size=16)
    kt = TensorType(DType.float32, ["t", 1, 8], device=CPU)
    ht = TensorType(DType.float32, ["t", 32], device=CPU)
    wt = TensorType(DType.float32, [(2 + 2) * 8, 32], device=CPU)
    qt = TensorType(DType.float32, ["t", 2, 8], device=CPU)
    ot = TensorType(DType.uint32, ["n"], device=CPU)
    with _graph(params, kt, ht, wt, qt, ot) as g:
        kv = FetchPagedKVCacheCollection(params)(*g.inputs[:4])
        k, h, w, q, off = g.inputs[4:]
        store_kv(kv, k, k, off, 0)  # store_kv supports any head_dim
        needs = "on the CPU needs head_dim to be a multiple of 16"
        with pytest.raises(ValueError, match=f"fused_qkv_matmul {needs}"):
            fused_qkv_matmul(kv, h, w, off, 0, 2)
        with pytest.raises(ValueError, match=rf"flash_attention {needs} .* got head_dim=8"):
            flash_attention(kv, q, off, 0, 0.35)


def test_gqa_group_past_64_fails_at_graph_build() -> None:
    params = KVCacheParams(dtype=DType.float32, n_kv_heads=1, head_dim=16, page_size=16)
    qt = TensorType(DType.float32, ["t", 128, 16], device=CPU)
    ot = TensorType(DType.uint32, ["n"], device=CPU)
    with _graph(params, qt, ot) as g:
        kv = FetchPagedKVCacheCollection(params)(*g.inputs[:4])
        match = "at most 64 query heads per KV head, got 128 query heads over 1"
        with pytest.raises(ValueError, match=match):
            flash_attention(kv, g.inputs[4], g.inputs[5], 0, 0.25)


def test_checked_mode_is_refused_for_a_gpu_cache() -> None:
    params = KVCacheParams(dtype=DType.bfloat16, n_kv_heads=2, head_dim=128, page_size=16)
    gpu = DeviceRef.GPU()
    kt = TensorType(DType.bfloat16, ["t", 2, 128], device=gpu)
    ot = TensorType(DType.uint32, ["n"], device=gpu)
    with _graph(params, kt, ot, device=gpu) as g:
        kv = FetchPagedKVCacheCollection(params)(*g.inputs[:4])  # unchecked: fine
        with pytest.raises(ValueError, match="checked=True needs a cache on the CPU"):
            FetchPagedKVCacheCollection(params, checked=True)(*g.inputs[:4])
        with pytest.raises(ValueError, match="checked mode needs a cache on the CPU, got blocks"):
            store_kv(kv, g.inputs[4], g.inputs[4], g.inputs[5], 0, checked=True)


def test_gpu_attention_refuses_pages_that_are_not_a_multiple_of_128() -> None:
    """MAX's GPU kernel, which the op runs there, fails to compile for such pages (its
    key tiles must lie within a page): the op says so at graph build instead."""
    gpu = DeviceRef.GPU()
    qt = TensorType(DType.bfloat16, ["t", 4, 128], device=gpu)
    ot = TensorType(DType.uint32, ["n"], device=gpu)
    for page_size, refused in ((16, True), (64, True), (128, False), (256, False)):
        params = KVCacheParams(dtype=DType.bfloat16, n_kv_heads=2, head_dim=128, page_size=page_size)
        with _graph(params, qt, ot, device=gpu) as g:
            kv = FetchPagedKVCacheCollection(params)(*g.inputs[:4])
            if refused:
                match = f"multiple of 128 tokens; this paged cache has page_size={page_size}"
                with pytest.raises(ValueError, match=match):
                    flash_attention(kv, g.inputs[4], g.inputs[5], 0, 0.1)
            else:
                flash_attention(kv, g.inputs[4], g.inputs[5], 0, 0.1)
    params = KVCacheParams(dtype=DType.bfloat16, n_kv_heads=2, head_dim=128, page_size=16)
    qt, ot = (dataclasses.replace(t, device=CPU) for t in (qt, ot))
    with _graph(params, qt, ot) as g:  # the CPU kernel takes any page size
        kv = FetchPagedKVCacheCollection(params)(*g.inputs[:4])
        flash_attention(kv, g.inputs[4], g.inputs[5], 0, 0.1)


def test_check_op_is_emitted_only_when_checking() -> None:
    params = KVCacheParams(dtype=DType.float32, n_kv_heads=2, head_dim=64, page_size=16)
    kt = TensorType(DType.float32, ["t", 2, 64], device=CPU)
    ot = TensorType(DType.uint32, ["n"], device=CPU)

    def ops_in(fetch_checked: bool, op_checked: bool | None) -> str:
        with _graph(params, kt, ot) as g:
            kv = FetchPagedKVCacheCollection(params, checked=fetch_checked)(*g.inputs[:4])
            store_kv(kv, g.inputs[4], g.inputs[4], g.inputs[5], 0, checked=op_checked)
            g.output()
        return str(g)

    assert "mokv.check_tables.ragged.paged" not in ops_in(False, None)
    assert "mokv.check_tables.ragged.paged" in ops_in(True, None)
    assert "mokv.check_tables.ragged.paged" in ops_in(False, True)  # the wrapper's flag wins
    assert "mokv.check_tables.ragged.paged" not in ops_in(True, False)
    with pytest.raises(TypeError, match="checked must be a bool"):
        FetchPagedKVCacheCollection(params, checked=1)  # type: ignore[arg-type]


# ---------------------------------------------------------------- run time


def _store_attention_inputs(cfg: Config, cache_lengths, new_tokens, seed=0):
    rng = np.random.default_rng(seed)
    cache = make_cache(cfg.params, cache_lengths, new_tokens, rng)
    total, d = sum(new_tokens), cfg.head_dim
    k, v = (rng.standard_normal((total, cfg.n_kv_heads, d)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((total, cfg.n_q, d)).astype(np.float32)
    return cache, [buffer(k), buffer(v), buffer(q)], row_offsets(new_tokens)


def _raises_before_the_kernel(model, cache, args, offsets, match: str) -> None:
    before = cache.blocks.copy()
    with pytest.raises(ValueError, match=match):
        model.execute(*cache.buffers(), *args, buffer(offsets))
    np.testing.assert_array_equal(cache.blocks, before)  # the guarded store_kv never ran


def _bit_identical(compiled, cfg: Config, cache_lengths, new_tokens, seed=5) -> None:
    results = []
    for c in (cfg, checked(cfg)):
        cache, args, offsets = _store_attention_inputs(c, cache_lengths, new_tokens, seed)
        (out,) = compiled("store_attention", c).execute(*cache.buffers(), *args, buffer(offsets))
        results.append((out.to_numpy(), cache.blocks))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])


def test_paged_bad_tables_raise_naming_the_entry(compiled) -> None:
    cfg = checked(PAGED_F32_GQA4)
    model = compiled("store_attention", cfg)
    # A page id far past the blocks buffer (unchecked: SIGSEGV in store_kv).
    cache, args, offsets = _store_attention_inputs(cfg, [20, 3], [1, 5])
    cache.lookup_table[1, 0] = 10**6
    _raises_before_the_kernel(model, cache, args, offsets,
                              r"lookup_table\[1, 0\] = 1000000 >= num_pages = \d+ \(blocks dim 0\)")
    # A cache length past the lookup row: 32 + 1 positions need 3 pages, the row has 2
    # (unchecked: store_kv writes into the page the next row names, another sequence's).
    # The row is cut to its pages: the check bounds positions by the table's width, and
    # a padded table (as managers and make_cache pad them for MAX) has room past them.
    cache, args, offsets = _store_attention_inputs(cfg, [20, 3], [1, 5])
    cache.lookup_table = cache.lookup_table[:, :2].copy()
    cache.cache_lengths[0] = 32
    _raises_before_the_kernel(model, cache, args, offsets,
                              r"cache_lengths\[0\] = 32 \+ 1 new tokens = 33 positions > 32")
    # Row offsets past the queries (unchecked: reads past k, v and q).
    cache, args, offsets = _store_attention_inputs(cfg, [20, 3], [1, 5])
    offsets[2] = 9
    _raises_before_the_kernel(model, cache, args, offsets,
                              r"input_row_offsets\[2\] = 9, expected total_tokens = 6")
    # The compiled model still works after the errors.
    cache, args, offsets = _store_attention_inputs(cfg, [20, 3], [1, 5])
    model.execute(*cache.buffers(), *args, buffer(offsets))


def test_paged_checked_results_are_bit_identical(compiled) -> None:
    _bit_identical(compiled, PAGED_F32_GQA4, [20, 0, 30, 16], [1, 35, 5, 1])


def test_continuous_bad_slot_raises_and_valid_tables_match(compiled) -> None:
    cfg = checked(CONT_F32_MHA)
    cache, args, offsets = _store_attention_inputs(cfg, [0, 17], [12, 1])
    cache.lookup_table[1] = cache.blocks.shape[0]  # one slot past the buffer
    _raises_before_the_kernel(compiled("store_attention", cfg), cache, args, offsets,
                              r"lookup_table\[1\] = 3 >= max_batch_size = 3 \(blocks dim 0\)")
    _bit_identical(compiled, CONT_F32_MHA, [0, 17, 70], [12, 1, 4])


def test_rope_positions_past_the_freqs_table_raise(compiled) -> None:
    """fused_qkv_matmul with RoPE reads freqs_cis row `position`: checked mode caps positions."""
    cfg, new_tokens = PAGED_ROPE, [19, 1]
    rng = np.random.default_rng(3)
    hidden = rng.standard_normal((sum(new_tokens), cfg.hidden)).astype(np.float32)
    wqkv = rng.standard_normal(((cfg.n_q + 2 * cfg.n_kv_heads) * cfg.head_dim, cfg.hidden))
    args = [buffer(hidden), buffer(wqkv.astype(np.float32)), buffer(row_offsets(new_tokens)),
            buffer(rope_freqs_cis(cfg.head_dim, MAX_SEQ_LEN))]

    def run(cfg: Config, cache_lengths: list[int]):
        cache = make_cache(cfg.params, cache_lengths, new_tokens, np.random.default_rng(4))
        return cache, compiled("qkv_attention", cfg), cache.buffers()

    results = []
    for c in (cfg, checked(cfg)):
        cache, model, inputs = run(c, [0, 13])
        q, attn = model.execute(*inputs, *args)
        results.append((q.to_numpy(), attn.to_numpy(), cache.blocks))
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)
    # Position 96 has no row in the 96-row table (the lookup row has room: 7 pages).
    cache, model, inputs = run(checked(cfg), [0, MAX_SEQ_LEN])
    before = cache.blocks.copy()
    match = r"cache_lengths\[1\] = 96 \+ 1 new tokens = 97 positions > 96 rows of freqs_cis"
    with pytest.raises(ValueError, match=match):
        model.execute(*inputs, *args)
    np.testing.assert_array_equal(cache.blocks, before)


def test_continuous_symbols_have_a_static_layer_dim() -> None:
    """The fetcher reads num_layers from blocks dim 2 of either layout's input symbols."""
    params = KVCacheParams(
        dtype=DType.float32,
        n_kv_heads=2,
        head_dim=64,
        cache_strategy="continuous",  # type: ignore[arg-type]  # the string form is accepted
    )
    with Graph("layers", input_types=list(CONTINUOUS.input_symbols(params, 3, 32, CPU))) as g:
        assert CONTINUOUS.fetch(params, None, *g.inputs).num_layers == 3
