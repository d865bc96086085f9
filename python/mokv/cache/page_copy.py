"""HostPages: the bytes of a replica's host tier, and the batched copies between tiers.

`read_pages` / `write_pages` move one device shard's pages to and from plain bytes (the
shared tier's values, see `mokv.remote`).

A host page has the device page layout `[2, num_layers, page_size, n_kv_heads_per_device,
head_dim]`, one buffer per device of the replica (tensor parallelism splits the heads,
so shard `d` of a page lives in `buffers[d][page_id]`), and one page is one contiguous
copy. Scaled FP8 pages have a second leaf, their scales (`[2, num_layers, page_size,
heads, head_dim // granularity]` float32 per page): one more buffer per device after the
values' (`buffers[n_devices + d]`), copied in the same calls under the same page ids.
Copies go one batch per device and direction per call:

- a device in host memory (the CPU device) is copied with numpy on aliasing views, as
  one `np.take(src, src_ids, axis=0, out=dst[run])` per run of consecutive destination
  pages (usually one run: fresh pages come out of the pools in order). That is one
  pass over the bytes; a fancy-index assignment `dst[ids] = src[ids]` would make two.
- an accelerator is copied with `max.driver.batch_inplace_copy` (one driver submission
  per device stream for the whole batch) between page slices of the buffers.

Copies are bit-exact: the views are unsigned integers of the element's size, so
bfloat16 (which numpy lacks) is moved as uint16.

On an accelerator the shard's host pages are allocated with `Usage.STAGING` (MAX 26.7's
pinned host memory for that device; `Buffer.pinned` tells whether it landed there), so
the driver copies them by DMA without a bounce buffer, and `batch_inplace_copy` enqueues
on each destination device's own stream, which the device's later graph launches follow.
The CPU device has neither; its copies are synchronous memcpys.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from max.driver import CPU, Buffer, Device, Usage, batch_inplace_copy
from max.dtype import DType

_BITS = {2: DType.uint16, 4: DType.uint32, 1: DType.uint8, 8: DType.uint64}


def numpy_view(buffer: Buffer) -> np.ndarray:
    """An unsigned-integer numpy array aliasing a host `buffer`'s bytes."""
    return buffer.view(_BITS[buffer.dtype.size_in_bytes]).to_numpy()


def _runs(ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(start index in ids, first id, length) of each run of consecutive ascending ids."""
    runs, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1:
            runs.append((start, ids[start], i - start))
            start = i
    return runs


def copy_pages(
    src: Sequence[Buffer],
    src_ids: Sequence[int],
    dst: Sequence[Buffer],
    dst_ids: Sequence[int],
    views: dict[int, np.ndarray] | None = None,
) -> None:
    """Copies page `src_ids[i]` of `src[d]` into page `dst_ids[i]` of `dst[d]` for every
    device shard `d`: one batch per shard. `views` memoizes numpy views by buffer id."""
    if not src_ids:
        return
    for s, t in zip(src, dst, strict=True):
        if s.device.is_host and t.device.is_host:
            _copy_host(_view(s, views), src_ids, _view(t, views), dst_ids)
        else:
            _copy_driver(s, src_ids, t, dst_ids)


def _copy_host(
    src: np.ndarray, src_ids: Sequence[int], dst: np.ndarray, dst_ids: Sequence[int]
) -> None:
    """One `np.take` per run of consecutive destination pages (one pass over the bytes)."""
    src_idx = np.asarray(src_ids, dtype=np.intp)
    for start, first, n in _runs(dst_ids):
        np.take(src, src_idx[start : start + n], axis=0, out=dst[first : first + n], mode="clip")


def _copy_driver(src: Buffer, src_ids: Sequence[int], dst: Buffer, dst_ids: Sequence[int]) -> None:
    """One `batch_inplace_copy` of page slices (the accelerator path)."""
    rest = (slice(None),) * (src.rank - 1)  # Buffer slicing wants every dimension
    batch_inplace_copy(
        [dst[(slice(i, i + 1),) + rest] for i in dst_ids],
        [src[(slice(i, i + 1),) + rest] for i in src_ids],
    )


def _view(buffer: Buffer, views: dict[int, np.ndarray] | None) -> np.ndarray:
    if views is None:
        return numpy_view(buffer)
    view = views.get(id(buffer))
    if view is None:
        view = views[id(buffer)] = numpy_view(buffer)
    return view


def _host_buffer(dtype: DType, shape: list[int], device: Device) -> Buffer:
    """Host memory for pages copied to and from `device`: pinned for an accelerator.

    On the CPU device the memory is reserved, not touched: the OS maps it on first
    write, so a large tier costs almost nothing at startup (see README, "Host tier").
    Pinning touches every page; a large pinned tier takes seconds (vLLM #42632).
    """
    if device.is_host:
        return Buffer(dtype, shape, device=CPU())
    return Buffer(dtype, shape, device=device, usage=Usage.STAGING)


def read_pages(
    buffer: Buffer, page_ids: Sequence[int], views: dict[int, np.ndarray] | None = None
) -> list[np.ndarray]:
    """Pages `page_ids` of one device shard as host arrays of the page's shape, for a
    reader that copies them at once (`RemotePageStore.put`): aliasing views on a host
    device, else rows of one host staging buffer filled by one batched copy."""
    if _in_host_memory(buffer):
        view = _view(buffer, views)
        return [view[i] for i in page_ids]
    staging = _host_buffer(buffer.dtype, [len(page_ids), *buffer.shape[1:]], buffer.device)
    _copy_driver(buffer, page_ids, staging, range(len(page_ids)))
    buffer.device.synchronize()  # the copy is enqueued; the reader reads the bytes now
    return list(numpy_view(staging))


def write_pages(
    pages: Sequence[memoryview],
    buffer: Buffer,
    page_ids: Sequence[int],
    views: dict[int, np.ndarray] | None = None,
) -> None:
    """Writes `pages[i]` (the bytes of one page of the shard's layout) into page
    `page_ids[i]` of one device shard: straight into a host device's pages, else into
    one host staging buffer and then one batched copy to the accelerator."""
    direct = _in_host_memory(buffer)
    if direct:
        target, rows = _view(buffer, views), page_ids
    else:
        staging = _host_buffer(buffer.dtype, [len(pages), *buffer.shape[1:]], buffer.device)
        target, rows = numpy_view(staging), range(len(pages))
    for row, page in zip(rows, pages, strict=True):
        target[row].reshape(-1).view(np.uint8)[:] = np.frombuffer(page, np.uint8)
    if not direct:
        _copy_driver(staging, range(len(pages)), buffer, page_ids)
        buffer.device.synchronize()  # the staging buffer must outlive the enqueued copy


def _in_host_memory(buffer: Buffer) -> bool:
    """Whether numpy can alias `buffer` (else it is copied through a staging buffer)."""
    return buffer.device.is_host


class HostPages:
    """The host tier's page bytes for one replica: one buffer per device shard."""

    def __init__(
        self,
        dtype: DType,
        num_pages: int,
        page_shape: Sequence[int],
        devices: Sequence[Device],
        scales: tuple[DType, Sequence[int]] | None = None,
    ) -> None:
        """`num_pages` pages of `page_shape` values of `dtype` per device, and with
        `scales` (their dtype and page shape) the scales leaf beside them."""
        self.num_pages = num_pages
        leaves = [(dtype, page_shape, d) for d in devices]
        if scales is not None:
            leaves += [(scales[0], scales[1], d) for d in devices]
        self.buffers = [_host_buffer(t, [num_pages, *shape], d) for t, shape, d in leaves]
        self.bytes_per_page = sum(int(np.prod(shape)) * t.size_in_bytes for t, shape, _ in leaves)
        self._views: dict[int, np.ndarray] = {}
        self.bytes_to_host = 0
        self.bytes_from_host = 0

    def offload(
        self, blocks: Sequence[Buffer], device_pages: Sequence[int], host_pages: Sequence[int]
    ) -> None:
        """Device pages -> host pages (one batch per device and leaf; `blocks` are the
        device buffers in `buffers` order)."""
        copy_pages(blocks, device_pages, self.buffers, host_pages, self._views)
        self.bytes_to_host += len(host_pages) * self.bytes_per_page

    def load(
        self, host_pages: Sequence[int], blocks: Sequence[Buffer], device_pages: Sequence[int]
    ) -> None:
        """Host pages -> device pages (one batch per device)."""
        copy_pages(self.buffers, host_pages, blocks, device_pages, self._views)
        self.bytes_from_host += len(device_pages) * self.bytes_per_page
