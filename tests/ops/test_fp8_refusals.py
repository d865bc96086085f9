"""Where FP8 pages stop (issue 53), refused by name when a graph is built: mokv's ops
over scaled pages on a GPU with activations other than bfloat16, a continuous
collection of scaled pages on a GPU, MAX's own attention layer on a scaled cache (MAX
refuses it itself, on any device) and on an unscaled one with bfloat16 queries (MAX's
attention wants FP8 queries there). mokv's ops over unscaled pages build on a GPU
(compiled for sm_100 in test_virtual_gpu.py); a CPU collection of them is refused
(tests/test_quantization.py)."""

from __future__ import annotations

import mokv
import numpy as np
import pytest
from max.dtype import DType
from max.graph import BufferType, DeviceRef, Graph, TensorType, ops
from max.nn import LayerList
from max.nn.attention import AttentionWithRope
from max.nn.rotary_embedding import RotaryEmbedding

FP8 = mokv.KVCacheParams(
    dtype=DType.float8_e4m3fn, n_kv_heads=2, head_dim=128, page_size=16,
    quantization=mokv.KVCacheQuantization(),
)
CPU = DeviceRef.CPU()


def cache_types(device: DeviceRef) -> list:
    return [
        BufferType(DType.float8_e4m3fn, ["pages", 2, 1, 16, 2, 128], device=device),
        BufferType(DType.float32, ["pages", 2, 1, 16, 2, 1], device=device),
        TensorType(DType.uint32, ["batch"], device=device),
        TensorType(DType.uint32, ["batch", "cols"], device=device),
        TensorType(DType.uint32, [1, 2], device=CPU),
    ]


@pytest.mark.parametrize("op", ["store_kv", "fused_qkv_matmul", "flash_attention"])
def test_activations_on_a_gpu_over_an_fp8_cache_are_bfloat16(op):
    """On a GPU, MAX's attention kernel reads scaled pages dequantized to bfloat16."""
    gpu = DeviceRef.GPU()
    f32 = DType.float32
    with Graph("fp8_ops_on_gpu", input_types=[
        *cache_types(gpu),
        TensorType(f32, ["tokens", 2, 128], device=gpu),
        TensorType(f32, ["tokens", 8, 128], device=gpu),
        TensorType(f32, ["tokens", 64], device=gpu),
        TensorType(f32, [12 * 128, 64], device=gpu),
        TensorType(DType.uint32, ["offsets"], device=gpu),
    ]) as g:
        blocks, scales, lengths, table, max_lengths, kv, q, hidden, w, offsets = g.inputs
        coll = mokv.FetchPagedKVCacheCollection(FP8)(blocks.buffer, lengths, table, max_lengths, scales.buffer)
        calls = {
            "store_kv": lambda: mokv.ops.store_kv(coll, kv, kv, offsets, 0),
            "fused_qkv_matmul": lambda: mokv.ops.fused_qkv_matmul(coll, hidden, w, offsets, 0, 8),
            "flash_attention": lambda: mokv.ops.flash_attention(coll, q, offsets, 0, 0.1),
        }
        with pytest.raises(ValueError, match=rf"{op}: over a float8_e4m3fn cache on a GPU, .* "
                           r"must be bfloat16 .*, got float32"):
            calls[op]()


UNSCALED = mokv.KVCacheParams(dtype=DType.float8_e4m3fn, n_kv_heads=2, head_dim=128, page_size=128)


@pytest.mark.parametrize("layout", [mokv.PAGED, mokv.CONTINUOUS], ids=["paged", "continuous"])
def test_mokv_ops_over_unscaled_fp8_pages_on_a_gpu_build(layout):
    """MAX's unscaled FP8 pages on a GPU: the plain inputs (no scales leaf), a collection
    of dtype code 4, and mokv's ops take float activations over it; attention returns
    q's dtype (the op casts MAX's bfloat16 output back)."""
    gpu = DeviceRef.GPU()
    with Graph("unscaled_fp8_on_gpu", input_types=[
        *layout.input_symbols(UNSCALED, 1, 256, gpu),
        TensorType(DType.bfloat16, ["tokens", 2, 128], device=gpu),
        TensorType(DType.float32, ["tokens", 8, 128], device=gpu),
        TensorType(DType.uint32, ["offsets"], device=gpu),
    ]) as g:
        *cache, kv, q, offsets = g.inputs
        coll = mokv.FetchKVCacheCollection(UNSCALED, 1, layout)(*cache)
        info = layout.info(coll)
        assert coll.type.parameters["dtype_code"] == 4
        assert info.dtype == DType.float8_e4m3fn and not info.scaled
        mokv.ops.store_kv(coll, kv, kv, offsets, 0)
        out = mokv.ops.flash_attention(coll, q, offsets, 0, 0.1)
        assert out.dtype == DType.float32 and out.device == gpu


def test_a_continuous_collection_of_scaled_fp8_pages_on_a_gpu_is_refused_by_name():
    gpu = DeviceRef.GPU()
    layout = mokv.CONTINUOUS
    with Graph("scaled_fp8_on_gpu", input_types=layout.input_symbols(FP8, 1, 256, gpu)) as g:
        fetch = mokv.FetchKVCacheCollection(FP8, 1, layout)
        with pytest.raises(ValueError, match=r"scaled FP8 pages .* in a continuous cache on "
                           "gpu:0: on a GPU mokv reads scaled pages in a paged cache only"):
            fetch(*g.inputs)
    # The paged layout's collection builds there (compiled in test_virtual_gpu.py).
    with Graph("scaled_fp8_paged_on_gpu", input_types=mokv.PAGED.input_symbols(FP8, 1, 256, gpu)) as g:
        assert mokv.FetchKVCacheCollection(FP8, 1, mokv.PAGED)(*g.inputs) is not None


def test_an_fp8_cache_takes_float_activations_and_no_other():
    with Graph("fp8_int_q", input_types=[
        *cache_types(CPU), TensorType(DType.int32, ["tokens", 8, 128], device=CPU),
        TensorType(DType.uint32, ["offsets"], device=CPU),
    ]) as g:
        blocks, scales, lengths, table, max_lengths, q, offsets = g.inputs
        coll = mokv.FetchPagedKVCacheCollection(FP8)(blocks.buffer, lengths, table, max_lengths, scales.buffer)
        with pytest.raises(TypeError, match="q must have dtype float32 or bfloat16 or float16, got int32"):
            mokv.ops.flash_attention(coll, q, offsets, 0, 0.1)


@pytest.mark.parametrize("device", [CPU, DeviceRef.GPU()], ids=["cpu", "gpu"])
def test_maxs_attention_layer_refuses_a_scaled_fp8_cache_itself(device):
    # MAX 26.7's AttentionWithRope stores K and V with `rope_split_store_ragged`, which
    # raises for a scaled cache before it reads the cache values: on any device, and on
    # MAX's own manager's caches as on mokv's (docs/quantized.md).
    rope = RotaryEmbedding(64, 8, 10000.0, 128, head_dim=128, interleaved=False)
    layers = LayerList([AttentionWithRope(  # a LayerList (and a state) names the weights
        rope=rope, num_attention_heads=8, num_key_value_heads=2, hidden_size=64,
        kv_params=mokv.max_kv_params(FP8, 1, [device]), devices=[device], dtype=DType.float32,
    )])
    layers.load_state_dict({
        name: np.zeros([int(d) for d in w.shape], np.float32) for name, w in layers.raw_state_dict().items()
    })
    with Graph("max_layer_fp8", input_types=[
        TensorType(DType.float32, ["tokens", 64], device=device),
        TensorType(DType.uint32, ["offsets"], device=device),
        TensorType(DType.float32, [128, 128], device=device),
    ]) as g:
        x, offsets, freqs = g.inputs
        layer_idx = ops.constant(np.uint32(0), DType.uint32, CPU)
        with pytest.raises(ValueError, match="rope_split_store_ragged does not support a scaled "
                           "quantized KV cache"):
            layers[0](layer_idx, x, None, freqs, offsets)


def test_maxs_attention_layer_on_unscaled_fp8_pages_wants_fp8_queries():
    """MAX 26.7's AttentionWithRope (its Llama's layer) on unscaled FP8 pages (its
    `--kv-cache-format float8_e4m3fn`) with bfloat16 weights and activations: MAX's own
    `flash_attention_ragged` takes queries of the cache's dtype only, so the layer does
    not build (a GPU graph, not compiled; the cache inputs are MAX's own params'). mokv's
    `flash_attention` takes bfloat16 queries over those pages (docs/quantized.md)."""
    from max.graph.weights import WeightData

    from ._max_layers import Dims, build_layers, layers_graph

    gpu = DeviceRef.GPU()
    dims = Dims(dtype=DType.bfloat16, hidden=256, head_dim=128, page_size=128, num_layers=1)
    layers = build_layers(dims, UNSCALED, gpu)
    layers.load_state_dict({
        name: WeightData.from_numpy(np.zeros([int(d) for d in w.shape], np.float32), name)
        .astype(DType.bfloat16) for name, w in layers.raw_state_dict().items()
    })
    (symbols,) = mokv.max_kv_params(UNSCALED, 1, [gpu]).get_symbolic_inputs()
    with pytest.raises(ValueError, match="expected input to be dtype: DType.float8_e4m3fn, "
                       "got DType.bfloat16"):
        layers_graph(symbols, layers, TensorType(DType.bfloat16, ["tokens", 256], device=gpu),
                     TensorType(DType.float32, [128, 128], device=gpu))
