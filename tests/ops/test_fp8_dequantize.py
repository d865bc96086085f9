"""The GPU's path of scaled FP8 pages, run on the CPU.

The dequantize step of attention over scaled FP8 pages on a GPU
(mojo/mokv/kernels/fp8_gpu.mojo): the same function fills a bfloat16 scratch cache from
the pages a batch reads in one layer, and MAX's GPU kernel then reads the scratch. Each
scratch value must be the float64 reference's `q * scale` rounded to float32 and then to
bfloat16 (nearest-even both times), exactly, and zero past the entry's cache and new
tokens; the scratch's lookup table must map column i of entry b to scratch page
b * columns + i. `store_kv` writes layer 1 of a cache of shuffled pages (heads of 256
lanes: two scales per head), at cache lengths that are not page multiples, then the op
`mokv.dequantize_pages.ragged.paged` copies every column of every entry.

Then the whole route of attention (scratch, table, MAX's kernel over them) with MAX's
CPU kernel, and the same checks test_on_gpu.py runs on a GPU (`check_scaled_attention`).
"""

from __future__ import annotations

import mokv
import numpy as np
import pytest
from max.driver import CPU, Buffer, Device
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import BufferType, DeviceRef, Graph, TensorType, ops
from mokv.compiler_output import filter_collection_warnings
from mokv.ops import kernels_path

from ..fp8_reference import decode_e4m3fn, dequantize_blocks, quantize_blocks
from ..mojo_defines import MAX_KERNELS_DEFINE
from .test_fp8_kernels import N_Q, attention, fp8_attention_bound

H, PAGE, LAYERS, PAGES, COLS = 2, 16, 2, 12, 4
D = 256  # two scales per head; the attention checks below take test_fp8_kernels.py's 128
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


# The path of attention on a GPU: heads of 128 lanes, pages of 128 (MAX's kernel), two
# pages per sequence and MAX's 16 columns of table padding; a prefill over two pages,
# then a decode and a chunk.
FP8_D, FP8_PAGES, FP8_COLS = 128, 6, 24
FP8_STEPS = (([0, 0], [150, 40]), ([150, 40], [1, 3]))
FP8_GPU_TOL = 2e-2
"""Of the largest output: over scaled FP8 pages a GPU attends in bfloat16 (q, the
dequantized scratch, MAX's softmax weights and the output, 2^-8 relative each)."""
MAX_CPU_BF16_TOL = 5e-2
"""Of the largest output, for MAX's CPU kernel over the bfloat16 scratch: its errors grow
with the keys a query reads, as if it summed P V in bfloat16 (measured 2026-11-28: 0.39
on outputs up to 12 at 26 to 150 keys, on this test's values; 0 for a query of one
key). A wrong scratch page or table entry moves a whole row by about max |v|."""


def scaled_attention_model(session: InferenceSession, device: DeviceRef):
    """store_kv then flash_attention over scaled FP8 pages of 128 on `device` (the heads
    of test_fp8_kernels.py), float32 inputs cast to bfloat16 in the graph."""
    f32 = DType.float32
    params = mokv.KVCacheParams(dtype=DType.float8_e4m3fn, n_kv_heads=H, head_dim=FP8_D, page_size=128,
                                quantization=mokv.KVCacheQuantization())
    with Graph("fp8_scaled_attention", input_types=[
        BufferType(DType.float8_e4m3fn, [FP8_PAGES, 2, 1, 128, H, FP8_D], device=device),
        BufferType(f32, [FP8_PAGES, 2, 1, 128, H, FP8_D // 128], device=device),
        TensorType(DType.uint32, ["batch"], device=device),
        TensorType(DType.uint32, ["batch", FP8_COLS], device=device),
        TensorType(DType.uint32, [1, 2], device=DeviceRef.CPU()),
        TensorType(f32, ["tokens", H, FP8_D], device=device),
        TensorType(f32, ["tokens", H, FP8_D], device=device),
        TensorType(f32, ["tokens", N_Q, FP8_D], device=device),
        TensorType(DType.uint32, ["offsets"], device=device),
    ], custom_extensions=[kernels_path()]) as g:
        blocks, scales, lengths, table, bounds, k, v, q, offsets = g.inputs
        kv = mokv.FetchPagedKVCacheCollection(params)(blocks.buffer, lengths, table, bounds, scales.buffer)
        k, v, q = (ops.cast(x.tensor, DType.bfloat16) for x in (k, v, q))
        mokv.ops.store_kv(kv, k, v, offsets, 0)
        out = mokv.ops.flash_attention(kv, q, offsets, 0, 1 / 128**0.5)
        g.output(ops.cast(out, f32))
    return session.load(g)


def check_scaled_attention(model, device: Device, rel_tol: float) -> None:
    """Two steps of `scaled_attention_model` on `device`: the pages hold exactly the
    float64 reference's quantization of the (bfloat16) values; attention is within
    `rel_tol` of the largest output (bfloat16's rounding) of float64 attention over
    the pages as the reference dequantizes them (rounded to bfloat16, as the scratch
    holds them), and within docs/quantized.md's bound (+ that) of float64 attention
    over the unquantized values."""
    rng = np.random.default_rng(53)
    bits = Buffer.from_numpy(np.zeros((FP8_PAGES, 2, 1, 128, H, FP8_D), np.uint8)).view(DType.float8_e4m3fn).to(device)
    scales = Buffer.from_numpy(np.zeros((FP8_PAGES, 2, 1, 128, H, FP8_D // 128), np.float32)).to(device)
    pages = rng.permutation(FP8_PAGES)[:4].reshape(2, 2)
    table = np.concatenate([pages, np.full((2, FP8_COLS - 2), pages[0, 0])], axis=1).astype(np.uint32)
    seqs: dict = {"k": [[], []], "v": [[], []]}
    for lengths, new in FP8_STEPS:
        total = sum(new)
        k, v = (round_to_bfloat16(rng.standard_normal((total, H, FP8_D)) * rng.uniform(0.1, 4, (total, H, 1)))
                for _ in range(2))
        q = round_to_bfloat16(rng.standard_normal((total, N_Q, FP8_D)) / 2)
        offsets = np.concatenate([[0], np.cumsum(new)]).astype(np.uint32)
        bounds = np.array([[max(new), max(c + n for c, n in zip(lengths, new))]], np.uint32)
        host = [np.array(lengths, np.uint32), table, None, k, v, q, offsets]
        args = [Buffer.from_numpy(a).to(device) if a is not None else Buffer.from_numpy(bounds) for a in host]
        device.synchronize()
        (out,) = model.execute(bits, scales, *args)
        got = out.to(CPU()).to_numpy().astype(np.float64)
        for b in range(2):
            for name, x in (("k", k), ("v", v)):
                seqs[name][b].append(x[offsets[b]:offsets[b + 1]].astype(np.float64))
        exact = {name: [np.concatenate(parts) for parts in per_seq] for name, per_seq in seqs.items()}
        page_bits = bits.to(CPU()).view(DType.uint8).to_numpy()
        page_scales = scales.to(CPU()).to_numpy()
        deq: dict = {"k": [], "v": []}
        for kv_idx, name in enumerate(("k", "v")):
            for b, x in enumerate(exact[name]):
                pos = np.arange(len(x))
                page, row = table[b, pos // 128], pos % 128
                got_q = decode_e4m3fn(page_bits[page, kv_idx, 0, row])
                got_scale = page_scales[page, kv_idx, 0, row]
                want_q, want_scale = quantize_blocks(x.astype(np.float32), 128)
                assert np.array_equal(got_scale, want_scale) and np.array_equal(got_q, want_q), (name, b)
                deq[name].append(dequantize_blocks(got_q, got_scale, 128))
        scale = 1 / 128**0.5
        as_read = attention(q, [round_to_bfloat16(x.astype(np.float32)) for x in deq["k"]],
                            [round_to_bfloat16(x.astype(np.float32)) for x in deq["v"]], lengths, offsets, scale)
        tol = rel_tol * np.abs(as_read).max()
        np.testing.assert_allclose(got, as_read, rtol=0, atol=tol)
        err = np.abs(got - attention(q, exact["k"], exact["v"], lengths, offsets, scale)).max(axis=-1)
        bound = fp8_attention_bound(q, exact["k"], exact["v"], deq["k"], deq["v"], lengths, offsets, scale)
        assert (err <= bound + tol).all(), (err.max(), bound.min())


def test_the_gpu_path_of_attention_runs_on_the_cpu(session):
    """The GPU's attention over scaled FP8 pages (the scratch, its table and MAX's
    kernel over them: paged_scaled_attention_with_max) on the CPU, where the define
    `MOKV_MAX_KERNELS` makes mokv's attention op take the GPU's route, with MAX's CPU
    kernel: the same checks as test_on_gpu.py's on a GPU."""
    session._set_mojo_define(MAX_KERNELS_DEFINE, "true")
    try:
        with filter_collection_warnings():
            model = scaled_attention_model(session, DeviceRef.CPU())
    finally:
        session._set_mojo_define(MAX_KERNELS_DEFINE, "false")
    check_scaled_attention(model, CPU(), MAX_CPU_BF16_TOL)
