"""vLLM's v1 `KVCacheManager` behind the scheduler's (mokv's) method names.

Installed by `make bench-vllm` (torch CPU, then `vllm==0.33.0` with `--no-deps` and the
packages its `vllm.v1.core` import chain needs: `benchmarks/requirements-vllm.txt`);
never a test dependency. Nothing of vLLM's engine, worker or GPU code runs: the manager
is plain Python over a `KVCacheConfig` of one full-attention group.

It is driven as vLLM's scheduler (`vllm/v1/core/sched/scheduler.py`) and engine core
drive it, with vLLM's defaults (watermark 0, no lookahead, no connector):

- the request's block hasher is vLLM's own (`get_request_block_hasher` after
  `init_none_hash`), with `prefix_caching_hash_algo="xxhash"`: XXH3-128 over the pickled
  `(parent hash, block tokens, extra keys)`, the same hash family as mokv's default
  (seeded XXH3-64). vLLM hashes a prompt once, when the request enters the engine: here
  in `external_claim`, timed; the blocks that fill during decode are hashed in `step`
  (vLLM: `Request.append_output_token_ids`), timed too;
- admission (`maybe_reserve` of a waiting or preempted request): `get_computed_blocks`,
  then `allocate_slots(num_new_computed_tokens=hits, new_computed_blocks=...)`, as the
  scheduler's waiting loop does; `record_prefix_cache_stats` (log_stats on, as `vllm
  serve` runs);
- a running request (`maybe_reserve`): `allocate_slots(request, window)`;
- `step`: `new_step_starts` (once per step) and `cache_blocks` up to the computed tokens;
- `fetch`: the block ids vLLM's scheduler puts in its `SchedulerOutput` (new blocks
  only, all blocks for a request just admitted); building the worker's block table is
  not the manager's work and is left out, where mokv's and MAX's `fetch` build the
  graph's input tensors (so vLLM's "runtime inputs" column is lighter work);
- `release` (finished or preempted): `free`.

One difference from vLLM's scheduler, needed to give all three managers the same work:
this harness's scheduler (`mokv_graphs.Scheduler`, shared by mokv, MAX and vLLM)
reserves a request's whole window before cutting the prompt chunk to the token budget,
so `allocate_slots` gets `delay_cache_blocks=True` and the full blocks are cached after
the step by `cache_blocks` (the call vLLM's scheduler makes after a step whose tokens
were not final at allocation). Caching at allocation would publish the blocks of
later chunks before they are computed, and other requests could hit them.
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import Any

VLLM_VERSION_WANTED = "0.33.0"
HASH_ALGO = "xxhash"  # vLLM's XXH3-128 option; its default is "sha256"


def available() -> str | None:
    """None when vLLM's manager imports, else why not (shown in the benchmark's table)."""
    try:
        _imports()
    except Exception as e:  # noqa: BLE001 - any import failure means: skip this peer
        return f"{type(e).__name__}: {e} (install it with `make bench-vllm`)"
    return None


def _imports():
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its per-process seed warning
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request, RequestStatus

    logging.getLogger("vllm").setLevel(logging.ERROR)
    return (torch, SamplingParams, get_hash_fn_by_name, kv_cache_utils, KVCacheManager,
            FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, Request, RequestStatus)


def version() -> str:
    from importlib.metadata import version as v

    return v("vllm")


class _VllmContext:
    """A vLLM `Request` under the names the scheduler reads (`mokv.TextContext`'s).

    `window` is the number of tokens the request runs this step (vLLM's scheduler keeps
    that count in its `num_scheduled_tokens`), `new_blocks` the blocks this step's
    reservation handed it (its `req_to_new_blocks`); `update` and `reset` do what vLLM's
    scheduler does to a request after a step and on preemption (untimed, as the
    contexts' `update` is for mokv and MAX).
    """

    __slots__ = ("req", "window", "new_blocks", "__weakref__")

    def __init__(self, req) -> None:
        self.req = req
        self.window = req.num_tokens
        self.new_blocks: Any = None  # vLLM's KVCacheBlocks, once reserved

    request_id = property(lambda self: self.req.request_id)
    start_idx = property(lambda self: self.req.num_computed_tokens)
    end_idx = property(lambda self: self.req.num_tokens)
    active_length = property(lambda self: self.window)
    is_chunked = property(lambda self: self.req.num_computed_tokens + self.window
                          < self.req.num_tokens)

    def chunk(self, max_tokens: int) -> None:
        self.window = min(self.window, max_tokens)

    def update(self, token: int) -> None:
        req = self.req
        chunked = self.is_chunked
        req.num_computed_tokens += self.window
        if not chunked:  # the token list grows; its new full blocks are hashed in `step`
            req._output_token_ids.append(token)
            req._all_token_ids.append(token)
        self.window = req.num_tokens - req.num_computed_tokens

    def reset(self) -> None:
        """vLLM's `_preempt_request`: the request keeps its tokens and block hashes and
        recomputes from 0 (or from its prefix-cache hits) when readmitted."""
        req = self.req
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.window = req.num_tokens


class VllmPaged:
    """vLLM's manager, driven through this adapter's methods: `manager` is the adapter."""

    name = "vllm-paged"

    def __init__(self, budget_pages, max_batch, max_seq_len, page_size=128, prefix=True,
                 hash_algo=HASH_ALGO, **_):
        (torch, self._SamplingParams, get_hash_fn_by_name, kv_cache_utils, KVCacheManager,
         FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, self._Request,
         self._Status) = _imports()
        hash_fn = get_hash_fn_by_name(hash_algo)
        kv_cache_utils.init_none_hash(hash_fn)  # what EngineCore does at startup
        self._hasher = kv_cache_utils.get_request_block_hasher(page_size, hash_fn)
        spec = FullAttentionSpec(block_size=page_size, num_kv_heads=1, head_size=16,
                                 dtype=torch.float32)
        # vLLM holds back block 0 as its null block: one more gives the same usable pages.
        config = KVCacheConfig(num_blocks=budget_pages + 1, kv_cache_tensors=[],
                               kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
        self.m = KVCacheManager(config, max_model_len=max_seq_len,
                                scheduler_block_size=page_size, hash_block_size=page_size,
                                enable_caching=prefix, log_stats=True)
        self.manager = self
        self.max_batch_size = max_batch
        self.total_pages = budget_pages
        self.kv_bytes = 0  # no KV tensors: only the manager runs
        self._contexts: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._num_running = 0

    def new_context(self, req):
        request = self._Request(f"r{req.rid}", req.prompt.tolist(),
                                self._SamplingParams(max_tokens=req.output_len), None)
        ctx = _VllmContext(request)
        self._contexts[request.request_id] = ctx
        return ctx

    def external_claim(self, request_id) -> None:
        req = self._contexts[request_id].req
        if req._block_hasher is None:  # EngineCore.add_request: the prompt's block hashes
            req._block_hasher = self._hasher
            req.update_block_hashes()

    def maybe_reserve(self, ctx: _VllmContext) -> bool:
        req, m = ctx.req, self.m
        if req.status == self._Status.RUNNING:
            ctx.new_blocks = m.allocate_slots(req, ctx.window, delay_cache_blocks=True)
            return ctx.new_blocks is not None
        blocks, hits, _ = m.get_computed_blocks(req)
        new = m.allocate_slots(req, req.num_tokens - hits, num_new_computed_tokens=hits,
                               new_computed_blocks=blocks, delay_cache_blocks=True,
                               has_scheduled_reqs=self._num_running > 0)
        if new is None:
            return False
        req.status = self._Status.RUNNING
        req.num_computed_tokens = hits
        ctx.window = req.num_tokens - hits
        ctx.new_blocks = m.get_blocks(req.request_id)  # a newly scheduled request: all of them
        m.record_prefix_cache_stats(req, hits)
        self._num_running += 1
        return True

    def fetch(self, batch: list[_VllmContext]):
        """What vLLM's scheduler hands its worker (`SchedulerOutput`): the block ids of
        each request's blocks new this step (all of them for a request just admitted);
        the worker appends them to its persistent block table."""
        return [c.new_blocks.get_block_ids(allow_none=True) for c in batch]

    def step(self, batch: list[_VllmContext]) -> None:
        m = self.m
        m.new_step_starts()
        for c in batch:
            req = c.req
            req.update_block_hashes()  # Request.append_output_token_ids' hashing
            m.cache_blocks(req, req.num_computed_tokens)

    def release(self, request_id) -> None:
        req = self._contexts[request_id].req
        if req.status == self._Status.RUNNING:
            self._num_running -= 1
            req.status = self._Status.PREEMPTED  # or finished: either way it holds nothing
        self.m.free(req)

    def used_pages(self) -> int:
        return self.total_pages - self.m.block_pool.get_num_free_blocks()


def check_version() -> str:
    """The installed vLLM version, with a note when it is not the one this was written for."""
    v = version()
    return v if v == VLLM_VERSION_WANTED else f"{v} (written for {VLLM_VERSION_WANTED})"

