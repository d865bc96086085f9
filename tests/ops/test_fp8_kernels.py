"""mokv's CPU kernels on FP8 pages with per-block scales (issue 53): `store_kv` and
`fused_qkv_matmul` quantize as they write, `flash_attention` dequantizes as it reads.

One graph per CPU path (native and portable) over a paged cache, and one over a
continuous cache (native path: the layouts differ only in where a token's row and
scales are, which the portable path addresses alike): the scaled collection, `store_kv` into
layer 0, `fused_qkv_matmul` into layer 1, attention over each layer. It runs twice on
one cache: a prefill of three sequences, then a step of two decodes and one three-token
chunk over those pages. Checked against tests/fp8_reference.py:

- the pages' bytes and scales are EXACTLY the float64 reference's quantization of the
  same values (store_kv: random values; fused_qkv_matmul: small integers, whose
  projections are exact in float32, so numpy has the kernel's values too);
- attention over the FP8 pages equals float64 attention over the reference's
  dequantized values to float32 rounding (so the kernel reads the pages as the
  reference does), and is within the bound `fp8_attention_bound` derives of float64
  attention over the unquantized float32 values. Where decode takes `vdpbf16ps`
  (an AVX-512 BF16 CPU's native paths), both comparisons add the bound
  `bf16_dot_bound` derives for its rounding of Q and P to bfloat16.
"""

from __future__ import annotations

import mokv
import numpy as np
import pytest
from max.driver import Buffer
from max.dtype import DType
from max.graph import BufferType, DeviceRef, Graph, TensorType, ops
from mokv.mojo_package import mojo_target_flags
from mokv.ops import portable_cpu_paths
from mokv.ops.cpu_paths import host_cpu_flags, host_takes_portable_paths

from ..fp8_reference import decode_e4m3fn, dequantize_blocks, quantize_blocks

H, GROUP, D, PAGE, LAYERS, PAGES, HIDDEN = 2, 4, 128, 16, 2, 12, 64
N_Q = H * GROUP
NB = D // 128
MAX_PAGES = 3  # lookup-table columns: 48 positions per sequence
SLOTS = 4  # of a continuous cache, of MAX_PAGES * PAGE positions each
# Softmax scales of layers 0 and 1: layer 1's integer projections are ~20 per lane.
SCALES = (1 / np.sqrt(D), 1 / np.sqrt(D) / 1024)
PARAMS = mokv.KVCacheParams(
    dtype=DType.float8_e4m3fn, n_kv_heads=H, head_dim=D, page_size=PAGE,
    quantization=mokv.KVCacheQuantization(),
)
PREFILL = ([0, 0, 0], [20, 33, 5])  # (cache lengths, new tokens): pages cross at 16 and 32
STEP = ([20, 33, 5], [1, 1, 3])  # two decodes and a chunk over the prefill's pages


def _build(layout: str) -> Graph:
    cpu = DeviceRef.CPU()
    f32 = DType.float32
    paged = layout == "paged"
    # The paged cache's pages, or the continuous cache's slots.
    rows = [PAGES, 2, LAYERS, PAGE, H] if paged else [SLOTS, 2, LAYERS, MAX_PAGES * PAGE, H]
    with Graph("fp8_kernels", input_types=[
        BufferType(DType.float8_e4m3fn, [*rows, D], device=cpu),
        BufferType(f32, [*rows, NB], device=cpu),
        TensorType(DType.uint32, ["batch"], device=cpu),
        TensorType(DType.uint32, ["batch", MAX_PAGES] if paged else ["batch"], device=cpu),
        TensorType(DType.uint32, [1, 2], device=cpu) if paged else TensorType(DType.bool, [1], device=cpu),
        TensorType(f32, ["tokens", H, D], device=cpu),  # k
        TensorType(f32, ["tokens", H, D], device=cpu),  # v
        TensorType(f32, ["tokens", N_Q, D], device=cpu),  # q of layer 0
        TensorType(f32, ["tokens", HIDDEN], device=cpu),
        TensorType(f32, [(N_Q + 2 * H) * D, HIDDEN], device=cpu),
        TensorType(DType.uint32, ["offsets"], device=cpu),
    ]) as g:
        blocks, scales, lengths, table, bounds, k, v, q, hidden, wqkv, offsets = g.inputs
        fetch = (mokv.FetchPagedKVCacheCollection if paged
                 else mokv.FetchContinuousBatchingKVCacheCollection)(PARAMS)
        kv = fetch(blocks.buffer, lengths, table, bounds, scales.buffer)
        mokv.ops.store_kv(kv, k, v, offsets, 0)
        q1 = mokv.ops.fused_qkv_matmul(kv, hidden, wqkv, offsets, 1, N_Q)
        out0 = mokv.ops.flash_attention(kv, q, offsets, 0, SCALES[0])
        q1 = ops.reshape(q1, [q1.shape[0], N_Q, D])
        out1 = mokv.ops.flash_attention(kv, q1, offsets, 1, SCALES[1])
        g.output(out0, q1, out1)
    return g


@pytest.fixture(scope="module", params=["native", "portable", "continuous"])
def model(request, session):
    """(the layout, its model) on a CPU path."""
    if request.param == "portable" and host_takes_portable_paths():
        pytest.skip("this host's native CPU paths are the portable ones")
    layout = "continuous" if request.param == "continuous" else "paged"
    with portable_cpu_paths(session, request.param == "portable"):
        return layout, session.load(_build(layout)), _may_dot_bf16(request.param)


def _may_dot_bf16(path: str) -> bool:
    """Whether decode may take `vdpbf16ps` (attention/forms.mojo's BF16_DOT): off the
    portable paths, on a CPU with AVX-512 BF16 (or a virtual CPU target, unknown here)."""
    return path != "portable" and (bool(mojo_target_flags()) or "avx512_bf16" in host_cpu_flags())


class Pages:
    """The FP8 cache's numpy arrays (the buffers alias them) and each sequence's pages
    (a paged cache) or slot (a continuous one)."""

    def __init__(self, rng, layout: str):
        self.paged = layout == "paged"
        rows = (PAGES, 2, LAYERS, PAGE, H) if self.paged else (SLOTS, 2, LAYERS, MAX_PAGES * PAGE, H)
        self.bits = np.zeros((*rows, D), np.uint8)
        self.scales = np.full((*rows, NB), np.nan, np.float32)
        if self.paged:
            self.table = rng.permutation(PAGES)[: 3 * MAX_PAGES].reshape(3, MAX_PAGES).astype(np.uint32)
        else:
            self.table = rng.permutation(SLOTS)[:3].astype(np.uint32)

    def where(self, b, positions):
        pos = np.asarray(positions)
        if not self.paged:
            return self.table[b], pos
        return self.table[b, pos // PAGE], pos % PAGE

    def bounds(self, lengths, new) -> np.ndarray:
        """The paged cache's max lengths, the continuous cache's `is_cache_empty`."""
        if not self.paged:
            return np.array([not any(lengths)])
        return np.array([[max(new), max(c + n for c, n in zip(lengths, new))]], np.uint32)

    def read(self, b, layer, kv, positions):
        """(FP8 values as float64, scales) of `positions` of sequence b."""
        page, row = self.where(b, positions)
        return decode_e4m3fn(self.bits[page, kv, layer, row]), self.scales[page, kv, layer, row]


def run(model, pages, rng, lengths, new, integers=False):
    """One step; returns the step's inputs and the model's outputs (float32 numpy)."""
    total = sum(new)
    k, v = (rng.standard_normal((2, total, H, D)) * rng.uniform(0.1, 4, (2, total, H, 1)))
    k[0, 0, :] = 0  # a block of zeros: scale 0, reads back zeros
    q = rng.standard_normal((total, N_Q, D)) / 2
    # Small integers: every projection is an exact float32 integer, as in numpy.
    hidden = rng.integers(-3, 4, (total, HIDDEN))
    wqkv = rng.integers(-2, 3, ((N_Q + 2 * H) * D, HIDDEN))
    offsets = np.concatenate([[0], np.cumsum(new)]).astype(np.uint32)
    f32 = [a.astype(np.float32) for a in (k, v, q, hidden, wqkv)]
    outs = model.execute(
        Buffer.from_numpy(pages.bits).view(DType.float8_e4m3fn), Buffer.from_numpy(pages.scales),
        Buffer.from_numpy(np.array(lengths, np.uint32)), Buffer.from_numpy(pages.table),
        Buffer.from_numpy(pages.bounds(lengths, new)), *(Buffer.from_numpy(a) for a in f32),
        Buffer.from_numpy(offsets),
    )
    return dict(zip(("k", "v", "q", "hidden", "wqkv"), f32)), [o.to_numpy() for o in outs], offsets


def projections(step):
    """Layer 1's K and V of a step, [tokens, H, D] each (exact: integer sums)."""
    qkv = step["hidden"].astype(np.float64) @ step["wqkv"].astype(np.float64).T
    k = qkv[:, N_Q * D:(N_Q + H) * D].reshape(-1, H, D)
    return k, qkv[:, (N_Q + H) * D:].reshape(-1, H, D)


def attention(q, keys, values, lengths, offsets, scale):
    """float64 causal GQA attention of each new token over its sequence's keys."""
    out = np.zeros(q.shape)
    for b in range(len(lengths)):
        for i, t in enumerate(range(offsets[b], offsets[b + 1])):
            n = lengths[b] + i + 1
            for qh in range(N_Q):
                s = keys[b][:n, qh // GROUP] @ q[t, qh] * scale
                p = np.exp(s - s.max())
                out[t, qh] = p / p.sum() @ values[b][:n, qh // GROUP]
    return out


def fp8_attention_bound(q, keys, values, approx_k, approx_v, lengths, offsets, scale):
    """Per output row, a bound on |attention(q, approx) - attention(q, exact)|.

    With score errors |ds_j| <= delta (delta = scale * max_j sum_i |q_i| |dk_ji|), the
    softmax weights move by a factor within e^(+-2 delta), so sum_j |dp_j| <=
    e^(2 delta) - 1, and O = sum_j p_j v_j moves by at most
    (e^(2 delta) - 1) max |v| + max |dv| per element. A priori delta <= scale *
    ||q||_1 * absmax(K block) * 2^-4 (e4m3fn keeps 3 mantissa bits); here the actual
    errors of the reference's quantization are used."""
    bound = np.zeros(q.shape[:2])
    for b, t, qh, n in _query_rows(lengths, offsets):
        h = qh // GROUP
        dk = np.abs(approx_k[b][:n, h] - keys[b][:n, h])
        delta = scale * (dk @ np.abs(q[t, qh])).max()
        dv = np.abs(approx_v[b][:n, h] - values[b][:n, h]).max()
        bound[t, qh] = np.expm1(2 * delta) * np.abs(values[b][:n, h]).max() + dv
    return bound


def _query_rows(lengths, offsets):
    """(sequence, token, query head, keys it sees) of every output row."""
    for b in range(len(lengths)):
        for i, t in enumerate(range(offsets[b], offsets[b + 1])):
            for qh in range(N_Q):
                yield b, t, qh, lengths[b] + i + 1


def bf16_dot_bound(q, approx_v, approx_k, lengths, offsets, scale):
    """Per output row, a bound on what decode with `vdpbf16ps` adds to the error of
    float32 attention over the same FP8 values.

    It rounds the scaled queries to bfloat16 (relative error <= 2^-9 per element), so a
    score moves by at most delta = 2^-9 * scale * max_j sum_i |q_i| |k_ji|, and O by
    (e^(2 delta) - 1) max |v| (as in `fp8_attention_bound`). It rounds each
    probability times its key's V scale to bfloat16 once (relative error <= 2^-9), so
    O = sum_j p_j v_j moves by at most 2^-9 max |v|; and those probabilities come from
    the degree-3 `exp2` (relative error <= 7.5e-5 in each weight's numerator and in
    the sum), which moves O by at most 2 * 7.5e-5 max |v|."""
    bound = np.zeros(q.shape[:2])
    for b, t, qh, n in _query_rows(lengths, offsets):
        h = qh // GROUP
        delta = 2.0**-9 * scale * (np.abs(approx_k[b][:n, h]) @ np.abs(q[t, qh])).max()
        vmax = np.abs(approx_v[b][:n, h]).max()
        bound[t, qh] = (np.expm1(2 * delta) + 2.0**-9 + 2 * 7.5e-5) * vmax
    return bound


def test_fp8_pages_store_and_attention(model):
    layout, model, may_dot = model
    rng = np.random.default_rng(53)
    pages = Pages(rng, layout)
    steps = [run(model, pages, rng, *PREFILL), run(model, pages, rng, *STEP)]
    # Each sequence's values per layer and K|V, in position order, across both steps.
    seqs = {(layer, kv): [[], [], []] for layer in range(LAYERS) for kv in range(2)}
    for step, _, offsets in steps:
        layer1 = projections(step)
        for b in range(3):
            rows = slice(offsets[b], offsets[b + 1])
            for kv, name in enumerate(("k", "v")):
                seqs[0, kv][b].append(step[name][rows].astype(np.float64))
                seqs[1, kv][b].append(layer1[kv][rows])
    exact = {key: [np.concatenate(parts) for parts in per_seq] for key, per_seq in seqs.items()}

    # 1. Pages: bytes and scales exactly the reference's quantization of the same values.
    deq = {}
    for (layer, kv), per_seq in exact.items():
        deq[layer, kv] = []
        for b, x in enumerate(per_seq):
            want_q, want_scale = quantize_blocks(x.astype(np.float32), 128)
            got_q, got_scale = pages.read(b, layer, kv, np.arange(len(x)))
            assert np.array_equal(got_scale, want_scale), (layer, kv, b)
            assert np.array_equal(got_q, want_q), (layer, kv, b)
            deq[layer, kv].append(dequantize_blocks(got_q, got_scale, 128))
    assert (exact[0, 0][0][0, 0] == 0).all() and (deq[0, 0][0][0, 0] == 0).all()

    # 2. Attention: the reference's dequantized pages as read, and within the bound.
    for (lengths, _), (step, outs, offsets) in zip((PREFILL, STEP), steps):
        out0, q1, out1 = (o.astype(np.float64) for o in outs)
        for layer, q in ((0, step["q"].astype(np.float64)), (1, q1)):
            got = out0 if layer == 0 else out1
            k, v = exact[layer, 0], exact[layer, 1]
            dk, dv = deq[layer, 0], deq[layer, 1]
            as_read = attention(q, dk, dv, lengths, offsets, SCALES[layer])
            scale = np.abs(as_read).max()
            rounding = 2e-5 * scale  # float32's
            if may_dot:
                rounding = rounding + bf16_dot_bound(q, dv, dk, lengths, offsets, SCALES[layer])
            read_err = np.abs(got - as_read).max(axis=-1)
            assert (read_err <= rounding).all(), (layer, read_err.max())
            err = np.abs(got - attention(q, k, v, lengths, offsets, SCALES[layer])).max(axis=-1)
            bound = fp8_attention_bound(q, k, v, dk, dv, lengths, offsets, SCALES[layer]) + rounding
            assert (err <= bound).all(), (layer, err.max(), bound.min())
            assert err.max() > 0  # the pages are quantized, not stored exactly
