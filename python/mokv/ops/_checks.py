"""Graph-build-time argument checks shared by the op wrappers.

Each raises at once, naming the argument and the offending value, so that a wrong
shape fails in Python with a readable message instead of deep in the Mojo compiler.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from max.dtype import DType
from max.graph import BufferValue, DeviceRef, Dim, StaticDim, TensorValue, ops
from max.graph.value import _OpaqueValue


def as_tensor(name: str, value: Any) -> TensorValue | BufferValue:
    """`value` as a graph tensor; TypeError if it is not tensor-like."""
    if isinstance(value, (TensorValue, BufferValue)):
        return value
    try:
        return TensorValue(value)
    except Exception as exc:  # noqa: BLE001 - re-raised with the argument's name
        raise TypeError(f"{name} must be a graph tensor, got {type(value).__name__}: {exc}") from None


def check_dtype(name: str, value: Any, *dtypes: DType) -> None:
    """TypeError unless `value.dtype` is one of `dtypes`."""
    dtype = as_tensor(name, value).dtype
    if dtype not in dtypes:
        allowed = " or ".join(d.name for d in dtypes)
        raise TypeError(f"{name} must have dtype {allowed}, got {dtype.name}")


def check_rank(name: str, value: Any, rank: int) -> None:
    """ValueError unless `value` has `rank` dimensions."""
    shape = as_tensor(name, value).shape
    if len(shape) != rank:
        raise ValueError(f"{name} must have rank {rank}, got shape {list(shape)}")


def check_static_dim(name: str, value: Any, axis: int, expected: int) -> None:
    """ValueError unless dim `axis` of `value` is the static size `expected`."""
    dim = as_tensor(name, value).shape[axis]
    if not isinstance(dim, StaticDim) or int(dim) != expected:
        raise ValueError(f"{name} dim {axis} must be {expected}, got {dim} (shape {list(as_tensor(name, value).shape)})")


def check_same_dim(name_a: str, a: Any, axis_a: int, name_b: str, b: Any, axis_b: int) -> None:
    """ValueError when two dims are both static and differ, or are different symbols."""
    da: Dim = as_tensor(name_a, a).shape[axis_a]
    db: Dim = as_tensor(name_b, b).shape[axis_b]
    if da != db:
        raise ValueError(f"{name_a} dim {axis_a} ({da}) must equal {name_b} dim {axis_b} ({db})")


def check_device(name: str, value: Any, device: DeviceRef) -> None:
    """ValueError unless `value` lives on `device`."""
    got = as_tensor(name, value).device
    if got != device:
        raise ValueError(f"{name} must be on {device}, got {got}")


_CACHE_KINDS = {"ContinuousBatchingKVCacheCollection": "continuous", "PagedKVCacheCollection": "paged"}


class CollectionInfo(NamedTuple):
    """What a wrapper needs to know about an opaque collection value."""

    kind: str  # "continuous" or "paged": the last component of the op name
    dtype: DType
    num_heads: int  # KV heads on this device
    head_size: int


def check_collection(name: str, value: Any) -> CollectionInfo:
    """The kind and static shape of a mokv collection; TypeError for anything else."""
    from ..graph.types import DTYPE_CODES  # local: graph imports this module

    if not isinstance(value, _OpaqueValue):
        raise TypeError(f"{name} must be a KV cache collection value, got {type(value).__name__}")
    t = value.type
    kind = _CACHE_KINDS.get(t.name)
    if kind is None:
        raise TypeError(f"{name} must be a mokv cache collection, got opaque type {t.name!r}")
    code_to_dtype = {code: dtype for dtype, code in DTYPE_CODES.items()}
    params = t.parameters
    return CollectionInfo(
        kind, code_to_dtype[int(params["dtype_code"])], int(params["num_heads"]), int(params["head_size"])
    )


def host_scalar(name: str, value: Any, dtype: DType) -> TensorValue:
    """`value` (a Python number or a host tensor of one element) as a [1] host tensor.

    The kernels read such scalars on the host at run time, so one compiled kernel serves
    every value (a kernel parameter would compile one instance per value). Rank 1 rather
    than rank 0 because MAX 26.7 hands a rank-0 constant to a custom op as rank 1.
    """
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a number or a {dtype} host tensor, got {value!r}")
    if isinstance(value, (int, float, np.number)):
        return ops.constant(np.array([value], dtype=dtype.to_numpy()), dtype, device=DeviceRef.CPU())
    check_dtype(name, value, dtype)
    check_device(name, value, DeviceRef.CPU())
    t = TensorValue(value)
    if len(t.shape) > 1 or (len(t.shape) == 1 and t.shape[0] != 1):
        raise ValueError(f"{name} must be a scalar or a [1] tensor, got shape {list(t.shape)}")
    return ops.reshape(t, [1])


def layer_index(layer_idx: Any) -> TensorValue:
    """`layer_idx` (int or uint32 host scalar tensor) as the [1] uint32 host tensor kernels read."""
    if isinstance(layer_idx, (bool, float, np.floating)):
        raise TypeError(f"layer_idx must be an int or a uint32 scalar tensor, got {layer_idx!r}")
    if isinstance(layer_idx, (int, np.integer)) and layer_idx < 0:
        raise ValueError(f"layer_idx must be >= 0, got {layer_idx}")
    return host_scalar("layer_idx", layer_idx, DType.uint32)


def check_row_offsets(input_row_offsets: Any, device: DeviceRef) -> TensorValue:
    """`input_row_offsets` uint32 [batch_size + 1] on `device`."""
    check_dtype("input_row_offsets", input_row_offsets, DType.uint32)
    check_rank("input_row_offsets", input_row_offsets, 1)
    check_device("input_row_offsets", input_row_offsets, device)
    return TensorValue(input_row_offsets)
