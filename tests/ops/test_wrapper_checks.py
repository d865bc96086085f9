"""The op wrappers reject bad arguments at graph-build time, naming them (no compile)."""

from __future__ import annotations

import pytest
from max.dtype import DType
from max.graph import DeviceRef, Graph, TensorType
from mokv.config.params import KVCacheParams
from mokv.layouts import PAGED, FetchPagedKVCacheCollection, PagedKVCacheCollectionType
from mokv.ops import flash_attention, fused_qkv_matmul, kernels_path, store_kv

PARAMS = KVCacheParams(dtype=DType.float32, n_kv_heads=2, head_dim=64, page_size=16)
CPU = DeviceRef.CPU()


def _graph(*extra: TensorType) -> Graph:
    return Graph("checks", input_types=[*PAGED.input_symbols(PARAMS, 2, 0, CPU), *extra],
                 custom_extensions=[kernels_path()])


def test_collection_type_names_the_mojo_struct() -> None:
    t = PagedKVCacheCollectionType(PARAMS)
    assert t.name == "PagedKVCacheCollection"
    assert t.parameters == {"dtype_code": 0, "num_heads": 2, "head_size": 64, "page_size": 16}


def test_fetch_checks_layers_and_accepts_the_namedtuple() -> None:
    with _graph() as g:
        with pytest.raises(ValueError, match="blocks dim 2 must be 3"):
            FetchPagedKVCacheCollection(PARAMS, num_layers=3)(*g.inputs)
        FetchPagedKVCacheCollection(PARAMS, num_layers=2)(tuple(g.inputs))


@pytest.mark.parametrize(
    "k_type,match",
    [
        (TensorType(DType.bfloat16, ["t", 2, 64], device=CPU), "k must have dtype float32"),
        (TensorType(DType.float32, ["t", 3, 64], device=CPU), "k dim 1 must be 2"),
        (TensorType(DType.float32, ["t", 128], device=CPU), "k must have rank 3"),
    ],
)
def test_store_kv_rejects_bad_k(k_type: TensorType, match: str) -> None:
    ot = TensorType(DType.uint32, ["n"], device=CPU)
    with _graph(k_type, ot) as g:
        kv = FetchPagedKVCacheCollection(PARAMS)(*g.inputs[:4])
        with pytest.raises((TypeError, ValueError), match=match):
            store_kv(kv, g.inputs[4], g.inputs[4], g.inputs[5], 0)


def test_layer_idx_and_offsets_are_checked() -> None:
    kt = TensorType(DType.float32, ["t", 2, 64], device=CPU)
    bad_off = TensorType(DType.int32, ["n"], device=CPU)
    off = TensorType(DType.uint32, ["n"], device=CPU)
    with _graph(kt, bad_off, off) as g:
        kv = FetchPagedKVCacheCollection(PARAMS)(*g.inputs[:4])
        k = g.inputs[4]
        with pytest.raises(TypeError, match="input_row_offsets must have dtype uint32"):
            store_kv(kv, k, k, g.inputs[5], 0)
        with pytest.raises(ValueError, match="layer_idx must be >= 0"):
            store_kv(kv, k, k, g.inputs[6], -1)


def test_fused_qkv_and_attention_check_heads() -> None:
    ht = TensorType(DType.float32, ["t", 32], device=CPU)
    wt = TensorType(DType.float32, [(8 + 4) * 64, 32], device=CPU)
    qt = TensorType(DType.float32, ["t", 3, 64], device=CPU)
    ot = TensorType(DType.uint32, ["n"], device=CPU)
    with _graph(ht, wt, qt, ot) as g:
        kv = FetchPagedKVCacheCollection(PARAMS)(*g.inputs[:4])
        h, w, q, off = g.inputs[4:]
        with pytest.raises(ValueError, match="n_heads=3 must be a multiple"):
            fused_qkv_matmul(kv, h, w, off, 0, 3)
        with pytest.raises(ValueError, match="wqkv dim 0 must be 1024"):
            fused_qkv_matmul(kv, h, w, off, 0, 12)
        with pytest.raises(ValueError, match="q dim 1"):
            flash_attention(kv, q, off, 0, 0.125)
        with pytest.raises(TypeError, match="collection must be a KV cache collection"):
            flash_attention(h, q, off, 0, 0.125)

