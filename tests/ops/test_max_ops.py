"""MAX's own graph ops on mokv's caches: a two-layer graph of MAX's `AttentionWithRope`
(`max.nn`: a QKV matmul, `rope_split_store_ragged`, `flash_attention_ragged`, o_proj)
run on a mokv manager's inputs in MAX's form (`manager.max_inputs(manager.fetch(...))`).

Over prefill, decode, a prefill on a cached prefix and a prefix found again after its
request was released, every output row equals
- a numpy reference that recomputes each sequence from its tokens (no cache at all), and
- the same two layers built from mokv's own ops (`fused_qkv_matmul` with RoPE,
  `flash_attention`) on the same weights, on a second manager given the same calls.

The extra inputs are checked against the helpers MAX's own manager builds them with.
"""

from __future__ import annotations

import mokv
import numpy as np
import pytest
from max import tree
from max.driver import CPU, Buffer
from max.dtype import DType
from max.graph import DeviceRef, Graph, TensorType, Weight, ops
from mokv import TextContext
from mokv.layouts.max_paged import lookup_table_width
from mokv.ops import flash_attention, fused_qkv_matmul, rope_freqs_cis

from ._max_layers import Dims, build_graph, build_layers

DIMS = Dims()
HIDDEN, N_HEADS, N_KV_HEADS, HEAD_DIM = DIMS.hidden, DIMS.n_heads, DIMS.n_kv_heads, DIMS.head_dim
NUM_LAYERS, MAX_SEQ_LEN = DIMS.num_layers, DIMS.max_seq_len


def build_mokv_graph(manager) -> Graph:
    """The same two layers on mokv's ops, on a fetcher's collection; the weights are
    `wqkv.<i>` (Q, K, V rows) and `wo_t.<i>` (o_proj transposed)."""
    (symbols,) = manager.input_symbols()
    cpu = DeviceRef.CPU()
    input_types = [*symbols, TensorType(DType.float32, ["tokens", HIDDEN], device=cpu),
                   TensorType(DType.uint32, ["batch_plus_1"], device=cpu),
                   TensorType(DType.float32, [MAX_SEQ_LEN, HEAD_DIM], device=cpu)]
    with Graph("mokv_attention", input_types=input_types) as graph:
        kv = manager.layout.fetch(manager.params, NUM_LAYERS, *graph.inputs[:4])
        h, offsets, freqs_cis = (v.tensor for v in graph.inputs[4:])
        q_size = N_HEADS * HEAD_DIM
        for i in range(NUM_LAYERS):
            wqkv = Weight(f"wqkv.{i}", DType.float32, [q_size + 2 * N_KV_HEADS * HEAD_DIM, HIDDEN],
                          device=cpu)
            q = fused_qkv_matmul(kv, h, wqkv, offsets, i, N_HEADS, freqs_cis=freqs_cis)
            attn = flash_attention(kv, ops.reshape(q, [-1, N_HEADS, HEAD_DIM]), offsets, i,
                                   scale=HEAD_DIM**-0.5)
            wo_t = Weight(f"wo_t.{i}", DType.float32, [q_size, HIDDEN], device=cpu)
            h = h + ops.reshape(attn, [-1, q_size]) @ wo_t
        graph.output(h)
    return graph


def rope(x: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE of `x [tokens, heads, head_dim]` at `positions`."""
    angles = positions[:, None] * DIMS.inverse_frequencies()[None, :]
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    lo, hi = x[..., : HEAD_DIM // 2], x[..., HEAD_DIM // 2:]
    return np.concatenate([lo * cos - hi * sin, hi * cos + lo * sin], axis=-1)


def reference(tokens: np.ndarray, embed: np.ndarray, weights: dict) -> np.ndarray:
    """Every row's output for one sequence, recomputed from its tokens in float64."""
    h = embed[tokens].astype(np.float64)
    positions = np.arange(len(tokens))
    group = N_HEADS // N_KV_HEADS
    for i in range(NUM_LAYERS):
        w = {k: weights[f"{i}.{k}.weight"].astype(np.float64) for k in ("q_proj", "k_proj", "v_proj", "o_proj")}
        q = rope((h @ w["q_proj"].T).reshape(-1, N_HEADS, HEAD_DIM), positions)
        k = rope((h @ w["k_proj"].T).reshape(-1, N_KV_HEADS, HEAD_DIM), positions)
        v = (h @ w["v_proj"].T).reshape(-1, N_KV_HEADS, HEAD_DIM)
        out = np.empty_like(q)
        for head in range(N_HEADS):
            scores = q[:, head] @ k[:, head // group].T / np.sqrt(HEAD_DIM)
            scores[np.triu_indices(len(tokens), 1)] = -np.inf
            p = np.exp(scores - scores.max(axis=1, keepdims=True))
            out[:, head] = (p / p.sum(axis=1, keepdims=True)) @ v[:, head // group]
        h = h + out.reshape(len(tokens), -1) @ w["o_proj"].T
    return h


def make_manager(session, params: mokv.KVCacheParams) -> mokv.PagedKVCacheManager:
    return mokv.PagedKVCacheManager(
        params, 4, MAX_SEQ_LEN, NUM_LAYERS, [CPU()], session,
        available_cache_memory=24 * params.bytes_per_page(NUM_LAYERS), enable_runtime_checks=True)


def test_max_attention_layers_on_a_mokv_manager(session):
    params = DIMS.kv_params(enable_prefix_caching=True)
    manager, twin = make_manager(session, params), make_manager(session, params)
    rng = np.random.default_rng(0)
    layers = build_layers(DIMS, params, DeviceRef.CPU())
    layers.load_state_dict({
        name: (0.1 * rng.standard_normal([int(d) for d in w.shape])).astype(np.float32)
        for name, w in layers.raw_state_dict().items()
    })
    weights = {k: np.asarray(v) for k, v in layers.state_dict().items()}
    graph = build_graph(DIMS, manager, layers, DeviceRef.CPU())
    model = session.load(graph, weights_registry=layers.state_dict())
    mokv_weights = {}
    for i in range(NUM_LAYERS):
        mokv_weights[f"wqkv.{i}"] = np.concatenate(
            [weights[f"{i}.{k}.weight"] for k in ("q_proj", "k_proj", "v_proj")])
        mokv_weights[f"wo_t.{i}"] = np.ascontiguousarray(weights[f"{i}.o_proj.weight"].T)
    with mokv.filter_collection_warnings():
        mokv_model = session.load(build_mokv_graph(twin), weights_registry=mokv_weights)
    embed = rng.standard_normal((1000, HIDDEN)).astype(np.float32)
    freqs = Buffer.from_numpy(DIMS.max_freqs_cis())
    mokv_freqs = Buffer.from_numpy(rope_freqs_cis(HEAD_DIM, MAX_SEQ_LEN))

    def step(batch: list[TextContext], twin_batch: list[TextContext]) -> list[int]:
        """Runs one step on both managers; returns where each request's cache ended."""
        for m, group in ((manager, batch), (twin, twin_batch)):
            for ctx in group:
                assert m.maybe_reserve(ctx)
        starts = [c.start_idx for c in batch]
        assert [c.start_idx for c in twin_batch] == starts
        rows = np.concatenate([embed[ctx.next_tokens] for ctx in batch])
        offsets = np.concatenate([[0], np.cumsum([ctx.active_length for ctx in batch])])
        step_inputs = [Buffer.from_numpy(rows), Buffer.from_numpy(offsets.astype(np.uint32))]
        (inputs,) = manager.max_inputs(manager.fetch(batch))
        out = model.execute(*tree.leaves(inputs), *step_inputs, freqs)[0].to_numpy()
        (twin_inputs,) = twin.fetch(twin_batch)
        mokv_out = mokv_model.execute(*twin_inputs, *step_inputs, mokv_freqs)[0].to_numpy()
        np.testing.assert_allclose(out, mokv_out, rtol=1e-4, atol=1e-4)
        for b, ctx in enumerate(batch):
            expected = reference(ctx.tokens[: ctx.active_idx], embed, weights)[ctx.start_idx:]
            np.testing.assert_allclose(out[offsets[b]:offsets[b + 1]], expected, rtol=2e-4, atol=2e-4)
        for ctx, twin_ctx in zip(batch, twin_batch):
            token = int(rng.integers(0, 1000))
            ctx.update(token)
            twin_ctx.update(token)
        manager.step(batch)
        twin.step(twin_batch)
        return starts

    def claim(tokens: np.ndarray) -> tuple[TextContext, TextContext]:
        pair = TextContext(tokens), TextContext(tokens)
        manager.external_claim(pair[0].request_id)
        twin.external_claim(pair[1].request_id)
        return pair

    system = np.arange(100, 140)  # 40 tokens: two full pages of 16
    a = claim(system)
    step([a[0]], [a[1]])  # prefill
    b = claim(np.concatenate([system[:32], [7, 8, 9, 10, 11]]))
    c = claim(np.arange(20))
    # decode + a prefill on a's two cached pages + a fresh prefill
    assert step(*zip(a, b, c)) == [40, 32, 0]
    step(*zip(a, b, c))
    manager.release(a[0].request_id)
    twin.release(a[1].request_id)
    d = claim(np.concatenate([system, [1, 2]]))
    assert step(*zip(b, d)) == [38, 32]  # a's pages found again after its release
    for _ in range(3):
        step(*zip(b, c, d))


def test_the_extra_inputs_are_the_ones_maxs_manager_builds(session):
    from max.nn.kv_cache import MHAKVCacheParams, build_max_lengths_tensors, padded_lut_cols

    assert [lookup_table_width(n) for n in range(1, 300)] == [padded_lut_cols(n) for n in range(1, 300)]
    manager = make_manager(session, DIMS.kv_params())
    a, b = TextContext(np.arange(40)), TextContext(np.arange(3))
    for ctx in (a, b):
        manager.external_claim(ctx.request_id)
    (inputs,) = manager.max_inputs(manager.fetch([a, b]))
    # MAX's manager: max prompt length = most new tokens, max cache length = most
    # cache + new tokens, from `build_max_lengths_tensors`; the MHA dispatch metadata
    # from its `MHAKVCacheParams.resolve_attn_key(...).pack_into(...)`.
    max_prompt, max_cache = build_max_lengths_tensors(40, 40)
    assert inputs.max_prompt_length.to_numpy().tolist() == max_prompt.to_numpy().tolist() == [40]
    assert inputs.max_cache_length.to_numpy().tolist() == max_cache.to_numpy().tolist() == [40]
    max_params = MHAKVCacheParams(dtype=DType.float32, head_dim=HEAD_DIM, num_layers=NUM_LAYERS,
                                  devices=[DeviceRef.CPU()], n_kv_heads=N_KV_HEADS,
                                  page_size=DIMS.page_size)
    metadata = np.zeros(4, np.int64)
    max_params.resolve_attn_key(2, 40, 40).pack_into(metadata, 40)
    assert inputs.attention_dispatch_metadata.to_numpy().tolist() == metadata.tolist()
    assert inputs.page_stride.to_numpy().tolist() == [-1]
    assert inputs.lookup_table.shape == (2, padded_lut_cols(3))
    assert inputs.kv_blocks is manager.replicas[0].blocks[0]
    (symbols,) = manager.max_input_symbols()
    assert [(t.dtype, t.rank) for t in tree.leaves(symbols)] == [
        (b.dtype, b.rank) for b in tree.leaves(inputs)]
    with pytest.raises(TypeError, match="paged"):
        cont = mokv.ContinuousKVCacheManager(
            mokv.KVCacheParams(DType.float32, N_KV_HEADS, HEAD_DIM, cache_strategy="continuous"),
            2, 32, NUM_LAYERS, [CPU()], session)
        cont.max_input_symbols()
