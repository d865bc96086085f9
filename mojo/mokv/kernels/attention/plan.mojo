"""Cutting a ragged batch into the CPU attention's work units."""

from std.math import ceildiv
from std.sys.info import num_physical_cores

from ...types import KVCacheT, U32Ptr
from .forms import MAX_ROWS, STAGED_UNITS
from .unit import Merge, Unit, head_rows

comptime MIN_SPLIT_KEYS = 256  # fewest keys a split of one unit's keys gets (split cost: one merge)
comptime SPLIT_ALIGN = 64  # split boundaries fall on multiples of this (whole key tiles)
comptime SPLIT_UNITS_PER_CORE = 8
"""Keys are split until there are this many units per core. With units taken on demand
(`parallel_units`) a core idles at most for the last unit's tail, so smaller units help
until their merges cost more: 4 -> 8 made median decode times 2-12 % lower on six of
seven 1 x 16k / 4 x 8k shapes and level on the seventh (GQA 1 bf16), six alternating runs."""


@always_inline
def _nearest_tile(keys: Int) -> Int:
    """`keys` rounded to the nearest multiple of SPLIT_ALIGN."""
    return (keys + SPLIT_ALIGN // 2) // SPLIT_ALIGN * SPLIT_ALIGN


def plan_units[Cache: KVCacheT](
    kc: Cache,
    offsets: U32Ptr,
    batch_size: Int,
    group: Int,
    window: Int,
    mut units: List[Unit],
    mut merges: List[Merge],
) raises -> Int:
    """Cuts the batch into units and returns the number of partial slots they use.

    Each entry's new tokens go in tiles of at most MAX_ROWS // group tokens. A tile
    takes as many KV heads as fit in MAX_ROWS rows: one head for a prefill tile, all
    of them for a decode token with group <= 8, so that decode walks each key tile's
    heads in address order. When that leaves too few units to keep every core busy
    (a few long decodes), the keys each unit's rows all see are split, at least
    MIN_SPLIT_KEYS apiece, and the last split of each to finish merges them.

    With a sliding window (`window` > 0 keys a query reads, itself included) a unit's
    keys start at its first token's window, so a long sequence's tiles before it are
    never read, and its splits share out only those keys.
    """
    comptime H = Cache.kv_params.num_heads
    if group > MAX_ROWS:
        raise Error("mokv flash_attention (CPU): n_q / n_kv_heads must be <= ", MAX_ROWS)
    var tq = max(1, MAX_ROWS // group)
    var whole = List[Unit]()
    for b in range(batch_size):
        var start = Int(offsets[unsafe_offset=b])
        var end = Int(offsets[unsafe_offset=b + 1])
        var t = start
        while t < end:
            var ntok = min(tq, end - t)
            var nh = H
            while nh * head_rows[STAGED_UNITS[Cache.dtype, Cache.kv_params.head_size]](ntok, group) > MAX_ROWS or H % nh != 0:
                nh -= 1
            var first_pos = kc.cache_length(b) + t - start
            var k_lo = max(0, first_pos - window + 1) if window else 0
            for h0 in range(0, H, nh):
                whole.append(Unit(b, t, t - start, ntok, h0, nh, k_lo, first_pos + ntok, -1, -1))
            t += ntok

    var want = ceildiv(SPLIT_UNITS_PER_CORE * num_physical_cores(), max(len(whole), 1))
    var n_parts = 0
    for u in whole:
        # Keys [k_lo, shared) are visible to the unit's first row; every split has some
        # (with a window, a later row may see none of a split's: the merge weighs its
        # empty state 0).
        var shared = u.k_hi - u.ntok + 1
        var splits = min(want, (shared - u.k_lo) // MIN_SPLIT_KEYS)
        if splits <= 1:
            units.append(u)
            continue
        # Boundaries at i * shared / splits, each rounded to the nearest whole tile, so the
        # splits differ by at most a tile. (A step rounded up to whole tiles left fewer,
        # longer splits and a short last one: 13 at 1 x 4096, so one core ran 7 of them and
        # the other 6, idle for the last ~40 us of a ~470 us call in a graph.)
        var lo = u.k_lo
        for i in range(splits):
            var hi = u.k_hi if i == splits - 1 else _nearest_tile(u.k_lo + ((i + 1) * (shared - u.k_lo)) // splits)
            units.append(Unit(u.b, u.tok0, u.i0, u.ntok, u.h0, u.nh, lo, hi, n_parts + i, len(merges)))
            lo = hi
        merges.append(Merge(Unit(u.b, u.tok0, u.i0, u.ntok, u.h0, u.nh, u.k_lo, u.k_hi, n_parts, -1), splits))
        n_parts += splits
    return n_parts
