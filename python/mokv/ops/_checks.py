"""Graph-build-time argument checks specific to the op wrappers (scalars, offsets).

The generic value checks are in `mokv.checks`; a collection argument is checked by
`mokv.layouts.collection_info`, which also tells the wrapper the collection's layout.
"""

from __future__ import annotations

from typing import Any

import numpy as np
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
