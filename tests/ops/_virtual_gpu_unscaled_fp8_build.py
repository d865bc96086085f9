"""Subprocess body of test_virtual_gpu.py's unscaled FP8 build: mokv's ops over MAX's
unscaled FP8 pages (docs/quantized.md), compiled for a virtual GPU.

    python _virtual_gpu_unscaled_fp8_build.py <api> <arch>      e.g. cuda sm_100

Paged: store_kv, fused_qkv_matmul (MAX's matmul, then mokv's epilogue casting K and V
to e4m3fn) and flash_attention with bfloat16 queries (MAX's native FP8 path writes
bfloat16 itself); continuous: store_kv and flash_attention with float32 queries (the
op casts MAX's bfloat16 output back) and MAX's sliding-window mask. Prints COMPILED
after load and EXEC_REFUSED:<exception type> after execute fails.

MAX 26.7's attention reads FP8 pages on sm_100-class and AMD GPUs only (its native FP8
path): for another NVIDIA arch (sm_90) the script checks that `flash_attention` is
refused by name when the graph is built, prints REFUSED and compiles nothing.
"""

from __future__ import annotations

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
    params = KVCacheParams(dtype=DType.float8_e4m3fn, n_kv_heads=2, head_dim=128, page_size=128)
    n_q, hidden, layers = 8, 256, 2
    paged = PAGED.input_symbols(params, layers, 256, dev)
    cont = CONTINUOUS.input_symbols(params, layers, 256, dev)
    ht = TensorType(DType.bfloat16, ["total_tokens", hidden], device=dev)
    wt = TensorType(DType.bfloat16, [(n_q + 4) * 128, hidden], device=dev)
    kt = TensorType(DType.float32, ["total_tokens", 2, 128], device=dev)
    qt = TensorType(DType.float32, ["total_tokens", n_q, 128], device=dev)
    ot = TensorType(DType.uint32, ["num_offsets"], device=dev)
    if sys.argv[1] == "cuda" and not sys.argv[2].startswith("sm_10"):
        with Graph("refused", input_types=[*paged, qt, ot]) as g:
            kv = FetchPagedKVCacheCollection(params, layers)(*g.inputs[:4])
            try:
                flash_attention(kv, g.inputs[4], g.inputs[5], 0, 0.08)
            except ValueError as exc:
                print(f"REFUSED:{exc}", flush=True)
        return
    with Graph("virtual_gpu_fp8", input_types=[*paged, *cont, ht, wt, kt, qt, ot],
               custom_extensions=[kernels_path()]) as g:
        p_in, c_in, (h, w, k, q32, off) = g.inputs[:4], g.inputs[4:8], g.inputs[8:]
        kv = FetchPagedKVCacheCollection(params, layers)(*p_in)
        store_kv(kv, k, k, off, 0)
        q = fused_qkv_matmul(kv, h, w, off, 1, n_q)
        paged_out = flash_attention(kv, ops.reshape(q, [q.shape[0], n_q, 128]), off, 1, 0.08)
        kv = FetchContinuousBatchingKVCacheCollection(params, layers)(*c_in)
        store_kv(kv, k, k, off, 0)
        g.output(paged_out, flash_attention(kv, q32, off, 0, 0.08, window_size=300))
    session = InferenceSession(devices=[CPU(), gpu])
    with filter_collection_warnings():
        model = session.load(g)
    print("COMPILED", flush=True)
    try:
        model.execute(*[Buffer.from_numpy(np.zeros(1, np.float32))])
    except Exception as exc:  # noqa: BLE001 - the type is what the test checks
        print(f"EXEC_REFUSED:{type(exc).__name__}", flush=True)


if __name__ == "__main__":
    main()
    # As in _virtual_gpu_build.py: leave without the interpreter shutdown that can abort
    # after a virtual-device session.
    os._exit(0)
