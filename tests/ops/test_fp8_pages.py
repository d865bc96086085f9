"""What FP8 pages rest on (issue 53): the float64 reference quantizer
(tests/fp8_reference.py) against Mojo's e4m3fn cast on a buffer of MAX's FP8 dtype on
the CPU, and the two MAX 26.7 facts that make mokv's CPU kernels do the FP8 work
themselves: MAX's own graph ops refuse FP8 on a CPU, custom ops on FP8 buffers run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from max.driver import CPU, Buffer
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import BufferType, DeviceRef, Graph, TensorType, ops

from ..fp8_reference import decode_e4m3fn, dequantize_blocks, quantize_blocks, round_e4m3fn
from .test_mojo_unit import CPU_PATHS, _mojo, _skip_unrunnable

CAST_OPS = Path(__file__).parent / "fp8_cast"
WIDEN_BYTES = Path(__file__).resolve().parents[1] / "mojo" / "fp8_widen_bytes.mojo"


def e4m3fn_values() -> np.ndarray:
    """Every finite non-negative e4m3fn value, ascending (from the bit layout)."""
    exps, mants = np.meshgrid(np.arange(16), np.arange(8), indexing="ij")
    normal = (1 + mants / 8) * 2.0 ** (exps - 7)
    values = np.where(exps == 0, mants / 8 * 2.0**-6, normal).reshape(-1)
    return np.sort(values[:-1])  # exponent 15, mantissa 7 is NaN


def probe_values() -> np.ndarray:
    """Each value, the midpoints between neighbours (ties), one float32 step either side
    of each midpoint, past 448, and all of it negated."""
    v = e4m3fn_values()
    mid = (v[:-1] + v[1:]) / 2
    up = np.nextafter(mid.astype(np.float32), np.float32(np.inf))
    down = np.nextafter(mid.astype(np.float32), np.float32(0))
    beyond = np.array([449, 463.99, 464, 465, 500, 1e6, 3e38])
    positive = np.concatenate([v, mid, up, down, beyond]).astype(np.float32)
    return np.concatenate([positive, -positive])


def test_the_reference_rounds_as_the_format_defines():
    assert len(e4m3fn_values()) == 127 and e4m3fn_values()[-1] == 448
    assert np.array_equal(round_e4m3fn(e4m3fn_values()), e4m3fn_values())
    # Ties to even; saturation; the subnormal floor (2**-10 ties to 0).
    assert round_e4m3fn(np.array([1.0625, 1.1875, 500, -1e9, 2**-10, 3 * 2**-10])).tolist() == [
        1.0, 1.25, 448, -448, 0, 2**-8]


def test_mojos_cast_on_fp8_pages_is_the_reference_on_every_boundary():
    cpu = DeviceRef.CPU()
    values = probe_values()
    n = len(values)
    with Graph("fp8_page_roundtrip", custom_extensions=[CAST_OPS], input_types=[
            BufferType(DType.float8_e4m3fn, [n], device=cpu),
            TensorType(DType.float32, [n], device=cpu)]) as graph:
        out = ops.inplace_custom("test_fp8_page_roundtrip", cpu, list(graph.inputs),
                                 out_types=[TensorType(DType.float32, [n], device=cpu)])[0]
        graph.output(out)
    model = InferenceSession(devices=[CPU()]).load(graph)
    pages = Buffer(DType.float8_e4m3fn, [n], device=CPU())
    (read_back,) = model.execute(pages, Buffer.from_numpy(values))
    got, want = read_back.to_numpy().astype(np.float64), round_e4m3fn(values)
    wrong = np.flatnonzero(got != want)
    assert not wrong.size, [(values[i], got[i], want[i]) for i in wrong[:5]]
    assert np.array_equal(np.signbit(got), np.signbit(want))


@pytest.mark.parametrize("cpu_path", ["native", "portable"])
def test_the_kernels_read_every_byte_as_the_reference(cpu_path):
    # The attention's widenings of FP8 bytes (simd.mojo `widen`: the bits moved into a
    # float16, widened in hardware; and with AVX-512 BF16 `widen_bf16`: the bits moved
    # into a bfloat16, subnormals from a table), on all 256 bytes: exactly the
    # reference's value (times the 2^-8 its callers fold into the scale). The two NaN
    # bytes, which no page holds (the quantize saturates at 448), read as +-480.
    _skip_unrunnable(cpu_path)
    proc = _mojo("run", *CPU_PATHS[cpu_path], str(WIDEN_BYTES))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    bits = np.array([int(line, 16) for line in proc.stdout.split()], np.uint32)
    assert len(bits) in (256, 512), len(bits)
    want = decode_e4m3fn(np.arange(256))
    finite = ~np.isnan(want)
    assert finite.sum() == 254
    for widening in bits.reshape(-1, 256):
        got = widening.view(np.float32).astype(np.float64)
        assert np.array_equal(got[finite], want[finite])
        assert np.array_equal(np.signbit(got[finite]), np.signbit(want[finite]))  # 0x80 is -0
        assert got[0x7F] == 480 and got[0xFF] == -480


def test_maxs_own_graph_ops_refuse_fp8_on_the_cpu():
    # Why mokv's CPU kernels quantize and dequantize themselves: MAX 26.7 compiles no
    # graph op of an FP8 tensor for a CPU (its FP8 kernels are GPU kernels).
    cpu = DeviceRef.CPU()
    with Graph("max_fp8_cast_cpu", input_types=[TensorType(DType.float32, [4], device=cpu)]) as g:
        g.output(ops.cast(ops.cast(g.inputs[0].tensor, DType.float8_e4m3fn), DType.float32))
    with pytest.raises(RuntimeError, match="Failed to compile") as info:
        InferenceSession(devices=[CPU()]).load(g)
    assert "f8e4m3fn data type is not supported on device 'cpu" in str(info.value.__cause__)


@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 300.0])
def test_a_blocks_error_is_at_most_half_a_step_of_its_scale(magnitude):
    # What to expect of FP8 pages: each value within 2**-4 of itself (3 mantissa bits),
    # or, below the normal range of its block, within half a subnormal step of the scale.
    rng = np.random.default_rng(int(magnitude * 1000))
    x = (rng.standard_normal((8, 2, 256)) * magnitude).astype(np.float32)
    x[0, 0, :128] = 0  # a block of zeros reads back zeros
    q, scale = quantize_blocks(x, 128)
    assert scale.shape == (8, 2, 2) and scale[0, 0, 0] == 0
    err = np.abs(dequantize_blocks(q, scale, 128) - x)
    bound = np.maximum(2.0**-4 * np.abs(x), 2.0**-10 * np.repeat(scale, 128, axis=-1))
    assert (err <= bound * (1 + 2**-20)).all()
    assert np.abs(q).max() == 448  # each block's absmax lands on the largest value
