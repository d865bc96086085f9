"""The manager's cache runs mokv's kernels: store_kv + ragged flash attention vs a naive reference.

Sequences are claimed, fetched, written with `store_kv` and attended with
`flash_attention` (the functions the graph ops call), then stepped; over several decode
steps, with one sequence released and its slot reused by a new prompt in a batch that
mixes prefill and decode. The reference recomputes attention from the test's own copy
of every K/V row.
"""

from std.math import exp
from std.testing import assert_almost_equal, assert_equal, TestSuite

from max.gpu.host import DeviceContext

from mokv.kernels.attention import flash_attention
from mokv.kernels.store_kv import store_kv
from mokv.manager import ContinuousBatchingKVCacheManager
from mokv.types import KVCacheStaticParams

comptime H = 2  # KV heads
comptime D = 16
comptime NQ = 4  # query heads (GQA group of 2)
comptime LAYERS = 2
comptime LAYER = 1
comptime KV = KVCacheStaticParams(num_heads=H, head_size=D)
comptime Manager = ContinuousBatchingKVCacheManager[DType.float32, KV]


struct Rng(Movable):
    var state: UInt64

    def __init__(out self, seed: Int):
        self.state = UInt64(seed)

    def next(mut self) -> Float32:
        """Uniform in [-1, 1)."""
        self.state = self.state * 6364136223846793005 + 1442695040888963407
        return Float32(Int((self.state >> 40) % 65536)) / 32768.0 - 1.0


struct History(Movable):
    """Every K and V row written for one sequence: [tokens, H, D] each."""

    var k: List[Float32]
    var v: List[Float32]

    def __init__(out self):
        self.k = List[Float32]()
        self.v = List[Float32]()


def _ptr(mut l: List[Float32]) -> Pointer[Float32, MutUntrackedOrigin]:
    return l.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()


def _run_step(
    mut m: Manager,
    seq_ids: List[Int],
    new_tokens: List[Int],
    mut hist: List[History],  # indexed by seq id (= slot)
    mut rng: Rng,
    ctx: DeviceContext,
) raises:
    """One ragged batch: new K/V and Q for each sequence, kernels, reference, step."""
    var n = len(seq_ids)
    var offsets = List[UInt32](length=n + 1, fill=0)
    for b in range(n):
        offsets[b + 1] = offsets[b] + UInt32(new_tokens[b])
    var total = Int(offsets[n])
    var k = List[Float32](length=total * H * D, fill=0)
    var v = List[Float32](length=total * H * D, fill=0)
    var q = List[Float32](length=total * NQ * D, fill=0)
    for i in range(total * H * D):
        k[i] = rng.next()
        v[i] = rng.next()
    for i in range(total * NQ * D):
        q[i] = rng.next()
    var out = List[Float32](length=total * NQ * D, fill=0)

    var coll = m.fetch[Manager.CollectionType](seq_ids)
    var op = offsets.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    store_kv[target="cpu"](coll, _ptr(k), _ptr(v), op, total, LAYER, ctx)
    var scale = Float32(1.0) / Float32(4.0)  # 1 / sqrt(D)
    var no_sinks = List[Float32]()
    flash_attention[target="cpu"](coll, _ptr(out), _ptr(q), op, total, NQ, LAYER, scale, 0, _ptr(no_sinks), 0, ctx)

    for b in range(n):
        var sid = seq_ids[b]
        var start = Int(offsets[b])
        for i in range(new_tokens[b]):
            for e in range(H * D):
                hist[sid].k.append(k[(start + i) * H * D + e])
                hist[sid].v.append(v[(start + i) * H * D + e])
        var cached = m.cache_length(sid)
        assert_equal(len(hist[sid].k), (cached + new_tokens[b]) * H * D)
        for i in range(new_tokens[b]):
            var pos = cached + i
            for qh in range(NQ):
                var h = qh // (NQ // H)
                var qrow = (start + i) * NQ * D + qh * D
                var scores = List[Float32](length=pos + 1, fill=0)
                var mx = Float32.MIN
                for key in range(pos + 1):
                    var s: Float32 = 0
                    for d in range(D):
                        s += q[qrow + d] * hist[sid].k[(key * H + h) * D + d]
                    scores[key] = s * scale
                    mx = max(mx, scores[key])
                var total_p: Float32 = 0
                for key in range(pos + 1):
                    scores[key] = exp(scores[key] - mx)
                    total_p += scores[key]
                for d in range(D):
                    var acc: Float32 = 0
                    for key in range(pos + 1):
                        acc += scores[key] * hist[sid].v[(key * H + h) * D + d]
                    assert_almost_equal(out[qrow + d], acc / total_p, atol=2e-5)
        # The cache itself holds the rows, in this sequence's slot, at their positions.
        var blocks = m.blocks_ptr()
        var slot_elems = 2 * LAYERS * m.max_seq_len * H * D
        for tok in range(cached + new_tokens[b]):
            for e in range(H * D):
                var k_off = sid * slot_elems + (0 * LAYERS + LAYER) * m.max_seq_len * H * D + tok * H * D + e
                var v_off = sid * slot_elems + (1 * LAYERS + LAYER) * m.max_seq_len * H * D + tok * H * D + e
                assert_equal(blocks[unsafe_offset=k_off], hist[sid].k[tok * H * D + e])
                assert_equal(blocks[unsafe_offset=v_off], hist[sid].v[tok * H * D + e])
    m.step(new_tokens, coll)
    _ = k^
    _ = v^
    _ = q^
    _ = out^
    _ = offsets^


def test_store_and_attend_over_decode_steps_and_reused_slots() raises:
    var ctx = DeviceContext(api="cpu")
    var m = Manager(3, 32, LAYERS, ctx, ctx)
    var hist = List[History]()
    for _ in range(3):
        hist.append(History())
    var rng = Rng(1)

    var ids = m.claim(2)  # [0, 1]
    _run_step(m, ids, [5, 3], hist, rng, ctx)  # context encoding
    for _ in range(3):  # decode
        _run_step(m, ids, [1, 1], hist, rng, ctx)
    assert_equal(m.cache_length(ids[0]), 8)
    assert_equal(m.cache_length(ids[1]), 6)

    m.release(ids[0])
    hist[ids[0]] = History()
    var c = m.claim(1)
    assert_equal(c[0], ids[0])  # the freed slot is reused
    var batch: List[Int] = [ids[1], c[0]]
    _run_step(m, batch, [1, 4], hist, rng, ctx)  # decode next to a new prompt in the old slot
    _run_step(m, batch, [1, 1], hist, rng, ctx)
    var third = m.claim(1)
    var all3: List[Int] = [third[0], c[0], ids[1]]
    _run_step(m, all3, [6, 2, 1], hist, rng, ctx)  # chunked prefill of c, new prompt, decode
    assert_equal(m.cache_length(c[0]), 7)
    assert_equal(m.cache_length(ids[1]), 9)
    assert_equal(m.num_inflight(), 0)


def main() raises:
    TestSuite.discover_tests[__functions_in_module()]().run()
