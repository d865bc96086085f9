"""A model of MAX's own layers on a mokv cache, shared by test_max_ops.py (CPU) and
_virtual_gpu_max_build.py (a virtual sm_90): `AttentionWithRope` layers with residuals,
whose cache inputs are a mokv manager's in MAX's form.

    graph inputs: max.tree.leaves(manager.max_input_symbols()[0]),
                  hidden [tokens, hidden_size], input_row_offsets uint32 [batch + 1],
                  freqs_cis float32 [max_seq_len, head_dim] (MAX's interleaved table)
    output:       hidden after `num_layers` of `h = h + attention_i(h)`

docs/max.md builds the same CPU graph (same shapes, same weight names), so one compile
serves both: MAX's compile cache keys on the graph's contents, not its name.
"""

from __future__ import annotations

from dataclasses import dataclass

import mokv
import numpy as np
from max import tree
from max.dtype import DType
from max.graph import DeviceRef, Graph, TensorType, ops


@dataclass(frozen=True)
class Dims:
    hidden: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    page_size: int = 16
    num_layers: int = 2
    max_seq_len: int = 128
    theta: float = 10000.0
    dtype: DType = DType.float32

    def kv_params(self, **overrides) -> mokv.KVCacheParams:
        return mokv.KVCacheParams(self.dtype, self.n_kv_heads, self.head_dim,
                                  page_size=self.page_size, **overrides)

    def inverse_frequencies(self) -> np.ndarray:
        return self.theta ** (-np.arange(0, self.head_dim // 2, dtype=np.float64) * 2 / self.head_dim)

    def max_freqs_cis(self) -> np.ndarray:
        """MAX's RoPE table: per position, (cos, sin) of each frequency, interleaved."""
        angles = np.arange(self.max_seq_len)[:, None] * self.inverse_frequencies()[None, :]
        table = np.stack([np.cos(angles), np.sin(angles)], axis=-1)
        return table.reshape(self.max_seq_len, self.head_dim).astype(np.float32)


def build_layers(dims: Dims, params: mokv.KVCacheParams, device: DeviceRef):
    """`dims.num_layers` of MAX's `AttentionWithRope` in a `LayerList` (weights `<i>.q_proj.weight`,
    ...), with rotate-half RoPE (Llama's)."""
    from max.nn import LayerList
    from max.nn.attention import AttentionWithRope
    from max.nn.rotary_embedding import RotaryEmbedding

    # Only `interleaved` is read from it: the table itself is a graph input.
    rope = RotaryEmbedding(dims.hidden, dims.n_heads, dims.theta, dims.max_seq_len,
                           head_dim=dims.head_dim, interleaved=False)
    kv_params = mokv.max_kv_params(params, dims.num_layers, [device])
    return LayerList([
        AttentionWithRope(rope=rope, num_attention_heads=dims.n_heads,
                          num_key_value_heads=dims.n_kv_heads, hidden_size=dims.hidden,
                          kv_params=kv_params, devices=[device], dtype=dims.dtype)
        for _ in range(dims.num_layers)
    ])


def build_graph(dims: Dims, manager, layers, device: DeviceRef) -> Graph:
    (symbols,) = manager.max_input_symbols()
    return layers_graph(symbols, layers, TensorType(dims.dtype, ["tokens", dims.hidden], device=device),
                        TensorType(DType.float32, [dims.max_seq_len, dims.head_dim], device=device))


def layers_graph(cache_symbols, layers, hidden: TensorType, freqs_cis: TensorType) -> Graph:
    """`h = h + layer_i(h)` over `layers` (MAX's attention layers: `AttentionWithRope`,
    `LatentAttentionWithRope`) on the cache inputs `cache_symbols` (one device's
    `KVCacheInputsPerDevice` of graph types, mokv's or MAX's own)."""
    cache_types = tree.leaves(cache_symbols)
    input_types = [*cache_types, hidden, TensorType(DType.uint32, ["batch_plus_1"], device=hidden.device),
                   freqs_cis]
    with Graph("max_attention_on_mokv", input_types=input_types) as graph:
        kv = mokv.max_cache_values(graph.inputs[: len(cache_types)])
        h, offsets, freqs = (v.tensor for v in graph.inputs[len(cache_types):])
        for i, layer in enumerate(layers):
            layer_idx = ops.constant(i, DType.uint32, device=DeviceRef.CPU())
            h = h + layer(layer_idx, h, kv, freqs, offsets)
        graph.output(h)
    return graph
