"""Host time of the Mojo ContinuousBatchingKVCacheManager's calls, from Mojo.

Run by benchmarks/bench_mojo_manager.py (`mojo run -I <mokv package dir> this file`);
prints one `name value` line per measurement (ns per call; ops/s for the threads).
"""

from std.time import perf_counter_ns

from max.algorithm import sync_parallelize
from max.gpu.host import DeviceContext

from mokv.manager import ContinuousBatchingKVCacheManager
from mokv.types import KVCacheStaticParams

comptime KV = KVCacheStaticParams(num_heads=1, head_size=16)
comptime Manager = ContinuousBatchingKVCacheManager[DType.float32, KV]
comptime SLOTS = 64
comptime REPS = 20000
comptime MAX_SEQ = REPS // 10 + 8  # the batch loop adds one token per step


def main() raises:
    var cpu = DeviceContext(api="cpu")
    var m = Manager(SLOTS, MAX_SEQ, 1, cpu, cpu)
    var t_claim = 0
    var t_fetch = 0
    var t_step = 0
    var t_release = 0
    for _ in range(REPS):
        var t0 = perf_counter_ns()
        var ids = m.claim(1)
        var t1 = perf_counter_ns()
        var coll = m.fetch[Manager.CollectionType](ids)
        var t2 = perf_counter_ns()
        m.step([1], coll)
        var t3 = perf_counter_ns()
        m.release(ids[0])
        var t4 = perf_counter_ns()
        t_claim += Int(t1 - t0)
        t_fetch += Int(t2 - t1)
        t_step += Int(t3 - t2)
        t_release += Int(t4 - t3)
    print("mojo_claim_ns", t_claim / REPS)
    print("mojo_fetch_ns", t_fetch / REPS)
    print("mojo_step_ns", t_step / REPS)
    print("mojo_release_ns", t_release / REPS)

    # Batch of 32 sequences: one fetch + one step per decode step.
    var ids = m.claim(32)
    var ones = List[Int](length=32, fill=1)
    var t0 = perf_counter_ns()
    for _ in range(REPS // 10):
        var coll = m.fetch[Manager.CollectionType](ids)
        m.step(ones, coll)
    print("mojo_fetch_step_batch32_ns", Int(perf_counter_ns() - t0) / (REPS // 10))
    for sid in ids:
        m.release(sid)

    # Threads: workers each run claim(1) -> fetch -> step -> release in a loop.
    comptime WORKERS = 8
    comptime ROUNDS = 5000
    var mp = Pointer(to=m).unsafe_origin_cast[MutUntrackedOrigin]()

    def body(w: Int) {var mp}:
        for _ in range(ROUNDS):
            try:
                var ids = mp[].claim(1)
                var coll = mp[].fetch[Manager.CollectionType](ids)
                mp[].step([1], coll)
                mp[].release(ids[0])
            except:
                pass

    var t5 = perf_counter_ns()
    sync_parallelize(body, WORKERS)
    var secs = Float64(perf_counter_ns() - t5) / 1e9
    print("mojo_threads_lifecycles_per_s", Float64(WORKERS * ROUNDS) / secs)
    print("mojo_threads_free_slots_after", m.num_free_slots())
