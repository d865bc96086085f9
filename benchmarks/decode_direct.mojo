"""CPU decode attention called directly, without a graph: for timing one shape and for perf.

    .venv/bin/mojo build -I mojo -D KV_HEADS=4 -D GROUP=8 -D DTYPE=bfloat16 \\
        -o /tmp/decode benchmarks/decode_direct.mojo
    /tmp/decode [context=16384] [batch=1] [calls=2000]
    perf record -o /tmp/decode.data /tmp/decode && perf annotate -i /tmp/decode.data --stdio

A binary built this way keeps its symbols, so `perf annotate` shows the kernel's loops
(inlined into `_attend_unit`); inside a graph the same code is JIT-compiled and perf
sees only anonymous addresses. The cache is the Mojo manager's (continuous, head size
128, one layer), `batch` sequences of `context` cached tokens, one new token each, with
DTYPE queries (as a model's attention hands them over). Prints the best and median
milliseconds per call and the median's GB/s of K/V read. Pin it to one core
(`taskset -c 0`) with a context that fits L2 to see the kernel's arithmetic alone.

The first sequence's outputs are checked against attention recomputed in float64 from
the cache's rows, so the timed calls must have attended the whole cache (a manager that
has gone away leaves the collection pointing at freed memory, and decode then looks ~40x
faster and attends to one position).
"""

from std.math import exp
from std.sys import argv
from std.sys.info import size_of
from std.sys.defines import get_defined_dtype, get_defined_int
from std.time import perf_counter_ns

from max.gpu.host import DeviceContext

from mokv.kernels.attention import flash_attention
from mokv.manager import ContinuousBatchingKVCacheManager
from mokv.types import KVCacheStaticParams

comptime H = get_defined_int["KV_HEADS", 4]()
comptime GROUP = get_defined_int["GROUP", 8]()
comptime DT = get_defined_dtype["DTYPE", DType.bfloat16]()
comptime D = 128
comptime NQ = H * GROUP
comptime Manager = ContinuousBatchingKVCacheManager[DT, KVCacheStaticParams(num_heads=H, head_size=D)]


def _value(i: Int) -> Float32:
    """A fixed pseudo-random multiple of 1/64 in (-1, 1), exact in bf16."""
    return Float32((i * 7919) % 127 - 63) / 64


def _arg(i: Int, default: Int) raises -> Int:
    var args = argv()
    return Int(args[i]) if len(args) > i else default


def _check_first_sequence(
    blocks: Pointer[Scalar[DT], MutUntrackedOrigin],
    plane: Int,  # elements of one K or V plane of a slot
    q: List[Scalar[DT]],
    output: List[Scalar[DT]],
    scale: Float32,
) raises:
    """Softmax(q K^T * scale) V for every query head of sequence 0, in float64."""
    var n = plane // (H * D)  # cached tokens and the new one
    var p = List[Float64](length=n, fill=0)
    for qh in range(NQ):
        var h = qh // GROUP
        var mx = Float64(-1e300)
        for t in range(n):
            var s: Float64 = 0
            for d in range(D):
                var kd = blocks[unsafe_offset=(t * H + h) * D + d].cast[DType.float64]()
                s += Float64(q[qh * D + d].cast[DType.float64]()) * Float64(kd)
            p[t] = s * Float64(scale)
            mx = max(mx, p[t])
        var total: Float64 = 0
        for t in range(n):
            p[t] = exp(p[t] - mx)
            total += p[t]
        for d in range(D):
            var want: Float64 = 0
            for t in range(n):
                want += p[t] * Float64(blocks[unsafe_offset=plane + (t * H + h) * D + d].cast[DType.float64]())
            want /= total
            var got = Float64(output[qh * D + d].cast[DType.float64]())
            if abs(got - want) > 1e-3 + abs(want) / 128:  # with bf16's rounding of Q and the output
                raise Error("sequence 0, query head ", qh, ", column ", d, ": ", got, ", expected ", want)


def main() raises:
    var ctx_len = _arg(1, 16384)
    var batch = _arg(2, 1)
    var calls = _arg(3, 2000)
    var cpu = DeviceContext(api="cpu")
    var m = Manager(batch, ctx_len + 1, 1, cpu, cpu)

    # Blocks are [slot, K/V, layer, position, head, D]; position ctx_len is the new token.
    var blocks = m.blocks_ptr()
    var plane = (ctx_len + 1) * H * D
    for slot in range(batch):
        for i in range(plane):
            blocks[unsafe_offset=(2 * slot) * plane + i] = _value(slot * plane + i).cast[DT]()
            blocks[unsafe_offset=(2 * slot + 1) * plane + i] = _value(slot * plane + i + 5).cast[DT]()
    var ids = m.claim(batch)
    m.step(ids, List[Int](length=batch, fill=ctx_len))
    var coll = m.fetch[Manager.CollectionType](ids)

    var q = List[Scalar[DT]](length=batch * NQ * D, fill=0)
    for i in range(len(q)):
        q[i] = _value(i + 11).cast[DT]()
    var output = List[Scalar[DT]](length=batch * NQ * D, fill=0)
    var offsets = List[UInt32](length=batch + 1, fill=0)
    for b in range(batch + 1):
        offsets[b] = UInt32(b)
    var qp = q.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    var op = output.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    var offp = offsets.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    var scale = Float32(0.088)  # ~1 / sqrt(D)

    var no_sinks = List[Float32]()
    var sinks = no_sinks.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()

    var times = List[Float64](capacity=calls)
    for _ in range(calls):
        var t0 = perf_counter_ns()
        flash_attention[target="cpu"](coll, op, qp, offp, batch, NQ, 0, scale, 0, sinks, 0, cpu)
        times.append(Float64(perf_counter_ns() - t0) / 1e6)
    sort(times)

    _check_first_sequence(blocks, plane, q, output, scale)

    var kv_bytes = Float64(2 * batch * (ctx_len + 1) * H * D * size_of[Scalar[DT]]())
    var median = times[len(times) // 2]
    print("decode", DT, "kv_heads", H, "group", GROUP, "context", ctx_len, "batch", batch)
    print("best_ms", times[0], "median_ms", median, "GBps", kv_bytes / median / 1e6)
    _ = q^  # the kernel read these through pointers: keep them (and the cache) alive
    _ = output^
    _ = offsets^
    _ = m^
