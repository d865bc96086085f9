"""Graph types and values of the opaque Mojo cache collections (seed 002).

Inside one graph the cache travels as ONE opaque value built by a constructor op from
the flat inputs of `mokv.inputs` (only flat tensors may cross a graph boundary: MAX 26.7
cannot feed or return opaque values). Every mokv kernel takes that value.

The `_OpaqueType` name must equal the Mojo struct's simple name, and its parameters
must name every struct parameter (see mojo/mokv/continuous.mojo, paged.mojo). A
`DType` parameter is mis-emitted by MAX 26.7 (`dtype=f32`), hence `dtype_code`.
"""

from __future__ import annotations

from max.dtype import DType
from max.graph.type import _OpaqueType
from max.graph.value import _OpaqueValue

from ..params import KVCacheParams

DTYPE_CODES: dict[DType, int] = {DType.float32: 0, DType.bfloat16: 1, DType.float16: 2}
"""Cache dtypes the kernels support, and their codes (`dtype_of` in mojo/mokv/types.mojo)."""


def dtype_code(dtype: DType) -> int:
    """The Mojo dtype code of `dtype`; ValueError for a dtype the kernels do not support."""
    try:
        return DTYPE_CODES[dtype]
    except KeyError:
        raise ValueError(
            f"dtype={dtype} is not supported by the mokv kernels; use one of {list(DTYPE_CODES)}"
        ) from None


def _static_params(kv_params: KVCacheParams) -> dict[str, int]:
    return {
        "dtype_code": dtype_code(kv_params.dtype),
        "num_heads": kv_params.n_kv_heads_per_device,
        "head_size": kv_params.head_dim,
    }


class ContinuousBatchingKVCacheCollectionType(_OpaqueType):
    """Graph type of the K/V view over every layer of a continuous-batching cache.

    The value does not own the cache memory: it points into the manager's buffers.
    """

    def __init__(self, kv_params: KVCacheParams) -> None:
        super().__init__("ContinuousBatchingKVCacheCollection", _static_params(kv_params))


class PagedKVCacheCollectionType(_OpaqueType):
    """Graph type of the K/V view over every layer of a paged cache."""

    def __init__(self, kv_params: KVCacheParams) -> None:
        params = _static_params(kv_params)
        params["page_size"] = kv_params.page_size
        super().__init__("PagedKVCacheCollection", params)


class ContinuousBatchingKVCacheType(_OpaqueType):
    """Graph type of ONE layer's K or V cache (Mojo `ContinuousBatchingKVCache`).

    Kept for parity with the seed API. No mokv op produces or consumes it: kernels
    take the collection plus a `layer_idx`, and the Mojo struct's `dtype_` parameter
    cannot be passed through an opaque type in MAX 26.7.
    """

    def __init__(self, kv_params: KVCacheParams) -> None:
        params = _static_params(kv_params)
        super().__init__("ContinuousBatchingKVCache", params)


class ContinuousBatchingKVCacheCollection(_OpaqueValue):
    """Graph value of a `ContinuousBatchingKVCacheCollectionType` (a view, owns nothing)."""


class ContinuousBatchingKVCache(_OpaqueValue):
    """Graph value of a `ContinuousBatchingKVCacheType`."""


class PagedKVCacheCollection(_OpaqueValue):
    """Graph value of a `PagedKVCacheCollectionType` (a view, owns nothing)."""
