"""Helpers for ragged batches: `input_row_offsets` [batch_size + 1] delimit each entry's new tokens."""

from ..types import U32Ptr


@always_inline
def batch_of_token(offsets: U32Ptr, batch_size: Int, tok: Int) -> Int:
    """The batch entry whose rows hold flat token `tok` (binary search in the offsets)."""
    var lo = 0
    var hi = batch_size  # invariant: offsets[lo] <= tok < offsets[hi]
    while hi - lo > 1:
        var mid = (lo + hi) // 2
        if Int(offsets[unsafe_offset=mid]) <= tok:
            lo = mid
        else:
            hi = mid
    return lo
