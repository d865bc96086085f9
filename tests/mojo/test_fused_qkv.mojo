"""The CPU fused QKV projection (+ RoPE) against dot products taken in Float64.

`fused_qkv_matmul` on the Mojo manager's continuous cache, for f32 and bf16: calls of
fewer than 16 tokens take the streaming path (4-token register blocks, then leftover
tokens), 16 or more the packed path (3W-token register blocks and their 2W/W tails).
A hidden size of 600 leaves K chunks with tails that no vector width divides. Q must
match the reference, K and V must land in the cache at each token's position.
"""

from std.math import cos, sin
from std.testing import assert_true, TestSuite

from max.gpu.host import DeviceContext

from mokv.kernels.fused_qkv import fused_qkv_matmul
from mokv.manager import ContinuousBatchingKVCacheManager
from mokv.types import KVCacheStaticParams

comptime H = 1  # KV heads
comptime D = 64
comptime NQ = 2  # query heads (GQA 2)
comptime K = 600  # hidden size
comptime MAX_LEN = 96
comptime LAYER = 0


def _value(i: Int, salt: Int) -> Float32:
    """A fixed pseudo-random multiple of 1/64 in (-1, 1), exact in bf16."""
    return Float32((i * 7919 + salt * 104729) % 127 - 63) / 64


def _check[dtype: DType, rope: Bool](cached: List[Int], new_tokens: List[Int]) raises:
    comptime Manager = ContinuousBatchingKVCacheManager[dtype, KVCacheStaticParams(num_heads=H, head_size=D)]
    comptime F = (NQ + 2 * H) * D  # output features: Q heads, K heads, V heads
    var ctx = DeviceContext(api="cpu")
    var n = len(new_tokens)
    var m = Manager(n, MAX_LEN, 1, ctx, ctx)
    var ids = m.claim(n)
    m.step(ids, cached)
    var offsets = List[UInt32](length=n + 1, fill=0)
    for b in range(n):
        offsets[b + 1] = offsets[b] + UInt32(new_tokens[b])
    var total = Int(offsets[n])
    var hidden = List[Scalar[dtype]](length=total * K, fill=0)
    var wqkv = List[Scalar[dtype]](length=F * K, fill=0)
    var freqs = List[Float32](length=MAX_LEN * D, fill=0)
    var q = List[Scalar[dtype]](length=total * NQ * D, fill=0)
    for i in range(len(hidden)):
        hidden[i] = _value(i, 1).cast[dtype]()
    for i in range(len(wqkv)):
        wqkv[i] = (_value(i, 2) / 8).cast[dtype]()
    for p in range(MAX_LEN):
        for i in range(D // 2):
            var angle = Float64(p) / (10000.0 ** (Float64(2 * i) / Float64(D)))
            freqs[p * D + i] = Float32(cos(angle))
            freqs[p * D + D // 2 + i] = Float32(sin(angle))

    var coll = m.fetch[Manager.CollectionType](ids)
    fused_qkv_matmul[Manager.CollectionType, dtype, rope, "cpu"](
        coll,
        q.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
        hidden.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
        wqkv.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
        offsets.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
        freqs.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
        total,
        K,
        NQ,
        LAYER,
        ctx,
    )

    # Tolerance: f32 sums in another order (600 products of magnitude <= 1/8), or one
    # bf16 rounding of the output (2^-8 relative).
    comptime rel: Float64 = 1.0 / 128 if dtype == DType.bfloat16 else 1e-5
    var blocks = m.blocks_ptr()
    var slot_elems = 2 * MAX_LEN * H * D
    var proj = List[Float64](length=F, fill=0)
    for b in range(n):
        for i in range(new_tokens[b]):
            var tok = Int(offsets[b]) + i
            var pos = cached[b] + i
            for f in range(F):
                var s: Float64 = 0
                for k in range(K):
                    s += Float64(hidden[tok * K + k].cast[DType.float64]()) * Float64(wqkv[f * K + k].cast[DType.float64]())
                proj[f] = s
            for head in range(NQ + 2 * H):
                comptime if rope:
                    if head < NQ + H:  # Q and K heads rotate (rotate-half pairing)
                        for d in range(D // 2):
                            var c = Float64(freqs[pos * D + d])
                            var sn = Float64(freqs[pos * D + D // 2 + d])
                            var x0 = proj[head * D + d]
                            var x1 = proj[head * D + D // 2 + d]
                            proj[head * D + d] = x0 * c - x1 * sn
                            proj[head * D + D // 2 + d] = x1 * c + x0 * sn
                for d in range(D):
                    var got: Float64
                    if head < NQ:
                        got = Float64(q[(tok * NQ + head) * D + d].cast[DType.float64]())
                    else:
                        var kv = 0 if head < NQ + H else 1
                        var h = head - NQ - kv * H
                        var off = ids[b] * slot_elems + kv * MAX_LEN * H * D + (pos * H + h) * D + d
                        got = Float64(blocks[unsafe_offset=off].cast[DType.float64]())
                    var want = proj[head * D + d]
                    assert_true(
                        abs(got - want) <= 1e-5 + rel * abs(want),
                        String("token ", tok, " head ", head, " column ", d, ": ", got, ", expected ", want),
                    )
    _ = hidden^  # the kernel read these through pointers: keep them alive until here
    _ = wqkv^
    _ = freqs^
    _ = q^
    _ = offsets^
    _ = m^


def test_float32_with_rope() raises:
    _check[DType.float32, True]([0, 13, 40], [5, 1, 2])  # streaming: a 4-token block + leftovers
    _check[DType.float32, True]([0, 13, 40], [50, 1, 3])  # packed: a 3W block and tails


def test_bfloat16() raises:
    _check[DType.bfloat16, False]([0, 13, 40], [5, 1, 2])
    _check[DType.bfloat16, False]([0, 3], [19, 7])


def main() raises:
    TestSuite.discover_tests[__functions_in_module()]().run()
