"""Wrapper of `mokv.fused_qkv_matmul.ragged.<cache>[.rope]`."""

from __future__ import annotations

from typing import Any

import numpy as np
from max.driver import accelerator_api
from max.dtype import DType
from max.graph import StaticDim, TensorType, TensorValue, ops

from ..checks import check_device, check_dtype, check_rank, check_same_dim, check_static_dim
from ..layouts import collection_info
from ._checks import (
    check_activation_dtype,
    check_head_dim,
    check_row_offsets,
    emit_table_check,
    host_scalar,
    layer_index,
    wants_check,
)


def fused_qkv_matmul(
    collection: Any,
    hidden: TensorValue,
    wqkv: TensorValue,
    input_row_offsets: TensorValue,
    layer_idx: int | TensorValue,
    n_heads: int,
    freqs_cis: TensorValue | None = None,
    checked: bool | None = None,
) -> TensorValue:
    """Projects hidden states to Q, K, V; returns Q and writes K and V into the cache.

    New token `i` of batch entry `b` is written at cache position `cache_lengths[b] + i`.
    With `freqs_cis`, Q and K are rotated (rotate-half / Llama pairing) at that position.

    Args:
        collection: a `PagedKVCacheCollection` or `ContinuousBatchingKVCacheCollection`.
        hidden: [total_tokens, hidden_size], the cache's dtype (a float8_e4m3fn cache:
            float32, bfloat16 or float16; K and V are quantized per 128 lanes as written).
        wqkv: [(n_heads + 2 * n_kv_heads) * head_dim, hidden_size], same dtype; rows are
            the Q heads, then the K heads, then the V heads (a Linear weight).
        input_row_offsets: uint32 [batch_size + 1].
        layer_idx: layer whose K/V to write (int, or uint32 scalar tensor on the host);
            an int must be below the collection's num_layers.
        n_heads: query heads on this device (a multiple of the cache's KV heads).
        freqs_cis: optional float32 [max_seq_len, head_dim]; row p holds
            (cos t_0 .. cos t_{d/2-1}, sin t_0 .. sin t_{d/2-1}) for position p.
        checked: check the runtime tables first (`mokv.check_tables`; with
            `freqs_cis`, also that every position has a row); None: the collection's
            `checked` (see `FetchKVCacheCollection`).

    On an NVIDIA GPU a bf16/f16 projection is MAX's matmul (tensor cores), followed by
    mokv's epilogue op (RoPE, Q out, K and V into the cache); on the CPU, for float32 and
    on AMD GPUs one mokv kernel does it all (on a GPU: plain dot products, slow).
    The CPU kernel needs head_dim to be a multiple of 16; the GPU kernel head_dim <= 1024
    (and even with RoPE). Other values are refused here.

    Returns:
        Q: [total_tokens, n_heads * head_dim], hidden's dtype (rotated if freqs_cis).
    """
    info = collection_info("collection", collection)
    hidden, wqkv = TensorValue(hidden), TensorValue(wqkv)
    if not isinstance(n_heads, int) or isinstance(n_heads, bool) or n_heads < 1:
        raise ValueError(f"n_heads must be a positive int, got {n_heads!r}")
    if n_heads % info.num_heads:
        raise ValueError(
            f"n_heads={n_heads} must be a multiple of the cache's {info.num_heads} KV heads"
        )
    check_activation_dtype("hidden", hidden, info.dtype, "fused_qkv_matmul", info.scaled)
    check_rank("hidden", hidden, 2)
    check_dtype("wqkv", wqkv, hidden.dtype)
    check_rank("wqkv", wqkv, 2)
    check_static_dim("wqkv", wqkv, 0, (n_heads + 2 * info.num_heads) * info.head_size)
    check_same_dim("wqkv", wqkv, 1, "hidden", hidden, 1)
    check_device("wqkv", wqkv, hidden.device)
    check_head_dim("fused_qkv_matmul", info.head_size, hidden.device, rope=freqs_cis is not None)
    offsets = check_row_offsets(input_row_offsets, hidden.device)
    layer = layer_index(layer_idx, info.num_layers)
    # On NVIDIA GPUs a bf16/f16 projection is MAX's matmul (tensor cores). Not float32:
    # MAX 26.7's appears to run on TF32 tensor cores (errors ~4e-4 on O(1) values measured
    # on an H200), and a float32 cache asks for float32 arithmetic. Not on AMD: MAX 26.7's bf16
    # matmul does not compile for gfx942 through virtual devices ("Cannot select: intrinsic
    # llvm.amdgcn.fdot2.f32.bf16", the compiler aborts). There mokv's own op projects.
    # The activations' dtype decides, not the cache's (an FP8 cache takes any of three).
    on_tensor_cores = (
        hidden.device.is_gpu() and accelerator_api() == "cuda" and hidden.dtype != DType.float32
    )
    name = info.layout.op_name("qkv_epilogue" if on_tensor_cores else "fused_qkv_matmul")
    extra: list[TensorValue] = []
    if freqs_cis is not None:
        freqs_cis = TensorValue(freqs_cis)
        check_dtype("freqs_cis", freqs_cis, DType.float32)
        check_rank("freqs_cis", freqs_cis, 2)
        check_static_dim("freqs_cis", freqs_cis, 1, info.head_size)
        check_device("freqs_cis", freqs_cis, hidden.device)
        extra.append(freqs_cis)
        name += ".rope"
    if wants_check(info, checked):
        positions = rope_rows(freqs_cis) if freqs_cis is not None else None
        collection = emit_table_check(collection, info, offsets, hidden, layer, positions)
    out_type = TensorType(
        hidden.dtype, [hidden.shape[0], n_heads * info.head_size], device=hidden.device
    )
    if on_tensor_cores:
        # MAX's matmul (tensor cores), then mokv's epilogue: RoPE, Q out, K/V into the cache.
        qkv = ops.matmul(hidden, ops.transpose(wqkv, 0, 1))
        values = [qkv, offsets, collection, layer, *extra]
    else:
        values = [hidden, wqkv, offsets, collection, layer, *extra]
    return ops.inplace_custom(name, hidden.device, values, out_types=[out_type])[0].tensor


def rope_rows(freqs_cis: TensorValue) -> TensorValue:
    """[1] uint32 host tensor: the rows of `freqs_cis` (positions RoPE can rotate)."""
    dim = freqs_cis.shape[0]
    if isinstance(dim, StaticDim):
        return host_scalar("max_positions", int(dim), DType.uint32)
    return ops.cast(ops.shape_to_tensor([dim]), DType.uint32)


def rope_freqs_cis(
    head_dim: int, max_seq_len: int, theta: float = 10000.0, inv_freq: np.ndarray | None = None
) -> np.ndarray:
    """Numpy float32 [max_seq_len, head_dim] table for `freqs_cis` (Llama's inverse frequencies).

    Row p = (cos(p * f_0) .. cos(p * f_{d/2-1}), sin(p * f_0) .. sin(p * f_{d/2-1})),
    f_i = theta ** (-2i / head_dim), or `inv_freq[i]` when given: a model that rescales
    its frequencies for long contexts (e.g. Llama 3.1) computes them itself, and `theta`
    is then unused.
    """
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for RoPE, got {head_dim}")
    if inv_freq is None:
        inv = theta ** (-np.arange(0, head_dim // 2, dtype=np.float64) * 2 / head_dim)
    else:
        inv = np.asarray(inv_freq, dtype=np.float64)
        if inv.shape != (head_dim // 2,):
            raise ValueError(f"inv_freq must have shape ({head_dim // 2},), got {inv.shape}")
    ang = np.arange(max_seq_len, dtype=np.float64)[:, None] * inv[None, :]
    return np.concatenate([np.cos(ang), np.sin(ang)], axis=1).astype(np.float32)
