"""Adapters that put three KV cache managers behind the scheduler's method names.

`mokv_graphs.Scheduler` calls mokv's names (`external_claim`, `maybe_reserve`, `fetch`,
`step`, `release`) and reads contexts through `mokv.TextContext`'s. Each adapter builds
one manager under the same page budget, hands the scheduler its `manager`, makes the
contexts of trace requests (`new_context`) and counts the pages in use:

- `MokvPaged`:      `mokv.PagedKVCacheManager` with its prefix cache on (further
                    `KVCacheParams` fields by keyword: a host tier, sessions);
- `MokvPagedNoLock`: the same without its per-call lock (what the lock costs);
- `MokvContinuous`: `mokv.ContinuousKVCacheManager`, as many `max_seq_len`
                    slots as the same memory budget holds (no prefix cache);
- `MaxPaged`:       MAX 26.7's `max.pipelines.kv_cache.PagedKVCacheManager` with its
                    prefix cache on, called the way MAX's own `TextBatchConstructor`
                    calls it (claim -> alloc -> runtime_inputs -> update -> step -> release).

Every adapter gets the same page budget (`budget_pages` pages of `page_size` tokens)
and the same tiny cache shape (the KV tensors are allocated but never touched: the
host-side cost does not depend on their size).
"""

from __future__ import annotations

import weakref

import mokv
from max.driver import CPU
from max.dtype import DType
from max.engine import InferenceSession
from vllm_peer import VllmPaged

SHAPE = dict(n_kv_heads=1, head_dim=16, num_layers=1)
_SESSION: InferenceSession | None = None


def session() -> InferenceSession:
    global _SESSION
    if _SESSION is None:
        _SESSION = InferenceSession(devices=[CPU()])
    return _SESSION


class _Mokv:
    """mokv's managers already have the scheduler's method names: `manager` is the manager."""

    def new_context(self, req):
        return mokv.TextContext(req.prompt, request_id=f"r{req.rid}", session_id=req.session)


class MokvPaged(_Mokv):
    name = "mokv-paged"

    def __init__(self, budget_pages, max_batch, max_seq_len, page_size=128, prefix=True,
                 prefix_hash=None, kv_events_config=None, **params_kw):
        """`params_kw`: further `KVCacheParams` fields (e.g. the shared tier's)."""
        if prefix_hash is not None:  # None: the default
            params_kw["prefix_hash"] = prefix_hash
        self.params = mokv.KVCacheParams(DType.float32, SHAPE["n_kv_heads"], SHAPE["head_dim"],
                                         page_size=page_size, enable_prefix_caching=prefix,
                                         **params_kw)
        memory = budget_pages * self.params.bytes_per_page(SHAPE["num_layers"])
        self.manager = mokv.PagedKVCacheManager(self.params, max_batch, max_seq_len,
                                                SHAPE["num_layers"], [CPU()], session(), memory,
                                                page_size=page_size,
                                                kv_events_config=kv_events_config)
        self.total_pages = self.manager.total_num_pages
        self.kv_bytes = self.total_pages * self.params.bytes_per_page(SHAPE["num_layers"])

    def used_pages(self) -> int:
        return self.total_pages - self.manager.num_free_blocks


class _NoLock:
    """Stands in for a manager's lock: acquiring it costs nothing."""

    def acquire(self) -> bool:
        return True

    def release(self) -> None:
        pass

    def __enter__(self) -> bool:
        return True

    def __exit__(self, *exc: object) -> None:
        pass


def _without_lock(manager_class: type) -> type:
    """A subclass whose public calls skip the manager's lock: the `synchronized`
    methods replaced by the functions they wrap (the few that take the lock inline
    get a `_NoLock`), to measure what the lock costs."""
    members = {}
    for name, attr in vars(manager_class).items():
        if isinstance(attr, property) and hasattr(attr.fget, "__wrapped__"):
            members[name] = property(attr.fget.__wrapped__)  # type: ignore[union-attr]
        elif hasattr(attr, "__wrapped__"):
            members[name] = attr.__wrapped__
    return type(f"Unlocked{manager_class.__name__}", (manager_class,), members)


class MokvPagedNoLock(MokvPaged):
    """`MokvPaged` without the per-call lock: the lock's uncontended cost is the gap."""

    name = "mokv-paged-nolock"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.manager.__class__ = _without_lock(mokv.PagedKVCacheManager)
        self.manager._lock = _NoLock()


class MokvContinuous(_Mokv):
    name = "mokv-continuous"

    def __init__(self, budget_pages, max_batch, max_seq_len, page_size=128, **_):
        self.params = mokv.KVCacheParams(DType.float32, SHAPE["n_kv_heads"], SHAPE["head_dim"],
                                         page_size=page_size,
                                         cache_strategy=mokv.KVCacheStrategy.CONTINUOUS)
        slots = max(1, min(max_batch, budget_pages * page_size // max_seq_len))
        self.pages_per_slot = -(-max_seq_len // page_size)
        self.manager = mokv.ContinuousKVCacheManager(
            self.params, slots, max_seq_len, SHAPE["num_layers"], [CPU()], session())
        self.total_pages = slots * self.pages_per_slot
        self.kv_bytes = slots * max_seq_len * self.params.bytes_per_token(SHAPE["num_layers"])

    def used_pages(self) -> int:
        m = self.manager
        return (m.max_cache_batch_size - m.num_free_blocks) * self.pages_per_slot


class _MaxContext:
    """A MAX `TextContext` under the names the scheduler reads (mokv.TextContext's)."""

    __slots__ = ("ctx",)

    def __init__(self, ctx) -> None:
        self.ctx = ctx

    request_id = property(lambda self: self.ctx.request_id)
    start_idx = property(lambda self: self.ctx.tokens.processed_length)
    end_idx = property(lambda self: len(self.ctx.tokens))
    active_length = property(lambda self: self.ctx.tokens.active_length)
    is_chunked = property(lambda self: self.ctx.tokens.current_position < len(self.ctx.tokens))

    def chunk(self, max_tokens: int) -> None:
        if max_tokens < self.ctx.tokens.active_length:  # MAX refuses a chunk that cuts nothing
            self.ctx.tokens.chunk(max_tokens)

    def update(self, token: int) -> None:
        self.ctx.update(token)

    def reset(self) -> None:
        self.ctx.reset()


class MaxPaged:
    """MAX's manager, driven through this adapter's methods: `manager` is the adapter."""

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
        self.manager = self
        self.max_batch_size = max_batch
        self.max_seq_len = max_seq_len
        self.total_pages = budget_pages
        self.kv_bytes = (budget_pages + 1) * page_size * 2 * SHAPE["num_layers"] * \
            SHAPE["n_kv_heads"] * SHAPE["head_dim"] * 4
        # MAX's claim and release take the context where mokv's take its id. Weak values:
        # a finished request's context (and its tokens) is freed when the replay drops it.
        self._contexts = weakref.WeakValueDictionary()

    def new_context(self, req):
        ctx = self._Ctx(request_id=self._RID(f"r{req.rid}"), max_length=self.max_seq_len,
                        tokens=self._Tokens(req.prompt.copy()))
        self._contexts[ctx.request_id] = ctx
        return _MaxContext(ctx)

    def external_claim(self, request_id) -> None:
        self.m.claim(self._contexts[request_id], 0)

    def maybe_reserve(self, ctx: _MaxContext) -> bool:
        try:
            self.m.alloc(ctx.ctx)
        except self._Err:
            return False
        return True

    def fetch(self, batch: list[_MaxContext]):
        return self.m.runtime_inputs([[c.ctx for c in batch]])

    def step(self, batch: list[_MaxContext]) -> None:
        for c in batch:
            self.m.step(c.ctx)

    def release(self, request_id) -> None:
        self.m.release(self._contexts[request_id])

    def used_pages(self) -> int:
        return self.total_pages - self.m.block_count(0).free


ADAPTERS = {a.name: a for a in (MokvPaged, MokvPagedNoLock, MokvContinuous, MaxPaged, VllmPaged)}
