"""The dequantize step of attention over scaled FP8 pages on a GPU
(mojo/mokv/kernels/fp8_gpu.mojo), run on the CPU: the same function fills a bfloat16
scratch cache from the pages a batch reads in one layer, and MAX's GPU kernel then reads
the scratch. Each scratch value must be the float64 reference's `q * scale` rounded to
float32 and then to bfloat16 (nearest-even both times), exactly, and zero past the
entry's cache and new tokens; the scratch's lookup
table must map column i of entry b to scratch page b * columns + i.

`store_kv` writes layer 1 of a cache of shuffled pages (heads of 256 lanes: two scales
per head), at cache lengths that are not page multiples, then the op
`mokv.dequantize_pages.ragged.paged` copies every column of every entry.
"""

from __future__ import annotations

import mokv
import numpy as np
import pytest
from max.driver import Buffer
from max.dtype import DType
from max.graph import BufferType, DeviceRef, Graph, TensorType, ops

from ..fp8_reference import decode_e4m3fn

H, D, PAGE, LAYERS, PAGES, COLS = 2, 256, 16, 2, 12, 4
LAYER = 1
PARAMS = mokv.KVCacheParams(
    dtype=DType.float8_e4m3fn, n_kv_heads=H, head_dim=D, page_size=PAGE,
    quantization=mokv.KVCacheQuantization(),
)
LENGTHS, NEW = [3, 17, 0], [20, 33, 5]  # cache + new tokens: 23, 50, 5 of 64 positions


@pytest.fixture(scope="module")
def model(session):
    cpu = DeviceRef.CPU()
    with Graph("fp8_dequantize", input_types=[
        BufferType(DType.float8_e4m3fn, [PAGES, 2, LAYERS, PAGE, H, D], device=cpu),
        BufferType(DType.float32, [PAGES, 2, LAYERS, PAGE, H, D // 128], device=cpu),
        TensorType(DType.uint32, ["batch"], device=cpu),
        TensorType(DType.uint32, ["batch", COLS], device=cpu),
        TensorType(DType.uint32, [1, 2], device=cpu),
        TensorType(DType.float32, ["tokens", H, D], device=cpu),
        TensorType(DType.uint32, ["offsets"], device=cpu),
    ]) as g:
        blocks, scales, lengths, table, bounds, kv, offsets = g.inputs
        coll = mokv.FetchPagedKVCacheCollection(PARAMS)(blocks.buffer, lengths, table, bounds, scales.buffer)
        mokv.ops.store_kv(coll, kv, kv * -0.5, offsets, LAYER)
        batch = lengths.shape[0]
        scratch, scratch_table = ops.inplace_custom(
            "mokv.dequantize_pages.ragged.paged", cpu,
            [offsets, coll, ops.constant(np.array([LAYER], np.uint32), DType.uint32, cpu)],
            out_types=[TensorType(DType.bfloat16, [batch * COLS, 2, 1, PAGE, H, D], device=cpu),
                       TensorType(DType.uint32, [batch, COLS], device=cpu)],
        )
        g.output(ops.cast(scratch.tensor, DType.float32), scratch_table.tensor)
    return session.load(g)


def round_to_bfloat16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (nearest, ties to even), as float32."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return rounded.astype(np.uint32).view(np.float32)


def test_the_scratch_is_the_reference_dequantization_rounded_to_bfloat16(model):
    rng = np.random.default_rng(53)
    bits = np.zeros((PAGES, 2, LAYERS, PAGE, H, D), np.uint8)
    scales = np.zeros((PAGES, 2, LAYERS, PAGE, H, D // 128), np.float32)
    table = rng.permutation(PAGES).reshape(3, COLS).astype(np.uint32)
    total = sum(NEW)
    kv = (rng.standard_normal((total, H, D)) * rng.uniform(0.01, 40, (total, H, 1))).astype(np.float32)
    offsets = np.concatenate([[0], np.cumsum(NEW)]).astype(np.uint32)
    bounds = np.array([[max(NEW), max(c + n for c, n in zip(LENGTHS, NEW))]], np.uint32)
    scratch, scratch_table = (o.to_numpy() for o in model.execute(
        Buffer.from_numpy(bits).view(DType.float8_e4m3fn), Buffer.from_numpy(scales),
        Buffer.from_numpy(np.array(LENGTHS, np.uint32)), Buffer.from_numpy(table),
        Buffer.from_numpy(bounds), Buffer.from_numpy(kv), Buffer.from_numpy(offsets),
    ))
    assert (scratch_table == np.arange(3 * COLS).reshape(3, COLS)).all()
    assert np.abs(scales[:, :, LAYER]).max() > 0  # store_kv wrote the pages the op reads
    for b, length in enumerate(c + n for c, n in zip(LENGTHS, NEW)):
        pos = np.arange(length)  # positions before the cache length hold zeros: read too
        page, row = table[b, pos // PAGE], pos % PAGE
        for k_or_v in range(2):
            q = decode_e4m3fn(bits[page, k_or_v, LAYER, row])  # [length, H, D]
            scale = np.repeat(scales[page, k_or_v, LAYER, row].astype(np.float64), 128, axis=-1)
            want = round_to_bfloat16((q * scale).astype(np.float32))
            got = scratch[b * COLS + pos // PAGE, k_or_v, 0, row]
            np.testing.assert_array_equal(got, want)
