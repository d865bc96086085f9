"""Wrappers of mokv's MLA ops (`mokv.mla_store.ragged.paged`, `mokv.mla_attention.ragged.paged`,
mojo/mokv/mla_ops.mojo): store a step's latents into an MLA cache's pages, and attend
over them in the absorbed form (docs/mla.md).

Both take the cache in MAX's form, the `KVCacheInputsPerDevice` of graph values that
`mokv.max_cache_values` makes of one device's inputs (`max_input_symbols(mla=True)`), so
that one set of graph inputs serves mokv's ops and MAX's MLA layers alike. On the CPU
both are mokv's kernels; on a GPU the store is mokv's kernel and the attention MAX 26.7's
MLA decode kernel (`mo.mla.decode.ragged.paged`) on the same pages.
"""

from __future__ import annotations

from typing import Any

from max.dtype import DType
from max.graph import Graph, TensorType, TensorValue, ops

from ..checks import check_device, check_dtype, check_rank, check_same_dim, check_static_dim
from ..layouts.base import _use_mokv_kernels
from ._checks import check_row_offsets, host_scalar, layer_index

CPU_MLA_MULTIPLE = 16
"""The CPU MLA attention kernel works on whole 16-lane vectors of a row and a latent."""


def _blocks(cache: Any) -> Any:
    """The cache's pages, checked to be an MLA block `[pages, 1, layers, page_size, 1,
    row_size]` (TypeError / ValueError naming what is not)."""
    blocks = getattr(cache, "kv_blocks", None)
    if blocks is None:
        raise TypeError(
            "cache must be one device's KVCacheInputsPerDevice of graph values "
            f"(mokv.max_cache_values), got {type(cache).__name__}"
        )
    check_rank("cache.kv_blocks", blocks, 6)
    check_static_dim("cache.kv_blocks", blocks, 1, 1)
    check_static_dim("cache.kv_blocks", blocks, 4, 1)
    return blocks


def mla_store(
    cache: Any,
    latent: TensorValue,
    k_rope: TensorValue,
    input_row_offsets: TensorValue,
    layer_idx: int | TensorValue,
) -> None:
    """Stores one layer's new latents and RoPE keys: token `i` of batch entry `b` (flat
    row `input_row_offsets[b] + i`) at position `cache_lengths[b] + i`, its row
    `[latent ; k_rope]`.

    Args:
        cache: one device's MLA cache values (`mokv.max_cache_values`).
        latent: [total_tokens, latent_dim] (the compressed KV, after its norm).
        k_rope: [total_tokens, rope_dim] (the shared RoPE key, rotated), latent's dtype;
            latent_dim + rope_dim is the cache's row size.
        input_row_offsets: uint32 [batch_size + 1].
        layer_idx: layer to write (int, or a uint32 scalar tensor on the host).
    """
    blocks = _blocks(cache)
    latent, k_rope = TensorValue(latent), TensorValue(k_rope)
    for name, x in (("latent", latent), ("k_rope", k_rope)):
        check_rank(name, x, 2)
        check_device(name, x, blocks.device)
    check_dtype("k_rope", k_rope, latent.dtype)
    check_same_dim("latent", latent, 0, "k_rope", k_rope, 0)
    row = int(blocks.shape[5])
    if int(latent.shape[1]) + int(k_rope.shape[1]) != row:
        raise ValueError(
            f"latent dim 1 ({latent.shape[1]}) + k_rope dim 1 ({k_rope.shape[1]}) must be "
            f"the cache's row size {row}"
        )
    offsets = check_row_offsets(input_row_offsets, blocks.device)
    _use_mokv_kernels(Graph.current)
    ops.inplace_custom(
        "mokv.mla_store.ragged.paged",
        blocks.device,
        [
            blocks,
            latent,
            k_rope,
            offsets,
            cache.cache_lengths,
            cache.lookup_table,
            layer_index(layer_idx, int(blocks.shape[2])),
        ],
    )


def mla_attention(
    cache: Any,
    q: TensorValue,
    input_row_offsets: TensorValue,
    layer_idx: int | TensorValue,
    scale: float,
    rope_dim: int,
) -> TensorValue:
    """Causal MLA attention of this step's absorbed queries over the cached latents.

    New token `i` of entry `b` reads positions `0 .. cache_lengths[b] + i` (its own row,
    and those of the entry's earlier new tokens, stored first: `mla_store`). Head `h`'s
    query is `[W_UK_h^T q_nope_h ; q_rope_h]` (the key up-projection folded in), its
    score with row `j` the dot product with `[c_j ; r_j]`, its output the
    softmax-weighted sum of the latents `c_j` (apply `W_UV_h` after).

    Args:
        cache: one device's MLA cache values (`mokv.max_cache_values`).
        q: [total_tokens, n_heads, row_size], the cache's dtype.
        input_row_offsets: uint32 [batch_size + 1].
        layer_idx: layer to read (int, or a uint32 scalar tensor on the host).
        scale: softmax scale (DeepSeek: 1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)).
        rope_dim: the RoPE part of a row (the rest is the latent).

    On the CPU, mokv's kernel (row size and latent width multiples of 16); on a GPU,
    MAX's MLA decode kernel, which takes a 64-wide RoPE key.

    Returns:
        [total_tokens, n_heads, latent_dim] in q's dtype.
    """
    blocks = _blocks(cache)
    q = TensorValue(q)
    check_rank("q", q, 3)
    check_dtype("q", q, blocks.dtype)
    check_device("q", q, blocks.device)
    row = int(blocks.shape[5])
    check_static_dim("q", q, 2, row)
    if rope_dim.__class__ is not int or not 0 < rope_dim < row:
        raise ValueError(f"rope_dim must be an int in (0, {row}), got {rope_dim!r}")
    latent_dim = row - rope_dim
    offsets = check_row_offsets(input_row_offsets, q.device)
    layer = layer_index(layer_idx, int(blocks.shape[2]))
    if not q.device.is_cpu():
        # MAX's op takes the layer as a rank-0 host scalar.
        return _max_mla_decode(cache, q, offsets, ops.reshape(layer, []), scale, rope_dim)
    if row % CPU_MLA_MULTIPLE or latent_dim % CPU_MLA_MULTIPLE:
        raise ValueError(
            f"mla_attention on the CPU needs the row size ({row}) and the latent width "
            f"({latent_dim}) to be multiples of {CPU_MLA_MULTIPLE}"
        )
    _use_mokv_kernels(Graph.current)
    out_type = TensorType(q.dtype, [q.shape[0], q.shape[1], latent_dim], device=q.device)
    return ops.inplace_custom(
        "mokv.mla_attention.ragged.paged",
        q.device,
        [
            q,
            offsets,
            blocks,
            cache.cache_lengths,
            cache.lookup_table,
            layer,
            host_scalar("scale", scale, DType.float32),
        ],
        out_types=[out_type],
    )[0].tensor


MAX_MLA_ROPE_DIM = 64
"""The RoPE width MAX 26.7's GPU MLA kernels take (DeepSeek's)."""


def _max_mla_decode(
    cache: Any, q: TensorValue, offsets: TensorValue, layer: TensorValue, scale: float, rope: int
) -> TensorValue:
    """MAX's MLA decode kernel on the same pages (a GPU), causal."""
    from max.nn.attention.mask_config import MHAMaskVariant
    from max.nn.kernels import flare_mla_decode_ragged

    if rope != MAX_MLA_ROPE_DIM:
        raise ValueError(
            f"mla_attention on a GPU is MAX's kernel, which takes rope_dim="
            f"{MAX_MLA_ROPE_DIM}, got {rope}"
        )
    if cache.attention_dispatch_metadata is None or cache.mla_num_partitions is None:
        raise ValueError("a GPU MLA cache needs MAX's MLA inputs (max_input_symbols(mla=True))")

    class _PageSize:  # all flare_mla_decode_ragged reads of its kv_params
        page_size = int(cache.kv_blocks.shape[3])

    return flare_mla_decode_ragged(
        _PageSize(),
        q,
        offsets,
        cache,
        layer,
        MHAMaskVariant.CAUSAL_MASK,
        scale,
        cache.attention_dispatch_metadata,
        qk_rope_dim=rope,
    )
