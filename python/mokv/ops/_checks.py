"""Graph-build-time argument checks specific to the op wrappers (scalars, offsets,
supported head sizes), and the checked mode's run-time table check.

The generic value checks are in `mokv.checks`; a collection argument is checked by
`mokv.layouts.collection_info`, which also tells the wrapper the collection's layout.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from max.driver import accelerator_api, accelerator_architecture_name, accelerator_count
from max.dtype import DType
from max.graph import DeviceRef, TensorValue, ops

from ..checks import check_device, check_dtype, check_rank


def host_scalar(name: str, value: Any, dtype: DType) -> TensorValue:
    """`value` (a Python number or a host tensor of one element) as a [1] host tensor.

    The kernels read such scalars on the host at run time, so one compiled kernel serves
    every value (a kernel parameter would compile one instance per value). Rank 1 rather
    than rank 0 because MAX 26.7 hands a rank-0 constant to a custom op as rank 1.
    """
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a number or a {dtype} host tensor, got {value!r}")
    if isinstance(value, (int, float, np.number)):
        return ops.constant(
            np.array([value], dtype=dtype.to_numpy()), dtype, device=DeviceRef.CPU()
        )
    check_dtype(name, value, dtype)
    check_device(name, value, DeviceRef.CPU())
    t = TensorValue(value)
    if len(t.shape) > 1 or (len(t.shape) == 1 and t.shape[0] != 1):
        raise ValueError(f"{name} must be a scalar or a [1] tensor, got shape {list(t.shape)}")
    return ops.reshape(t, [1])


def layer_index(layer_idx: Any, num_layers: int | None = None) -> TensorValue:
    """`layer_idx` (int or uint32 host scalar tensor) as the [1] uint32 host tensor kernels read.

    An int is checked against `num_layers` (the collection's, when its fetcher knew it);
    a tensor's value is only known at run time (checked mode checks it there).
    """
    if isinstance(layer_idx, (bool, float, np.floating)):
        raise TypeError(f"layer_idx must be an int or a uint32 scalar tensor, got {layer_idx!r}")
    if isinstance(layer_idx, (int, np.integer)):
        if layer_idx < 0:
            raise ValueError(f"layer_idx must be >= 0, got {layer_idx}")
        if num_layers is not None and layer_idx >= num_layers:
            raise ValueError(
                f"layer_idx={layer_idx} is out of range: the collection has num_layers={num_layers}"
            )
    return host_scalar("layer_idx", layer_idx, DType.uint32)


QUANTIZED_CACHE_DTYPES = (DType.float8_e4m3fn,)
"""Cache dtypes whose values the kernels quantize as they write and dequantize as they
read (MAX 26.7's FP8 pages, scaled or not), computing in the activations' dtype."""
COMPUTE_DTYPES = (DType.float32, DType.bfloat16, DType.float16)


def check_activation_dtype(
    name: str, x: TensorValue, cache_dtype: DType, op: str, scaled: bool
) -> None:
    """`x` (q, k, v or hidden) must have the cache's dtype, or, over a quantized (FP8)
    cache, a float dtype to compute in; bfloat16 over scaled pages on a GPU (MAX's
    kernel reads them dequantized to bfloat16 there)."""
    if cache_dtype not in QUANTIZED_CACHE_DTYPES:
        check_dtype(name, x, cache_dtype)
        return
    check_dtype(name, x, *COMPUTE_DTYPES)
    if scaled and not x.device.is_cpu() and x.dtype != DType.bfloat16:
        raise ValueError(
            f"{op}: over a {cache_dtype.name} cache on a GPU, {name} must be bfloat16 (MAX's "
            f"attention kernel reads the pages dequantized to bfloat16), got {x.dtype.name}"
        )


NATIVE_FP8_CUDA_ARCHS = ("sm_100", "sm_101", "sm_103")
"""NVIDIA GPUs on which MAX 26.7's attention reads FP8 pages (its native FP8 path, Blackwell
datacenter parts: `_is_sm10x_gpu`); on AMD GPUs it does too, on none before sm_100."""


def check_native_fp8_attention(op: str, device: DeviceRef) -> None:
    """ValueError naming the GPU unless MAX's attention reads FP8 pages on it (when
    the graph is built where MAX sees a GPU, virtual ones included; elsewhere the
    compile for the GPU stops in MAX's kernel)."""
    if device.is_cpu() or accelerator_count() == 0 or accelerator_api() != "cuda":
        return
    arch = accelerator_architecture_name()
    if not arch.startswith(NATIVE_FP8_CUDA_ARCHS):
        raise ValueError(
            f"{op} over unscaled FP8 pages on {arch}: MAX 26.7's attention reads FP8 pages "
            f"only on its native FP8 path, on {', '.join(NATIVE_FP8_CUDA_ARCHS)} or AMD "
            "GPUs (docs/quantized.md)"
        )


CPU_HEAD_DIM_MULTIPLE = 16
"""The CPU fused_qkv_matmul and flash_attention kernels work on whole 16-lane vectors."""
GPU_MAX_HEAD_DIM = 1024
"""The GPU fused_qkv_matmul kernel runs one thread per feature of a head (a block of head_dim)."""
GPU_PAGE_MULTIPLE = 128
"""On a GPU, paged attention is MAX 26.7's kernel, whose key tiles (64 or 128 tokens) must
lie within one page: MAX's own paged cache takes pages of a multiple of 128 tokens only."""
CPU_MAX_GROUP = 64
"""The CPU flash_attention kernel keeps every query head of a GQA group in one work unit."""


def check_head_dim(op: str, head_dim: int, device: DeviceRef, rope: bool = False) -> None:
    """ValueError naming the supported values unless `op`'s kernel runs `head_dim` on `device`."""
    if device.is_cpu():
        if head_dim % CPU_HEAD_DIM_MULTIPLE:
            raise ValueError(
                f"{op} on the CPU needs head_dim to be a multiple of {CPU_HEAD_DIM_MULTIPLE} "
                f"(16, 32, 48, 64, 80, 96, 128, ...), got head_dim={head_dim}"
            )
    else:
        if head_dim > GPU_MAX_HEAD_DIM:
            raise ValueError(
                f"{op} on a GPU supports head_dim <= {GPU_MAX_HEAD_DIM}, got {head_dim}"
            )
        if rope and head_dim % 2:
            raise ValueError(f"{op} with RoPE needs an even head_dim, got {head_dim}")


def check_group(op: str, n_heads: int, n_kv_heads: int, device: DeviceRef) -> None:
    """ValueError unless the query heads per KV head are supported on `device`."""
    if device.is_cpu() and n_heads // n_kv_heads > CPU_MAX_GROUP:
        raise ValueError(
            f"{op} on the CPU supports at most {CPU_MAX_GROUP} query heads per KV head, got "
            f"{n_heads} query heads over {n_kv_heads} KV heads"
        )


def check_gpu_page_size(op: str, info: Any, device: DeviceRef) -> None:
    """ValueError unless a paged cache's pages suit MAX's attention kernel on a GPU."""
    if not device.is_cpu() and info.page_size is not None and info.page_size % GPU_PAGE_MULTIPLE:
        raise ValueError(
            f"{op} on a GPU runs MAX's attention kernel, which needs pages of a multiple of "
            f"{GPU_PAGE_MULTIPLE} tokens; this paged cache has page_size={info.page_size}"
        )


def wants_check(info: Any, checked: bool | None) -> bool:
    """Whether an op checks its tables: the wrapper's `checked`, else the collection's."""
    if checked is None:
        return bool(info.checked)
    if not isinstance(checked, bool):
        raise TypeError(f"checked must be a bool or None, got {checked!r}")
    return checked


def emit_table_check(
    collection: Any,
    info: Any,
    offsets: TensorValue,
    rows: TensorValue,
    layer_idx: TensorValue,
    max_positions: TensorValue | None = None,
) -> Any:
    """Emits `mokv.check_tables.ragged.<layout>` (checked mode); returns the collection
    value that the guarded kernel must take instead of `collection`.

    The op reads the collection's flat inputs, `offsets`, dim 0 of `rows` (the kernel's
    token rows: total_tokens), `layer_idx` and `max_positions` ([1] uint32 host: a cap
    on cache length + new tokens, the RoPE table's rows) on the host, raises at run
    time naming the first bad entry (mojo/mokv/kernels/checks.mojo), and returns the
    collection unchanged. The kernel's dependency on that returned value is what orders
    it after the check and skips it when the check raised: MAX 26.7 does not keep the
    device chain's order between an op on the blocks buffer and ops on the collection.
    """
    if not info.inputs:
        raise ValueError(
            "checked mode needs a collection built by a mokv fetcher (FetchPagedKVCacheCollection, "
            "...): this one does not carry its flat inputs"
        )
    blocks, cache_lengths, lookup_table = info.inputs[:3]
    if blocks.device != DeviceRef.CPU():
        raise ValueError(f"checked mode needs a cache on the CPU, got blocks on {blocks.device}")
    rows = TensorValue(rows)
    if len(rows.shape) != 2:
        rows = ops.reshape(rows, [rows.shape[0], -1])
    if max_positions is None:
        max_positions = host_scalar("max_positions", 0, DType.uint32)
    out_type = collection.type
    checked = ops.inplace_custom(
        info.layout.op_name("check_tables"),
        blocks.device,
        [collection, blocks, cache_lengths, lookup_table, offsets, rows, layer_idx, max_positions],
        out_types=[out_type],
        parameters=dict(out_type.parameters),
    )[0]
    value = info.layout.Collection(checked)
    value.num_layers, value.checked, value.inputs = info.num_layers, info.checked, info.inputs
    return value


def check_row_offsets(input_row_offsets: Any, device: DeviceRef) -> TensorValue:
    """`input_row_offsets` uint32 [batch_size + 1] on `device`."""
    check_dtype("input_row_offsets", input_row_offsets, DType.uint32)
    check_rank("input_row_offsets", input_row_offsets, 1)
    check_device("input_row_offsets", input_row_offsets, device)
    return TensorValue(input_row_offsets)
