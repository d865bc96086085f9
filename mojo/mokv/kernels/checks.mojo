"""Checked mode: verify a batch's runtime tables before a kernel trusts them.

The kernels index the cache through `cache_lengths`, `lookup_table` and
`input_row_offsets` without bounds checks (that is what makes them fast). A table
built by hand can therefore make a kernel read or write outside the cache buffer or
into another sequence's pages. `mokv.check_tables.ragged.<cache>` (ops.mojo) runs these
functions on the host, in the device chain just before the kernel it guards, and raises
an `Error` naming the bad entry; the graph's `execute` then raises in Python and the
kernel does not run. See python/mokv/ops/_checks.py (`emit_table_check`) for when the
op wrappers emit it.

What is verified, for a batch of `batch_size` sequences and `total_tokens` new tokens:

    layer_idx           < num_layers (blocks dim 2)
    input_row_offsets   batch_size + 1 entries, starting at 0, non-decreasing,
                        ending at total_tokens (the rows of the op's token tensor)
    cache_lengths[b] + new tokens of b   <= the sequence's capacity:
                        paged       max_num_pages * page_size (the lookup row's width)
                        continuous  max_seq_len (blocks dim 3)
                        and <= max_positions when given (RoPE table rows)
    paged               lookup_table has batch_size rows, and every page id a
                        sequence touches (positions [0, cache_length + new)) < num_pages
    continuous          lookup_table has batch_size slots, each < max_batch_size
                        (blocks dim 0)

Cost: O(batch_size + pages touched) integer reads on the host per op call.
"""

from std.math import ceildiv

from ..types import U32Ptr


def check_offsets(offsets: U32Ptr, num_offsets: Int, batch_size: Int, total_tokens: Int) raises:
    """Raises unless `offsets` are batch_size + 1 non-decreasing rows from 0 to total_tokens."""
    if num_offsets != batch_size + 1:
        raise Error(
            "mokv checked tables: input_row_offsets has ", num_offsets,
            " entries, expected batch_size + 1 = ", batch_size + 1, " (batch_size = cache_lengths entries)",
        )
    var first = Int(offsets[unsafe_offset=0])
    if first != 0:
        raise Error("mokv checked tables: input_row_offsets[0] = ", first, ", expected 0")
    for b in range(batch_size):
        var lo = Int(offsets[unsafe_offset=b])
        var hi = Int(offsets[unsafe_offset=b + 1])
        if hi < lo:
            raise Error(
                "mokv checked tables: input_row_offsets decreases: [", b, "] = ", lo, " > [", b + 1, "] = ", hi
            )
    var last = Int(offsets[unsafe_offset=batch_size])
    if last != total_tokens:
        raise Error(
            "mokv checked tables: input_row_offsets[", batch_size, "] = ", last,
            ", expected total_tokens = ", total_tokens, " (dim 0 of the op's token rows)",
        )


def check_layer(layer_idx: Int, num_layers: Int) raises:
    """Raises unless `layer_idx` names a layer of the cache buffer."""
    if layer_idx >= num_layers:
        raise Error("mokv checked tables: layer_idx = ", layer_idx, " >= num_layers = ", num_layers)


def _check_end(b: Int, cache_length: Int, new_tokens: Int, capacity: Int, what: StaticString, max_positions: Int) raises:
    var end = cache_length + new_tokens
    if end > capacity:
        raise Error(
            "mokv checked tables: cache_lengths[", b, "] = ", cache_length, " + ", new_tokens,
            " new tokens = ", end, " positions > ", capacity, " (", what, ")",
        )
    if max_positions > 0 and end > max_positions:
        raise Error(
            "mokv checked tables: cache_lengths[", b, "] = ", cache_length, " + ", new_tokens,
            " new tokens = ", end, " positions > ", max_positions, " rows of freqs_cis",
        )


def check_paged_tables(
    cache_lengths: U32Ptr,  # [batch_size]
    batch_size: Int,
    lookup_table: U32Ptr,  # [lookup_rows, max_num_pages]
    lookup_rows: Int,
    max_num_pages: Int,
    num_pages: Int,  # blocks dim 0
    num_layers: Int,  # blocks dim 2
    page_size: Int,  # blocks dim 3
    offsets: U32Ptr,  # [num_offsets]
    num_offsets: Int,
    total_tokens: Int,
    layer_idx: Int,
    max_positions: Int,  # 0: no limit beyond the lookup row
) raises:
    """Raises naming the first entry that would make a paged kernel leave its bounds."""
    check_layer(layer_idx, num_layers)
    if lookup_rows != batch_size:
        raise Error(
            "mokv checked tables: lookup_table has ", lookup_rows, " rows, expected batch_size = ", batch_size,
            " (cache_lengths entries)",
        )
    check_offsets(offsets, num_offsets, batch_size, total_tokens)
    var capacity = max_num_pages * page_size
    for b in range(batch_size):
        var c = Int(cache_lengths[unsafe_offset=b])
        var n = Int(offsets[unsafe_offset=b + 1]) - Int(offsets[unsafe_offset=b])
        _check_end(b, c, n, capacity, "lookup_table row: max_num_pages * page_size", max_positions)
        var row = lookup_table.unsafe_offset(b * max_num_pages)
        for p in range(ceildiv(c + n, page_size)):
            var page_id = Int(row[unsafe_offset=p])
            if page_id >= num_pages:
                raise Error(
                    "mokv checked tables: lookup_table[", b, ", ", p, "] = ", page_id,
                    " >= num_pages = ", num_pages, " (blocks dim 0)",
                )


def check_continuous_tables(
    cache_lengths: U32Ptr,  # [batch_size]
    batch_size: Int,
    lookup_table: U32Ptr,  # [lookup_len]
    lookup_len: Int,
    max_batch_size: Int,  # blocks dim 0
    num_layers: Int,  # blocks dim 2
    max_seq_len: Int,  # blocks dim 3
    offsets: U32Ptr,  # [num_offsets]
    num_offsets: Int,
    total_tokens: Int,
    layer_idx: Int,
    max_positions: Int,  # 0: no limit beyond max_seq_len
) raises:
    """Raises naming the first entry that would make a continuous-batching kernel leave its bounds."""
    check_layer(layer_idx, num_layers)
    if lookup_len != batch_size:
        raise Error(
            "mokv checked tables: lookup_table has ", lookup_len, " slots, expected batch_size = ", batch_size,
            " (cache_lengths entries)",
        )
    check_offsets(offsets, num_offsets, batch_size, total_tokens)
    for b in range(batch_size):
        var slot = Int(lookup_table[unsafe_offset=b])
        if slot >= max_batch_size:
            raise Error(
                "mokv checked tables: lookup_table[", b, "] = ", slot, " >= max_batch_size = ", max_batch_size,
                " (blocks dim 0)",
            )
        var c = Int(cache_lengths[unsafe_offset=b])
        var n = Int(offsets[unsafe_offset=b + 1]) - Int(offsets[unsafe_offset=b])
        _check_end(b, c, n, max_seq_len, "max_seq_len, blocks dim 3", max_positions)
