"""MAX's own Gemma 3 attention layers (`Gemma3Attention`: three sliding-window layers
and one full-attention layer, with residuals) over a mokv cache of a sliding-window and
a full group, against the same graph on MAX 26.7's own (Jenga) manager, on the CPU in
float32: prefill, decode past several windows, a prefix hit, a window that crosses
pages. The graph takes MAX's input tree as Gemma 3's does (`unflatten_basic_kv_tree`),
so the same compiled model serves both managers."""

from __future__ import annotations

import numpy as np
from max import tree
from max.driver import Buffer
from max.dtype import DType
from max.graph import DeviceRef, Graph, TensorType
from max.nn import LayerList
from max.nn.kv_cache import MultiKVCacheParams
from max.nn.rotary_embedding import Llama3RotaryEmbedding
from max.pipelines.architectures.gemma3.layers.attention import Gemma3Attention

from .conftest import max_context
from .test_groups import loaders, max_params

WINDOW = 160  # MAX's CPU kernel masks 128 scores at a time: a window of at least 128
HIDDEN, N_HEADS, N_KV_HEADS, HEAD_DIM = 64, 4, 2, 16
PATTERN = ["sliding_attention"] * 3 + ["full_attention"]  # Gemma 3's 5:1, shortened


def gemma3_params() -> MultiKVCacheParams:
    return MultiKVCacheParams.from_params({
        "sliding_attention": max_params(num_layers=3, window_size=WINDOW),
        "full_attention": max_params(num_layers=1),
    })


def make_layers(params: MultiKVCacheParams) -> LayerList:
    """MAX's layers in `PATTERN`, each numbered within its group as Gemma 3 numbers them."""
    cpu = DeviceRef.CPU()
    rope = Llama3RotaryEmbedding(HIDDEN, N_HEADS, 10000.0, 1024, head_dim=HEAD_DIM, interleaved=False)
    counts = {"sliding_attention": 0, "full_attention": 0}
    layers = []
    for kind in PATTERN:
        layers.append(Gemma3Attention(
            rope_global=rope, rope_local=rope, num_attention_heads=N_HEADS,
            num_key_value_heads=N_KV_HEADS, hidden_size=HIDDEN,
            kv_params=params.children[kind], layer_idx=counts[kind],
            is_sliding=kind == "sliding_attention", dtype=DType.float32, devices=[cpu],
            local_window_size=WINDOW))
        counts[kind] += 1
    return LayerList(layers)


def build_graph(params: MultiKVCacheParams, stack: LayerList) -> Graph:
    cpu = DeviceRef.CPU()
    cache_types = tree.leaves(params.get_symbolic_inputs())
    input_types = [*cache_types, TensorType(DType.float32, ["tokens", HIDDEN], device=cpu),
                   TensorType(DType.uint32, ["batch_plus_1"], device=cpu)]
    with Graph("gemma3_attention", input_types=input_types) as graph:
        sliding, full = params.unflatten_basic_kv_tree(iter(graph.inputs[: len(cache_types)]))
        collections = {"sliding_attention": sliding[0], "full_attention": full[0]}
        h, offsets = (v.tensor for v in graph.inputs[len(cache_types):])
        for kind, layer in zip(PATTERN, stack):
            h = h + layer(h, collections[kind], input_row_offsets=offsets)
        graph.output(h)
    return graph


def random_weight(rng, weight) -> Buffer:
    """0.2 N(0, 1) in the weight's dtype: Gemma 3's q and k norms are bfloat16 (MAX's
    layer casts them to the activations' dtype)."""
    values = (0.2 * rng.standard_normal([int(d) for d in weight.shape])).astype(np.float32)
    if weight.dtype == DType.bfloat16:
        return Buffer.from_numpy((values.view(np.uint32) >> 16).astype(np.uint16)).view(DType.bfloat16)
    return Buffer.from_numpy(values)


def test_gemma3_attention_on_a_mokv_cache_equals_max_s_own_manager(session):
    params = gemma3_params()
    layers = make_layers(params)
    rng = np.random.default_rng(3)
    layers.load_state_dict({name: random_weight(rng, w) for name, w in layers.raw_state_dict().items()})
    model = session.load(build_graph(params, layers), weights_registry=layers.state_dict())
    embed = rng.standard_normal((300, HIDDEN)).astype(np.float32)
    theirs, ours = loaders(session, params, pages=200)

    def step(batch: dict) -> None:
        """One step of the same requests (allocated) on both managers: the outputs agree;
        then each request's next step is allocated."""
        outs = []
        for manager, contexts in batch.items():
            rows = np.concatenate([embed[ctx.tokens.active % 300] for ctx in contexts])
            offsets = np.cumsum([0] + [ctx.tokens.active_length for ctx in contexts]).astype(np.uint32)
            inputs = tree.leaves(manager.runtime_inputs([contexts]))
            out = model.execute(*inputs, Buffer.from_numpy(rows), Buffer.from_numpy(offsets))[0]
            outs.append(out.to_numpy().copy())  # a copy: the next run must not touch it
        positions = [ctx.tokens.processed_length for ctx in batch[ours]]
        np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-5,
                                   err_msg=f"requests at {positions}")
        token = int(rng.integers(3, 256))
        for manager, contexts in batch.items():
            for ctx in contexts:
                ctx.update(token)
                manager.step(ctx)
                manager.alloc(ctx)

    a = {m: max_context(range(200, 460)) for m in (theirs, ours)}  # 400 tokens: 4 pages
    for m, ctx in a.items():
        m.claim(ctx)
        m.alloc(ctx)
    step({m: [ctx] for m, ctx in a.items()})  # prefill past the window
    b = {m: max_context(range(200, 330)) for m in (theirs, ours)}  # a's first two pages
    for m, ctx in b.items():
        m.claim(ctx)
        m.alloc(ctx)
        assert ctx.cached_prefix_length == 256, ctx.cached_prefix_length  # a joint hit
    step({m: [a[m], b[m]] for m in (theirs, ours)})
    for _ in range(150):  # a decodes from 401 to 550: its window crosses pages 3 and 4
        step({m: [a[m], b[m]] for m in (theirs, ours)})
    for m in (theirs, ours):
        m.shutdown()
