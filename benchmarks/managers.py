"""Adapters that give the scheduler loop one vocabulary over three KV cache managers.

- `MokvPaged`:      `mokv.PagedKVCacheManager` with its prefix cache on;
- `MokvContinuous`: `mokv.ContinuousBatchingKVCacheManager`, as many `max_seq_len`
                    slots as the same memory budget holds (no prefix cache);
- `MaxPaged`:       MAX 26.7's `max.pipelines.kv_cache.PagedKVCacheManager` with its
                    prefix cache on, driven the way MAX's own `TextBatchConstructor`
                    drives it (claim -> alloc -> runtime_inputs -> update -> step -> release).

Every adapter gets the same page budget (`budget_pages` pages of `page_size` tokens)
and the same tiny cache shape (the KV tensors are allocated but never touched: the
host-side cost does not depend on their size).
"""

from __future__ import annotations

from max.driver import CPU
from max.dtype import DType
from max.engine import InferenceSession

import mokv

SHAPE = dict(n_kv_heads=1, head_dim=16, num_layers=1)
_SESSION: InferenceSession | None = None


def session() -> InferenceSession:
    global _SESSION
    if _SESSION is None:
        _SESSION = InferenceSession(devices=[CPU()])
    return _SESSION


class _MokvBase:
    def new_context(self, req):
        return mokv.TextContext(req.prompt, request_id=f"r{req.rid}")

    def claim(self, ctx) -> bool:
        try:
            self.m.external_claim(ctx.request_id, 0)
        except mokv.BatchTooLargeError:
            return False
        return True

    def reserve(self, ctx) -> bool:
        return self.m.maybe_reserve(ctx, 1)

    def fetch(self, batch):
        return self.m.fetch(batch, 1)

    def step(self, batch) -> None:
        self.m.step(batch)

    def release(self, ctx) -> None:
        self.m.release(ctx.request_id)

    # Context-side calls (outside the timers).
    start = staticmethod(lambda ctx: ctx.start_idx)
    end = staticmethod(lambda ctx: ctx.end_idx)
    active = staticmethod(lambda ctx: ctx.active_length)
    chunk = staticmethod(lambda ctx, n: ctx.chunk(n))
    update = staticmethod(lambda ctx, tok: ctx.update(tok))
    reset = staticmethod(lambda ctx: ctx.reset())


class MokvPaged(_MokvBase):
    name = "mokv-paged"

    def __init__(self, budget_pages, max_batch, max_seq_len, page_size=128, prefix=True,
                 prefix_hash="builtin"):
        self.params = mokv.KVCacheParams(DType.float32, SHAPE["n_kv_heads"], SHAPE["head_dim"],
                                         page_size=page_size, enable_prefix_caching=prefix,
                                         prefix_hash=prefix_hash)
        memory = budget_pages * self.params.bytes_per_page(SHAPE["num_layers"])
        self.m = mokv.PagedKVCacheManager(self.params, max_batch, max_seq_len, SHAPE["num_layers"],
                                          [CPU()], session(), memory, page_size=page_size)
        self.total_pages = self.m.total_num_pages
        self.kv_bytes = self.total_pages * self.params.bytes_per_page(SHAPE["num_layers"])

    def used_pages(self) -> int:
        return self.total_pages - self.m.num_free_blocks


class MokvContinuous(_MokvBase):
    name = "mokv-continuous"

    def __init__(self, budget_pages, max_batch, max_seq_len, page_size=128, **_):
        self.params = mokv.KVCacheParams(DType.float32, SHAPE["n_kv_heads"], SHAPE["head_dim"],
                                         page_size=page_size,
                                         cache_strategy=mokv.KVCacheStrategy.CONTINUOUS)
        slots = max(1, min(max_batch, budget_pages * page_size // max_seq_len))
        self.pages_per_slot = -(-max_seq_len // page_size)
        self.m = mokv.ContinuousBatchingKVCacheManager(self.params, slots, max_seq_len,
                                                       SHAPE["num_layers"], [CPU()], session())
        self.total_pages = slots * self.pages_per_slot
        self.kv_bytes = slots * max_seq_len * self.params.bytes_per_token(SHAPE["num_layers"])

    def used_pages(self) -> int:
        return (self.m.max_cache_batch_size - self.m.num_free_blocks) * self.pages_per_slot


class MaxPaged:
    name = "max-paged"

    def __init__(self, budget_pages, max_batch, max_seq_len, page_size=128, prefix=True, **_):
        from max.graph import DeviceRef

        from maxcompat import load_max_pipelines

        Manager, Params, self._Ctx, self._Tokens, self._RID, self._Err = load_max_pipelines()
        params = Params(dtype=DType.float32, head_dim=SHAPE["head_dim"],
                        num_layers=SHAPE["num_layers"], devices=[DeviceRef.CPU()],
                        enable_prefix_caching=prefix, page_size=page_size,
                        n_kv_heads=SHAPE["n_kv_heads"])
        self.m = Manager(params=params, session=session(), total_num_pages=budget_pages,
                         max_batch_size=max_batch)
        self.max_seq_len = max_seq_len
        self.total_pages = budget_pages
        self.kv_bytes = (budget_pages + 1) * page_size * 2 * SHAPE["num_layers"] * \
            SHAPE["n_kv_heads"] * SHAPE["head_dim"] * 4

    def new_context(self, req):
        return self._Ctx(request_id=self._RID(f"r{req.rid}"), max_length=self.max_seq_len,
                         tokens=self._Tokens(req.prompt.copy()))

    def claim(self, ctx) -> bool:
        self.m.claim(ctx, 0)
        return True

    def reserve(self, ctx) -> bool:
        try:
            self.m.alloc(ctx)
        except self._Err:
            return False
        return True

    def fetch(self, batch):
        return self.m.runtime_inputs([batch])

    def step(self, batch) -> None:
        for ctx in batch:
            self.m.step(ctx)

    def release(self, ctx) -> None:
        self.m.release(ctx)

    def used_pages(self) -> int:
        return self.total_pages - self.m.block_count(0).free

    start = staticmethod(lambda ctx: ctx.tokens.processed_length)
    end = staticmethod(lambda ctx: len(ctx.tokens))
    active = staticmethod(lambda ctx: ctx.tokens.active_length)
    update = staticmethod(lambda ctx, tok: ctx.update(tok))
    reset = staticmethod(lambda ctx: ctx.reset())

    @staticmethod
    def chunk(ctx, n):
        if n < ctx.tokens.active_length:
            ctx.tokens.chunk(n)


ADAPTERS = {a.name: a for a in (MokvPaged, MokvContinuous, MaxPaged)}
