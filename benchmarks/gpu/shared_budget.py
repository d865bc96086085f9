"""A cache of groups on one shared budget, on a GPU (issue 52, item 6): each group's
buffer is a view of one uint8 allocation on the device (`groups/budget.py`). Checks that
the views alias the allocation there as on the CPU, and that a bfloat16 cache of a
sliding and a full group of different page sizes serves two requests whose slots move
between the groups.

    python benchmarks/gpu/shared_budget.py [--cpu]     # exits 1 on a mismatch
"""

from __future__ import annotations

import sys

import mokv
import numpy as np
from max.driver import CPU, Accelerator, Buffer
from max.dtype import DType
from max.engine import InferenceSession


def main(device) -> None:
    slab = Buffer(DType.uint8, [4 * 256], device=device)
    wide = slab.view(DType.bfloat16, [4, 2, 1, 4, 2, 8])  # 256-byte pages
    narrow = slab.view(DType.float32, [8, 2, 1, 4, 1, 4])  # 128-byte pages
    values = np.arange(8 * 32, dtype=np.float32).reshape(8, 2, 1, 4, 1, 4)
    narrow.inplace_copy_from(Buffer.from_numpy(values).to(device))
    back = np.frombuffer(wide.to(CPU()).view(DType.uint8, [1024]).to_numpy().tobytes(), np.float32)
    assert (back == values.reshape(-1)).all(), "views of one allocation do not alias"

    params = mokv.KVCacheParams(
        dtype=DType.bfloat16, n_kv_heads=2, head_dim=16, page_size=4, enable_prefix_caching=True,
        groups=(mokv.CacheGroupConfig("sliding", 5, window_size=6),
                mokv.CacheGroupConfig("full", 1, n_kv_heads=1)),
    )
    session = InferenceSession(devices=[device])
    manager = mokv.PagedKVCacheManager(
        params, max_batch_size=2, max_seq_len=64, num_layers=6, devices=[device],
        session=session, available_cache_memory=24 * 5 * 2 * 4 * 2 * 16 * 2, page_size=4,
        enable_runtime_checks=True,
    )
    budget = manager.replicas[0].budget
    assert budget is not None
    assert budget.ratios == [1, 10] and budget.num_slots == 24, (budget.ratios, budget.num_slots)
    a, b = mokv.TextContext(np.arange(40), "a"), mokv.TextContext(np.arange(100, 140), "b")
    for ctx in (a, b):
        manager.external_claim(ctx.request_id)
        inputs = manager.fetch([ctx])
        assert [i.blocks.shape[0] for i in inputs] == [24, 240], [i.blocks.shape for i in inputs]
        ctx.update(1)
        manager.step([ctx])
    manager.release(a.request_id)
    manager.release(b.request_id)
    manager.check_invariants()
    assert manager.num_free_blocks == manager.total_num_pages == 24
    print(f"shared budget on {device}: views alias; the groups had {budget.num_owned} of 24 slots")


if __name__ == "__main__":
    main(CPU() if "--cpu" in sys.argv else Accelerator())
