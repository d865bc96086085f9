"""Scaled FP8 pages (fp8.mojo's format) on a GPU: the writes quantize with the CPU's
own row quantizer, and attention reads the pages through a bfloat16 copy.

  * Writes: one GPU thread per (token, head) runs `store_row`, the function the CPU
    kernels call, so a row's bytes and scales are the CPU's for the same values by
    construction (float32 division, nearest-even, saturating; zeros -> scale 0).
  * Reads: MAX 26.7's GPU attention kernels take no per-block scales for an MHA cache
    (docs/quantized.md), so `dequantize_pages` copies the pages a batch reads in one
    layer into a bfloat16 scratch cache, `q * scale` in float32 rounded to bfloat16,
    with a lookup table of its own, and MAX's kernel then runs over the scratch as
    over a bfloat16 cache (kernels/max_kernels.mojo). The same function runs on the
    CPU, where the suite compares the scratch with the float64 reference.
"""

from std.math import ceildiv

from max.gpu import block_dim, block_idx, global_idx, thread_idx
from max.gpu.host import DeviceContext
from max.gpu.host.info import is_cpu

from ..paged import PagedKVCacheCollection
from ..types import KVCacheT, Ptr, SCALE_BLOCK, U32Ptr, is_quantized
from .fp8 import store_row
from .parallel import parallel_units
from .ragged import batch_of_token

comptime ROWS_PER_BLOCK = 128
"""GPU threads per block of `store_rows_quantized`: one (token, head) row each."""
comptime DEQUANTIZE_THREADS = 256
"""GPU threads per block of `dequantize_pages`: one block per scratch page."""


def store_rows_quantized[Cache: KVCacheT, in_dtype: DType](
    cache: Cache,
    src: Ptr[in_dtype],  # [total_tokens, num_heads, head_size]
    offsets: U32Ptr,  # [batch_size + 1]
    total_tokens: Int,
    ctx: DeviceContext,
) raises:
    """`store_kv` of an FP8 cache on a GPU: each thread quantizes one head's row of one
    new token into its position (cache_lengths[b] + i), with `store_row`."""
    comptime H = Cache.kv_params.num_heads
    comptime D = Cache.kv_params.head_size
    comptime assert is_quantized[Cache.dtype](), "store_rows_quantized writes FP8 caches"
    var batch_size = cache.batch_size()
    var rows = total_tokens * H

    def kernel() {var cache, var src, var offsets, var batch_size, var rows}:
        var row = Int(global_idx.x)
        if row < rows:
            var tok = row // H
            var b = batch_of_token(offsets, batch_size, tok)
            var pos = cache.cache_length(b) + tok - Int(offsets[unsafe_offset=b])
            store_row(cache, b, row % H, pos, src.unsafe_offset(row * D))

    if rows > 0:
        ctx.enqueue_function(kernel, grid_dim=ceildiv(rows, ROWS_PER_BLOCK), block_dim=ROWS_PER_BLOCK)


@always_inline
def _dequantize_page[Cache: KVCacheT, //, page_size: Int](
    kc: Cache,
    vc: Cache,
    offsets: U32Ptr,
    scratch: Ptr[DType.bfloat16],
    table: U32Ptr,
    pages_per_row: Int,
    cols: Int,
    unit: Int,  # (batch entry, lookup-table column)
    first: Int,
    step: Int,  # this worker's elements of the page: first, first + step, ...
):
    """Scratch page b * pages_per_row + i from page i of entry b (`unit` = b * cols + i),
    and its table entry; a column past `pages_per_row` points at scratch page 0 (MAX's
    kernels may read table entries past a row's pages, never their keys' values)."""
    comptime H = Cache.kv_params.num_heads
    comptime D = Cache.kv_params.head_size
    comptime PLANE = page_size * H * D  # K or V of one page of one layer
    var b = unit // cols
    var i = unit % cols
    var page = b * pages_per_row + i
    if first == 0:
        table.unsafe_store(unit, UInt32(page if i < pages_per_row else 0))
    if i >= pages_per_row:
        return
    # Rows past the entry's cache and new tokens hold no values: zeros, as MAX's kernel
    # may read (and mask) them, and 0 * NaN of an unwritten row would not mask.
    var length = kc.cache_length(b) + Int(offsets[unsafe_offset=b + 1]) - Int(offsets[unsafe_offset=b])
    var e = first
    while e < 2 * PLANE:
        var r = e % PLANE
        var pos = i * page_size + r // (H * D)
        var value: Float32 = 0
        if pos < length:
            var h = (r // D) % H
            var d = r % D
            var cache = kc if e < PLANE else vc
            var q = cache.row_ptr(b, h, pos).unsafe_load(d).cast[DType.float32]()
            value = q * cache.scale_ptr(b, h, pos).unsafe_load(d // SCALE_BLOCK)
        scratch.unsafe_store(page * 2 * PLANE + e, value.cast[DType.bfloat16]())
        e += step


def dequantize_pages[dtype_code: Int, H: Int, D: Int, page_size: Int, target: StaticString](
    coll: PagedKVCacheCollection[dtype_code, H, D, page_size],
    layer_idx: Int,
    offsets: U32Ptr,  # [batch_size + 1]
    scratch: Ptr[DType.bfloat16],  # [batch_size * pages_per_row, 2, 1, page_size, H, D]
    table: U32Ptr,  # [batch_size, coll.max_num_pages]: the scratch's lookup table
    pages_per_row: Int,  # <= coll.max_num_pages
    ctx: DeviceContext,
) raises:
    """Copies the first `pages_per_row` pages of each batch entry's row of one layer
    into a bfloat16 scratch cache of one layer (MAX's page layout), each value
    `q * scale` (float32) rounded to bfloat16 and the positions past the entry's cache
    and new tokens zeros, and writes its lookup table."""
    comptime Coll = PagedKVCacheCollection[dtype_code, H, D, page_size]
    comptime assert Coll.scaled, "dequantize_pages reads scaled FP8 pages"
    var kc = coll.get_key_cache(layer_idx)
    var vc = coll.get_value_cache(layer_idx)
    var cols = coll.max_num_pages
    var units = coll.batch_size() * cols
    comptime if is_cpu[target]():
        def body(unit: Int) {imm kc, imm vc, imm offsets, imm scratch, imm table, imm pages_per_row, imm cols}:
            _dequantize_page[page_size=page_size](kc, vc, offsets, scratch, table, pages_per_row, cols, unit, 0, 1)

        parallel_units(body, units, ctx)
    else:
        def kernel() {var kc, var vc, var offsets, var scratch, var table, var pages_per_row, var cols}:
            _dequantize_page[page_size=page_size](
                kc, vc, offsets, scratch, table, pages_per_row, cols, Int(block_idx.x), Int(thread_idx.x), Int(block_dim.x)
            )

        if units > 0:
            ctx.enqueue_function(kernel, grid_dim=units, block_dim=DEQUANTIZE_THREADS)
