"""Subprocess body of test_virtual_gpu.py's MAX-MLA-layer test: MAX's own
`LatentAttentionWithRope` (the attention of MAX's deepseekV2 / V3 pipelines) on a mokv
MLA cache, compiled for a virtual GPU.

    python _virtual_gpu_max_mla_build.py <api> <arch>      e.g. cuda sm_90

MAX's layer takes bfloat16 weights only and its MLA kernels are GPU kernels, so it cannot
run on the CPU. Each of its graph modes ("auto": prefill and decode in one op, what a
pipeline builds by default; "decode": a decode-only server's, MAX's `decode_only`
pipeline role) is built twice: on the inputs of a mokv `NullKVCacheManager`
(`max_input_symbols`) and on those MAX's own `MLAKVCacheParams` declare
(`get_symbolic_inputs`, what MAX's own manager feeds); their texts must be equal (prints
SAME_GRAPH). Then mokv's decode graph loads (COMPILED <seconds>) and its execute is
refused (EXEC_REFUSED:<exception type>). Only that one compiles: equal texts compile
alike, and the decode kernels read the same cache values as the fused op. It costs 273 s
of CPU cold (2026-11-28, 2-core box at load 12-16), nearly all of it MAX's
JitCompileKernels pass (its pass timing), and as much again for a graph that differs in
the hidden size only: kernels compiled for one graph are not reused by the next. The
"auto" graph took 360 s at the same load (its prefill kernels too); a second layer adds
nothing but time.
DeepSeek-V2-Lite's attention shapes (16 heads of 128 + 64, values of 128, a latent of
512, no query compression) at a small hidden size, one layer, pages of 128.
"""

from __future__ import annotations

import os
import re
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
from max.graph import DeviceRef, Graph, TensorType  # noqa: E402
from max.nn import LayerList  # noqa: E402
from max.nn.attention import LatentAttentionWithRope  # noqa: E402
from max.nn.rotary_embedding import RotaryEmbedding  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from _max_layers import layers_graph  # type: ignore[import-not-found]  # noqa: E402
from _virtual_gpu_load import load_then_execute  # type: ignore[import-not-found]  # noqa: E402

HIDDEN, HEADS, NOPE, ROPE, V_DIM, LATENT = 256, 16, 128, 64, 128, 512
LAYERS, PAGE, MAX_SEQ = 1, 128, 256


def build(layers: LayerList, cache_symbols) -> Graph:
    return layers_graph(cache_symbols, layers,
                        TensorType(DType.bfloat16, ["tokens", HIDDEN], device=DeviceRef.GPU()),
                        TensorType(DType.float32, [MAX_SEQ, ROPE], device=DeviceRef.GPU()))


def mla_layers(max_params, graph_mode: str) -> LayerList:
    # Only `compute_scale` is read from the rope: the table itself is a graph input.
    rope = RotaryEmbedding(HIDDEN, HEADS, 10000.0, MAX_SEQ, head_dim=ROPE, interleaved=True)
    layers = LayerList([
        LatentAttentionWithRope(rope=rope, num_attention_heads=HEADS, num_key_value_heads=1,
                                hidden_size=HIDDEN, kv_params=max_params, dtype=DType.bfloat16,
                                devices=[DeviceRef.GPU()], kv_lora_rank=LATENT,
                                qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V_DIM,
                                buffer_size=MAX_SEQ, graph_mode=graph_mode)
        for _ in range(LAYERS)
    ])
    layers.state_dict()  # names the weights `<layer>.q_proj.weight`, ...
    return layers


def without_dim_names(graph: Graph) -> str:
    """The graph's text with its symbolic dims renamed in order of declaration: mokv names
    a cache's dims after its replica (`replica_0_batch_size`), MAX after its namespace
    (`mla_batch_size`)."""
    text = str(graph)
    declared = re.match(r"mo\.graph @\w+<([^>]*)>", text)
    assert declared is not None, text[:200]
    for i, name in enumerate(declared.group(1).split(", ")):
        text = re.sub(rf"\b{name}\b", f"dim{i}", text)
    return text


def main() -> None:
    gpu, dev = Accelerator(), DeviceRef.GPU()
    group = mokv.CacheGroupConfig("mla", LAYERS, latent_dim=LATENT, rope_dim=ROPE)
    params = mokv.KVCacheParams(DType.bfloat16, 1, LATENT + ROPE, page_size=PAGE, groups=(group,))
    max_params = mokv.max_kv_params(params, LAYERS, [dev], num_q_heads=HEADS)
    session = InferenceSession(devices=[CPU(), gpu])
    manager = mokv.NullKVCacheManager(params, 4, MAX_SEQ, LAYERS, [gpu], session,
                                      available_cache_memory=0, page_size=PAGE)
    for mode in ("auto", "decode"):  # the last one built is the one compiled
        layers = mla_layers(max_params, mode)
        ours = build(layers, manager.max_input_symbols()[0])
        theirs = build(mla_layers(max_params, mode), max_params.get_symbolic_inputs()[0])
        if without_dim_names(ours) != without_dim_names(theirs):
            print(f"GRAPHS_DIFFER {mode}", flush=True)
            return
    print("SAME_GRAPH", flush=True)
    load_then_execute(session, ours, weights_registry=layers.state_dict())


if __name__ == "__main__":
    main()
    # MAX 26.7 can abort while tearing down virtual devices at interpreter exit.
    os._exit(0)
