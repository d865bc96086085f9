"""The decoder runs on a cache owned by the Mojo manager and matches the uncached recompute.

The continuous decoder graph (compiled once for the Python manager's input types) is
fed the Mojo manager's `fetch`: its blocks are the Mojo-owned memory, so the graph's
K/V writes land in the Mojo manager's cache; `step` then commits them by sequence id.
"""

import mokv
import mokv_graphs as mg
import numpy as np
from max.driver import CPU

from .conftest import CONFIG, MAX_BATCH_SIZE, MAX_SEQ_LEN, PAGE_SIZE

ATOL = 2e-4


def test_requests_on_the_mojo_managers_cache(weights, session, continuous_model):
    params = CONFIG.kv_params("continuous", page_size=PAGE_SIZE, enable_prefix_caching=False)
    manager = mokv.MojoContinuousBatchingKVCacheManager(
        params, MAX_BATCH_SIZE, MAX_SEQ_LEN, CONFIG.num_layers, [CPU()], session
    )
    rng = np.random.default_rng(3)
    live: dict[int, mokv.TextContext] = {}

    def admit(n_tokens: int) -> None:
        (seq_id,) = manager.claim(1)
        live[seq_id] = mokv.TextContext(rng.integers(0, CONFIG.vocab_size, n_tokens))

    def step() -> None:
        seq_ids = list(live)
        batch = [live[s] for s in seq_ids]
        logits = continuous_model.execute(batch, manager.fetch(seq_ids))
        manager.step({s: len(live[s].next_tokens) for s in seq_ids})
        for seq_id, ctx, row in zip(seq_ids, batch, logits):
            ref = mg.reference_logits(CONFIG, weights, ctx.tokens[: ctx.active_idx])[-1]
            np.testing.assert_allclose(row, ref, atol=ATOL, rtol=0)
            ctx.update(int(np.argmax(row)))
            assert manager.cache_length(seq_id) == ctx.start_idx

    admit(21)
    admit(3)
    for _ in range(4):  # prefill both, then decode together
        step()
    # The graph wrote every committed token's K/V into the Mojo-owned memory, and
    # nothing past it (slot 1 was never used before).
    blocks = manager.blocks_array
    for seq_id, ctx in live.items():
        assert blocks[seq_id, :, :, : ctx.start_idx].any(axis=(0, 1, 3, 4)).all()
    assert not blocks[1, :, :, live[1].start_idx :].any()
    first = min(live)
    manager.release(first)
    del live[first]
    admit(7)  # takes the released slot: a new prompt over the old sequence's rows
    assert first in live
    for _ in range(3):
        step()
    for seq_id in list(live):
        manager.release(seq_id)
    assert manager.num_free_blocks == MAX_BATCH_SIZE
