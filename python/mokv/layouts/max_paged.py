"""The paged layout as MAX's own graph ops take it: the one place that knows MAX's form.

mokv's paged pages are byte-identical to MAX's (`blocks [pages, 2, layers, page_size,
kv_heads, head_dim]`, packed), so MAX 26.7's paged ops (`max.nn.kernels`:
`flash_attention_ragged`, `fused_qkv_ragged_matmul`, `rope_split_store_ragged`, ...,
and the `max.nn` layers built on them, e.g. `AttentionWithRope`) run on a mokv cache
once they get the inputs in MAX's form, a `max.nn.kv_cache.KVCacheInputsPerDevice`
(`PagedCacheValues` inside a graph), one per device:

    field                        from mokv's RaggedKVCacheInputs (`fetch`, `input_symbols`)
    kv_blocks                    blocks (the same buffer)
    cache_lengths                cache_lengths (the same buffer)
    lookup_table                 lookup_table (the same buffer: `fetch` pads it as MAX
                                 does, `lookup_table_width` below)
    max_prompt_length  uint32 [1], host   max_lengths[0, 0]: most new tokens of a sequence
    max_cache_length   uint32 [1], host   max_lengths[0, 1]: most cache + new tokens
    page_stride        int64 [1], host    -1: the pages are packed
    attention_dispatch_metadata int64 [4], host   (batch_size, max_prompt_length,
                                 num_partitions, max_cache_length), MAX's `MHAAttnKey`

A cache of scaled FP8 pages (`KVCacheParams.quantization`) has MAX's three scale
fields too, before `attention_dispatch_metadata` (MAX's field order, so its
`max.tree.leaves` order):

    kv_scales                    scales (`ScaledRaggedKVCacheInputs.scales`, the same buffer)
    scales_page_stride int64 [1], host   -1: the scale pages are packed
    scales_lookup_table          lookup_table (the same buffer: the scales share the
                                 values' page ids, as in every MAX cache but its
                                 pooled one)

An MLA cache (`KVCacheParams.kv_dim` 1, MAX's `MLAKVCacheParams`) has MAX's MLA form
instead of the last field, with the query heads of a device (`mla_q_heads`):

    attention_dispatch_metadata int64 [3], on the cache's device   (batch_size,
                                 max_prompt_length, num_partitions), MAX's `MLAAttnKey`
    mla_num_partitions int64 [1], host    num_partitions

On a CPU MAX's MLA dispatch is its sentinel (one partition, the batch's own sizes); on
an accelerator MAX's `mla_dispatch_args_scalar` gives all three.

Everything comes from shapes and the host-side `max_lengths`, so converting a device's
`fetch` output never reads a device buffer back. After `increment_cache_lengths` the
next step's `max_lengths` row 0 gives the next step's values.

Two of MAX's rules that mokv's own tables follow so that MAX's GPU kernels can read them
(also what mokv's GPU ops need when they call MAX's kernels):

- `max_lengths[s, 1]` (hence `max_cache_length`) counts the cache *and* the step's new
  tokens, the bound MAX's GPU attention sizes its work by (a smaller one drops keys);
- the lookup table is `lookup_table_width(n)` columns wide, every entry a valid page id:
  MAX's GPU kernels load up to 16 entries past a row's last page for SIMD alignment
  (`max.nn.kv_cache.padded_lut_cols`; MAX fills them with a null page it allocates,
  mokv with page `LOOKUP_PAD_PAGE`). They only read there; nothing is written.

These are MAX-internal interfaces that move between releases (mokv pins `max==26.7.0`):
every use of them is in this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
from max.driver import CPU, Buffer, Device
from max.dtype import DType
from max.graph import BufferType, BufferValue, DeviceRef, TensorType, TensorValue, Value

from ..config.params import KVCacheParams
from .paged import PagedInputs, RaggedKVCacheInputs, ScaledRaggedKVCacheInputs

if TYPE_CHECKING:  # `max.nn` takes ~0.25 s to import: loaded on first use, not with mokv
    from max.nn.kv_cache import (
        KVCacheInputsPerDevice,
        MHAKVCacheParams,
        MLAKVCacheParams,
        MultiKVCacheParams,
    )

LOOKUP_TABLE_TAIL = 16
"""Columns past the rounded-up width, for the GPU kernels' 16-wide SIMD loads."""

LOOKUP_PAD_PAGE = 0
"""The page id in every lookup-table entry past a sequence's pages (any valid id works:
those entries are read, never written)."""

PACKED_PAGE_STRIDE = -1
"""MAX's `page_stride` for packed pages (`max.nn.kv_cache.PACKED_PAGE_STRIDE`)."""

NUM_MAX_INPUTS = 7
"""Leaves of one device's `KVCacheInputsPerDevice` here (`max.tree.leaves` order); an
MLA cache's has one more (`mla_num_partitions`), a cache of scaled pages
`NUM_SCALE_INPUTS` more."""

NUM_SCALE_INPUTS = 3
"""MAX's scale leaves: `kv_scales`, `scales_page_stride`, `scales_lookup_table`."""


def lookup_table_width(num_pages: int) -> int:
    """Columns of a lookup table whose longest row holds `num_pages` pages:
    `round_up(num_pages, 8) + 16`, MAX's `padded_lut_cols`."""
    return -(-num_pages // 8) * 8 + LOOKUP_TABLE_TAIL


def num_partitions(batch_size: int, max_cache_length: int, n_kv_heads: int, device: Device) -> int:
    """MAX's split of decode attention over the keys: 1 on a CPU (MAX's CPU kernel does
    not split), else MAX's own heuristic for the device."""
    if device.is_host or batch_size < 1:
        return 1
    from max._kv_cache_ops import mha_decode_num_partitions  # needs a device context

    return mha_decode_num_partitions(batch_size, max_cache_length, n_kv_heads, device)


def dispatch_metadata(
    batch_size: int, max_prompt_length: int, max_cache_length: int, partitions: int
) -> np.ndarray:
    """int64 `[4]`: MAX's MHA dispatch metadata, in `MHAAttnKey.pack_into`'s order."""
    return np.array([batch_size, max_prompt_length, partitions, max_cache_length], np.int64)


def mla_dispatch(shape: DispatchShape, mla_q_heads: int, device: Device) -> np.ndarray:
    """int64 `[3]`: MAX's MLA dispatch metadata (`MLAAttnKey.pack_into`'s order: batch
    size, prompt width, partitions) for a batch of `shape` on `device`, whose MLA layers
    have `mla_q_heads` query heads: MAX's sentinel on a CPU (its CPU kernels do not
    split), else MAX's own `mla_dispatch_args_scalar` (which may round the first two)."""
    if device.is_host or shape.batch_size < 1:
        return np.array([shape.batch_size, shape.max_prompt_length, 1], np.int64)
    from max._kv_cache_ops import mla_dispatch_args_scalar  # needs a device context

    args = mla_dispatch_args_scalar(
        shape.batch_size,
        shape.max_cache_length,
        shape.max_prompt_length,
        mla_q_heads,
        False,  # mokv's MLA latents are never FP8 (`KVCacheParams` refuses them)
        device,
    )
    return np.array([int(n) for n in args], np.int64)


def max_input_symbols(
    symbols: PagedInputs[BufferType, TensorType], mla: bool = False
) -> KVCacheInputsPerDevice[TensorType, BufferType]:
    """The graph types of one device's inputs in MAX's form, from mokv's
    `input_symbols()` entry for that device (the extras are host tensors; an MLA
    cache's dispatch metadata is on the cache's device, as MAX declares it; scaled
    pages have MAX's scale fields)."""
    from max.nn.kv_cache import KVCacheInputsPerDevice

    if not isinstance(symbols, (RaggedKVCacheInputs, ScaledRaggedKVCacheInputs)):
        raise TypeError(
            "max_input_symbols takes one device's paged input_symbols() entry "
            f"(RaggedKVCacheInputs), got {type(symbols).__name__}"
        )

    def host(dtype: DType, size: int) -> TensorType:
        return TensorType(dtype, [size], device=DeviceRef.CPU())

    metadata = host(DType.int64, 4)
    if mla:
        metadata = TensorType(DType.int64, [3], device=symbols.blocks.device)
    scales = symbols.scales if isinstance(symbols, ScaledRaggedKVCacheInputs) else None
    scaled = scales is not None
    return KVCacheInputsPerDevice(
        kv_blocks=symbols.blocks,
        cache_lengths=symbols.cache_lengths,
        lookup_table=symbols.lookup_table,
        max_prompt_length=host(DType.uint32, 1),
        max_cache_length=host(DType.uint32, 1),
        page_stride=host(DType.int64, 1),
        kv_scales=scales,
        scales_page_stride=host(DType.int64, 1) if scaled else None,
        scales_lookup_table=symbols.lookup_table if scaled else None,
        attention_dispatch_metadata=metadata,
        mla_num_partitions=host(DType.int64, 1) if mla else None,
    )


class DispatchShape(NamedTuple):
    """The batch shape MAX resolves its attention dispatch for (MAX's
    `BatchCharacteristics`): under graph capture an upper bound of the real batch's."""

    batch_size: int
    max_prompt_length: int
    max_cache_length: int


def max_runtime_inputs(
    inputs: PagedInputs[Buffer, Buffer],
    n_kv_heads_per_device: int,
    lookup_pages: int | None = None,
    dispatch_shape: DispatchShape | None = None,
    mla_q_heads: int | None = None,
) -> KVCacheInputsPerDevice[Buffer, Buffer]:
    """One device's `fetch` output in MAX's form (the same cache buffers, plus host
    scalars from `max_lengths` row 0; nothing is read from the device). `mla_q_heads`:
    the query heads per device of an MLA cache's layers (MAX's MLA form, module
    docstring); None for a cache of K and V heads.

    Graph capture replays a graph built for an upper bound: `lookup_pages` widens the
    lookup table to that many pages (padded as MAX pads, `lookup_table_width`), and
    `dispatch_shape` replaces the batch's own lengths and size in the scalars and the
    dispatch metadata. ValueError if the real batch exceeds either."""
    paged = (RaggedKVCacheInputs, ScaledRaggedKVCacheInputs)
    if not isinstance(inputs, paged) or not isinstance(inputs.blocks, Buffer):
        raise TypeError(
            "max_runtime_inputs takes one device's paged fetch() entry "
            f"(RaggedKVCacheInputs of Buffers), got {type(inputs).__name__}"
        )
    from max.nn.kv_cache import KVCacheInputsPerDevice

    max_lengths = inputs.max_lengths.to_numpy()
    if max_lengths.shape[0] < 1:
        raise ValueError("max_lengths has no step left: fetch again for the next step")
    real = DispatchShape(int(inputs.cache_lengths.shape[0]), *(int(n) for n in max_lengths[0]))
    shape = real
    if dispatch_shape is not None:
        if any(r > d for r, d in zip(real, dispatch_shape)):
            raise ValueError(
                f"the batch {real} exceeds the capture's dispatch shape {dispatch_shape}"
            )
        shape = dispatch_shape
    lookup_table = inputs.lookup_table
    if lookup_pages is not None:
        lookup_table = _widened(
            lookup_table, lookup_table_width(lookup_pages), real.max_cache_length
        )
    device = inputs.blocks.device
    mla_partitions = None
    if mla_q_heads is None:
        metadata = Buffer.from_numpy(
            dispatch_metadata(
                shape.batch_size,
                shape.max_prompt_length,
                shape.max_cache_length,
                num_partitions(
                    shape.batch_size, shape.max_cache_length, n_kv_heads_per_device, device
                ),
            )
        )
    else:
        packed = mla_dispatch(shape, mla_q_heads, device)
        metadata = Buffer.from_numpy(packed)
        metadata = metadata if device.is_host else metadata.to(device)
        mla_partitions = Buffer.from_numpy(packed[2:])
    scales = inputs.scales if isinstance(inputs, ScaledRaggedKVCacheInputs) else None
    scaled = scales is not None
    return KVCacheInputsPerDevice(
        kv_blocks=inputs.blocks,
        cache_lengths=inputs.cache_lengths,
        lookup_table=lookup_table,
        max_prompt_length=Buffer.from_numpy(np.array([shape.max_prompt_length], np.uint32)),
        max_cache_length=Buffer.from_numpy(np.array([shape.max_cache_length], np.uint32)),
        page_stride=_packed_stride(),
        kv_scales=scales,
        scales_page_stride=_packed_stride() if scaled else None,
        scales_lookup_table=lookup_table if scaled else None,
        attention_dispatch_metadata=metadata,
        mla_num_partitions=mla_partitions,
    )


def _packed_stride() -> Buffer:
    """int64 `[1]`, host: MAX's `page_stride` of packed pages."""
    return Buffer.from_numpy(np.array([PACKED_PAGE_STRIDE], np.int64))


def _widened(lookup_table: Buffer, width: int, max_cache_length: int) -> Buffer:
    """The table padded to `width` columns with `LOOKUP_PAD_PAGE` (on its own device);
    ValueError if that is narrower than it (the batch reaches `max_cache_length`)."""
    have = int(lookup_table.shape[1])
    if width < have:
        raise ValueError(
            f"the capture's lookup table of {width} columns is narrower than the batch's "
            f"{have} (it reaches {max_cache_length} tokens)"
        )
    if width == have:
        return lookup_table
    host = (
        lookup_table.to_numpy()
        if lookup_table.device.is_host
        else lookup_table.to(CPU()).to_numpy()
    )
    wide = np.full((host.shape[0], width), LOOKUP_PAD_PAGE, dtype=host.dtype)
    wide[:, :have] = host
    out = Buffer.from_numpy(wide)
    return out if lookup_table.device.is_host else out.to(lookup_table.device)


def max_cache_values(values: Sequence[Value[Any]]) -> KVCacheInputsPerDevice[TensorValue, Any]:
    """`PagedCacheValues` (what `max.nn`'s attention layers take) from one device's
    `NUM_MAX_INPUTS` graph input values (one more for an MLA cache, `NUM_SCALE_INPUTS`
    more for a cache of scaled pages), in the order `max.tree.leaves` gives
    `max_input_symbols`'s types."""
    from max.nn.kv_cache import KVCacheInputsPerDevice

    values = list(values)
    counts = (NUM_MAX_INPUTS, NUM_MAX_INPUTS + 1)
    if len(values) not in counts and len(values) - NUM_SCALE_INPUTS not in counts:
        raise ValueError(
            f"expected the {NUM_MAX_INPUTS} MAX cache inputs (one more of an MLA cache, "
            f"{NUM_SCALE_INPUTS} more of scaled pages), got {len(values)}"
        )
    scale_inputs = NUM_SCALE_INPUTS if len(values) - NUM_SCALE_INPUTS in counts else 0
    blocks, *tensors = values
    if not isinstance(blocks, BufferValue):
        blocks = blocks.buffer
    cache_lengths, lookup_table, max_prompt, max_cache, page_stride, *rest = tensors
    scales: list[Any] = rest[:scale_inputs]
    metadata, *mla = rest[scale_inputs:]
    if scales:  # a buffer, then two tensors
        kv_scales = scales[0]
        scales = [
            kv_scales if isinstance(kv_scales, BufferValue) else kv_scales.buffer,
            *(_tensor(t) for t in scales[1:]),
        ]
    return KVCacheInputsPerDevice(
        kv_blocks=blocks,
        cache_lengths=_tensor(cache_lengths),
        lookup_table=_tensor(lookup_table),
        max_prompt_length=_tensor(max_prompt),
        max_cache_length=_tensor(max_cache),
        page_stride=_tensor(page_stride),
        kv_scales=scales[0] if scales else None,
        scales_page_stride=scales[1] if scales else None,
        scales_lookup_table=scales[2] if scales else None,
        attention_dispatch_metadata=_tensor(metadata),
        mla_num_partitions=_tensor(mla[0]) if mla else None,
    )


def _tensor(value: Any) -> TensorValue:
    return value if isinstance(value, TensorValue) else value.tensor


def max_kv_params(
    params: KVCacheParams,
    num_layers: int,
    devices: Sequence[DeviceRef],
    num_q_heads: int | None = None,
) -> MHAKVCacheParams | MLAKVCacheParams | MultiKVCacheParams:
    """MAX 26.7's `KVCacheParams` of the same cache, for MAX's layers (`kv_params=`): a
    cache of groups (`params.groups`) is MAX's `MultiKVCacheParams` of one child per
    group, under the group's name, in order (a windowed child has its `window_size`);
    a cache of one MLA group is MAX's `MLAKVCacheParams`, which needs the model's query
    heads (`num_q_heads`, ValueError without them). Quantized pages carry MAX's
    `kvcache_quant_config`. Recurrent state (`params.recurrent`) is a
    `RecurrentStateParams` child after the attention children, under its name."""
    from max.nn.kv_cache import (
        KVCacheQuantizationConfig,
        MHAKVCacheParams,
        MLAKVCacheParams,
        MultiKVCacheParams,
        RecurrentStateParams,
        RecurrentStateRegion,
    )

    quantization = params.quantization
    quant_config = (
        None
        if quantization is None
        else KVCacheQuantizationConfig(
            scale_dtype=quantization.scale_dtype,
            quantization_granularity=quantization.granularity,
        )
    )

    def leaf(
        p: KVCacheParams, layers: int, window: int | None
    ) -> MHAKVCacheParams | MLAKVCacheParams:
        shared = dict(
            dtype=p.dtype,
            head_dim=p.head_dim,
            num_layers=layers,
            devices=list(devices),
            page_size=p.page_size,
            enable_prefix_caching=p.enable_prefix_caching,
            data_parallel_degree=p.data_parallel_degree,
            kvcache_quant_config=quant_config,
        )
        if p.mla_group is None:
            return MHAKVCacheParams(n_kv_heads=p.n_kv_heads, window_size=window, **shared)
        if type(num_q_heads) is not int or num_q_heads < 1:
            raise ValueError(
                f"an MLA cache's MAX params need the model's query heads: num_q_heads must "
                f"be a positive int, got {num_q_heads!r}"
            )
        return MLAKVCacheParams(num_q_heads=num_q_heads, **shared)

    state = params.recurrent
    if state is None and (not params.groups or params.mla_group is not None):
        return leaf(params, num_layers, None)
    children: dict[str, Any] = {
        g.name: leaf(params.group_params(g), g.num_layers, g.window_size)
        for g in params.cache_groups(num_layers)
    }
    if state is not None:
        children[state.name] = RecurrentStateParams(
            regions=tuple(
                RecurrentStateRegion(r.leaf_id, r.num_layers, r.row_shape, r.dtype)
                for r in state.regions
            ),
            devices=list(devices),
            data_parallel_degree=params.data_parallel_degree,
        )
    return MultiKVCacheParams.from_params(children)
