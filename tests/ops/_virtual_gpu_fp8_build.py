"""Subprocess body of test_virtual_gpu.py's scaled FP8 test: mokv's ops over scaled FP8
pages (paged) compiled for a virtual GPU.

    python _virtual_gpu_fp8_build.py <api> <arch>      e.g. cuda sm_90
Prints COMPILED <seconds> after load and EXEC_REFUSED:<exception type> after execute
fails.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from max import driver

driver.set_virtual_device_api(sys.argv[1])
driver.set_virtual_device_target_arch(sys.argv[2])
driver.set_virtual_device_count(1)

from max.driver import CPU, Accelerator  # noqa: E402
from max.dtype import DType  # noqa: E402
from max.engine import InferenceSession  # noqa: E402
from max.graph import DeviceRef, Graph, TensorType, ops  # noqa: E402
from mokv.compiler_output import filter_collection_warnings  # noqa: E402
from mokv.config.params import KVCacheParams  # noqa: E402
from mokv.config.quantization import KVCacheQuantization  # noqa: E402
from mokv.layouts import PAGED, FetchPagedKVCacheCollection  # noqa: E402
from mokv.ops import flash_attention, fused_qkv_matmul, kernels_path, store_kv  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from _virtual_gpu_load import load_then_execute  # type: ignore[import-not-found]  # noqa: E402


def main() -> None:
    gpu = Accelerator()
    dev = DeviceRef.GPU()
    params = KVCacheParams(dtype=DType.float8_e4m3fn, n_kv_heads=2, head_dim=128, page_size=128,
                           quantization=KVCacheQuantization())
    n_q, hidden, layers = 8, 256, 2
    paged = PAGED.input_symbols(params, layers, 64, dev)
    ht = TensorType(DType.bfloat16, ["total_tokens", hidden], device=dev)
    wt = TensorType(DType.bfloat16, [(n_q + 4) * 128, hidden], device=dev)
    kt = TensorType(DType.bfloat16, ["total_tokens", 2, 128], device=dev)
    ot = TensorType(DType.uint32, ["num_offsets"], device=dev)
    ft = TensorType(DType.float32, [64, 128], device=dev)
    with Graph("virtual_gpu_fp8", input_types=[*paged, ht, wt, kt, ot, ft],
               custom_extensions=[kernels_path()]) as g:
        p_in, (h, w, k, off, freqs) = g.inputs[:len(paged)], g.inputs[len(paged):]
        kv = FetchPagedKVCacheCollection(params, layers)(*p_in)
        store_kv(kv, k, k, off, 0)
        q = fused_qkv_matmul(kv, h, w, off, 1, n_q, freqs_cis=freqs)
        q3 = ops.reshape(q, [q.shape[0], n_q, 128])
        g.output(flash_attention(kv, q3, off, 1, 0.08))
    with filter_collection_warnings():
        load_then_execute(InferenceSession(devices=[CPU(), gpu]), g)


if __name__ == "__main__":
    main()
    os._exit(0)  # as _virtual_gpu_build.py: skip the shutdown that can abort
