"""The pages of an MLA cache, as its kernels address them, and the store of a step's
latents into them.

An MLA cache holds one row of `D = latent_dim + rope_dim` values per token and layer
(`blocks [total_num_pages, 1, num_layers, page_size, 1, D]`, MAX 26.7's MLA block): the
compressed KV latent in `[0, latent_dim)`, the RoPE key every head shares after it.
Token `t` of batch entry `b` lives in page `lookup_table[b, t // page_size]`, row
`t % page_size`, as in mokv's other paged caches.
"""

from std.math import ceildiv

from max.gpu import block_dim, block_idx, thread_idx
from max.gpu.host import DeviceContext
from max.gpu.host.info import is_cpu

from ...types import Ptr, U32Ptr
from ..parallel import parallel_units
from ..ragged import batch_of_token


struct LatentPages[dtype: DType](TrivialRegisterPassable):
    """A non-owning view of one layer of an MLA cache's pages and a batch's tables."""

    var blocks: Ptr[Self.dtype]  # [total_num_pages, 1, num_layers, page_size, 1, row_size]
    var cache_lengths: U32Ptr  # [batch_size]
    var lookup_table: U32Ptr  # [batch_size, lookup_cols]
    var lookup_cols: Int
    var num_layers: Int
    var page_size: Int
    var row_size: Int
    var layer: Int

    def __init__(
        out self,
        blocks: Ptr[Self.dtype],
        cache_lengths: U32Ptr,
        lookup_table: U32Ptr,
        lookup_cols: Int,
        num_layers: Int,
        page_size: Int,
        row_size: Int,
        layer: Int,
    ):
        self.blocks = blocks
        self.cache_lengths = cache_lengths
        self.lookup_table = lookup_table
        self.lookup_cols = lookup_cols
        self.num_layers = num_layers
        self.page_size = page_size
        self.row_size = row_size
        self.layer = layer

    @always_inline
    def cache_length(self, b: Int) -> Int:
        return Int(self.cache_lengths[unsafe_offset=b])

    @always_inline
    def row(self, b: Int, pos: Int) -> Ptr[Self.dtype]:
        """Token `pos` of batch entry `b`: its `row_size` values in this layer."""
        var page = Int(self.lookup_table[unsafe_offset=b * self.lookup_cols + pos // self.page_size])
        var slot = (page * self.num_layers + self.layer) * self.page_size + pos % self.page_size
        return self.blocks.unsafe_offset(slot * self.row_size)


def mla_store[dtype: DType, in_dtype: DType, target: StaticString](
    pages: LatentPages[dtype],
    latent: Ptr[in_dtype],  # [total_tokens, latent_dim]
    k_rope: Ptr[in_dtype],  # [total_tokens, rope_dim]
    offsets: U32Ptr,  # [batch_size + 1]
    batch_size: Int,
    total_tokens: Int,
    latent_dim: Int,
    ctx: DeviceContext,
) raises:
    """Writes new token `i` of entry `b` (flat row `offsets[b] + i`) at cache position
    `cache_lengths[b] + i`: its latent, then its RoPE key (the cache prefix is never
    overwritten)."""
    var rope_dim = pages.row_size - latent_dim

    comptime if is_cpu[target]():
        # Chunks of tokens, not batch entries, so one long prefill still uses every core.
        comptime CHUNK = 32

        def body(chunk: Int) {imm pages, imm latent, imm k_rope, imm offsets, imm batch_size, imm total_tokens, imm latent_dim, imm rope_dim}:
            for tok in range(chunk * CHUNK, min(total_tokens, (chunk + 1) * CHUNK)):
                var b = batch_of_token(offsets, batch_size, tok)
                var dst = pages.row(b, pages.cache_length(b) + tok - Int(offsets[unsafe_offset=b]))
                for d in range(latent_dim):
                    dst.unsafe_store(d, latent.unsafe_load(tok * latent_dim + d).cast[dtype]())
                for d in range(rope_dim):
                    dst.unsafe_store(latent_dim + d, k_rope.unsafe_load(tok * rope_dim + d).cast[dtype]())

        parallel_units(body, ceildiv(total_tokens, CHUNK), ctx)
    else:
        # One block per token, threads over its row.
        def kernel() {var pages, var latent, var k_rope, var offsets, var batch_size, var latent_dim, var rope_dim}:
            var tok = Int(block_idx.x)
            var b = batch_of_token(offsets, batch_size, tok)
            var dst = pages.row(b, pages.cache_length(b) + tok - Int(offsets[unsafe_offset=b]))
            var e = Int(thread_idx.x)
            while e < latent_dim + rope_dim:
                if e < latent_dim:
                    dst.unsafe_store(e, latent.unsafe_load(tok * latent_dim + e).cast[dtype]())
                else:
                    dst.unsafe_store(e, k_rope.unsafe_load(tok * rope_dim + e - latent_dim).cast[dtype]())
                e += Int(block_dim.x)

        if total_tokens > 0:
            ctx.enqueue_function(kernel, grid_dim=total_tokens, block_dim=min(latent_dim + rope_dim, 256))
