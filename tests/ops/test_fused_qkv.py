"""fused_qkv_matmul (+ RoPE) then flash_attention on its Q, against numpy."""

from __future__ import annotations

import numpy as np
import pytest
from max.dtype import DType
from mokv.ops import rope_freqs_cis

from .conftest import (
    LAYER,
    MAX_SEQ_LEN,
    Config,
    buffer,
    make_cache,
    plan_graphs,
    ref_attention,
    ref_rope,
    row_offsets,
    storage,
    values,
)

CASES = [
    # paged, f32, RoPE, GQA 4, head 64
    Config("paged", DType.float32, n_kv_heads=2, head_dim=64, group=4, page_size=16, hidden=96, rope=True),
    # continuous, bf16, no RoPE, GQA 8... head 128
    Config("continuous", DType.bfloat16, n_kv_heads=1, head_dim=128, group=8, hidden=64),
    # paged, bf16, RoPE, MHA, head 128
    Config("paged", DType.bfloat16, n_kv_heads=2, head_dim=128, group=1, page_size=8, hidden=128, rope=True),
    # hidden 600: two K chunks (512 + 88), each with a tail that is not a multiple of 16
    Config("paged", DType.float32, n_kv_heads=1, head_dim=64, group=2, page_size=16, hidden=600),
    # hidden 600 in bf16: the packed path widens the weights into an f32 strip per K
    # chunk of 256 (600 = 256 + 256 + 88); float32 (above) reads its rows in place
    Config("paged", DType.bfloat16, n_kv_heads=1, head_dim=64, group=2, page_size=16, hidden=600),
]
TOL = {DType.float32: 1e-4, DType.bfloat16: 3e-2}


# Token layouts (cache_lengths, new_tokens) for the CPU paths' tails. Fewer than 16
# tokens in all run the streaming path (4-token register blocks, then 1-3 leftover
# tokens); 16 or more run the packed path, whose blocks are 48 tokens (3 vectors),
# then a 32- or 16-token tail, in units of at most 512 tokens.
LAYOUTS = {
    "stream-8": ([0, 13, 40], [5, 1, 2]),  # 4-token block + 1 leftover, decode, 2 leftovers
    "packed-22": ([0, 13, 40], [19, 1, 2]),  # one 32-token tail block (10 zero columns)
    "packed-54": ([0, 13, 40], [50, 1, 3]),  # a 48-token block, then a 16-token tail
    "packed-537": ([0, 3], [530, 7]),  # two units: 512 tokens (48-blocks + 32), then 25
}
TAIL_CASES = [
    (CASES[3], "stream-8"), (CASES[3], "packed-54"), (CASES[3], "packed-537"),  # hidden 600
    (CASES[2], "stream-8"), (CASES[2], "packed-54"),  # bf16, RoPE
    (CASES[0], "stream-8"),  # f32, RoPE, head 64
    (CASES[4], "stream-8"), (CASES[4], "packed-537"),  # bf16, hidden 600
]
plan_graphs("qkv_attention", CASES)
plan_graphs("qkv_attention", [cfg for cfg, _ in TAIL_CASES], paths=("portable",))


def _ids(c: Config) -> str:
    return f"{c.strategy}-{c.dtype}-g{c.group}-d{c.head_dim}-h{c.hidden}-rope{int(c.rope)}"


@pytest.mark.parametrize("cfg", CASES, ids=_ids)
def test_fused_qkv_then_attention(compiled, cfg):
    _check(compiled, cfg, *LAYOUTS["packed-22"])  # prefill | decode | prefill on a prefix


@pytest.mark.parametrize("cfg,layout", TAIL_CASES, ids=lambda x: x if isinstance(x, str) else _ids(x))
def test_fused_qkv_token_tails(compiled_each_path, cfg, layout):
    _check(compiled_each_path, cfg, *LAYOUTS[layout])


def _check(compiled, cfg: Config, cache_lengths: list[int], new_tokens: list[int],
           attn_tol: float | None = None) -> None:
    rng = np.random.default_rng(7)
    cache = make_cache(cfg.params, cache_lengths, new_tokens, rng)
    total, d = sum(new_tokens), cfg.head_dim
    hidden = storage(rng.standard_normal((total, cfg.hidden)).astype(np.float32) * 0.5, cfg.dtype)
    rows = (cfg.n_q + 2 * cfg.n_kv_heads) * d
    wqkv = storage(rng.standard_normal((rows, cfg.hidden)).astype(np.float32) / np.sqrt(cfg.hidden), cfg.dtype)
    offsets = row_offsets(new_tokens)
    freqs = rope_freqs_cis(d, MAX_SEQ_LEN)
    extra = [buffer(freqs)] if cfg.rope else []
    q_buf, attn_buf = compiled("qkv_attention", cfg).execute(
        *cache.buffers(), buffer(hidden, cfg.dtype), buffer(wqkv, cfg.dtype), buffer(offsets), *extra
    )
    as_np = lambda b: (b.view(DType.uint16) if cfg.dtype == DType.bfloat16 else b).to_numpy()  # noqa: E731
    q, attn = values(as_np(q_buf), cfg.dtype), values(as_np(attn_buf), cfg.dtype)

    # Reference projection in float64 from the (already rounded) inputs.
    proj = values(hidden, cfg.dtype).astype(np.float64) @ values(wqkv, cfg.dtype).astype(np.float64).T
    ref_q = proj[:, : cfg.n_q * d].reshape(total, cfg.n_q, d)
    ref_k = proj[:, cfg.n_q * d : (cfg.n_q + cfg.n_kv_heads) * d].reshape(total, cfg.n_kv_heads, d)
    ref_v = proj[:, (cfg.n_q + cfg.n_kv_heads) * d :].reshape(total, cfg.n_kv_heads, d)
    tol = TOL[cfg.dtype]
    for b in range(len(new_tokens)):
        for i, t in enumerate(range(offsets[b], offsets[b + 1])):
            pos = cache_lengths[b] + i
            if cfg.rope:
                ref_q[t], ref_k[t] = ref_rope(ref_q[t], pos, freqs), ref_rope(ref_k[t], pos, freqs)
            np.testing.assert_allclose(cache.rows(b, LAYER, 0, pos, pos + 1)[0], ref_k[t], atol=tol, rtol=tol)
            np.testing.assert_allclose(cache.rows(b, LAYER, 1, pos, pos + 1)[0], ref_v[t], atol=tol, rtol=tol)
    np.testing.assert_allclose(q.reshape(total, cfg.n_q, d), ref_q, atol=tol, rtol=tol)
    ref = ref_attention(q.reshape(total, cfg.n_q, d), cache, offsets, LAYER, 1.0 / np.sqrt(d))
    np.testing.assert_allclose(attn, ref, atol=attn_tol or tol, rtol=attn_tol or tol)
