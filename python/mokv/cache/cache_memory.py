"""The cache's K/V buffers, on transparent huge pages where the device is host memory.

Decode attention streams every cached K/V byte of a request once per step. On the CPU
device the buffer is ordinary process memory; with 4 KiB pages a 1 x 16k bfloat16 read
of 32 MiB walks 8192 page-table entries, and the hardware prefetchers stop at every
4 KiB boundary. Linux backs a range with 2 MiB pages when asked with
`madvise(MADV_HUGEPAGE)` before its first touch (THP mode `madvise`, the usual default;
mode `always` does it unasked, `never` refuses). numpy asks for every array of 4 MiB or
more, so the read probe the benchmarks set decode against was already on huge pages
and the cache was not. Measured (emeraldrapids, 2 cores, bf16 GQA 8 decode in graphs):
see benchmarks/README, "Huge pages for the cache".

The advice is a hint: where the OS cannot follow it (another OS, THP off) the buffer
is the same memory on small pages. It covers the 2 MiB-aligned interior of the
buffer. It belongs to the address range, not to the buffer: when MAX's allocator
later reuses that range for another buffer, the advice is still there (harmless, and
why a test cannot tell advised from plain buffers after the first advice). Huge
pages commit memory in 2 MiB steps as the cache is first written; a cache is sized
to be used, so this costs at most 2 MiB per buffer over small pages.
"""

from __future__ import annotations

import ctypes
import functools
import math
import sys
from collections.abc import Sequence

from max.driver import Buffer, Device
from max.dtype import DType

from ..errors import InsufficientMemoryError

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # <linux/mman.h>


def cache_buffer(dtype: DType, shape: Sequence[int], device: Device) -> Buffer:
    """A buffer for K/V pages on `device`; huge-page backed in host memory on Linux.
    InsufficientMemoryError naming the shape and bytes when the device cannot hold it
    (MAX raises a bare ValueError, or a TypeError for dims past 64 bits)."""
    nbytes = math.prod(shape) * dtype.size_in_bytes
    where = f"a K/V buffer of shape {list(shape)} ({nbytes} bytes of {dtype.name}) on {device}"
    if nbytes >= 2**63:
        raise InsufficientMemoryError(f"{where} is past any device's memory")
    try:
        buffer = Buffer(dtype, list(shape), device=device)
    except (ValueError, MemoryError) as e:
        raise InsufficientMemoryError(f"{where}: the device cannot hold it ({e})") from None
    if device.is_host and sys.platform == "linux":
        advise_huge_pages(buffer)
    return buffer


def advise_huge_pages(buffer: Buffer) -> bool:
    """Asks Linux to back the buffer's aligned interior with 2 MiB pages; True if it took.

    Pages already touched keep their small pages (khugepaged may merge them later),
    so this is for fresh buffers."""
    lo, hi = aligned_interior(buffer)
    if hi <= lo:
        return False
    return _libc().madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_HUGEPAGE) == 0


def aligned_interior(buffer: Buffer) -> tuple[int, int]:
    """[lo, hi): the addresses of the whole huge pages inside the buffer (hi <= lo: none)."""
    start = buffer._data_ptr()
    end = start + buffer.num_elements * buffer.dtype.size_in_bytes
    return -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc
