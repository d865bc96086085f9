"""MLA caches against GQA caches: what a token costs, what a budget admits, and how much
of the CPU's read bandwidth mokv's MLA decode attention uses.

1. Bytes per token and requests admitted at once (mokv's own sizing: `bytes_per_token`,
   `infer_optimal_batch_size`) for DeepSeek-V2-Lite's MLA cache (27 layers, a latent of
   512 and a RoPE key of 64, bfloat16) against caches of K and V heads for a model of
   the same size: the same 27 layers and 16 heads as GQA with 4 KV heads of 128, and as
   the un-absorbed heads MLA replaces (16 K heads of 192 and V heads of 128: 16 heads of
   160 each way carry the same bytes). At 1 and 2 tensor-parallel devices: an MLA latent
   is whole on every device, K and V heads are split.
2. CPU MLA decode attention (`mokv.ops.mla_attention`, bfloat16 cache, 16 heads,
   DeepSeek's row of 576) per (batch, context): the achieved read bandwidth `bytes of
   latents read / time`, interleaved with two-thread read probes (bench_attention's
   `ReadProbe`) and reported as a share of them, as the GQA kernels are.
"""

from __future__ import annotations

from collections.abc import Callable

import mokv
import numpy as np
from bench_attention import ReadProbe, _time
from max import tree
from max.driver import CPU, Buffer
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import DeviceRef, Graph, TensorType
from mokv.layouts import PAGED, RaggedKVCacheInputs
from mokv.layouts.max_paged import max_input_symbols, max_runtime_inputs
from mokv.managers.paged.sizing import infer_optimal_batch_size

LAYERS, HEADS, LATENT, ROPE, PAGE = 27, 16, 512, 64, 128
ROW = LATENT + ROPE
MLA_GROUP = mokv.CacheGroupConfig("mla", LAYERS, latent_dim=LATENT, rope_dim=ROPE)
BUDGET, SEQ = 8 * 2**30, 4096


def caches(tp: int) -> dict[str, mokv.KVCacheParams]:
    bf16 = DType.bfloat16
    return {
        "MLA (DeepSeek-V2-Lite)": mokv.KVCacheParams(bf16, 1, ROW, PAGE, n_devices=tp, groups=(MLA_GROUP,)),
        "GQA, 4 KV heads of 128": mokv.KVCacheParams(bf16, 4, 128, PAGE, n_devices=tp),
        "MHA, 16 heads (un-absorbed)": mokv.KVCacheParams(bf16, 16, 160, PAGE, n_devices=tp),
    }


def sizing() -> list[dict]:
    rows = []
    for tp in (1, 2):
        for name, params in caches(tp).items():
            rows.append({
                "cache": name, "tp": tp, "bytes_per_token": params.bytes_per_token(LAYERS),
                "requests_admitted": infer_optimal_batch_size(params, SEQ, LAYERS, BUDGET * tp),
            })
    return rows


def cases(quick: bool) -> list[tuple[int, int]]:
    return [(1, 4096), (8, 2048)] if quick else [(1, 4096), (1, 16384), (8, 2048), (32, 1024)]


class MLADecode:
    """One layer's MLA decode attention on a bfloat16 cache of `batch` x `context` rows."""

    def __init__(self, session: InferenceSession, batch: int, context: int):
        params = mokv.KVCacheParams(DType.bfloat16, 1, ROW, PAGE, groups=(
            mokv.CacheGroupConfig("mla", 1, latent_dim=LATENT, rope_dim=ROPE),))
        cpu = DeviceRef.CPU()
        symbols = max_input_symbols(PAGED.input_symbols(params, 1, context + 1, cpu), mla=True)
        cache_types = tree.leaves(symbols)
        types = [*cache_types, TensorType(DType.bfloat16, ["t", HEADS, ROW], device=cpu),
                 TensorType(DType.uint32, ["b1"], device=cpu)]
        with Graph("bench_mla_decode", input_types=types) as g:
            cache = mokv.max_cache_values(g.inputs[: len(cache_types)])
            q, offsets = (v.tensor for v in g.inputs[len(cache_types):])
            g.output(mokv.ops.mla_attention(cache, q, offsets, 0, 0.07, ROPE))
        self.model = session.load(g)
        per_seq = -(-(context + 1) // PAGE)
        rng = np.random.default_rng(0)
        blocks = rng.integers(0x3C00, 0x3F80, (batch * per_seq, 1, 1, PAGE, 1, ROW), dtype=np.uint16)
        table = np.arange(batch * per_seq, dtype=np.uint32).reshape(batch, per_seq)
        inputs = RaggedKVCacheInputs(
            Buffer.from_numpy(blocks).view(DType.bfloat16),
            Buffer.from_numpy(np.full(batch, context, np.uint32)),
            Buffer.from_numpy(table), Buffer.from_numpy(np.array([[1, context + 1]], np.uint32)))
        q = rng.integers(0x3C00, 0x3F80, (batch, HEADS, ROW), dtype=np.uint16)
        self._keep = (blocks, table, q)
        self.args = [*tree.leaves(max_runtime_inputs(inputs, 1, mla_q_heads=HEADS)),
                     Buffer.from_numpy(q).view(DType.bfloat16),
                     Buffer.from_numpy(np.arange(batch + 1, dtype=np.uint32))]
        self.bytes_read = batch * (context + 1) * ROW * 2

    def __call__(self) -> None:
        self.model.execute(*self.args)


def run(quick: bool, tick: Callable[[], None] = lambda: None) -> dict:
    session = InferenceSession(devices=[CPU()])
    probe = ReadProbe(256 * 2**20)
    rows = []
    for batch, context in cases(quick):
        kernel = MLADecode(session, batch, context)
        shares, gbps = [], []
        for _ in range(3 if quick else 7):
            read = probe(1)
            seconds = _time(kernel, 0.3 if quick else 1.0)
            gbps.append(kernel.bytes_read / seconds / 1e9)
            shares.append(gbps[-1] / read)
        rows.append({"batch": batch, "context": context, "ms": kernel.bytes_read / np.median(gbps) / 1e6,
                     "GBps": float(np.median(gbps)), "share_of_read": float(np.median(shares))})
        tick()
    return {"sizing": sizing(), "decode": rows, "budget_GiB_per_device": BUDGET / 2**30,
            "max_seq_len": SEQ}


def table(r: dict) -> list[str]:
    """The markdown tables of `run`'s result."""
    lines = [f"### MLA caches: bytes per token and requests of {r['max_seq_len']} tokens "
             f"admitted in {r['budget_GiB_per_device']:.0f} GiB per device (bfloat16, 27 layers)",
             "", "| cache | TP | bytes per token (replica) | requests admitted |", "|---|---|---|---|"]
    lines += [f"| {row['cache']} | {row['tp']} | {row['bytes_per_token']} | {row['requests_admitted']} |"
              for row in r["sizing"]]
    lines += ["", "### CPU MLA decode attention (bfloat16, 16 heads, rows of 576)", "",
              "| batch | context | ms | GB/s read | share of the two-thread read |", "|---|---|---|---|---|"]
    lines += [f"| {row['batch']} | {row['context']} | {row['ms']:.2f} | {row['GBps']:.2f} | "
              f"{100 * row['share_of_read']:.0f}% |" for row in r["decode"]]
    return lines + [""]


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(run("--quick" in sys.argv), indent=1))
