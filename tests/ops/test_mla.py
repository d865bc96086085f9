"""mokv's MLA kernels on the CPU (mla_store, then absorbed mla_attention), on both CPU
paths, against a numpy float64 reference of the un-absorbed formula: a batch mixing a
prefill after a cached prefix, a fresh prefill and decodes across key blocks, pages in
shuffled order, ten heads (a unit of eight and one of two)."""

from __future__ import annotations

import numpy as np
import pytest
from max import tree
from max.driver import Buffer
from max.dtype import DType
from max.graph import DeviceRef, Graph, TensorType
from mokv import CacheGroupConfig, KVCacheParams, max_cache_values
from mokv.layouts import PAGED, RaggedKVCacheInputs
from mokv.layouts.max_paged import max_input_symbols, max_runtime_inputs
from mokv.ops import mla_attention, mla_store, portable_cpu_paths

from .conftest import buffer, storage, values

LATENT, ROPE, NOPE, V_DIM, HEADS = 32, 16, 24, 20, 10
ROW = LATENT + ROPE
PAGE, LAYERS, LAYER, PAGES = 4, 2, 1, 40
CACHED, NEW = [9, 17, 0, 33], [5, 1, 7, 1]
SCALE = 1 / np.sqrt(NOPE + ROPE)
TOL = {DType.float32: 2e-5, DType.bfloat16: 3e-2}


def mla_params(dtype: DType) -> KVCacheParams:
    group = CacheGroupConfig("mla", LAYERS, latent_dim=LATENT, rope_dim=ROPE)
    return KVCacheParams(dtype, 1, ROW, page_size=PAGE, groups=(group,))


def build(dtype: DType) -> Graph:
    """Stores the step's latents into layer LAYER, then attends; outputs the latents."""
    symbols = max_input_symbols(
        PAGED.input_symbols(mla_params(dtype), LAYERS, 64, DeviceRef.CPU()), mla=True
    )
    cache_types = tree.leaves(symbols)
    cpu = DeviceRef.CPU()
    input_types = [
        *cache_types,
        TensorType(dtype, ["tokens", LATENT], device=cpu),
        TensorType(dtype, ["tokens", ROPE], device=cpu),
        TensorType(dtype, ["tokens", HEADS, ROW], device=cpu),
        TensorType(DType.uint32, ["batch_plus_1"], device=cpu),
    ]
    with Graph("mla_store_attention", input_types=input_types) as graph:
        cache = max_cache_values(graph.inputs[: len(cache_types)])
        latent, k_rope, q, offsets = (v.tensor for v in graph.inputs[len(cache_types) :])
        mla_store(cache, latent, k_rope, offsets, LAYER)
        graph.output(mla_attention(cache, q, offsets, LAYER, SCALE, ROPE))
    return graph


@pytest.fixture(scope="module")
def compiled(session):
    models = {}

    def get(dtype: DType, path: str):
        if (dtype, path) not in models:
            with portable_cpu_paths(session, portable=path == "portable"):
                models[dtype, path] = session.load(build(dtype))
        return models[dtype, path]

    return get


def reference(latents, ropes, q_nope, q_rope, w_uk, w_uv, tokens_of):
    """float64, un-absorbed: per head, keys [W_UK c ; r] and values W_UV c."""
    out = np.zeros((len(q_nope), HEADS, V_DIM))
    for t, (b, pos) in enumerate(tokens_of):
        c, r = latents[b][: pos + 1], ropes[b][: pos + 1]
        for h in range(HEADS):
            k_nope, v = c @ w_uk[h].T, c @ w_uv[h].T
            s = SCALE * (k_nope @ q_nope[t, h] + r @ q_rope[t, h])
            p = np.exp(s - s.max())
            out[t, h] = p @ v / p.sum()
    return out


@pytest.mark.parametrize(
    "dtype, path",
    [(DType.float32, "native"), (DType.float32, "portable"), (DType.bfloat16, "native")],
)
def test_store_then_absorbed_attention_is_the_un_absorbed_formula(compiled, dtype, path):
    rng = np.random.default_rng(54)
    batch = len(CACHED)
    blocks = storage(rng.standard_normal((PAGES, 1, LAYERS, PAGE, 1, ROW)), dtype)
    before = blocks.copy()
    page_order = rng.permutation(PAGES)
    per_seq = [-(-(c + n) // PAGE) for c, n in zip(CACHED, NEW)]
    table = np.zeros((batch, max(per_seq) + 16), np.uint32)
    starts = np.cumsum([0, *per_seq])
    for b in range(batch):
        table[b, : per_seq[b]] = page_order[starts[b] : starts[b + 1]]
    total = sum(NEW)
    latent = storage(rng.standard_normal((total, LATENT)), dtype)
    k_rope = storage(rng.standard_normal((total, ROPE)), dtype)
    w_uk = rng.standard_normal((HEADS, NOPE, LATENT)) / np.sqrt(LATENT)
    w_uv = rng.standard_normal((HEADS, V_DIM, LATENT)) / np.sqrt(LATENT)
    q_nope, q_rope = rng.standard_normal((total, HEADS, NOPE)), rng.standard_normal((total, HEADS, ROPE))
    absorbed = np.concatenate([np.einsum("hnc,thn->thc", w_uk, q_nope), q_rope], axis=2)
    offsets = np.cumsum([0, *NEW]).astype(np.uint32)
    max_lengths = np.array([[max(NEW), max(c + n for c, n in zip(CACHED, NEW))]], np.uint32)
    inputs = RaggedKVCacheInputs(
        blocks=buffer(blocks, dtype),
        cache_lengths=Buffer.from_numpy(np.array(CACHED, np.uint32)),
        lookup_table=Buffer.from_numpy(table),
        max_lengths=Buffer.from_numpy(max_lengths),
    )
    cache = tree.leaves(max_runtime_inputs(inputs, 1, mla_q_heads=HEADS))
    model = compiled(dtype, path)
    (out,) = model.execute(
        *cache,
        buffer(latent, dtype),
        buffer(k_rope, dtype),
        buffer(storage(absorbed, dtype), dtype),
        Buffer.from_numpy(offsets),
    )
    got = values((out.view(DType.uint16) if dtype == DType.bfloat16 else out).to_numpy(), dtype)

    # The store: each new row at its position, in its page; nothing else changed.
    latents, ropes, tokens_of = [], [], []
    expected = before.copy()
    for b in range(batch):
        rows = values(expected[table[b, : per_seq[b]], 0, LAYER, :, 0, :], dtype)
        rows = rows.reshape(-1, ROW)
        for i in range(NEW[b]):
            pos, t = CACHED[b] + i, offsets[b] + i
            slot = (table[b, pos // PAGE], 0, LAYER, pos % PAGE, 0)
            expected[slot] = np.concatenate([latent[t], k_rope[t]])
            rows[pos] = values(expected[slot], dtype)
            tokens_of.append((b, pos))
        latents.append(rows[:, :LATENT].astype(np.float64))
        ropes.append(rows[:, LATENT:].astype(np.float64))
    np.testing.assert_array_equal(blocks, expected)

    # The attention: W_UV applied to the kernel's latent outputs, against the formula.
    ours = np.einsum("hvc,thc->thv", w_uv, got.astype(np.float64))
    want = reference(latents, ropes, q_nope, q_rope, w_uk, w_uv, tokens_of)
    np.testing.assert_allclose(ours, want, atol=TOL[dtype], rtol=TOL[dtype])
