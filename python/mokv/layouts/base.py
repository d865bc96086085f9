"""A cache layout: everything that differs between cache kinds at the graph boundary.

Only flat tensors cross a graph's inputs (MAX 26.7 cannot feed an opaque value into a
graph). A manager's `fetch` returns one tuple of `max.driver.Buffer`s per device and its
`input_symbols` the same tuple of graph types; inside the graph a fetcher turns the
tuple into ONE opaque Mojo collection value, and every mokv kernel takes that value.

A `CacheLayout` names all of it for one cache kind:

    name                 "paged" / "continuous": the `KVCacheStrategy` value and the last
                         part of every op name (`mokv.store_kv.ragged.<name>`)
    Inputs               the NamedTuple of flat tensors, in constructor-op argument order
    ScaledInputs         the same with the scales leaf last, for scaled pages
                         (`KVCacheParams.quantization`; docs/quantized.md)
    input_symbols(...)   the graph types of one device's inputs
    empty_inputs(...)    runtime inputs of those dtypes and ranks that hold no memory
                         (the null manager's, for compile-only builds)
    CollectionType       the `_OpaqueType` of the Mojo collection struct
    Collection           its graph value class (named like the Mojo struct)
    fetch(...)           the graph callable that emits `mokv.kv_collection_ctor.<name>`

Adding a layout is one module beside this one (a `CacheLayout` subclass registered in
`mokv.layouts.LAYOUTS`) plus its Mojo struct and ops.

The `_OpaqueType` name must equal the Mojo struct's simple name, and its parameters must
name every struct parameter. A `DType` parameter is mis-emitted by MAX 26.7
(`dtype=f32`, an unknown name), hence the integer `dtype_code`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, NamedTuple

from max.dtype import DType
from max.graph import BufferValue, DeviceRef, Graph, StaticDim, TensorValue, ops
from max.graph.type import _OpaqueType
from max.graph.value import _OpaqueValue

from ..checks import check_dtype, check_rank, check_static_dim
from ..config.params import KVCacheParams
from ..config.quantization import QUANTIZED_DTYPES
from ..mojo_package import kernels_path

DTYPE_CODES: dict[DType, int] = {
    DType.float32: 0,
    DType.bfloat16: 1,
    DType.float16: 2,
    DType.float8_e4m3fn: 3,  # with its scales: `mokv.kv_collection_ctor.paged.scaled`
}
"""Cache dtypes the kernels support, and their codes (`dtype_of` in mojo/mokv/types.mojo)."""
UNSCALED_FP8_CODE = 4
"""The code of float8_e4m3fn pages without scales (MAX's unscaled FP8 pages; a GPU's)."""


def dtype_code(dtype: DType) -> int:
    """The Mojo dtype code of `dtype`; ValueError for a dtype the kernels do not support."""
    try:
        return DTYPE_CODES[dtype]
    except KeyError:
        raise ValueError(
            f"dtype={dtype} is not supported by the mokv kernels; use one of {list(DTYPE_CODES)}"
        ) from None


class TensorSpec(NamedTuple):
    """Name, dtype and rank of one flat input after `blocks`."""

    name: str
    dtype: DType
    rank: int


class CollectionInfo(NamedTuple):
    """What an op wrapper needs to know about a collection value."""

    layout: CacheLayout
    dtype: DType
    num_heads: int  # KV heads on this device
    head_size: int
    num_layers: int | None = None  # layers of the cache buffer, when known at graph build
    page_size: int | None = None  # tokens per page (paged layouts)
    checked: bool = False  # the fetcher's `checked`: wrappers check the runtime tables
    scaled: bool = False  # FP8 values with per-block scales (not MAX's unscaled pages)
    inputs: tuple[Any, ...] = ()  # the flat input values the collection was built from


class KVCollectionValue(_OpaqueValue):
    """Graph value of a mokv collection, plus what its fetcher knew.

    The Mojo value is a view over the flat inputs; the Python object also carries
    `num_layers` (so that an int `layer_idx` is checked when the graph is built), the
    fetcher's `checked` flag and the flat input values themselves (which the checked
    mode's `mokv.check_tables` op reads). A value re-wrapped from a bare `_OpaqueValue`
    has `num_layers=None`, `checked=False` and no inputs.
    """

    num_layers: int | None = None
    checked: bool = False
    inputs: tuple[Any, ...] = ()


class CacheLayout(ABC):
    """One cache kind's graph boundary (see the module docstring)."""

    name: ClassVar[str]
    Inputs: ClassVar[Any]  # a NamedTuple class: (blocks, *tensors)
    ScaledInputs: ClassVar[Any]  # a NamedTuple class: (blocks, *tensors, scales)
    CollectionType: ClassVar[type[_OpaqueType]]
    Collection: ClassVar[type[_OpaqueValue]]
    tensors: ClassVar[tuple[TensorSpec, ...]]  # the flat inputs after `blocks`

    def __repr__(self) -> str:
        return f"<mokv cache layout {self.name!r}>"

    @abstractmethod
    def input_symbols(
        self,
        params: KVCacheParams,
        num_layers: int,
        max_seq_len: int,
        device: DeviceRef,
        dim_prefix: str = "",
    ) -> Any:
        """The graph types of one device's inputs (an `Inputs` of types); `dim_prefix`
        starts the name of every dim that varies per batch (one per replica)."""

    @abstractmethod
    def empty_inputs(
        self,
        params: KVCacheParams,
        num_layers: int,
        max_seq_len: int,
        batch_size: int,
        num_steps: int,
    ) -> Any:
        """Host buffers of the input dtypes and ranks that hold no cache memory
        (compile-only mode)."""

    def with_scales(
        self,
        params: KVCacheParams,
        inputs: Any,
        values_shape: Sequence[Any],
        make: Callable[[DType, list[Any]], Any],
    ) -> Any:
        """`inputs` (an `Inputs`) as they are, or for scaled pages a `ScaledInputs` whose
        scales leaf is `make(scale dtype, shape)`: a type or a buffer of the shape of
        `params.scales_shape(values_shape)` beside values of `values_shape`."""
        quantization = params.quantization
        shape = params.scales_shape(list(values_shape))
        if quantization is None or shape is None:
            return inputs
        return self.ScaledInputs(*inputs, make(quantization.scale_dtype, shape))

    def collection_parameters(self, params: KVCacheParams) -> dict[str, int]:
        """The Mojo collection struct's parameters."""
        unscaled_fp8 = params.dtype in QUANTIZED_DTYPES and params.quantization is None
        return {
            "dtype_code": UNSCALED_FP8_CODE if unscaled_fp8 else dtype_code(params.dtype),
            "num_heads": params.n_kv_heads_per_device,
            "head_size": params.head_dim,
        }

    def check_blocks(self, blocks: BufferValue, params: KVCacheParams) -> None:  # noqa: B027
        """Checks of `blocks` beyond the dims every layout shares (none by default: a
        layout overrides it only when it has some)."""

    def op_name(self, op: str) -> str:
        """The registered name of `op` for this layout: `mokv.<op>.ragged.<name>`."""
        return f"mokv.{op}.ragged.{self.name}"

    def fetch(
        self, kv_params: KVCacheParams, num_layers: int | None, *inputs: Any, checked: bool = False
    ) -> Any:
        """The collection value of one device's flat input values (see `FetchKVCacheCollection`)."""
        return FetchKVCacheCollection(kv_params, num_layers, layout=self, checked=checked)(*inputs)

    def info(self, collection: _OpaqueValue) -> CollectionInfo:
        """The static facts of a collection value of this layout."""
        params = collection.type.parameters
        code_to_dtype = {code: dtype for dtype, code in DTYPE_CODES.items()}
        code_to_dtype[UNSCALED_FP8_CODE] = DType.float8_e4m3fn
        return CollectionInfo(
            self,
            code_to_dtype[int(params["dtype_code"])],
            int(params["num_heads"]),
            int(params["head_size"]),
            num_layers=getattr(collection, "num_layers", None),
            page_size=int(params["page_size"]) if "page_size" in params else None,
            checked=bool(getattr(collection, "checked", False)),
            scaled=int(params["dtype_code"]) == DTYPE_CODES[DType.float8_e4m3fn],
            inputs=tuple(getattr(collection, "inputs", ())),
        )


def _use_mokv_kernels(graph: Graph) -> None:
    """Adds mokv's kernel package to the graph being built, unless it is there already.

    So that a graph gets mokv's ops without naming `custom_extensions` itself. (Its
    compile prints a harmless warning per collection hand-off unless the caller
    compiles inside `mokv.filter_collection_warnings()`.)
    """
    path = kernels_path()
    if path not in graph.kernel_libraries_paths:
        graph._import_kernels([path])


class FetchKVCacheCollection:
    """Turns one device's flat cache inputs into the layout's opaque collection value.

    Not to be confused with a manager's `fetch`, which returns the runtime Buffers for a
    batch: this one runs while a graph is built, on the graph values of those inputs.

        fetch = FetchPagedKVCacheCollection(kv_params, num_layers=2)
        kv = fetch(*graph.inputs[:4])     # or fetch(the Inputs NamedTuple of values)

    Subclasses set `layout`; the base class takes it as an argument. The graph being
    built gets mokv's kernel package.

    `num_layers` (else the static dim 2 of `blocks`) travels with the collection, so
    the op wrappers reject an int `layer_idx >= num_layers` while the graph is built.

    `checked=True` turns on the kernels' checked mode for every op on this collection
    (an op wrapper's own `checked=` overrides it): before each kernel, the op
    `mokv.check_tables.ragged.<layout>` verifies the runtime tables on the host
    (mojo/mokv/kernels/checks.mojo) and raises, naming the bad entry, instead of
    letting the kernel read or write outside the cache. For tables built by hand;
    a manager's `fetch` output is valid by construction. CPU caches only: on another
    device it is refused here, at graph build.

    Scaled FP8 pages (`kv_params.quantization`) take the layout's `ScaledInputs`, the
    scales last, and build the collection over both (`mokv.kv_collection_ctor.<name>
    .scaled`), paged or continuous, on the CPU, and paged on a GPU (a continuous
    cache's are refused there by name when the collection is built); unscaled FP8 pages
    (MAX's `--kv-cache-format float8_e4m3fn`) take the plain `Inputs` on a GPU, and are
    refused by name on the CPU, whose kernels read scaled pages only.
    """

    layout: CacheLayout

    def __init__(
        self,
        kv_params: KVCacheParams,
        num_layers: int | None = None,
        layout: CacheLayout | None = None,
        *,
        checked: bool = False,
    ) -> None:
        if layout is not None:
            self.layout = layout
        if not isinstance(getattr(self, "layout", None), CacheLayout):
            raise TypeError("FetchKVCacheCollection needs a layout (mokv.PAGED or mokv.CONTINUOUS)")
        if not isinstance(kv_params, KVCacheParams):
            raise TypeError(f"kv_params must be a KVCacheParams, got {type(kv_params).__name__}")
        if num_layers is not None and (
            not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 1
        ):
            raise ValueError(f"num_layers must be a positive int or None, got {num_layers!r}")
        if not isinstance(checked, bool):
            raise TypeError(f"checked must be a bool, got {checked!r}")
        dtype_code(kv_params.dtype)  # fail at construction for an unsupported dtype
        self.kv_params = kv_params
        self.num_layers = num_layers
        self.checked = checked

    def __call__(self, *inputs: Any) -> Any:
        layout, params = self.layout, self.kv_params
        if len(inputs) == 1 and isinstance(inputs[0], tuple):
            inputs = tuple(inputs[0])
        scaled = params.quantization is not None
        expected = 1 + len(layout.tensors) + scaled
        if len(inputs) != expected:
            raise TypeError(
                f"{type(self).__name__} expects the {expected} {layout.name} cache inputs "
                f"{'of scaled pages, the scales last ' if scaled else ''}(or their "
                f"NamedTuple), got {len(inputs)}"
            )
        blocks, *tensors = inputs
        scales = [tensors.pop()] if scaled else []
        if not isinstance(blocks, BufferValue):
            raise TypeError(
                f"blocks must be a BufferValue (a mutable graph input), got {type(blocks).__name__}"
            )
        check_dtype("blocks", blocks, params.dtype)
        check_rank("blocks", blocks, 6)
        check_static_dim("blocks", blocks, 1, 2)
        check_static_dim("blocks", blocks, 4, params.n_kv_heads_per_device)
        check_static_dim("blocks", blocks, 5, params.head_dim)
        if self.num_layers is not None:
            check_static_dim("blocks", blocks, 2, self.num_layers)
        layout.check_blocks(blocks, params)
        for spec, value in zip(layout.tensors, tensors):
            check_dtype(spec.name, value, spec.dtype)
            check_rank(spec.name, value, spec.rank)
        for value in scales:
            _check_scales(value, blocks, params)
        if params.dtype in QUANTIZED_DTYPES and not scaled and blocks.device.is_cpu():
            raise ValueError(
                f"dtype={params.dtype} without scales (MAX's unscaled FP8 pages) on the "
                "CPU: mokv's CPU kernels read scaled pages only; unscaled ones run on a "
                "GPU (docs/quantized.md)"
            )
        if scaled and not blocks.device.is_cpu() and layout.name != "paged":
            raise ValueError(
                f"scaled FP8 pages (quantization={params.quantization!r}) in a {layout.name} "
                f"cache on {blocks.device}: on a GPU mokv reads scaled pages in a paged "
                "cache only (docs/quantized.md)"
            )
        if self.checked and blocks.device != DeviceRef.CPU():
            raise ValueError(
                f"checked=True needs a cache on the CPU (the table check reads the tables on "
                f"the host), got blocks on {blocks.device}"
            )
        _use_mokv_kernels(Graph.current)
        out_type = layout.CollectionType(params)
        tensors = [TensorValue(t) for t in tensors]
        value = ops.inplace_custom(
            f"mokv.kv_collection_ctor.{layout.name}" + (".scaled" if scaled else ""),
            blocks.device,
            [blocks, *scales, *tensors],
            out_types=[out_type],
            parameters=dict(out_type.parameters),
        )[0]
        collection = layout.Collection(value)
        layers_dim = blocks.shape[2]
        collection.num_layers = (
            self.num_layers
            if self.num_layers is not None
            else int(layers_dim)
            if isinstance(layers_dim, StaticDim)
            else None
        )
        collection.checked = self.checked
        collection.inputs = (blocks, *tensors)  # what the checked mode's table check reads
        return collection


def _check_scales(scales: Any, blocks: BufferValue, params: KVCacheParams) -> None:
    """TypeError / ValueError unless `scales` is the scales leaf of `blocks`: a buffer
    of the scale dtype, of the values' shape with `scales_per_head` in the last dim."""
    if not isinstance(scales, BufferValue):
        raise TypeError(
            f"scales must be a BufferValue (a mutable graph input), got {type(scales).__name__}"
        )
    assert params.quantization is not None  # only scaled pages have a scales input
    check_dtype("scales", scales, params.quantization.scale_dtype)
    check_rank("scales", scales, 6)
    for axis, dim in enumerate(blocks.shape[1:-1], start=1):
        if isinstance(dim, StaticDim):
            check_static_dim("scales", scales, axis, int(dim))
    check_static_dim("scales", scales, 5, params.scales_per_head)
