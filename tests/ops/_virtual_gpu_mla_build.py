"""Subprocess body of test_virtual_gpu.py's MLA test: mokv's MLA store and, on a GPU,
MAX's MLA decode kernel over the same pages, compiled for a virtual GPU.

    python _virtual_gpu_mla_build.py <api> <arch>      e.g. cuda sm_90

DeepSeek's shapes (bfloat16, a latent of 512 and a RoPE key of 64, 16 query heads,
pages of 128), the cache inputs in MAX's MLA form (`max_input_symbols(mla=True)`).
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

from max import tree  # noqa: E402
from max.driver import CPU, Accelerator  # noqa: E402
from max.dtype import DType  # noqa: E402
from max.engine import InferenceSession  # noqa: E402
from max.graph import DeviceRef, Graph, TensorType  # noqa: E402
from mokv import CacheGroupConfig, KVCacheParams, max_cache_values  # noqa: E402
from mokv.layouts import PAGED  # noqa: E402
from mokv.layouts.max_paged import max_input_symbols  # noqa: E402
from mokv.ops import mla_attention, mla_store  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from _virtual_gpu_load import load_then_execute  # type: ignore[import-not-found]  # noqa: E402

LATENT, ROPE, HEADS, LAYERS = 512, 64, 16, 2


def main() -> None:
    gpu, dev = Accelerator(), DeviceRef.GPU()
    group = CacheGroupConfig("mla", LAYERS, latent_dim=LATENT, rope_dim=ROPE)
    params = KVCacheParams(DType.bfloat16, 1, LATENT + ROPE, page_size=128, groups=(group,))
    symbols = max_input_symbols(PAGED.input_symbols(params, LAYERS, 256, dev), mla=True)
    cache_types = tree.leaves(symbols)
    input_types = [
        *cache_types,
        TensorType(DType.bfloat16, ["tokens", LATENT], device=dev),
        TensorType(DType.bfloat16, ["tokens", ROPE], device=dev),
        TensorType(DType.bfloat16, ["tokens", HEADS, LATENT + ROPE], device=dev),
        TensorType(DType.uint32, ["batch_plus_1"], device=dev),
    ]
    with Graph("mla_on_gpu", input_types=input_types) as graph:
        cache = max_cache_values(graph.inputs[: len(cache_types)])
        latent, k_rope, q, offsets = (v.tensor for v in graph.inputs[len(cache_types) :])
        for layer in range(LAYERS):
            mla_store(cache, latent, k_rope, offsets, layer)
            out = mla_attention(cache, q, offsets, layer, 0.1, ROPE)
        graph.output(out)
    load_then_execute(InferenceSession(devices=[CPU(), gpu]), graph)


if __name__ == "__main__":
    main()
    # MAX 26.7 can abort while tearing down virtual devices at interpreter exit.
    os._exit(0)
