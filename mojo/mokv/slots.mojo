"""Thread-safe slot bookkeeping of the continuous-batching cache (the Mojo manager's state).

A sequence id IS its slot index (0 .. max_batch_size - 1), as in
python/mokv/managers/continuous.py: free slots sit on a stack initialised
`[max_batch_size - 1, ..., 0]`, `claim` pops from the end (lowest slot first) and
`release` pushes the slot back; a slot's cache length restarts at 0 when it is claimed.

Thread safety: every public method takes one spin lock around the shared state
(free stack, lengths, claimed flags), so claim, lookup, step and release may run
from several threads at once. `seq_id_counter`, the number of sequences ever claimed,
is an atomic so it can be read without the lock; it is incremented under the lock (a
`fetch_add` after the lock was released lost increments in the threaded stress test
with Mojo 1.2, cause not found; inside the lock the count is exact).

Errors: a caller's mistake raises an `Error` whose text starts with the name of the
mokv Python error it stands for, then names the bad value:

    UnknownRequestError: ...   an id that is not claimed (or already released)
    BatchTooLargeError: ...    more sequences than free slots / than max_batch_size
    SequenceTooLongError: ...  a length past max_seq_len
    ValueError: ...            a non-positive claim, a negative length, a duplicate id

(python/mokv/managers/mojo_continuous.py turns the prefix back into the type.) Every
check runs before the first write, so a raising call leaves the table unchanged. The
lock is released before raising (the message is built under the lock, raised after).
"""

from std.atomic import Atomic
from std.utils.lock import BlockingScopedLock, BlockingSpinLock

from .types import U32Ptr

comptime UNKNOWN_REQUEST = "UnknownRequestError: "
comptime BATCH_TOO_LARGE = "BatchTooLargeError: "
comptime SEQUENCE_TOO_LONG = "SequenceTooLongError: "
comptime VALUE_ERROR = "ValueError: "


struct ContinuousBatchingSlotTable(Movable):
    """Free slots and cache lengths of `max_batch_size` slots of `max_seq_len` tokens.

    Invariants (under the lock): every slot is either on the free stack or claimed,
    never both; `0 <= cache_length <= max_seq_len` for every slot.
    """

    var max_batch_size: Int
    """Slots: sequences held at once."""
    var max_seq_len: Int
    """Tokens one slot holds."""
    var seq_id_counter: Atomic[Int64]
    """Sequences claimed since construction (atomic: read it without the lock)."""
    var _lock: BlockingSpinLock
    var _free_slots: List[Int]  # stack; the top (end) is the next slot handed out
    var _cache_lengths: List[Int]  # [max_batch_size] tokens committed per slot
    var _claimed: List[Bool]  # [max_batch_size]
    var _seen: List[Int]  # [max_batch_size] duplicate detection: _seen[slot] == _stamp
    var _stamp: Int

    def __init__(out self, max_batch_size: Int, max_seq_len: Int) raises:
        if max_batch_size < 1:
            raise Error(t"{VALUE_ERROR}max_batch_size must be positive, got {max_batch_size}")
        if max_seq_len < 1:
            raise Error(t"{VALUE_ERROR}max_seq_len must be positive, got {max_seq_len}")
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.seq_id_counter = Atomic[Int64](0)
        self._lock = BlockingSpinLock()
        self._free_slots = List[Int](capacity=max_batch_size)
        for slot in range(max_batch_size - 1, -1, -1):
            self._free_slots.append(slot)
        self._cache_lengths = List[Int](length=max_batch_size, fill=0)
        self._claimed = List[Bool](length=max_batch_size, fill=False)
        self._seen = List[Int](length=max_batch_size, fill=0)
        self._stamp = 0

    # --- queries ---------------------------------------------------------------------

    def _is_claimed(self, seq_id: Int) -> Bool:
        """Caller holds the lock."""
        return seq_id >= 0 and seq_id < self.max_batch_size and self._claimed[seq_id]

    def contains(mut self, seq_id: Int) -> Bool:
        """Whether `seq_id` is claimed."""
        with BlockingScopedLock(self._lock):
            return self._is_claimed(seq_id)

    def num_free_slots(mut self) -> Int:
        """Slots that `claim` can hand out now."""
        with BlockingScopedLock(self._lock):
            return len(self._free_slots)

    def cache_length(mut self, seq_id: Int) raises -> Int:
        """Tokens committed for `seq_id`."""
        var length = -1
        with BlockingScopedLock(self._lock):
            if self._is_claimed(seq_id):
                length = self._cache_lengths[seq_id]
        if length < 0:
            raise Error(t"{UNKNOWN_REQUEST}sequence id {seq_id} is not claimed")
        return length

    def slot_lengths(mut self) -> List[Int]:
        """A copy of every slot's length, claimed or free (free slots keep their last one)."""
        with BlockingScopedLock(self._lock):
            return self._cache_lengths.copy()

    # --- changes ---------------------------------------------------------------------

    def claim(mut self, batch_size: Int) raises -> List[Int]:
        """Binds `batch_size` free slots to new sequences and returns their ids."""
        if batch_size < 1:
            raise Error(t"{VALUE_ERROR}claim(batch_size={batch_size}): batch_size must be positive")
        var seq_ids = List[Int](capacity=batch_size)
        var num_free: Int
        with BlockingScopedLock(self._lock):
            num_free = len(self._free_slots)
            if batch_size <= num_free:
                for _ in range(batch_size):
                    var slot = self._free_slots.pop()
                    self._claimed[slot] = True
                    self._cache_lengths[slot] = 0
                    seq_ids.append(slot)
                _ = self.seq_id_counter.fetch_add(Int64(batch_size))
        if len(seq_ids) == 0:
            raise Error(
                t"{BATCH_TOO_LARGE}cannot claim {batch_size} sequences: {num_free} of"
                t" {self.max_batch_size} slots are free"
            )
        return seq_ids^

    def release(mut self, seq_id: Int) raises:
        """Returns the slot of `seq_id` to the free stack."""
        var ok = False
        with BlockingScopedLock(self._lock):
            if self._is_claimed(seq_id):
                self._claimed[seq_id] = False
                self._free_slots.append(seq_id)
                ok = True
        if not ok:
            raise Error(t"{UNKNOWN_REQUEST}sequence id {seq_id} is not claimed (never, or already released)")

    def _check_ids(mut self, seq_ids: List[Int]) -> String:
        """Caller holds the lock. The first problem of a batch of ids, or "" when none:
        an unclaimed id, then a repeated one."""
        for seq_id in seq_ids:
            if not self._is_claimed(seq_id):
                return String(t"{UNKNOWN_REQUEST}sequence id {seq_id} is not claimed")
        self._stamp += 1
        for seq_id in seq_ids:
            if self._seen[seq_id] == self._stamp:
                return String(t"{VALUE_ERROR}sequence id {seq_id} appears twice in one batch")
            self._seen[seq_id] = self._stamp
        return String()

    def lookup(mut self, seq_ids: List[Int], cache_lengths: U32Ptr, lookup_table: U32Ptr) raises -> Bool:
        """Writes each sequence's length and slot (`fetch`'s inputs); True if all lengths are 0.

        `cache_lengths` and `lookup_table` hold `len(seq_ids)` entries each. Checks, in
        this order: at most `max_batch_size` ids, every id claimed, no id twice.
        """
        var n = len(seq_ids)
        if n > self.max_batch_size:
            raise Error(t"{BATCH_TOO_LARGE}batch of {n} is larger than max_batch_size={self.max_batch_size}")
        var err: String
        var is_empty = True
        with BlockingScopedLock(self._lock):
            err = self._check_ids(seq_ids)
            if not err:
                for i in range(n):
                    var length = self._cache_lengths[seq_ids[i]]
                    is_empty = is_empty and length == 0
                    cache_lengths[unsafe_offset=i] = UInt32(length)
                    lookup_table[unsafe_offset=i] = UInt32(seq_ids[i])
        if err:
            raise Error(err)
        return is_empty

    def step(mut self, seq_ids: List[Int], valid_lengths: List[Int]) raises:
        """Commits `valid_lengths[i]` new tokens to `seq_ids[i]`, all or nothing.

        Checks, in this order: equal list lengths, every id claimed, no id twice, no
        negative count, no resulting length past `max_seq_len`.
        """
        if len(seq_ids) != len(valid_lengths):
            raise Error(
                t"{VALUE_ERROR}step got {len(seq_ids)} sequence ids but {len(valid_lengths)} valid lengths"
            )
        var err: String
        with BlockingScopedLock(self._lock):
            err = self._check_ids(seq_ids)
            if not err:
                for i in range(len(seq_ids)):
                    if valid_lengths[i] < 0:
                        err = String(
                            t"{VALUE_ERROR}sequence {seq_ids[i]}: negative number of new tokens {valid_lengths[i]}"
                        )
                        break
            if not err:
                for i in range(len(seq_ids)):
                    var grown = self._cache_lengths[seq_ids[i]] + valid_lengths[i]
                    if grown > self.max_seq_len:
                        err = String(
                            t"{SEQUENCE_TOO_LONG}sequence {seq_ids[i]} holds"
                            t" {self._cache_lengths[seq_ids[i]]} tokens: {valid_lengths[i]} new"
                            t" tokens would pass max_seq_len={self.max_seq_len}"
                        )
                        break
            if not err:
                for i in range(len(seq_ids)):
                    self._cache_lengths[seq_ids[i]] += valid_lengths[i]
        if err:
            raise Error(err)
