"""ContinuousBatchingKVCacheManager under concurrent claim / fetch / step / release.

Workers share one manager. Each claims a few sequences, checks that nobody else holds
their slots (an ownership table of the test's own, behind its own lock), fetches and
steps them several times checking every length, makes a few bad calls, and releases
them. At the end every slot must be free and every call accounted for.
"""

from std.atomic import Atomic
from std.testing import assert_equal, assert_true, TestSuite
from std.time import perf_counter_ns
from std.utils.lock import BlockingScopedLock, BlockingSpinLock

from max.algorithm import sync_parallelize
from max.gpu.host import DeviceContext

from mokv.manager import ContinuousBatchingKVCacheManager
from mokv.types import KVCacheStaticParams

comptime KV = KVCacheStaticParams(num_heads=1, head_size=4)
comptime Manager = ContinuousBatchingKVCacheManager[DType.float32, KV]
comptime SLOTS = 3  # fewer than the workers can hold at once: claims also fail
comptime MAX_SEQ = 64
comptime WORKERS = 8
comptime ROUNDS = 3000
comptime RENDEZVOUS_NS = 10_000_000_000  # a pool with one thread never gets a second worker


struct Shared(Movable):
    """The test's view of who holds which slot, and its counters."""

    var lock: BlockingSpinLock
    var owner: List[Int]  # [SLOTS] worker holding the slot, or -1
    var double_grants: Atomic[Int64]
    var wrong_lengths: Atomic[Int64]
    var unexpected_errors: Atomic[Int64]
    var expected_errors: Atomic[Int64]
    var claims: Atomic[Int64]
    var steps: Atomic[Int64]
    var held: Int  # slots held now, and the most ever held at once (under `lock`)
    var max_held: Int
    var running: Int  # workers running now, and the most ever at once (under `lock`)
    var max_running: Int

    def __init__(out self):
        self.lock = BlockingSpinLock()
        self.owner = List[Int](length=SLOTS, fill=-1)
        self.double_grants = Atomic[Int64](0)
        self.wrong_lengths = Atomic[Int64](0)
        self.unexpected_errors = Atomic[Int64](0)
        self.expected_errors = Atomic[Int64](0)
        self.claims = Atomic[Int64](0)
        self.steps = Atomic[Int64](0)
        self.held = 0
        self.max_held = 0
        self.running = 0
        self.max_running = 0

    def take(mut self, slot: Int, worker: Int):
        with BlockingScopedLock(self.lock):
            if self.owner[slot] != -1:
                _ = self.double_grants.fetch_add(1)
            self.owner[slot] = worker
            self.held += 1
            self.max_held = max(self.max_held, self.held)

    def give_back(mut self, slot: Int):
        with BlockingScopedLock(self.lock):
            self.owner[slot] = -1
            self.held -= 1

    def enter(mut self) -> Int:
        """A worker starts; returns the most workers ever running at once."""
        with BlockingScopedLock(self.lock):
            self.running += 1
            self.max_running = max(self.max_running, self.running)
            return self.max_running

    def most_running(mut self) -> Int:
        with BlockingScopedLock(self.lock):
            return self.max_running

    def leave(mut self):
        with BlockingScopedLock(self.lock):
            self.running -= 1


def _rendezvous(s: Pointer[Shared, MutUntrackedOrigin]):
    """Waits, running, until another worker runs too (or 10 s pass): a worker takes
    about a millisecond, less than a pool thread may take to wake up, so without this one
    thread could run every worker in turn and the workers would never overlap."""
    var start = perf_counter_ns()
    if s[].enter() >= 2:
        return
    while s[].most_running() < 2 and perf_counter_ns() - start < RENDEZVOUS_NS:
        pass


def _worker(m: Pointer[Manager, MutUntrackedOrigin], s: Pointer[Shared, MutUntrackedOrigin], worker: Int) raises:
    _rendezvous(s)
    try:
        _work(m, s, worker)
    finally:
        s[].leave()


def _work(m: Pointer[Manager, MutUntrackedOrigin], s: Pointer[Shared, MutUntrackedOrigin], worker: Int) raises:
    var rng = UInt64(worker * 7919 + 17)
    for _ in range(ROUNDS):
        rng = rng * 6364136223846793005 + 1442695040888963407
        var want = Int((rng >> 33) % 2) + 1
        var ids: List[Int]
        try:
            ids = m[].claim(want)
        except e:
            if not String(e).startswith("BatchTooLargeError"):
                raise e^
            _ = s[].expected_errors.fetch_add(1)
            continue
        _ = s[].claims.fetch_add(Int64(len(ids)))
        for sid in ids:
            s[].take(sid, worker)
        var lengths = List[Int](length=len(ids), fill=0)
        var num_steps = Int((rng >> 40) % 4) + 1
        for step in range(num_steps):
            var coll = m[].fetch[Manager.CollectionType](ids)
            for b in range(len(ids)):
                if Int(coll.cache_lengths[unsafe_offset=b]) != lengths[b] or Int(coll.lookup_table[unsafe_offset=b]) != ids[b]:
                    _ = s[].wrong_lengths.fetch_add(1)
            var grow = List[Int](length=len(ids), fill=0)
            for b in range(len(ids)):
                grow[b] = 8 if step == 0 else 1  # context encoding, then one token
                lengths[b] += grow[b]
            m[].step(grow, coll)
            _ = s[].steps.fetch_add(1)
        for b in range(len(ids)):
            if m[].cache_length(ids[b]) != lengths[b]:
                _ = s[].wrong_lengths.fetch_add(1)
        try:  # past max_seq_len: rejected, nothing changes
            m[].step(ids, List[Int](length=len(ids), fill=MAX_SEQ))
            _ = s[].unexpected_errors.fetch_add(1)
        except:
            _ = s[].expected_errors.fetch_add(1)
        for b in range(len(ids)):
            s[].give_back(ids[b])  # before release: the slot may be granted again at once
            m[].release(ids[b])
        try:  # an id that is no slot (a double release could hit a slot another worker
            # claimed again meanwhile: ids are slots, as in the Python manager)
            m[].release(SLOTS + worker)
            _ = s[].unexpected_errors.fetch_add(1)
        except:
            _ = s[].expected_errors.fetch_add(1)


def test_concurrent_workers_never_share_a_slot() raises:
    var cpu = DeviceContext(api="cpu")
    var m = Manager(SLOTS, MAX_SEQ, 2, cpu, cpu)
    var s = Shared()
    var mp = Pointer(to=m).unsafe_origin_cast[MutUntrackedOrigin]()
    var sp = Pointer(to=s).unsafe_origin_cast[MutUntrackedOrigin]()

    def body(worker: Int) {var mp, var sp}:
        try:
            _worker(mp, sp, worker)
        except e:
            print("worker", worker, "failed:", e)
            _ = sp[].unexpected_errors.fetch_add(1)

    sync_parallelize(body, WORKERS)
    assert_equal(Int(s.double_grants.load()), 0)
    assert_equal(Int(s.wrong_lengths.load()), 0)
    assert_equal(Int(s.unexpected_errors.load()), 0)
    assert_equal(m.num_free_slots(), SLOTS)
    # Two workers ran at once (the rendezvous waits for it; only a pool of one thread
    # fails this). How many slots they held at once depends on the scheduler: reported.
    assert_true(s.max_running >= 2, "the workers never ran at once")
    assert_equal(m.num_inflight(), 0)
    assert_equal(Int(m.cache_lengths.seq_id_counter.load()), Int(s.claims.load()))
    print("claims", s.claims.load(), "steps", s.steps.load(), "expected errors", s.expected_errors.load(), "most slots held at once", s.max_held, "most workers running at once", s.max_running)


def main() raises:
    TestSuite.discover_tests[__functions_in_module()]().run()
