"""Page copies between tiers (`mokv.cache.page_copy`): the host tier's batched copies
(`HostPages`) and the shared tier's page bytes (`read_pages` / `write_pages`), bit-exact
on numpy views and through the driver's batched copies."""

import numpy as np
import pytest
from max.driver import CPU, Accelerator, Buffer, accelerator_count
from max.dtype import DType
from mokv.cache import page_copy
from mokv.cache.page_copy import HostPages

NUM_LAYERS = 2


@pytest.mark.parametrize("dtype", [DType.float32, DType.bfloat16])
@pytest.mark.parametrize("path", ["numpy", "driver"])
def test_round_trip_is_bit_exact_with_split_heads(dtype, path, monkeypatch):
    """device -> host -> other device pages, two TP shards of one head each."""
    if path == "driver":  # the accelerator path, run on CPU buffers
        monkeypatch.setattr(page_copy, "_copy_host", lambda s, si, d, di: pytest.fail("numpy"))
        real = page_copy.copy_pages

        def driver_only(src, src_ids, dst, dst_ids, views=None):
            for s, t in zip(src, dst):
                page_copy._copy_driver(s, src_ids, t, dst_ids)
        monkeypatch.setattr(page_copy, "copy_pages", driver_only)
        assert real is not driver_only
    page_shape = [2, NUM_LAYERS, 4, 1, 8]  # [2, layers, page_size, heads per device, head_dim]
    shards = [Buffer(dtype, [8, *page_shape], device=CPU()) for _ in range(2)]
    rng = np.random.default_rng(0)
    original = []
    for shard in shards:
        bits = page_copy.numpy_view(shard)
        bits[:] = rng.integers(0, np.iinfo(bits.dtype).max, bits.shape, dtype=bits.dtype)
        original.append(bits.copy())
    host = HostPages(dtype, 5, page_shape, [CPU(), CPU()])
    host.offload(shards, [6, 1, 2], [4, 0, 1])  # runs [4] and [0, 1]
    for shard in shards:
        page_copy.numpy_view(shard)[:] = 0
    host.load([1, 4, 0], shards, [3, 5, 7])
    for shard, bits in zip(shards, original):
        back = page_copy.numpy_view(shard)
        np.testing.assert_array_equal(back[[3, 5, 7]], bits[[2, 6, 1]])
    assert host.bytes_to_host == host.bytes_from_host == 3 * host.bytes_per_page


@pytest.mark.skipif(accelerator_count() == 0, reason="needs a GPU (runs where MAX sees one)")
def test_accelerator_round_trip_through_pinned_host_pages():
    """On a GPU the host pages are pinned (`Usage.STAGING`) and the batched driver copies
    move pages bit-exact both ways."""
    gpu = Accelerator()
    page_shape = [2, NUM_LAYERS, 4, 1, 8]
    bits = np.random.default_rng(0).integers(0, 2**32, [6, *page_shape], dtype=np.uint32)
    device = Buffer.from_numpy(bits.view(np.float32)).to(gpu)
    host = HostPages(DType.float32, 4, page_shape, [gpu])
    assert host.buffers[0].pinned
    host.offload([device], [5, 0, 3], [1, 2, 0])
    host.load([2, 0, 1], [device], [1, 2, 4])
    back = device.to(CPU()).to_numpy().view(np.uint32)
    np.testing.assert_array_equal(back[[1, 2, 4]], bits[[0, 3, 5]])
    np.testing.assert_array_equal(back[[0, 3, 5]], bits[[0, 3, 5]])  # sources untouched


@pytest.mark.parametrize("dtype", [DType.float32, DType.bfloat16])
@pytest.mark.parametrize("path", ["host", "staged"])
def test_page_bytes_round_trip_bit_exact(dtype, path, monkeypatch):
    """read_pages -> bytes -> write_pages, on aliasing views or through a staging buffer
    and `batch_inplace_copy` (the accelerator path, run on CPU buffers)."""
    if path == "staged":
        monkeypatch.setattr(page_copy, "_in_host_memory", lambda buffer: False)
    shape = [6, 2, 2, 4, 1, 8]
    src, dst = (Buffer(dtype, shape, device=CPU()) for _ in range(2))
    bits = page_copy.numpy_view(src)
    bits[:] = np.random.default_rng(0).integers(0, np.iinfo(bits.dtype).max, bits.shape,
                                                dtype=bits.dtype)
    page_copy.numpy_view(dst)[:] = 0
    pages = [bytes(p) for p in page_copy.read_pages(src, [4, 1, 2])]  # as the store keeps them
    page_copy.write_pages([memoryview(p) for p in pages], dst, [0, 5, 3])
    back = page_copy.numpy_view(dst)
    np.testing.assert_array_equal(back[[0, 5, 3]], bits[[4, 1, 2]])
    assert not back[[1, 2, 4]].any()
