"""CPU decode attention over FP8 pages (issue 53), against bfloat16 and float32 pages,
in one run.

One layer of Llama-3-8B-shaped attention (32 query heads, 8 KV heads, head_dim 128,
pages of 128): mokv's `flash_attention` over its paged cache of float32, bfloat16 and
float8_e4m3fn values (the last with MAX's per-128-lane float32 scales,
`mokv.FetchPagedKVCacheCollection`), each side timed with bench_attention's interleaved
read probes (`_decode_cells`). Decode streams every cached K and V row once: FP8 pages
are 0.52x the bytes of bfloat16 pages (scales included), so a memory-bound kernel would
run in about half bfloat16's time. mokv's FP8 decode reads the bytes in its decode forms
(widened in registers, to bfloat16 for `vdpbf16ps` on a CPU with AVX-512 BF16, else to
float32; each key's scale folded into its scores and probabilities): the table shows how
close it comes.

With `portable`, the three caches again on the portable CPU paths (kernels/cpu.mojo),
at the quick shapes only: three more graphs to compile, the part's main cost on a
loaded machine (the first such run, at every shape, was stopped after 40 minutes).

MAX's own CPU attention takes no FP8 cache (MAX 26.7 compiles no FP8 op for a CPU);
its side is attempted with an FP8 cache and the refusal recorded.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import mokv
import mokv.ops
import numpy as np
from bench_attention import (
    HKV,
    PAGE,
    D,
    H,
    MaxSide,
    MokvSide,
    ReadProbe,
    _decode_cells,
    _q_and_offsets,
)
from max.driver import CPU, Buffer
from max.dtype import DType
from max.graph import BufferType, DeviceRef, Graph, TensorType

FP8 = mokv.KVCacheParams(
    dtype=DType.float8_e4m3fn, n_kv_heads=HKV, head_dim=D, page_size=PAGE,
    quantization=mokv.KVCacheQuantization(),
)


class Fp8Side:
    """mokv's flash attention over FP8 pages with their scales (float32 queries)."""

    name = "mokv-paged-fp8"

    def __init__(self, session, portable: bool = False):
        self.name += "-portable" if portable else ""
        cpu = DeviceRef.CPU()
        with Graph("mokv_attention_fp8", input_types=[
            TensorType(DType.float32, ["total_tokens", H, D], cpu),
            TensorType(DType.uint32, ["batch_plus_1"], cpu),
            BufferType(DType.float8_e4m3fn, ["pages", 2, 1, PAGE, HKV, D], device=cpu),
            BufferType(DType.float32, ["pages", 2, 1, PAGE, HKV, FP8.scales_per_head], device=cpu),
            TensorType(DType.uint32, ["batch"], cpu),
            TensorType(DType.uint32, ["batch", "max_pages"], cpu),
            TensorType(DType.uint32, [1, 2], cpu),
        ]) as g:
            q, offsets, blocks, scales, *tables = g.inputs
            coll = mokv.FetchPagedKVCacheCollection(FP8)(blocks.buffer, *tables, scales.buffer)
            g.output(mokv.ops.flash_attention(coll, q.tensor, offsets.tensor, 0, 1 / math.sqrt(D)))
        with mokv.ops.portable_cpu_paths(session, portable), mokv.filter_collection_warnings():
            self.model = session.load(g)

    def inputs(self, cached: list[int], new: list[int]) -> list[Buffer]:
        per_seq = [-(-(c + n) // PAGE) for c, n in zip(cached, new)]
        pages = sum(per_seq)
        rng = np.random.default_rng(0)
        # Real memory: every byte written (a pattern of e4m3fn values of magnitude <= 448).
        bits = rng.integers(0, 0x7E, (pages, 2, 1, PAGE, HKV, D), dtype=np.uint8)
        bits |= rng.integers(0, 2, bits.shape, dtype=np.uint8) << 7
        scales = np.full((pages, 2, 1, PAGE, HKV, FP8.scales_per_head), 1 / 448, np.float32)
        table = np.zeros((len(cached), max(per_seq)), np.uint32)
        first = np.concatenate([[0], np.cumsum(per_seq)])
        for b, n in enumerate(per_seq):
            table[b, :n] = np.arange(first[b], first[b] + n)
        lengths = np.array(cached, np.uint32)
        max_lengths = np.array([[max(new), max(c + n for c, n in zip(cached, new))]], np.uint32)
        self._keep = (bits, scales)  # the buffers alias the arrays
        return [*_q_and_offsets(new, DType.float32), Buffer.from_numpy(bits).view(DType.float8_e4m3fn),
                Buffer.from_numpy(scales), Buffer.from_numpy(lengths), Buffer.from_numpy(table),
                Buffer.from_numpy(max_lengths)]


def cases(quick: bool) -> list[tuple[int, int]]:
    """Decode (batch, context) pairs."""
    return [(1, 4096), (1, 16384)] if quick else [(1, 4096), (1, 16384), (4, 8192)]


def kv_bytes(dtype: DType, batch: int, context: int) -> int:
    """Bytes of K and V (and scales) a decode step reads."""
    per_token = 2 * HKV * (D * dtype.size_in_bytes + (4 * FP8.scales_per_head if dtype == DType.float8_e4m3fn else 0))
    return batch * (context + 1) * per_token


def run(quick: bool = False, progress=None, portable: bool = False) -> dict:
    from max.engine import InferenceSession

    session = InferenceSession(devices=[CPU()])
    probe = ReadProbe(1 << (28 if quick else 29))
    out: dict = {"shape": {"n_heads": H, "n_kv_heads": HKV, "head_dim": D, "page_size": PAGE},
                 "errors": {}, "decode": []}
    paths = [False, True] if portable else [False]
    sides: list[tuple[DType, Any]] = []
    for on_portable in paths:
        makers: list[tuple[DType, Callable[[], Any]]] = [
            (DType.float32, lambda: MokvSide(session, "paged", HKV, DType.float32, portable=on_portable)),
            (DType.bfloat16, lambda: MokvSide(session, "paged", HKV, DType.bfloat16, portable=on_portable)),
            (DType.float8_e4m3fn, lambda: Fp8Side(session, portable=on_portable))]
        for dtype, make in makers:
            side = make()
            side.name = f"{side.name}-{dtype.name}" if dtype != DType.float8_e4m3fn else side.name
            sides.append((dtype, side))
            if progress:
                progress()
    for b, c in cases(quick):
        # The sides take turns (`_decode_cells`), timed against float32's bytes; each
        # side's GB/s and share of the read are then scaled to the bytes it reads. The
        # portable sides join at the quick shapes only.
        now = [(dtype, side) for dtype, side in sides if (b, c) in cases(True) or "portable" not in side.name]
        ref = kv_bytes(DType.float32, b, c)
        cells = _decode_cells([side for _, side in now], probe, b, c, ref, 0.3 if quick else 0.6)
        row: dict = {"batch": b, "context": c}
        for dtype, side in now:
            own = kv_bytes(dtype, b, c)
            cell = cells[side.name]
            row[side.name] = {**cell, "kv_bytes": own, "GBps": cell["GBps"] * own / ref,
                              "share_of_read": cell["share_of_read"] * own / ref}
        out["decode"].append(row)
        if progress:
            progress()
    for _, side in sides:  # free the caches
        side.model = side._keep = None
    try:
        MaxSide(session, HKV, DType.float8_e4m3fn)
        out["errors"]["max-paged-fp8"] = None
    except Exception as e:  # noqa: BLE001 - the refusal is the result
        cause = e.__cause__ or e
        out["errors"]["max-paged-fp8"] = f"{type(e).__name__}: {str(e)[:200]} / {str(cause)[:300]}"
    return out


def table(r: dict) -> list[str]:
    """The markdown table of `run`'s result, a row per CPU path and shape: ms per decode
    step (GB/s read, share of the two-thread read) per cache dtype, and bfloat16's time
    over FP8's (above 1: FP8 is faster)."""
    lines = [f"### CPU decode attention over FP8, bf16 and f32 pages ({r['shape']['n_heads']} q heads, "
             f"{r['shape']['n_kv_heads']} KV heads of {r['shape']['head_dim']})", "",
             "| path | batch × context | float32 ms (GB/s, share) | bfloat16 | FP8 + scales | bf16 / FP8 time |",
             "|---|---|---|---|---|---|"]
    for path, tag in (("native", ""), ("portable", "-portable")):
        for row in r["decode"]:
            names = [f"mokv-paged{tag}-float32", f"mokv-paged{tag}-bfloat16", f"mokv-paged-fp8{tag}"]
            if names[2] not in row:
                continue
            cells = [f"{row[s]['ms']:.2f} ({row[s]['GBps']:.1f}, {100 * row[s]['share_of_read']:.0f}%)"
                     for s in names]
            ratio = row[names[1]]["ms"] / row[names[2]]["ms"]
            lines.append(f"| {path} | {row['batch']} × {row['context']} | " + " | ".join(cells) + f" | ×{ratio:.2f} |")
    if r["errors"].get("max-paged-fp8"):
        lines.append(f"\nMAX's attention over an FP8 cache: {r['errors']['max-paged-fp8'][:300]}")
    return lines + [""]


def plan_size(quick: bool, portable: bool = False) -> int:
    """Progress-bar steps `run` reports."""
    return 3 * (1 + portable) + len(cases(quick))


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(run("--quick" in sys.argv, portable="--portable" in sys.argv), indent=1))
