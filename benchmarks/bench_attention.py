"""Ragged flash attention over a KV cache on the CPU: mokv's kernels against MAX's.

One layer of Llama-3-8B-shaped attention (32 query heads, 8 KV heads, head_dim 128,
float32), compiled once per implementation and run on identical request shapes:

- **decode**: B requests, each with `ctx` cached tokens and one new query token. The
  kernel must stream every cached K and V row once, so it is memory bound: we report
  the achieved bandwidth `bytes of K/V read / time` next to the machine's copy
  bandwidth measured in the same run (a numpy copy, and a two-thread read);
- **prefill**: one request of L new tokens, causal (compute bound): time and GFLOP/s.

A second table, **shapes**, times long-context decode for every GQA group (1, 4, 8:
32 query heads over 32, 8 or 4 KV heads) in float32 and bfloat16. Every decode timing
is interleaved with two-thread read probes and reported as a share of them.

Implementations: mokv's `mokv.ops.flash_attention` over the paged and the continuous
cache (inputs from mokv's own managers), and MAX 26.7's `flash_attention_ragged` over
its paged cache (inputs from MAX's `PagedKVCacheManager`). Cache memory is filled with
data before timing (untouched pages would read as the shared zero page). Each timing is
the median of repeated `model.execute` calls after a warm-up, graph launch included.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from functools import partial

import mokv
import mokv.ops  # noqa: F401
import numpy as np
from max.driver import CPU, Buffer, Device
from max.dtype import DType
from max.graph import DeviceRef, Graph, TensorType, ops

H, HKV, D = 32, 8, 128
DTYPE, PAGE = DType.float32, 128
KV_BYTES_PER_TOKEN = 2 * HKV * D * 4
MAX_CTX = 16384


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    return (np.ascontiguousarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def _fill(buf: Buffer) -> None:
    """Writes a repeating random pattern over the whole buffer (cheap, and real memory).

    A buffer on an accelerator is filled from a host copy of the pattern."""
    row = np.random.default_rng(0).standard_normal((1, D)).astype(np.float32) * 0.1
    bf16 = buf.dtype == DType.bfloat16
    host = buf if buf.device.is_host else Buffer(buf.dtype, list(buf.shape), device=CPU())
    (host.view(DType.uint16) if bf16 else host).to_numpy().reshape(-1, D)[...] = _bf16_bits(row) if bf16 else row
    if host is not buf:
        buf.inplace_copy_from(host)
        buf.device.synchronize()


def _time(fn: Callable[[], object], min_time: float, max_reps: int = 200) -> float:
    fn()
    times: list[float] = []
    t_end = time.perf_counter() + min_time
    while len(times) < 3 or (time.perf_counter() < t_end and len(times) < max_reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


class ReadProbe:
    """GB/s of a two-thread streaming read (numpy maxima over the two halves of an array).

    The memory bandwidth of a shared VM drifts by tens of percent within seconds, so a
    decode timing is interleaved with probes (`_decode_cells`) and set against them.
    The read is `np.maximum.reduce`, not a sum: numpy's pairwise float sum is bound by
    arithmetic on some CPUs (emeraldrapids, one thread: 18.6 GB/s in L2 and 8.7 from
    memory, against 58.6 and 16.0 for the maximum), which made the probe read half of
    what the memory gives and decode shares pass 200%."""

    def __init__(self, nbytes: int):
        self.src = np.ones(nbytes // 4, dtype=np.float32)
        self.halves = np.array_split(self.src, 2)

    def _read2(self) -> None:
        ts = [threading.Thread(target=np.maximum.reduce, args=(h,)) for h in self.halves]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    def __call__(self, repeats: int = 5) -> float:
        return self.src.nbytes / min(_time(self._read2, 0) for _ in range(repeats)) / 1e9


def copy_bandwidth(probe: ReadProbe, repeats: int = 5) -> dict:
    """GB/s of a numpy copy (bytes copied / time), and of one- and two-thread reads."""
    src = probe.src
    dst = np.empty_like(src)
    copy = min(_time(lambda: np.copyto(dst, src), 0) for _ in range(repeats))
    one = min(_time(lambda: np.maximum.reduce(src), 0) for _ in range(repeats))
    return {"numpy_copy_GBps": src.nbytes / copy / 1e9, "read_2threads_GBps": probe(repeats),
            "read_1thread_GBps": src.nbytes / one / 1e9, "bytes": src.nbytes}


def execute_floor_us(session) -> float:
    """Median µs of `execute` for a one-op graph (x + 1 over one float): MAX's own cost
    per call, which every decode cell pays on top of its kernel. It sets how small a
    cell can be and still reach a share of the read (MAX 26.7 on a 2-vCPU VM: 34 µs,
    12% of the 0.28 ms that 8 MiB take at 30 GB/s)."""
    cpu = DeviceRef.CPU()
    with Graph("execute_floor", input_types=[TensorType(DType.float32, [1], cpu)]) as g:
        g.output(g.inputs[0].tensor + 1)
    model = session.load(g)
    x = Buffer.from_numpy(np.zeros(1, np.float32))
    return _time(lambda: model.execute(x), 0.5, max_reps=5000) * 1e6


def _io_types(dtype: DType = DTYPE, device: Device = CPU()):
    ref = DeviceRef.from_device(device)
    return [TensorType(dtype, ["total_tokens", H, D], ref),
            TensorType(DType.uint32, ["batch_plus_1"], ref)]


def _q_and_offsets(new: list[int], dtype: DType = DTYPE, device: Device = CPU()) -> list[Buffer]:
    q = np.random.default_rng(1).standard_normal((sum(new), H, D)).astype(np.float32)
    offsets = np.concatenate([[0], np.cumsum(new)]).astype(np.uint32)
    if dtype == DType.bfloat16:
        bufs = [Buffer.from_numpy(_bf16_bits(q)).view(DType.bfloat16), Buffer.from_numpy(offsets)]
    else:
        bufs = [Buffer.from_numpy(q), Buffer.from_numpy(offsets)]
    if device.is_host:
        return bufs
    bufs = [b.to(device) for b in bufs]
    device.synchronize()  # copies are enqueued, not done
    return bufs


class MokvSide:
    """mokv's flash attention over one of its caches ("paged" or "continuous")."""

    def __init__(self, session, kind: str, hkv: int = HKV, dtype: DType = DTYPE,
                 slots: int = 64, max_ctx: int = MAX_CTX, device: Device = CPU(),
                 portable: bool = False):
        self.session, self.kind, self.dtype = session, kind, dtype
        self.name = f"mokv-{kind}" + ("-portable" if portable else "")  # the portable CPU paths
        self.device = device
        strategy = mokv.KVCacheStrategy.PAGED if kind == "paged" else mokv.KVCacheStrategy.CONTINUOUS
        self.params = mokv.KVCacheParams(dtype, hkv, D, page_size=PAGE, cache_strategy=strategy)
        if kind == "continuous":  # one cache for every case (its max_seq_len is a static dim)
            self.mgr = mokv.ContinuousKVCacheManager(self.params, slots, max_ctx + 1, 1,
                                                     [device], session)
        else:
            self.mgr = self._paged_manager(1, 2 * PAGE)
        with Graph(f"mokv_attention_{kind}",
                   input_types=[*_io_types(dtype, device), *self.mgr.input_symbols()[0]]) as g:
            q, offsets, *kv = g.inputs
            coll = self.mgr.layout.fetch(self.params, 1, *kv)
            out = mokv.ops.flash_attention(coll, q.tensor, offsets.tensor, 0, 1 / math.sqrt(D))
            g.output(out)
        with mokv.ops.portable_cpu_paths(session, portable), mokv.filter_collection_warnings():
            self.model = session.load(g)

    def _paged_manager(self, batch: int, seq: int):
        pages = batch * -(-seq // PAGE) + 1
        return mokv.PagedKVCacheManager(self.params, batch, seq, 1, [self.device], self.session,
                                        pages * self.params.bytes_per_page(1))

    def inputs(self, cached: list[int], new: list[int]) -> list[Buffer]:
        if self.kind == "paged":
            self.mgr = self._paged_manager(len(cached), max(c + n for c, n in zip(cached, new)))
            self._claimed = []
        for rid in list(getattr(self, "_claimed", [])):
            self.mgr.release(rid)
        ctxs = [mokv.TextContext(np.zeros(c + n, dtype=np.int64)) for c, n in zip(cached, new)]
        for ctx, c in zip(ctxs, cached):
            self.mgr.external_claim(ctx.request_id, 0)
            assert self.mgr.maybe_reserve(ctx, 1)
            if c:
                ctx.skip_cached_prefix(c)
        self._claimed = [ctx.request_id for ctx in ctxs]
        kv = self.mgr.fetch(ctxs, 1)[0]
        if self.kind == "paged" or not self.device.is_host:  # (a GPU's continuous cache: all of it)
            _fill(kv.blocks)
        else:
            bf16 = kv.blocks.dtype == DType.bfloat16
            blocks = (kv.blocks.view(DType.uint16) if bf16 else kv.blocks).to_numpy()
            for slot, c in enumerate(cached):
                blocks[slot, :, :, : c + new[slot]] = 0x3D4D if bf16 else 0.05  # 0x3D4D: 0.05 in bf16
        return [*_q_and_offsets(new, self.dtype, self.device), *kv]


class MaxSide:
    """MAX 26.7's `flash_attention_ragged` over its own paged cache."""

    name = "max-paged"

    def __init__(self, session, hkv: int = HKV, dtype: DType = DTYPE, device: Device = CPU()):
        from max.nn.attention.mask_config import MHAMaskVariant
        from max.nn.kernels import flash_attention_ragged
        from max.nn.kv_cache import MHAKVCacheParams
        from maxcompat import load_max_pipelines

        self.Manager, _, self.Ctx, self.Tokens, self.RID, _ = load_max_pipelines()
        self.session, self.dtype, self.device = session, dtype, device
        self.params = MHAKVCacheParams(dtype=dtype, head_dim=D, num_layers=1,
                                       devices=[DeviceRef.from_device(device)], page_size=PAGE,
                                       n_kv_heads=hkv)
        with Graph("max_attention",
                   input_types=[*_io_types(dtype, device), *self.params.flattened_kv_inputs()]) as g:
            q, offsets, *kv = g.inputs
            coll = self.params.unflatten_kv_inputs(iter(kv))[0]
            out = flash_attention_ragged(self.params, q.tensor, offsets.tensor, coll,
                                         ops.constant(0, DType.uint32, DeviceRef.CPU()),
                                         MHAMaskVariant.CAUSAL_MASK, 1 / math.sqrt(D))
            g.output(out)
        with mokv.filter_collection_warnings():
            self.model = session.load(g)

    def inputs(self, cached: list[int], new: list[int]) -> list[Buffer]:
        from max import tree

        pages = sum(-(-(c + n) // PAGE) for c, n in zip(cached, new)) + 1
        mgr = self.Manager(params=self.params, session=self.session, total_num_pages=pages,
                           max_batch_size=len(cached))
        ctxs = []
        for i, (c, n) in enumerate(zip(cached, new)):
            ctx = self.Ctx(request_id=self.RID(f"a{i}"), max_length=c + n + 8,
                           tokens=self.Tokens(np.zeros(c + n, dtype=np.int64)))
            mgr.claim(ctx, 0)
            mgr.alloc(ctx)
            if c:
                ctx.tokens.skip_processing(c)
            ctxs.append(ctx)
        kv = mgr.runtime_inputs([ctxs])
        _fill(kv[0].kv_blocks)
        self._keep = mgr  # the inputs alias the manager's buffers
        return [*_q_and_offsets(new, self.dtype, self.device), *tree.leaves(kv)]


def cases(quick: bool) -> dict:
    """Decode (batch, context) pairs, capped at ~1.1 GB of K/V each, and prefill lengths;
    `shapes`: (KV heads, dtype) pairs (GQA 1, 4, 8 of 32 query heads) and their
    long-context decode (batch, context) pairs."""
    batches, ctxs = ([1, 16], [512, 4096, 16384]) if quick else ([1, 4, 16, 64], [512, 2048, 8192, 16384])
    decode = [(b, c) for b in batches for c in ctxs if b * c * KV_BYTES_PER_TOKEN <= 1.1e9]
    shapes = [(hkv, dt) for hkv in (32, 8, 4) for dt in (DType.float32, DType.bfloat16)]
    shape_decode = [(1, 8192)] if quick else [(1, 4096), (1, 16384), (4, 8192)]
    return {"decode": decode, "prefill": [512, 2048] if quick else [512, 1024, 2048],
            "shapes": shapes, "shape_decode": shape_decode}


def _decode_cells(sides: list, probe: ReadProbe, b: int, c: int, kv_bytes: int, min_time: float,
                  rounds: int = 7) -> dict[str, dict]:
    """Decode timings of `sides` on one (batch, context), interleaved with read probes.

    Each of `rounds` rounds gives every side, in an order that rotates from round to round,
    the median of three probe reads followed by its kernel's calls for `min_time / rounds`
    seconds. A side's share of the read is the median over rounds of (kernel GB/s / probe
    GB/s of that round): each kernel figure is set against the bandwidth of its own moment,
    and all sides take the same statistic. (Setting a whole timing against the best of
    probes bracketing it made the share swing by ±10 points whenever a probe caught a burst.)

    The sides take turns so that one cell's rounds spread over all the sides' time (about
    three seconds, not one): the VM's read bursts of 37-44 GB/s can last a second, and a
    kernel bound by arithmetic (GQA 8) cannot follow them, so a cell timed inside one read
    68-83% of the probe where the same cell read 90-105% in other runs."""
    args = {side.name: side.inputs([c] * b, [1] * b) for side in sides}
    reads, times, shares = ({side.name: list[float]() for side in sides} for _ in range(3))
    for r in range(rounds):
        for side in sides[r % len(sides):] + sides[:r % len(sides)]:
            read = probe(1)  # (`_time` warms the kernel up after it)
            t = _time(partial(side.model.execute, *args[side.name]), min_time / rounds)
            reads[side.name].append(read)
            times[side.name].append(t)
            shares[side.name].append(kv_bytes / t / 1e9 / read)
    cells = {}
    for name in args:
        t, rd = float(np.median(times[name])), reads[name]
        cells[name] = {"ms": t * 1e3, "GBps": kv_bytes / t / 1e9,
                       "read_2threads_GBps": float(np.median(rd)),
                       "read_range_GBps": [min(rd), max(rd)],
                       "share_of_read": float(np.median(shares[name]))}
    return cells


def _portable_side(portable: bool, make):
    """[(name, make)] for the mokv side on the portable CPU paths, when asked for."""
    return [("mokv-paged-portable", make)] if portable else []


def run_shapes(session, probe: ReadProbe, quick: bool, progress=None, portable: bool = False) -> list[dict]:
    """Long-context decode for each (GQA group, dtype): mokv paged and continuous, MAX;
    with `portable`, mokv paged on the portable CPU paths too."""
    plan = cases(quick)
    min_time = 0.3 if quick else 0.6
    rows = []
    for hkv, dt in plan["shapes"]:
        kv_bytes_tok = 2 * hkv * D * dt.size_in_bytes
        pairs = [(b, c) for b, c in plan["shape_decode"] if b * c * kv_bytes_tok <= 1.1e9]
        sides, errors = [], {}
        max_b = max(b for b, _ in pairs)
        max_c = max(c for _, c in pairs)
        for name, make in (("max-paged", lambda: MaxSide(session, hkv, dt)),
                           ("mokv-paged", lambda: MokvSide(session, "paged", hkv, dt)),
                           ("mokv-continuous", lambda: MokvSide(session, "continuous", hkv, dt,
                                                                slots=max_b, max_ctx=max_c)),
                           *_portable_side(portable, lambda: MokvSide(session, "paged", hkv, dt,
                                                                      portable=True))):
            try:
                sides.append(make())
            except Exception as e:  # noqa: BLE001 - reported, not fatal
                errors[name] = f"{type(e).__name__}: {str(e)[:300]}"
        for b, c in pairs:
            row = {"group": H // hkv, "n_kv_heads": hkv, "dtype": str(dt).split(".")[-1], "batch": b,
                   "context": c, "kv_bytes": b * (c + 1) * kv_bytes_tok, "errors": errors}
            row.update(_decode_cells(sides, probe, b, c, row["kv_bytes"], min_time))
            rows.append(row)
        for side in sides:  # free the caches before the next shape
            side.mgr = side.model = side._keep = None
        if progress:
            progress()
    return rows


def run(quick: bool = False, progress=None, portable: bool = False) -> dict:
    """`portable`: add mokv's paged side on the portable CPU paths (`portable_cpu_paths`:
    the kernels an AVX2 host runs), timed beside the others."""
    from max.engine import InferenceSession

    session = InferenceSession(devices=[CPU()])
    probe = ReadProbe(1 << (28 if quick else 29))
    out: dict = {"shape": {"n_heads": H, "n_kv_heads": HKV, "head_dim": D, "dtype": "float32",
                           "page_size": PAGE},
                 "sides": {}, "errors": {},
                 "decode": [], "prefill": [], "copy": copy_bandwidth(probe)}
    sides = []
    for name, make in (("max-paged", lambda: MaxSide(session)),
                       ("mokv-paged", lambda: MokvSide(session, "paged")),
                       ("mokv-continuous", lambda: MokvSide(session, "continuous")),
                       *_portable_side(portable, lambda: MokvSide(session, "paged", portable=True))):
        t0 = time.perf_counter()
        try:
            sides.append(make())
            out["sides"][name] = {"build_and_load_s": round(time.perf_counter() - t0, 2)}
        except Exception as e:  # noqa: BLE001 - a side that cannot build is reported, not fatal
            out["errors"][name] = f"{type(e).__name__}: {str(e)[:600]}"
        if progress:
            progress()
    out["execute_floor_us"] = execute_floor_us(session)
    min_time = 0.3 if quick else 0.8
    plan = cases(quick)
    for b, c in plan["decode"]:
        row = {"batch": b, "context": c, "kv_bytes": b * (c + 1) * KV_BYTES_PER_TOKEN}
        row.update(_decode_cells(sides, probe, b, c, row["kv_bytes"], min_time))
        out["decode"].append(row)
        if progress:
            progress()
    for n in plan["prefill"]:
        flops = 4 * H * D * n * (n + 1) / 2  # QK^T and PV over the causal half
        row = {"tokens": n}
        for side in sides:
            args = side.inputs([0], [n])
            t = _time(lambda: side.model.execute(*args), min_time, max_reps=20)
            row[side.name] = {"ms": t * 1e3, "GFLOPs": flops / t / 1e9}
        out["prefill"].append(row)
        if progress:
            progress()
    for side in sides:
        side.mgr = side.model = None
    sides.clear()
    out["shapes"] = run_shapes(session, probe, quick, progress, portable)
    return out


def plan_size(quick: bool, portable: bool = False) -> int:
    """Progress-bar steps `run` reports."""
    p = cases(quick)
    return 3 + portable + len(p["decode"]) + len(p["prefill"]) + len(p["shapes"])


if __name__ == "__main__":
    import json
    import sys

    portable = "--portable" in sys.argv
    if "--shapes" in sys.argv:  # only the GQA x dtype table
        from max.engine import InferenceSession

        rows = run_shapes(InferenceSession(devices=[CPU()]), ReadProbe(1 << 28), "--quick" in sys.argv,
                          portable=portable)
        print(json.dumps(rows, indent=1))
    else:
        print(json.dumps(run("--quick" in sys.argv, portable=portable), indent=1))
