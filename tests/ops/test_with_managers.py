"""The kernels on inputs that the managers build: mixed batches over shared prefix pages.

Each request's K, V and Q rows are random; the test remembers every K/V row it fed
for each request and token position, and checks attention against numpy over exactly
those rows. A prefix hit must therefore read the rows the first request wrote into the
shared pages, and a request must never see another's rows. Rows are keyed by the token
prefix they belong to, so the requests here diverge at page boundaries or not at all.
"""

from __future__ import annotations

import mokv
import numpy as np
from max.driver import CPU, Buffer
from mokv import TextContext

from .conftest import MAX_SEQ_LEN, NUM_LAYERS
from .test_store_attention import CONT_F32_MHA, PAGED_F32_GQA4


class Run:
    """Feeds a manager's batches through the store+attention graph, recording K/V rows."""

    def __init__(self, model, cfg, rng):
        self.model, self.cfg, self.rng = model, cfg, rng
        self.rows: dict[tuple[bytes, int], tuple[np.ndarray, np.ndarray]] = {}

    def step(self, manager, batch: list[TextContext]) -> None:
        cfg = self.cfg
        new = [ctx.active_length for ctx in batch]
        offsets = np.concatenate([[0], np.cumsum(new)]).astype(np.uint32)
        k, v, q = (self.rng.standard_normal((int(offsets[-1]), h, cfg.head_dim)).astype(np.float32)
                   for h in (cfg.n_kv_heads, cfg.n_kv_heads, cfg.n_q))
        for b, ctx in enumerate(batch):
            for i, pos in enumerate(range(ctx.start_idx, ctx.active_idx)):
                self.rows[(ctx.tokens[: pos + 1].tobytes(), pos)] = (k[offsets[b] + i], v[offsets[b] + i])
        (inputs,) = manager.fetch(batch)
        (out,) = self.model.execute(*inputs, *(Buffer.from_numpy(a) for a in (k, v, q, offsets)))
        out = out.to_numpy()
        group = cfg.group
        for b, ctx in enumerate(batch):
            for i, pos in enumerate(range(ctx.start_idx, ctx.active_idx)):
                keys = np.stack([self.rows[(ctx.tokens[: t + 1].tobytes(), t)][0] for t in range(pos + 1)])
                vals = np.stack([self.rows[(ctx.tokens[: t + 1].tobytes(), t)][1] for t in range(pos + 1)])
                row = offsets[b] + i
                for h in range(cfg.n_q):
                    s = keys[:, h // group] @ q[row, h] / np.sqrt(cfg.head_dim)
                    p = np.exp(s - s.max())
                    np.testing.assert_allclose(out[row, h], p @ vals[:, h // group] / p.sum(),
                                               rtol=2e-4, atol=2e-5)
        for ctx in batch:
            ctx.update(int(self.rng.integers(0, 50)))
        manager.step(batch)


def test_paged_manager_inputs_with_prefix_hits(session, compiled):
    cfg = PAGED_F32_GQA4
    params = mokv.KVCacheParams(cfg.dtype, cfg.n_kv_heads, cfg.head_dim, page_size=cfg.page_size,
                                enable_prefix_caching=True)
    manager = mokv.PagedKVCacheManager(params, 4, MAX_SEQ_LEN, NUM_LAYERS, [CPU()], session,
                                       available_cache_memory=24 * params.bytes_per_page(NUM_LAYERS),
                                       page_size=cfg.page_size, enable_runtime_checks=True)
    run = Run(compiled("store_attention", cfg), cfg, np.random.default_rng(0))
    system = np.arange(100, 140)  # 40 tokens: pages 0 and 1 full
    a = TextContext(system)
    manager.claim(a.request_id)
    run.step(manager, [a])  # prefill
    b = TextContext(np.concatenate([system[:32], [7, 8, 9, 10, 11]]))
    c = TextContext(np.arange(20))
    for ctx in (b, c):
        manager.claim(ctx.request_id)
        manager.alloc(ctx)
    assert b.start_idx == 32  # two shared pages, reused
    assert manager.get_req_blocks(b.request_id)[:2] == manager.get_req_blocks(a.request_id)[:2]
    run.step(manager, [a, b, c])  # decode + prefill on a cached prefix + fresh prefill
    run.step(manager, [a, b, c])  # decode all three, b and c cross page boundaries later
    manager.release(a.request_id)
    d = TextContext(np.concatenate([system, [1, 2]]))
    manager.claim(d.request_id)
    manager.alloc(d)  # a's pages, freed but cached, are found again
    assert d.start_idx == 32
    run.step(manager, [b, d])


def test_continuous_manager_inputs(session, compiled):
    cfg = CONT_F32_MHA
    params = mokv.KVCacheParams(cfg.dtype, cfg.n_kv_heads, cfg.head_dim,
                                cache_strategy=mokv.KVCacheStrategy.CONTINUOUS)
    manager = mokv.ContinuousKVCacheManager(params, 3, MAX_SEQ_LEN, NUM_LAYERS, [CPU()], session)
    run = Run(compiled("store_attention", cfg), cfg, np.random.default_rng(1))
    a, b = TextContext(np.arange(9)), TextContext(np.arange(50, 53))
    for ctx in (a, b):
        manager.external_claim(ctx.request_id)
    run.step(manager, [a, b])
    c = TextContext(np.arange(30, 40))
    manager.external_claim(c.request_id)
    run.step(manager, [b, c, a])
