"""Decode and prefill attention on a GPU: mokv's kernels against MAX's, with HBM bandwidth.

Runs where MAX sees an accelerator (`max.driver.accelerator_count() > 0`):

    python benchmarks/bench_gpu_attention.py [--quick] [--bf16 | --f32] [--qkv] [--json PATH]
        [--groups 1,4,8 | none] [--lock PATH]

`--groups` picks the GQA groups (`none`: only `--qkv`); processes given one `--lock` file
compile side by side and take turns for their timings (benchmarks/gpu_machine.sh).

Same sides as bench_attention.py (mokv paged and continuous, MAX 26.7's
`flash_attention_ragged` over its paged cache), built for the GPU, where mokv's op runs
MAX's kernel on a view of mokv's cache (kernels/max_kernels.mojo): the figure to watch
is mokv within a few % of MAX (same kernel; the difference is the op around it). 32
query heads, head_dim 128, page 128; GQA 1/4/8 (32, 8, 4 KV heads), float32 and bfloat16.

- **decode**: B requests of `ctx` cached tokens and one new token each. It must read
  every cached K and V byte once: the figure of merit is those bytes over the time,
  next to a device-to-device copy of a 2 GiB buffer measured in the same run (its
  bytes read + written over its time: what HBM sustains when streaming).
- **prefill**: one causal request of L new tokens, in TFLOP/s (QK^T and PV over the
  causal half).
- **qkv** (`--qkv`): the bf16 QKV projection at Llama-3-8B shapes, mokv's
  fused_qkv_matmul (MAX's matmul + mokv's epilogue) against MAX's bare matmul.

Timing: the GPU runs launches in order, so `REPS` executions are issued back to back
and the device synchronized once; the time per execution is the median over 5 such
groups, after a warm-up. The host's launch cost therefore overlaps the GPU's work
except for the smallest shapes, which are reported anyway (the ms column shows it).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from bench_attention import D, H, MaxSide, MokvSide  # noqa: E402
from max.driver import CPU, Accelerator, Buffer, accelerator_count  # noqa: E402
from max.dtype import DType  # noqa: E402
from max.engine import InferenceSession  # noqa: E402

REPS = 10
def _time_gpu(fn, device, reps: int = REPS, groups: int = 5) -> float:
    """Seconds per call of `fn` (issued `reps` times per synchronize), median of groups."""
    fn()
    device.synchronize()
    times = []
    for _ in range(groups):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        device.synchronize()
        times.append((time.perf_counter() - t0) / reps)
    return float(np.median(times))


def copy_bandwidth(device, nbytes: int = 1 << 31) -> float:
    """GB/s of a device-to-device copy, bytes read + written over the time."""
    src = Buffer(DType.uint8, [nbytes], device=device)
    dst = Buffer(DType.uint8, [nbytes], device=device)
    src.inplace_copy_from(Buffer.from_numpy(np.full(nbytes, 7, np.uint8)))
    t = _time_gpu(lambda: dst.inplace_copy_from(src), device)
    return 2 * nbytes / t / 1e9


def qkv_rows(session, gpu, token_counts=(1, 512, 4096)) -> list[dict]:
    """bf16 QKV projection at Llama-3-8B shapes (4096 -> 32 + 2 x 8 heads of 128): mokv's
    fused_qkv_matmul (on a GPU: MAX's matmul, then mokv's RoPE/cache-write epilogue)
    against the bare MAX matmul, in TFLOP/s."""
    import mokv
    import mokv.ops  # noqa: F401
    from max.graph import DeviceRef, Graph, TensorType, ops

    hidden_size, hkv, n_q, page = 4096, 8, 32, 128
    features = (n_q + 2 * hkv) * D
    dev, bf16 = DeviceRef.GPU(), DType.bfloat16
    params = mokv.KVCacheParams(bf16, hkv, D, page_size=page)
    hidden_t = TensorType(bf16, ["tokens", hidden_size], dev)
    weight_t = TensorType(bf16, [features, hidden_size], dev)
    freqs_t = TensorType(DType.float32, [8192, D], dev)
    with Graph("mokv_qkv", input_types=[*mokv.PAGED.input_symbols(params, 1, 0, dev), hidden_t, weight_t,
                                        TensorType(DType.uint32, ["batch_plus_1"], dev), freqs_t]) as g:
        *kv, h, w, offsets, freqs = g.inputs
        coll = mokv.FetchPagedKVCacheCollection(params, num_layers=1)(*kv)
        g.output(mokv.ops.fused_qkv_matmul(coll, h, w, offsets, 0, n_q, freqs))
    with mokv.filter_collection_warnings():
        mokv_model = session.load(g)
    with Graph("max_qkv", input_types=[hidden_t, weight_t]) as g:
        h, w = g.inputs
        g.output(ops.matmul(h.tensor, ops.transpose(w.tensor, 0, 1)))
    max_model = session.load(g)

    def on_gpu(a: np.ndarray, dtype: DType | None = None) -> Buffer:
        buf = Buffer.from_numpy(a)
        return (buf.view(dtype) if dtype else buf).to(gpu)

    rng = np.random.default_rng(0)
    bits = lambda x: (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)  # noqa: E731
    weight = on_gpu(bits(rng.standard_normal((features, hidden_size)) * 0.02), bf16)
    freqs = on_gpu(mokv.ops.rope_freqs_cis(D, 8192))
    rows = []
    for t in token_counts:
        pages = -(-t // page)
        hidden = on_gpu(bits(rng.standard_normal((t, hidden_size))), bf16)
        cache = [on_gpu(np.zeros((pages + 1, 2, 1, page, hkv, D), np.uint16), bf16),
                 on_gpu(np.zeros(1, np.uint32)),
                 on_gpu(np.arange(1, pages + 1, dtype=np.uint32).reshape(1, pages)),
                 Buffer.from_numpy(np.array([[t, 0]], np.uint32))]
        offsets = on_gpu(np.array([0, t], np.uint32))
        gpu.synchronize()
        flops = 2 * t * hidden_size * features
        row = {"tokens": t}
        for name, fn in (("max-matmul", lambda: max_model.execute(hidden, weight)),
                         ("mokv-fused_qkv", lambda: mokv_model.execute(*cache, hidden, weight, offsets, freqs))):
            sec = _time_gpu(fn, gpu)
            row[name] = {"ms": sec * 1e3, "TFLOPs": flops / sec / 1e12}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def decode_cases(quick: bool):
    shapes = [(hkv, dt) for hkv in (32, 8, 4) for dt in (DType.bfloat16, DType.float32)]
    pairs = [(32, 4096), (8, 16384)] if quick else [(1, 16384), (32, 4096), (64, 8192), (8, 32768)]
    return shapes, pairs


@contextlib.contextmanager
def _exclusive(lock: str | None):
    """Holds the file lock `lock` (none: nothing): several benchmark processes compile
    side by side and take turns on the GPU for their timings."""
    if lock is None:
        yield
        return
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def run(quick: bool, dtypes: list[DType] | None = None, groups: list[int] | None = None,
        lock: str | None = None) -> dict:
    gpu = Accelerator()
    session = InferenceSession(devices=[CPU(), gpu])
    out: dict = {"device": str(gpu), "copy_GBps": None, "decode": [], "prefill": [], "errors": {}}
    if "--qkv" in sys.argv:
        with _exclusive(lock):
            try:
                out["qkv"] = qkv_rows(session, gpu)
            except Exception as e:  # noqa: BLE001
                out["errors"]["qkv"] = f"{type(e).__name__}: {str(e)[:600]}"
    shapes, pairs = decode_cases(quick)
    for hkv, dt in shapes:
        if (dtypes and dt not in dtypes) or (groups is not None and H // hkv not in groups):
            continue
        max_b, max_c = max(b for b, _ in pairs), max(c for _, c in pairs)
        sides: list = []
        makers = [
            ("max-paged", lambda: MaxSide(session, hkv, dt, gpu)),
            ("mokv-paged", lambda: MokvSide(session, "paged", hkv, dt, device=gpu)),
            (
                "mokv-continuous",
                lambda: MokvSide(
                    session, "continuous", hkv, dt, slots=max_b, max_ctx=max_c, device=gpu
                ),
            ),
        ]
        for name, make in makers:
            try:
                sides.append(make())
            except Exception as e:  # noqa: BLE001 - a side that cannot build is reported
                out["errors"][f"{name}/{hkv}/{dt}"] = f"{type(e).__name__}: {str(e)[:400]}"
        with _exclusive(lock):
            if out["copy_GBps"] is None:
                out["copy_GBps"] = copy_bandwidth(gpu)
            _time_shape(out, sides, hkv, dt, pairs, quick, gpu)
        for side in sides:  # free the caches before the next shape
            side.mgr = side.model = None
            if hasattr(side, "_keep"):
                side._keep = None
    return out


def _time_shape(out: dict, sides: list, hkv: int, dt: DType, pairs, quick: bool, gpu) -> None:
    """Decode rows of one (KV heads, dtype) shape, and (GQA 4, bf16) its prefill rows."""
    kv_tok = 2 * hkv * D * dt.size_in_bytes
    for b, c in pairs:
        if b * c * kv_tok > 8e9:
            continue
        row = {"group": H // hkv, "dtype": str(dt).split(".")[-1], "batch": b, "context": c,
               "kv_bytes": b * (c + 1) * kv_tok}
        for side in sides:
            try:
                args = side.inputs([c] * b, [1] * b)
                t = _time_gpu(lambda: side.model.execute(*args), gpu)
                row[side.name] = {"ms": t * 1e3, "GBps": row["kv_bytes"] / t / 1e9,
                                  "share_of_copy": row["kv_bytes"] / t / 1e9 / out["copy_GBps"]}
            except Exception as e:  # noqa: BLE001
                row[side.name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        out["decode"].append(row)
        print(_decode_line(row), flush=True)
    if hkv == 8 and dt == DType.bfloat16:
        for n in ([2048] if quick else [1024, 4096]):
            flops = 4 * H * D * n * (n + 1) / 2
            row = {"group": H // hkv, "dtype": "bfloat16", "tokens": n}
            for side in sides:
                try:
                    args = side.inputs([0], [n])
                    t = _time_gpu(lambda: side.model.execute(*args), gpu, reps=3, groups=3)
                    row[side.name] = {"ms": t * 1e3, "TFLOPs": flops / t / 1e12}
                except Exception as e:  # noqa: BLE001
                    row[side.name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            out["prefill"].append(row)
            print(json.dumps(row), flush=True)


def _decode_line(row: dict) -> str:
    cells = []
    for name in ("max-paged", "mokv-paged", "mokv-continuous"):
        if name not in row:
            continue
        r = row[name]
        cells.append(f"{name} " + (f"{r['ms']:.3f} ms {r['share_of_copy']:.0%}" if "ms" in r else r.get("error", "-")[:80]))
    return f"GQA {row['group']} {row['dtype']:8s} {row['batch']}x{row['context']}: " + " | ".join(cells)


if __name__ == "__main__":
    if accelerator_count() == 0:
        sys.exit("no accelerator: this benchmark runs on a GPU")
    only = {"--bf16": [DType.bfloat16], "--f32": [DType.float32]}
    arg = lambda flag: sys.argv[sys.argv.index(flag) + 1] if flag in sys.argv else None  # noqa: E731
    groups = arg("--groups")  # e.g. "1,4" (GQA groups to run), "none": no attention
    result = run("--quick" in sys.argv, next((v for k, v in only.items() if k in sys.argv), None),
                 None if groups is None else [int(g) for g in groups.split(",") if g != "none"],
                 arg("--lock"))
    if result["copy_GBps"]:
        print(f"device-to-device copy: {result['copy_GBps']:.0f} GB/s (read + written)")
    print(json.dumps(result["errors"], indent=1))
    if "--json" in sys.argv:
        Path(str(arg("--json"))).write_text(json.dumps(result, indent=1))
