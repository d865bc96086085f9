"""ContinuousBatchingKVCacheManager: lifecycle, slot order, errors that change nothing."""

from std.testing import assert_equal, assert_false, assert_raises, assert_true, TestSuite

from max.gpu.host import DeviceContext

from mokv.manager import ContinuousBatchingKVCacheManager
from mokv.types import KVCacheStaticParams

comptime KV = KVCacheStaticParams(num_heads=2, head_size=8)
comptime Manager = ContinuousBatchingKVCacheManager[DType.float32, KV]


def _manager(max_batch_size: Int = 4, max_seq_len: Int = 16) raises -> Manager:
    var cpu = DeviceContext(api="cpu")
    return Manager(max_batch_size, max_seq_len, 3, cpu, cpu)


def test_claim_hands_out_lowest_free_slots() raises:
    var m = _manager()
    assert_equal(m.num_elements(), 4 * 2 * 3 * 16 * 2 * 8)
    var a = m.claim(2)
    assert_equal(a, [0, 1])
    m.release(0)
    var b = m.claim(2)
    assert_equal(b, [0, 2])  # the released slot is on top of the free stack
    assert_equal(m.num_free_slots(), 1)
    assert_equal(Int(m.cache_lengths.seq_id_counter.load()), 4)
    assert_true(m.contains(1))
    assert_false(m.contains(3))


def test_fetch_step_release_lifecycle() raises:
    var m = _manager()
    var ids = m.claim(2)
    var coll = m.fetch[Manager.CollectionType](ids)
    assert_true(coll.is_cache_empty)
    assert_equal(coll.batch_size(), 2)
    assert_equal(coll.num_layers(), 3)
    assert_equal(m.num_inflight(), 1)
    m.step([5, 3], coll)  # context encoding
    assert_equal(m.num_inflight(), 0)
    assert_equal(m.cache_length(ids[0]), 5)
    assert_equal(m.cache_length(ids[1]), 3)
    var rev: List[Int] = [ids[1], ids[0]]
    var c2 = m.fetch[Manager.CollectionType](rev)
    assert_false(c2.is_cache_empty)
    assert_equal(Int(c2.cache_lengths[unsafe_offset=0]), 3)
    assert_equal(Int(c2.lookup_table[unsafe_offset=0]), ids[1])
    assert_equal(Int(c2.cache_lengths[unsafe_offset=1]), 5)
    m.step([1, 1], c2)
    assert_equal(m.cache_length(ids[0]), 6)
    with assert_raises(contains="already stepped"):
        m.step([1, 1], c2)
    m.release(ids[0])
    var again = m.claim(1)
    assert_equal(again[0], ids[0])
    assert_equal(m.cache_length(again[0]), 0)  # a reclaimed slot starts empty


def test_errors_name_the_value_and_change_nothing() raises:
    var m = _manager(max_batch_size=2, max_seq_len=8)
    var ids = m.claim(1)
    with assert_raises(contains="BatchTooLargeError: cannot claim 2 sequences: 1 of 2"):
        _ = m.claim(2)
    with assert_raises(contains="ValueError: claim(batch_size=0)"):
        _ = m.claim(0)
    with assert_raises(contains="ValueError: claim(batch_size=-1)"):
        _ = m.claim(-1)
    assert_equal(m.num_free_slots(), 1)
    with assert_raises(contains="UnknownRequestError: sequence id 7"):
        m.release(7)
    with assert_raises(contains="UnknownRequestError: sequence id 1"):
        m.step([ids[0], 1], [1, 1])
    with assert_raises(contains="ValueError: sequence 0: negative number of new tokens -2"):
        m.step(ids, [-2])
    with assert_raises(contains="SequenceTooLongError: sequence 0 holds 0 tokens: 9 new tokens would pass max_seq_len=8"):
        m.step(ids, [9])
    with assert_raises(contains="ValueError: sequence id 0 appears twice"):
        _ = m.fetch[Manager.CollectionType]([0, 0])
    with assert_raises(contains="ValueError: sequence id 0 appears twice"):
        m.step([0, 0], [1, 1])
    with assert_raises(contains="ValueError: step got 1 sequence ids but 2 valid lengths"):
        m.step(ids, [1, 1])
    with assert_raises(contains="BatchTooLargeError: batch of 3 is larger than max_batch_size=2"):
        _ = m.fetch[Manager.CollectionType]([0, 0, 0])
    with assert_raises(contains="UnknownRequestError: sequence id -1"):
        _ = m.fetch[Manager.CollectionType]([-1])
    assert_equal(m.cache_length(ids[0]), 0)
    assert_equal(m.num_inflight(), 0)
    m.step(ids, [8])  # exactly max_seq_len fits
    assert_equal(m.cache_length(ids[0]), 8)
    m.release(ids[0])
    with assert_raises(contains="UnknownRequestError: sequence id 0 is not claimed (never, or already released)"):
        m.release(ids[0])
    with assert_raises(contains="UnknownRequestError"):
        _ = m.cache_length(ids[0])
    assert_equal(m.num_free_slots(), 2)  # the lock was released by every raising call
    assert_equal(m.claim(2), [0, 1])


def main() raises:
    TestSuite.discover_tests[__functions_in_module()]().run()
