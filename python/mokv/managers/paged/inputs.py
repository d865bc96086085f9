"""The graph inputs of a paged replica's batch: the page table and the per-device tuples.

Per device, `fetch` hands the graph a `RaggedKVCacheInputs` (layout in
`mokv.layouts.paged`):

    blocks         the replica's buffer on that device
    cache_lengths  uint32 [batch_size]: tokens in each request's cache before the step
    lookup_table   uint32 [batch_size, lookup_table_width(max_pages)]: token t of
                   request b is in page lookup_table[b, t // page_size], row
                   t % page_size; every entry is a valid page id
    max_lengths    uint32 [num_steps, 2], host: per step s, MAX's (most new tokens of
                   one request, most cache + new tokens of one request)
    scales         scaled FP8 pages only (`ScaledRaggedKVCacheInputs`): the scales
                   buffer beside `blocks` on that device

A request's window, in tokens: `[start_idx, active_idx)` is processed in the first step
and each later step adds one token, so the table covers
`max(start_idx + active_length) + num_steps - 1` tokens of the longest request, and is
padded as MAX pads it (`mokv.layouts.max_paged`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from max.driver import Buffer, Device

from ...layouts import RaggedKVCacheInputs, ScaledRaggedKVCacheInputs
from ...layouts.max_paged import LOOKUP_PAD_PAGE, lookup_table_width
from ...layouts.paged import PagedInputs


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class PageTable:
    """Row `slot` lists the pages of the request in that slot (`max_requests` rows of
    `lookup_table_width(max_pages_per_seq)`), so that a batch's lookup table is one
    numpy take. Every entry is a valid page id: `LOOKUP_PAD_PAGE` until a request's
    pages are written there (entries past a request's pages may hold an earlier
    request's; kernels read them at most, never for a token of the request)."""

    def __init__(self, max_requests: int, max_pages_per_seq: int) -> None:
        width = lookup_table_width(max_pages_per_seq)
        self._rows = np.full((max_requests, width), LOOKUP_PAD_PAGE, dtype=np.uint32)

    def set_row(self, slot: int, pages: Sequence[int], start: int = 0) -> None:
        """Row `slot` starts with `pages`, whose first `start` it holds already (a page
        appended: one scalar write, ~40 ns against ~1.4 us for a row of 100 pages)."""
        if len(pages) == start + 1:
            self._rows[slot, start] = pages[start]
        else:
            self._rows[slot, start : len(pages)] = pages[start:]

    def pad(self, slot: int, start: int, end: int) -> None:
        """Entries `[start, end)` of row `slot` are the pad page (pages a sliding window
        released: kernels never read a token there)."""
        self._rows[slot, start:end] = LOOKUP_PAD_PAGE

    def inputs(
        self,
        blocks: Sequence[Buffer],
        devices: Sequence[Device],
        slots: Sequence[int],
        starts: Sequence[int],
        actives: Sequence[int],
        num_steps: int,
        page_size: int,
        scales: Sequence[Buffer] | None = None,
    ) -> list[PagedInputs[Buffer, Buffer]]:
        """One tuple per device for a batch: request `i` holds row `slots[i]`, its cache
        ends at `starts[i]` and it processes `actives[i]` tokens in the first step.

        Plain Python lists are used until the final arrays: for a few dozen requests
        they beat numpy's per-call overhead.
        """
        max_active = max(actives, default=0)
        max_end = max((s + a for s, a in zip(starts, actives)), default=0)
        max_pages = max(1, ceil_div(max_end + num_steps - 1, page_size))
        cache_lengths = np.array(starts, dtype=np.uint32)
        lookup_table = self._rows[slots, : lookup_table_width(max_pages)]
        # Row s, as MAX builds it (`build_max_lengths_tensor`): (most tokens one sequence
        # processes in step s, most cache + new tokens of one sequence after step s).
        max_lengths = np.array(
            [(max_active if s == 0 else 1, max_end + s) for s in range(num_steps)],
            dtype=np.uint32,
        )
        # Buffer.from_numpy aliases host memory; on an accelerator the small tables are copied.
        host = [Buffer.from_numpy(cache_lengths), Buffer.from_numpy(lookup_table)]
        max_lengths_buf = Buffer.from_numpy(max_lengths)
        tables = [host if d.is_host else [t.to(d) for t in host] for d in devices]
        if scales is not None:
            return [
                ScaledRaggedKVCacheInputs(b, lengths, table, max_lengths_buf, s)
                for b, s, (lengths, table) in zip(blocks, scales, tables)
            ]
        return [
            RaggedKVCacheInputs(b, lengths, table, max_lengths_buf)
            for b, (lengths, table) in zip(blocks, tables)
        ]
