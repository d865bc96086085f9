"""ContinuousBatchingKVCacheManager: a Mojo program that owns a KV cache.

The manager owns the blocks buffer of the continuous layout (continuous.mojo)

    blocks_buf  [max_batch_size, 2, num_layers, max_seq_len, num_heads, head_size]  on this_device

and hands out `ContinuousBatchingKVCacheCollection` views of it, the same struct the
graph ops consume, so mokv's kernels (kernels/store_kv.mojo, kernels/attention/)
run on it directly. Lifecycle of one sequence:

    claim(n)                 -> seq_ids (a seq id is its slot, lowest free slot first)
    fetch(seq_ids)           -> collection  (cache_lengths = tokens committed so far)
    ... kernels write K/V at cache_lengths[b] + i and attend ...
    step(valid_lengths, coll^)  commits: each length grows by valid_lengths[b]
    (fetch -> step) per generated token
    release(seq_id)          the slot goes back to the free stack

Thread safety: the slot state is a `ContinuousBatchingSlotTable` (one spin lock
around it, slots.mojo), and the collections in flight are tracked under a second spin
lock, so claim, fetch, step and release may be called from several threads at once.
Two threads must not write K/V into the same sequence at once (that is the caller's
data, not the manager's state).

Each `fetch` allocates the batch's `cache_lengths` and `lookup_table` ([batch_size]
uint32 each, one host array, copied to this_device unless that is the CPU) and keeps it until `step` consumes the
collection (or the manager dies): the collection is a view and owns nothing.
"""

from max.gpu.host import DeviceBuffer, DeviceContext
from std.utils.lock import BlockingScopedLock, BlockingSpinLock

from .continuous import ContinuousBatchingKVCacheCollection
from .slots import ContinuousBatchingSlotTable, VALUE_ERROR
from .types import KVCacheStaticParams, KVCollectionT, Ptr, U32Ptr, dtype_code_of, is_quantized


struct _InflightBatch(Movable):
    """The arrays behind one fetched collection: `[cache_lengths | lookup_table]`.

    On a CPU `this_device` the collection points into `host`; otherwise into `device`,
    a copy of `host` on the device.
    """

    var host: List[UInt32]  # [2 * batch_size] (at least 1 element)
    var device: Optional[DeviceBuffer[DType.uint32]]
    var seq_ids: List[Int]
    var key: Int  # address the collection's cache_lengths points at

    def __init__(out self, var host: List[UInt32], var device: Optional[DeviceBuffer[DType.uint32]], var seq_ids: List[Int], key: Int):
        self.host = host^
        self.device = device^
        self.seq_ids = seq_ids^
        self.key = key


struct ContinuousBatchingKVCacheManager[dtype: DType, kv_params: KVCacheStaticParams](Movable):
    """Manages a batch-split KV cache across several sequences; thread-safe.

    Parameters:
        dtype: Element type of the cache (float32, bfloat16 or float16).
        kv_params: KV heads and head size of one token's K (or V) in one layer.
    """

    comptime CollectionType = ContinuousBatchingKVCacheCollection[
        dtype_code_of[Self.dtype](), Self.kv_params.num_heads, Self.kv_params.head_size
    ]
    """What `fetch` returns and the graph ops consume."""

    var blocks_buf: DeviceBuffer[Self.dtype]
    """[max_batch_size, 2, num_layers, max_seq_len, num_heads, head_size] on `this_device`."""
    var cache_lengths: ContinuousBatchingSlotTable
    """Slot assignment and committed lengths (and `seq_id_counter`), behind a spin lock."""
    var num_blocks: Int
    """Slots in `blocks_buf` (= max_batch_size)."""
    var max_batch_size: Int
    var max_seq_len: Int
    var num_layers: Int
    var this_device: DeviceContext
    """Where the cache and the fetched arrays live, and where the kernels run."""
    var other_device: DeviceContext
    """The host side (staging of the fetched arrays)."""
    var _inflight: List[_InflightBatch]
    var _inflight_lock: BlockingSpinLock
    var _on_host: Bool  # this_device is the CPU: fetched arrays need no device copy

    def __init__(
        out self,
        max_batch_size: Int,
        max_seq_len: Int,
        num_layers: Int,
        other_device: DeviceContext,
        this_device: DeviceContext,
    ) raises:
        """Allocates the zero-filled cache of `max_batch_size` slots on `this_device`."""
        comptime assert not is_quantized[Self.dtype](), "the Mojo manager holds no FP8 cache (it has no scales to hand the kernels)"
        comptime assert Self.kv_params.num_heads > 0, "kv_params.num_heads must be positive"
        comptime assert Self.kv_params.head_size > 0, "kv_params.head_size must be positive"
        if num_layers < 1:
            raise Error(t"{VALUE_ERROR}num_layers must be positive, got {num_layers}")
        self.cache_lengths = ContinuousBatchingSlotTable(max_batch_size, max_seq_len)
        self.num_blocks = max_batch_size
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.num_layers = num_layers
        self.this_device = this_device
        self.other_device = other_device
        var n = max_batch_size * 2 * num_layers * max_seq_len * Self.kv_params.num_heads * Self.kv_params.head_size
        self.blocks_buf = this_device.enqueue_create_buffer[Self.dtype](n)
        this_device.enqueue_memset(self.blocks_buf, 0)
        this_device.synchronize()
        self._inflight = List[_InflightBatch]()
        self._inflight_lock = BlockingSpinLock()
        self._on_host = this_device.api() == "cpu"

    # --- the cache memory ------------------------------------------------------------

    def blocks_ptr(self) -> Ptr[Self.dtype]:
        """Address of `blocks_buf` (device memory unless `this_device` is the CPU)."""
        return self.blocks_buf.unsafe_ptr().unsafe_mut_cast[True]().unsafe_origin_cast[MutUntrackedOrigin]()

    def num_elements(self) -> Int:
        """Elements in `blocks_buf`."""
        return len(self.blocks_buf)

    # --- lifecycle -------------------------------------------------------------------

    @staticmethod
    def _check_collection[collection_t: KVCollectionT]():
        """`collection_t` must be `CollectionType` (`rebind` would accept any other one)."""
        comptime assert (
            collection_t.name_str == Self.CollectionType.name_str
            and collection_t.CacheType.dtype == Self.dtype
            and collection_t.CacheType.kv_params.num_heads == Self.kv_params.num_heads
            and collection_t.CacheType.kv_params.head_size == Self.kv_params.head_size
        ), "fetch/step take this manager's CollectionType (continuous, same dtype and kv_params)"

    def claim(mut self, batch_size: Int) raises -> List[Int]:
        """Assigns `batch_size` free slots to new sequences and returns their seq_ids."""
        return self.cache_lengths.claim(batch_size)

    def fetch[collection_t: KVCollectionT](mut self, seq_ids: List[Int]) raises -> collection_t:
        """The collection of the given sequences, in that order (raises for an unclaimed
        or repeated id). Its cache_lengths are the tokens committed so far."""
        Self._check_collection[collection_t]()
        var n = len(seq_ids)
        var host = List[UInt32](length=max(2 * n, 1), fill=0)
        var host_ptr = host.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
        var is_empty = self.cache_lengths.lookup(seq_ids, host_ptr, host_ptr.unsafe_offset(n))
        var p = host_ptr  # a List's elements stay put when the List is moved
        var device = Optional[DeviceBuffer[DType.uint32]](None)
        if not self._on_host:
            var arrays = self.this_device.enqueue_create_buffer[DType.uint32](len(host))
            self.this_device.enqueue_copy(arrays, host.unsafe_ptr())
            self.this_device.synchronize()
            p = arrays.unsafe_ptr().unsafe_mut_cast[True]().unsafe_origin_cast[MutUntrackedOrigin]()
            device = arrays^
        var coll = Self.CollectionType(
            self.blocks_ptr(),
            p.unsafe_bitcast[Float32](),  # no scales (no FP8 cache here): never read
            p,
            p.unsafe_offset(n),
            n,
            self.max_batch_size,
            self.num_layers,
            self.max_seq_len,
            is_empty,
        )
        with BlockingScopedLock(self._inflight_lock):
            self._inflight.append(_InflightBatch(host^, device^, seq_ids.copy(), Int(p)))
        return rebind[collection_t](coll)

    def step[collection_t: KVCollectionT](mut self, valid_lengths: List[Int], var inflight_cache: collection_t) raises:
        """Commits the tokens written through `inflight_cache` (from `fetch`): batch entry
        `b`'s length grows by `valid_lengths[b]`. All or nothing: on an error the lengths
        are unchanged and the collection stays in flight."""
        Self._check_collection[collection_t]()
        var coll = rebind[Self.CollectionType](inflight_cache)
        var key = Int(coll.cache_lengths)
        var seq_ids = List[Int]()
        var found = -1
        with BlockingScopedLock(self._inflight_lock):
            for i in range(len(self._inflight)):
                if self._inflight[i].key == key:
                    found = i
                    seq_ids = self._inflight[i].seq_ids.copy()
                    break
        if found < 0:
            raise Error(t"{VALUE_ERROR}step: the collection was not fetched from this manager, or was already stepped")
        self.cache_lengths.step(seq_ids, valid_lengths)
        with BlockingScopedLock(self._inflight_lock):
            for i in range(len(self._inflight)):  # other threads may have moved it
                if self._inflight[i].key == key:
                    _ = self._inflight.pop(i)
                    break

    def step(mut self, seq_ids: List[Int], valid_lengths: List[Int]) raises:
        """Commits `valid_lengths[i]` new tokens to `seq_ids[i]` (no collection needed)."""
        self.cache_lengths.step(seq_ids, valid_lengths)

    def release(mut self, seq_id: Int) raises:
        """Marks `seq_id` as finished; its slot goes back to the pool."""
        self.cache_lengths.release(seq_id)

    # --- queries ---------------------------------------------------------------------

    def contains(mut self, seq_id: Int) -> Bool:
        """Whether `seq_id` is claimed."""
        return self.cache_lengths.contains(seq_id)

    def cache_length(mut self, seq_id: Int) raises -> Int:
        """Tokens committed for `seq_id`."""
        return self.cache_lengths.cache_length(seq_id)

    def num_free_slots(mut self) -> Int:
        """Slots that `claim` can hand out now."""
        return self.cache_lengths.num_free_slots()

    def num_inflight(mut self) -> Int:
        """Collections fetched and not yet stepped."""
        with BlockingScopedLock(self._inflight_lock):
            return len(self._inflight)
