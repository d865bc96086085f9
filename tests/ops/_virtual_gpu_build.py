"""Subprocess body of test_virtual_gpu.py: compile every op for a virtual GPU.

Virtual-device mode is process-global, so it runs in its own interpreter:
    python _virtual_gpu_build.py <api> <arch>      e.g. cuda sm_90, hip gfx942
    python _virtual_gpu_build.py <api> <arch> unscaled_fp8   (`unscaled_fp8` below)
Prints COMPILED after load and EXEC_REFUSED:<exception type> after execute fails.
"""

from __future__ import annotations

import dataclasses
import os
import sys

from max import driver

driver.set_virtual_device_api(sys.argv[1])
driver.set_virtual_device_target_arch(sys.argv[2])
driver.set_virtual_device_count(1)

import numpy as np  # noqa: E402
from max.driver import CPU, Accelerator, Buffer  # noqa: E402
from max.dtype import DType  # noqa: E402
from max.engine import InferenceSession  # noqa: E402
from max.graph import DeviceRef, Graph, TensorType, ops  # noqa: E402
from mokv.compiler_output import filter_collection_warnings  # noqa: E402
from mokv.config.params import KVCacheParams  # noqa: E402
from mokv.config.quantization import KVCacheQuantization  # noqa: E402
from mokv.layouts import (  # noqa: E402
    CONTINUOUS,
    PAGED,
    FetchContinuousBatchingKVCacheCollection,
    FetchPagedKVCacheCollection,
)
from mokv.ops import flash_attention, fused_qkv_matmul, kernels_path, store_kv  # noqa: E402


def main() -> None:
    gpu = Accelerator()
    dev = DeviceRef.GPU()
    params = KVCacheParams(dtype=DType.bfloat16, n_kv_heads=2, head_dim=128, page_size=128)
    n_q, hidden, layers = 8, 256, 2
    paged, cont, ht, wt, kt, ot = graph_types(params, 64, DType.bfloat16, n_q, hidden, layers)
    ft = TensorType(DType.float32, [64, 128], device=dev)
    # Scaled FP8 pages (NVIDIA only): MAX's attention runs over a bfloat16 scratch of the
    # same shapes as `params`' pages, so it shares the bfloat16 graph's kernel build.
    fp8 = dataclasses.replace(params, dtype=DType.float8_e4m3fn, quantization=KVCacheQuantization())
    fp8_paged: list = list(PAGED.input_symbols(fp8, layers, 64, dev)) if sys.argv[1] == "cuda" else []
    with Graph(
        "virtual_gpu", input_types=[*paged, *cont, ht, wt, kt, ot, ft, *fp8_paged],
        custom_extensions=[kernels_path()],
    ) as g:
        p_in, c_in, (h, w, k, off, freqs) = g.inputs[:4], g.inputs[4:8], g.inputs[8:13]
        outs = []
        for kv in (FetchPagedKVCacheCollection(params, layers)(*p_in),
                   FetchContinuousBatchingKVCacheCollection(params, layers)(*c_in)):
            store_kv(kv, k, k, off, 0)
            q = fused_qkv_matmul(kv, h, w, off, 1, n_q)
            q = fused_qkv_matmul(kv, h, w, off, 1, n_q, freqs_cis=freqs)
            q3 = ops.reshape(q, [q.shape[0], n_q, 128])
            outs.append(flash_attention(kv, q3, off, 1, 0.08))
            outs.append(flash_attention(kv, q3, off, 1, 0.08, window_size=300))  # MAX's window mask
        if fp8_paged:
            kv = FetchPagedKVCacheCollection(fp8, layers)(*g.inputs[13:])
            store_kv(kv, k, k, off, 0)
            q = fused_qkv_matmul(kv, h, w, off, 1, n_q, freqs_cis=freqs)
            outs.append(flash_attention(kv, ops.reshape(q, [q.shape[0], n_q, 128]), off, 1, 0.08))
        g.output(*outs)
    # One collection read by 16 ops: MAX 26.7 cuts a GPU graph into regions of at most
    # 16 ops, so the collection crosses a region boundary while ops of its own region
    # still read it. That fails to compile ("use of uninitialized value") unless the
    # collection type is TrivialRegisterPassable (mokv/types.mojo, KVCollectionT).
    with Graph("virtual_gpu_split", input_types=[*paged, kt, ot], custom_extensions=[kernels_path()]) as g2:
        kv = FetchPagedKVCacheCollection(params, layers)(*g2.inputs[:4])
        for i in range(16):
            store_kv(kv, g2.inputs[4], g2.inputs[4], g2.inputs[5], i % layers)
        g2.output()
    load_then_execute(gpu, g2, g)


def graph_types(params: KVCacheParams, max_seq_len: int, kv_dtype: DType, n_q: int, hidden: int,
                layers: int) -> tuple:
    """A GPU graph's input types: the paged and the continuous cache's, hidden (bfloat16),
    wqkv (bfloat16, heads of 128), K or V rows of `kv_dtype` and the row offsets."""
    dev = DeviceRef.GPU()
    return (
        PAGED.input_symbols(params, layers, max_seq_len, dev),
        CONTINUOUS.input_symbols(params, layers, max_seq_len, dev),
        TensorType(DType.bfloat16, ["total_tokens", hidden], device=dev),
        TensorType(DType.bfloat16, [(n_q + 2 * params.n_kv_heads) * 128, hidden], device=dev),
        TensorType(kv_dtype, ["total_tokens", params.n_kv_heads, 128], device=dev),
        TensorType(DType.uint32, ["num_offsets"], device=dev),
    )


def load_then_execute(gpu, *graphs: Graph) -> None:
    """Loads `graphs` for the virtual GPU (COMPILED), then executes the last one, which
    a compile-only device refuses (EXEC_REFUSED:<exception type>)."""
    session = InferenceSession(devices=[CPU(), gpu])
    with filter_collection_warnings():
        models = [session.load(graph) for graph in graphs]
    print("COMPILED", flush=True)
    try:
        models[-1].execute(*[Buffer.from_numpy(np.zeros(1, np.float32))])
    except Exception as exc:  # noqa: BLE001 - the type is what the test checks
        print(f"EXEC_REFUSED:{type(exc).__name__}", flush=True)


def unscaled_fp8() -> None:
    """mokv's ops over MAX's unscaled FP8 pages (docs/quantized.md). Paged: store_kv,
    fused_qkv_matmul (MAX's matmul, then mokv's epilogue casting K and V to e4m3fn) and
    flash_attention with bfloat16 queries (MAX's native FP8 path writes bfloat16
    itself); with a 4th argument `continuous`, instead: store_kv and flash_attention
    over a continuous cache with float32 queries (the op casts MAX's bfloat16 output
    back) and MAX's sliding-window mask.

    MAX 26.7's attention reads FP8 pages on sm_100-class and AMD GPUs only: for another
    NVIDIA arch (sm_90) this checks that `flash_attention` is refused by name when the
    graph is built, prints REFUSED and compiles nothing."""
    dev = DeviceRef.GPU()
    params = KVCacheParams(dtype=DType.float8_e4m3fn, n_kv_heads=2, head_dim=128, page_size=128)
    n_q, hidden, layers = 8, 256, 2
    paged, cont, ht, wt, kt, ot = graph_types(params, 256, DType.float32, n_q, hidden, layers)
    qt = TensorType(DType.float32, ["total_tokens", n_q, 128], device=dev)
    if sys.argv[1] == "cuda" and not sys.argv[2].startswith("sm_10"):
        with Graph("refused", input_types=[*paged, qt, ot]) as g:
            kv = FetchPagedKVCacheCollection(params, layers)(*g.inputs[:4])
            try:
                flash_attention(kv, g.inputs[4], g.inputs[5], 0, 0.08)
            except ValueError as exc:
                print(f"REFUSED:{exc}", flush=True)
        return
    if sys.argv[4:] == ["continuous"]:  # a second MAX attention kernel: outside make test
        with Graph("virtual_gpu_fp8_continuous", input_types=[*cont, kt, qt, ot],
                   custom_extensions=[kernels_path()]) as g:
            c_in, (k, q32, off) = g.inputs[:4], g.inputs[4:]
            kv = FetchContinuousBatchingKVCacheCollection(params, layers)(*c_in)
            store_kv(kv, k, k, off, 0)
            g.output(flash_attention(kv, q32, off, 0, 0.08, window_size=300))
    else:
        with Graph("virtual_gpu_fp8", input_types=[*paged, ht, wt, kt, ot],
                   custom_extensions=[kernels_path()]) as g:
            p_in, (h, w, k, off) = g.inputs[:4], g.inputs[4:]
            kv = FetchPagedKVCacheCollection(params, layers)(*p_in)
            store_kv(kv, k, k, off, 0)
            q = fused_qkv_matmul(kv, h, w, off, 1, n_q)
            g.output(flash_attention(kv, ops.reshape(q, [q.shape[0], n_q, 128]), off, 1, 0.08))
    load_then_execute(Accelerator(), g)


if __name__ == "__main__":
    if sys.argv[3:4] == ["unscaled_fp8"]:
        unscaled_fp8()
    else:
        main()
    # After a virtual-device session, MAX's runtime threads sometimes abort the process
    # during interpreter shutdown ("terminate called without an active exception",
    # SIGABRT). Everything this script reports is printed and flushed by now, so leave
    # without running the shutdown that can abort.
    os._exit(0)
