"""Subprocess body of test_virtual_gpu.py's MAX-MLA-layer test: MAX's own
`LatentAttentionWithRope` (the attention of MAX's deepseekV2 / V3 pipelines) on a mokv
MLA cache, compiled for a virtual GPU.

    python _virtual_gpu_max_mla_build.py <api> <arch>      e.g. cuda sm_90

MAX's layer takes bfloat16 weights only and its MLA kernels (`mla_prefill_decode_graph`:
prefill and decode in one graph, as MAX's "auto" graph mode builds) are GPU kernels, so
it cannot run on the CPU. The same graph is built twice: on the inputs of a mokv
`NullKVCacheManager` (`max_input_symbols`) and on those MAX's own `MLAKVCacheParams`
declare (`get_symbolic_inputs`, what MAX's own manager feeds); their texts must be equal
(prints SAME_GRAPH), then mokv's one loads (COMPILED <seconds>) and its execute is
refused (EXEC_REFUSED:<exception type>). DeepSeek-V2-Lite's attention shapes (16 heads
of 128 + 64, values of 128, a latent of 512, no query compression) at a small hidden
size, two layers, pages of 128.
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
LAYERS, PAGE, MAX_SEQ = 2, 128, 256


def build(layers: LayerList, cache_symbols) -> Graph:
    return layers_graph(cache_symbols, layers,
                        TensorType(DType.bfloat16, ["tokens", HIDDEN], device=DeviceRef.GPU()),
                        TensorType(DType.float32, [MAX_SEQ, ROPE], device=DeviceRef.GPU()))


def mla_layers(max_params) -> LayerList:
    # Only `compute_scale` is read from the rope: the table itself is a graph input.
    rope = RotaryEmbedding(HIDDEN, HEADS, 10000.0, MAX_SEQ, head_dim=ROPE, interleaved=True)
    layers = LayerList([
        LatentAttentionWithRope(rope=rope, num_attention_heads=HEADS, num_key_value_heads=1,
                                hidden_size=HIDDEN, kv_params=max_params, dtype=DType.bfloat16,
                                devices=[DeviceRef.GPU()], kv_lora_rank=LATENT,
                                qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V_DIM,
                                buffer_size=MAX_SEQ)
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
    layers = mla_layers(max_params)
    ours = build(layers, manager.max_input_symbols()[0])
    theirs = build(mla_layers(max_params), max_params.get_symbolic_inputs()[0])
    same = without_dim_names(ours) == without_dim_names(theirs)
    print("SAME_GRAPH" if same else "GRAPHS_DIFFER", flush=True)
    load_then_execute(session, ours, weights_registry=layers.state_dict())


if __name__ == "__main__":
    main()
    # MAX 26.7 can abort while tearing down virtual devices at interpreter exit.
    os._exit(0)
