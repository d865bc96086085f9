"""Store this step's new K and V rows into one layer of the cache.

New token `i` of batch entry `b` (flat row `input_row_offsets[b] + i`) goes to cache
position `cache_lengths[b] + i`: the cache prefix is never overwritten.
"""

from std.math import ceildiv

from max.gpu import block_dim, block_idx, thread_idx
from max.gpu.host import DeviceContext
from max.gpu.host.info import is_cpu

from ..types import KVCacheT, KVCollectionT, Ptr, U32Ptr
from .fp8 import store_row
from .fp8_gpu import store_rows_quantized
from .parallel import parallel_units
from .ragged import batch_of_token
from .unscaled_fp8 import saturated


def store_kv_cache[Cache: KVCacheT, in_dtype: DType, scaled: Bool, target: StaticString](
    cache: Cache,
    src: Ptr[in_dtype],  # [total_tokens, num_heads, head_size]
    offsets: U32Ptr,  # [batch_size + 1]
    total_tokens: Int,
    ctx: DeviceContext,
) raises:
    """Writes `src` into `cache` at each token's position (one K or V plane); `scaled`:
    the collection's (an FP8 cache's values have per-block scales)."""
    comptime H = Cache.kv_params.num_heads
    comptime D = Cache.kv_params.head_size
    var batch_size = cache.batch_size()

    comptime if is_cpu[target]():
        # Chunks of tokens, not batch entries, so one long prefill still uses every core.
        comptime CHUNK = 32
        def body(chunk: Int) {imm cache, imm src, imm offsets, imm total_tokens, imm batch_size}:
            var end = min(total_tokens, (chunk + 1) * CHUNK)
            for tok in range(chunk * CHUNK, end):
                var b = batch_of_token(offsets, batch_size, tok)
                var pos = cache.cache_length(b) + tok - Int(offsets[unsafe_offset=b])
                for h in range(H):
                    store_row(cache, b, h, pos, src.unsafe_offset((tok * H + h) * D))

        parallel_units(body, ceildiv(total_tokens, CHUNK), ctx)
    elif scaled:
        store_rows_quantized(cache, src, offsets, total_tokens, ctx)
    else:
        # One block per token, threads over the token's H * D elements. An FP8 cache
        # here is unscaled (kernels/unscaled_fp8.mojo): each value cast, saturated.
        def kernel() {var cache, var src, var offsets, var batch_size}:
            var tok = Int(block_idx.x)
            var b = batch_of_token(offsets, batch_size, tok)
            var pos = cache.cache_length(b) + tok - Int(offsets[unsafe_offset=b])
            var e = Int(thread_idx.x)
            while e < H * D:
                var h = e // D
                var d = e % D
                cache.row_ptr(b, h, pos).unsafe_store(d, saturated[Cache.dtype](src.unsafe_load(tok * H * D + e)))
                e += Int(block_dim.x)

        if total_tokens > 0:
            ctx.enqueue_function(kernel, grid_dim=total_tokens, block_dim=min(H * D, 256))


def store_kv[Coll: KVCollectionT, in_dtype: DType, target: StaticString](
    coll: Coll,
    k: Ptr[in_dtype],  # [total_tokens, num_heads, head_size]
    v: Ptr[in_dtype],  # [total_tokens, num_heads, head_size]
    offsets: U32Ptr,  # [batch_size + 1]
    total_tokens: Int,
    layer_idx: Int,
    ctx: DeviceContext,
) raises:
    """Stores K and V of `layer_idx` (generic body of `mokv.store_kv.ragged.*`)."""
    store_kv_cache[scaled=Coll.scaled, target=target](coll.get_key_cache(layer_idx), k, offsets, total_tokens, ctx)
    store_kv_cache[scaled=Coll.scaled, target=target](coll.get_value_cache(layer_idx), v, offsets, total_tokens, ctx)
