"""Subprocess body of test_virtual_gpu.py's MAX-layers test: the model of _max_layers.py
(MAX's `AttentionWithRope` on a mokv cache in MAX's form) compiled for a virtual GPU.

    python _virtual_gpu_max_build.py <api> <arch>      e.g. cuda sm_90

The cache inputs come from a `NullKVCacheManager` (compile-only mode: no memory) on the
virtual device, at the sizes MAX's GPU kernels take (bfloat16, head_dim 128, pages of
128). Prints COMPILED <seconds> after load and EXEC_REFUSED:<exception type> after
execute fails.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from max import driver

driver.set_virtual_device_api(sys.argv[1])
driver.set_virtual_device_target_arch(sys.argv[2])
driver.set_virtual_device_count(1)

import mokv  # noqa: E402
from max.driver import CPU, Accelerator  # noqa: E402
from max.dtype import DType  # noqa: E402
from max.engine import InferenceSession  # noqa: E402
from max.graph import DeviceRef  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
# tests/ops/_max_layers.py, found through sys.path above (this runs as a script)
from _max_layers import Dims, build_graph, build_layers  # type: ignore[import-not-found]  # noqa: E402
from _virtual_gpu_load import load_then_execute  # type: ignore[import-not-found]  # noqa: E402

DIMS = Dims(hidden=256, n_heads=8, n_kv_heads=2, head_dim=128, page_size=128, max_seq_len=256,
            dtype=DType.bfloat16)


def main() -> None:
    gpu = Accelerator()
    params = DIMS.kv_params()
    session = InferenceSession(devices=[CPU(), gpu])
    manager = mokv.NullKVCacheManager(params, 4, DIMS.max_seq_len, DIMS.num_layers, [gpu],
                                      session, available_cache_memory=0)
    layers = build_layers(DIMS, params, DeviceRef.GPU())
    weights = layers.state_dict()  # zeros: the weights' values do not matter here
    graph = build_graph(DIMS, manager, layers, DeviceRef.GPU())
    load_then_execute(session, graph, weights_registry=weights)


if __name__ == "__main__":
    main()
    # MAX 26.7 can abort while tearing down virtual devices at interpreter exit: leave
    # before that (see _virtual_gpu_build.py).
    os._exit(0)
