"""Subprocess body of test_virtual_gpu.py: compile every op for a virtual GPU.

Virtual-device mode is process-global, so it runs in its own interpreter:
    python _virtual_gpu_build.py <api> <arch>      e.g. cuda sm_90, hip gfx942
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
    paged = PAGED.input_symbols(params, layers, 64, dev)
    cont = CONTINUOUS.input_symbols(params, layers, 64, dev)
    ht = TensorType(DType.bfloat16, ["total_tokens", hidden], device=dev)
    wt = TensorType(DType.bfloat16, [(n_q + 4) * 128, hidden], device=dev)
    kt = TensorType(DType.bfloat16, ["total_tokens", 2, 128], device=dev)
    ot = TensorType(DType.uint32, ["num_offsets"], device=dev)
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
    session = InferenceSession(devices=[CPU(), gpu])
    with filter_collection_warnings():
        session.load(g2)
        model = session.load(g)
    print("COMPILED", flush=True)
    try:
        model.execute(*[Buffer.from_numpy(np.zeros(1, np.float32))])
    except Exception as exc:  # noqa: BLE001 - the type is what the test checks
        print(f"EXEC_REFUSED:{type(exc).__name__}", flush=True)


if __name__ == "__main__":
    main()
    # After a virtual-device session, MAX's runtime threads sometimes abort the process
    # during interpreter shutdown ("terminate called without an active exception",
    # SIGABRT). Everything this script reports is printed and flushed by now, so leave
    # without running the shutdown that can abort.
    os._exit(0)
