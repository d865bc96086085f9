"""Graph-build-time checks of graph values, shared by the layouts and the op wrappers.

Each raises at once, naming the argument and the offending value, so that a wrong
shape fails in Python with a readable message instead of deep in the Mojo compiler.
This module imports nothing else from mokv, so any module may use it.
"""

from __future__ import annotations

from typing import Any

from max.dtype import DType
from max.graph import BufferValue, DeviceRef, Dim, StaticDim, TensorValue


def as_tensor(name: str, value: Any) -> TensorValue | BufferValue:
    """`value` as a graph tensor; TypeError if it is not tensor-like."""
    if isinstance(value, (TensorValue, BufferValue)):
        return value
    try:
        return TensorValue(value)
    except Exception as exc:  # noqa: BLE001 - re-raised with the argument's name
        raise TypeError(
            f"{name} must be a graph tensor, got {type(value).__name__}: {exc}"
        ) from None


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
    shape = as_tensor(name, value).shape
    dim = shape[axis]
    if not isinstance(dim, StaticDim) or int(dim) != expected:
        raise ValueError(f"{name} dim {axis} must be {expected}, got {dim} (shape {list(shape)})")


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
