"""GQA attention over the KV cache on NVIDIA tensor cores: flash-decoding, one warp per unit.

Staged: compiled for sm_90 in the test suite (its SASS, 32 `HMMA.16816` per 16 keys, read
with `benchmarks/gpu_sass.py`), not yet run on a GPU, so `flash_attention` takes it only when asked
(`gpu_tensor_cores=True` in Python). `attention/gpu.mojo` stays the default.

Why: on an H200 the CUDA-core kernel read K/V at ~50% of a device copy for GQA 4 and
~25% for GQA 8 (docs/benchmarks.md, "GPU (NVIDIA H200)"), against 74-77% for GQA 1: per key, a
lane does 4 or 8 heads' FMAs and butterflies. Here a warp's 16 keys x GB heads of
scores are 2 x D / 16 `mma.sync.m16n8k16` and their P V another D / 8, so the per-key
work no longer grows with the group.

A unit is (new token, GB = 4 or 8 query heads of one KV head, split of the keys), as in
`gpu_attention`; splits and their merge are that module's. Lane `lane` is (g, t) =
(lane / 4, lane % 4), the fragments' row group and thread in group (PTX ISA, "Matrix
Fragments for mma.m16n8k16"). Per step of 16 keys:

  * S = Q K^T, M = heads (16 rows, rows >= GB zero), N = keys (two blocks of 8), K =
    head dim. A (Q) and B (K^T) fragments pair the same head-dim elements, so any
    permutation of the head dim applied to both leaves S unchanged: step `ks` takes
    physical element 32 (ks / 2) + 8 t + 4 (ks % 2) + 2 r + e for fragment register r
    and half e. Then each lane's whole share of a K row is D / 32 aligned 16-byte loads
    of row g (block 0) and g + 8 (block 1), and Q is read the same way once.
  * The score fragment (row g, keys 2t + e of each block) is the A fragment of P for
    P V over 16 keys, as in FlashAttention 2, so P never leaves registers.
  * O = P V, N = head-dim columns in D / 8 blocks: column n of block j is physical
    column n * D / 8 + j, so lane g's B fragments come from one contiguous D / 8
    elements of each of its four V rows (keys 2t, 2t + 1, 8 + 2t, 9 + 2t), and a
    lane's O columns 2t + e over all blocks are one contiguous run again at the end.
  * Softmax in base 2 (log2(e) folded into Q's scale; Q is rounded to the cache's
    dtype after scaling, P before P V), row max over the 4 lanes of a row by two
    shuffles; the row sum l stays per lane and is summed once at the end.
"""

from std.math import exp2
from std.sys.info import is_nvidia_gpu

from max.gpu import block_idx, thread_idx
from max.gpu.compute.mma import mma
from max.gpu.host import DeviceContext
from max.gpu.primitives.warp import shuffle_xor

from ...types import KVCacheT, Ptr, U32Ptr
from .gpu import LOG2E, WARP, merge_splits, split_keys_of, split_plan

comptime KEYS = 16  # keys per step: two n8 score blocks, one k16 step of P V


def tensor_core_cache_ok[dtype: DType, D: Int]() -> Bool:
    """Whether `gpu_attention_mma` serves a cache of this dtype and head size: bf16 or
    f16, D a multiple of 64 (16-byte loads of D / 8 columns per lane). Its units also
    need 4 or 8 query heads (a GQA group that is a multiple of 4)."""
    return (dtype == DType.bfloat16 or dtype == DType.float16) and D % 64 == 0


@always_inline
def _mma[T: DType](a: SIMD[T, 8], b: SIMD[T, 4], c: SIMD[DType.float32, 4]) -> SIMD[DType.float32, 4]:
    """Returns a b + c for one m16n8k16 tile (fragments in PTX register order)."""
    var d = SIMD[DType.float32, 4](0)
    mma(d, a, b, c)
    return d


@always_inline
def _a_fragment[T: DType](x0: Scalar[T], x1: Scalar[T], x2: Scalar[T], x3: Scalar[T]) -> SIMD[T, 8]:
    """An A fragment with rows g + 8 zero: registers a0 = (x0, x1), a2 = (x2, x3)."""
    comptime zero = Scalar[T](0)
    return SIMD[T, 8](x0, x1, zero, zero, x2, x3, zero, zero)


def gpu_attention_mma[Cache: KVCacheT, q_dtype: DType, GB: Int](
    kc: Cache,
    vc: Cache,
    output: Ptr[q_dtype],  # [total_tokens, n_q, D]
    q: Ptr[q_dtype],  # [total_tokens, n_q, D]
    offsets: U32Ptr,  # [batch_size + 1], on the device
    total_tokens: Int,
    n_q: Int,
    group: Int,
    scale: Float32,
    ctx: DeviceContext,
) raises:
    """Enqueues the units (and the merge when keys are split) for GB = 4 or 8 heads per unit."""
    comptime D = Cache.kv_params.head_size
    comptime T = Cache.dtype
    comptime assert T == q_dtype, "tensor-core attention takes queries in the cache's dtype"
    comptime assert GB == 4 or GB == 8, "tensor-core attention serves 4 or 8 heads per unit"
    comptime assert tensor_core_cache_ok[T, D](), "tensor-core attention: bf16/f16 caches, head size % 64 == 0"
    comptime CHUNKS = D // 32  # 16-byte chunks of a Q or K row per lane
    comptime NB = D // 8  # n8 blocks of O's columns = V columns per lane
    var batch_size = kc.batch_size()
    var max_positions = kc.max_positions()
    var head_blocks = n_q // GB
    var rows = total_tokens * head_blocks
    if rows == 0:
        return
    var splits, split_keys = split_plan(rows, max_positions, KEYS)
    var qscale = scale * LOG2E
    # Split partial states, laid out as `merge_splits` reads them.
    var parts = ctx.enqueue_create_buffer[DType.float32](max(1, rows * GB * splits * (D + 2)) if splits > 1 else 1)
    var part_ptr = parts.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()

    def unit() {var kc, var vc, var q, var output, var offsets, var batch_size, var n_q, var group, var head_blocks, var rows, var splits, var split_keys, var qscale, var part_ptr}:
        comptime if is_nvidia_gpu():
            var row = Int(block_idx.x)
            var split = Int(block_idx.y)
            var lane = Int(thread_idx.x)
            var g = lane // 4
            var t = lane % 4
            var tok = row // head_blocks
            var qh0 = (row % head_blocks) * GB
            var h = qh0 // group
            var b, k0, k1 = split_keys_of(kc, offsets, batch_size, tok, split, splits, split_keys)

            # Q's A fragments, one per step of 16 head-dim elements (see the docstring's order).
            var qa = Array[SIMD[T, 8], D // 16](fill=0)
            if g < GB:
                var qrow = q.unsafe_offset((tok * n_q + qh0 + g) * D + 8 * t)
                comptime for c in range(CHUNKS):
                    var x = (qrow.unsafe_load[width=8, alignment=16](32 * c).cast[DType.float32]() * qscale).cast[T]()
                    comptime for hh in range(2):
                        qa[2 * c + hh] = _a_fragment[T](x[4 * hh], x[4 * hh + 1], x[4 * hh + 2], x[4 * hh + 3])

            var o = Array[SIMD[DType.float32, 4], NB](fill=0)  # [j]: (row g, columns 2t, 2t + 1 of block j), rows g + 8
            var m = Float32.MIN  # row g's running max, the same in its 4 lanes
            var l: Float32 = 0  # this lane's share of row g's sum
            var j0 = k0
            while j0 < k1:
                var s = Array[SIMD[DType.float32, 4], 2](fill=0)
                comptime for blk in range(2):
                    var krow = kc.row_ptr(b, h, min(j0 + 8 * blk + g, k1 - 1)).unsafe_offset(8 * t)
                    comptime for c in range(CHUNKS):
                        var x = krow.unsafe_load[width=8, alignment=16](32 * c)
                        comptime for hh in range(2):
                            s[blk] = _mma[T](qa[2 * c + hh], x.slice[4, offset=4 * hh](), s[blk])
                # Keys past the split's end (their rows were clamped above) get no weight.
                var mx = Float32.MIN
                comptime for blk in range(2):
                    comptime for e in range(2):
                        if j0 + 8 * blk + 2 * t + e >= k1:
                            s[blk][e] = Float32.MIN
                        mx = max(mx, s[blk][e])
                mx = max(mx, shuffle_xor(mx, UInt32(1)))
                mx = max(mx, shuffle_xor(mx, UInt32(2)))
                var m_new = max(m, mx)
                # No key yet keeps m_new = -inf: 0 as the base keeps every weight 0 instead of NaN.
                var base = m_new if m_new > Float32.MIN else Float32(0)
                var alpha = exp2(m - base)
                var p = Array[Scalar[T], 4](fill=0)
                var psum: Float32 = 0
                comptime for blk in range(2):
                    comptime for e in range(2):
                        var w = exp2(s[blk][e] - base)
                        psum += w
                        p[2 * blk + e] = w.cast[T]()
                l = l * alpha + psum
                m = m_new
                var pa = _a_fragment[T](p[0], p[1], p[2], p[3])

                var vr = Array[SIMD[T, NB], 4](fill=0)  # keys 2t, 2t + 1, 8 + 2t, 9 + 2t: columns g NB .. g NB + NB
                comptime for i in range(4):
                    var key = min(j0 + 8 * (i // 2) + 2 * t + i % 2, k1 - 1)
                    vr[i] = vc.row_ptr(b, h, key).unsafe_offset(g * NB).unsafe_load[width=NB, alignment=16](0)
                comptime for j in range(NB):
                    o[j] = _mma[T](pa, SIMD[T, 4](vr[0][j], vr[1][j], vr[2][j], vr[3][j]), o[j] * alpha)
                j0 += KEYS

            l += shuffle_xor(l, UInt32(1))
            l += shuffle_xor(l, UInt32(2))
            if g >= GB:
                return
            var qh = qh0 + g
            comptime for e in range(2):
                var run = SIMD[DType.float32, NB](0)  # this lane's columns (2t + e) NB .. + NB
                comptime for j in range(NB):
                    run[j] = o[j][e]
                var col = (2 * t + e) * NB
                if splits == 1:
                    output.unsafe_offset((tok * n_q + qh) * D + col).unsafe_store[alignment=16](0, (run / l).cast[q_dtype]())
                else:
                    var part = (tok * n_q + qh) * splits + split
                    part_ptr.unsafe_offset(part * D + col).unsafe_store[alignment=16](0, run)
                    if t == 0 and e == 0:
                        var ml = part_ptr.unsafe_offset(rows * GB * splits * D + 2 * part)
                        ml.unsafe_store(0, m)
                        ml.unsafe_store(1, l)

    ctx.enqueue_function(unit, grid_dim=(rows, splits), block_dim=WARP)
    if splits > 1:
        merge_splits[q_dtype, D](output, part_ptr, total_tokens * n_q, splits, ctx)
    _ = parts^  # freed in stream order, after the kernels that read it
