"""The DeepSeek-V2-Lite-shaped MLA decoder (graphs/mla_decoder.py) on a mokv MLA cache:
its logits over prefill, decode steps and prefix hits equal the un-absorbed numpy
float64 model without a cache, and the cached run equals an uncached one; and Hugging
Face transformers' DeepSeek-V2 on the same weights (an HF checkpoint, graphs/mla_hf.py)
gives the same logits over its own prefill and cached decode. That test needs torch (the
`hf` extra, which `make test` installs); without it, it skips, except under CI (CI=true),
where it fails: CI runs `make test`."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import mokv
import numpy as np
import pytest
from max import tree
from max.driver import CPU, Buffer
from max.dtype import DType
from mokv import TextContext
from mokv_graphs.mla_decoder import (
    MLADecoderConfig,
    build_mla_decoder_graph,
    init_mla_weights,
    mla_reference_logits,
    rope_tables,
)
from mokv_graphs.mla_hf import write_hf_checkpoint

from ..child_env import child_env

CONFIG = MLADecoderConfig()
PAGE = 4


def make_manager(session, prefix_caching=True):
    c = CONFIG
    params = mokv.KVCacheParams(
        DType.float32, 1, c.kv_lora_rank + c.qk_rope_head_dim, page_size=PAGE,
        enable_prefix_caching=prefix_caching, groups=(c.cache_group(),),
    )
    return mokv.PagedKVCacheManager(
        params, max_batch_size=4, max_seq_len=64, num_layers=c.num_layers, devices=[CPU()],
        session=session, available_cache_memory=64 * params.bytes_per_page(c.num_layers),
        page_size=PAGE,
    )


@pytest.fixture(scope="module")
def model(session):
    weights = init_mla_weights(CONFIG, seed=3)
    cos, sin = rope_tables(CONFIG)
    registry = weights | {"rope.cos": cos.astype(np.float32), "rope.sin": sin.astype(np.float32)}
    graph = build_mla_decoder_graph(CONFIG, make_manager(session).max_input_symbols()[0])
    # The session keeps views of the arrays: the registry lives as long as the model.
    return session.load(graph, weights_registry=registry), registry


def step(model, manager, batch) -> np.ndarray:
    """One ragged step of `batch` (claimed contexts) through the cache."""
    compiled, _ = model
    cache = manager.max_inputs(manager.fetch(batch), mla_q_heads=CONFIG.n_heads)
    tokens = np.concatenate([ctx.next_tokens for ctx in batch]).astype(np.int64)
    positions = np.concatenate([np.arange(ctx.start_idx, ctx.active_idx) for ctx in batch])
    offsets = np.cumsum([0] + [len(ctx.next_tokens) for ctx in batch]).astype(np.uint32)
    (logits,) = compiled.execute(
        Buffer.from_numpy(tokens), Buffer.from_numpy(positions.astype(np.int64)),
        Buffer.from_numpy(offsets), *tree.leaves(cache[0]),
    )
    return logits.to_numpy()


def test_prefill_decode_and_prefix_hits_equal_the_numpy_model(session, model):
    _, weights = model
    manager = make_manager(session)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, CONFIG.vocab_size, n) for n in (11, 6)]
    batch = [TextContext(p, f"r{i}") for i, p in enumerate(prompts)]
    for ctx in batch:
        manager.external_claim(ctx.request_id)
    generated = [list(p) for p in prompts]
    for _ in range(6):  # a mixed prefill, then decode steps across page boundaries
        logits = step(model, manager, batch)
        for row, ctx, seq in zip(logits, batch, generated):
            np.testing.assert_allclose(
                row, mla_reference_logits(CONFIG, weights, seq), atol=1e-4, rtol=1e-4
            )
            token = int(np.argmax(row))
            seq.append(token)
            ctx.update(token)
        manager.step(batch)
    manager.release("r0")
    # A prefix hit: the first 16 tokens of r0's sequence are cached pages.
    again = TextContext(np.array(generated[0][:16] + [5, 7]), "hit")
    manager.external_claim("hit")
    assert manager.maybe_reserve(again) and again.start_idx == 16
    (logits,) = step(model, manager, [again])
    want = mla_reference_logits(CONFIG, weights, generated[0][:16] + [5, 7])
    np.testing.assert_allclose(logits, want, atol=1e-4, rtol=1e-4)


def test_a_cached_run_equals_an_uncached_one(session, model):
    """Decode steps through the cache give the logits of a fresh prefill of the whole
    sequence each time (a new request on a cache without prefix caching)."""
    cached, uncached = make_manager(session), make_manager(session, prefix_caching=False)
    seq = list(np.random.default_rng(1).integers(0, CONFIG.vocab_size, 9))
    ctx = TextContext(np.array(seq), "c")
    cached.external_claim("c")
    for i in range(5):
        (row,) = step(model, cached, [ctx])
        fresh = TextContext(np.array(seq), f"u{i}")
        uncached.external_claim(fresh.request_id)
        (want,) = step(model, uncached, [fresh])
        uncached.release(fresh.request_id)
        np.testing.assert_allclose(row, want, atol=1e-5, rtol=1e-5)
        token = int(np.argmax(row))
        seq.append(token)
        ctx.update(token)
        cached.step([ctx])


def test_hugging_face_deepseek_v2_gives_the_same_logits(session, model, tmp_path: Path):
    """transformers' DeepseekV2ForCausalLM, loaded from an HF checkpoint of the decoder's
    weights (float32, eager attention, its own DynamicCache), against mokv's cached
    decoder: a prompt's prefill, then greedy decode steps, logits within 1e-4."""
    if os.environ.get("CI") == "true" and importlib.util.find_spec("torch") is None:
        pytest.fail("CI=true: this test must run; make test installs torch (the hf extra)")
    torch = pytest.importorskip("torch", reason="the hf extra installs torch (make test does)")
    from transformers import DeepseekV2ForCausalLM

    _, registry = model
    weights = {name: registry[name] for name in CONFIG.weight_shapes()}
    path = write_hf_checkpoint(CONFIG, weights, tmp_path / "deepseek-v2-tiny")
    hf = DeepseekV2ForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    manager = make_manager(session)
    prompt = np.random.default_rng(2).integers(0, CONFIG.vocab_size, 10)
    ctx = TextContext(prompt, "hf")
    manager.external_claim("hf")
    with torch.no_grad():
        out = hf(torch.from_numpy(prompt[None].astype(np.int64)), use_cache=True)
        for _ in range(6):
            (ours,) = step(model, manager, [ctx])
            theirs = out.logits[0, -1].numpy()
            np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=1e-4)
            token = int(np.argmax(ours))
            ctx.update(token)
            manager.step([ctx])
            out = hf(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)


def test_the_gpu_deepseek_script_writes_its_checkpoint_and_imports():
    """benchmarks/gpu/deepseek.py runs MAX's deepseekV2 pipeline on a GPU only; here it
    writes its checkpoint, imports the pipeline and reads the config back."""
    root = Path(__file__).parents[2]
    proc = subprocess.run([sys.executable, "benchmarks/gpu/deepseek.py", "--check"], cwd=root,
                          capture_output=True, text=True, timeout=600, env=child_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "CHECKED DeepseekV2ForCausalLM deepseek_v2 512" in proc.stdout
