"""Memory of a sliding-window model's cache, side by side on one trace (issue 52, item 6).

A Gemma-3-like cache: 6 layers, 5 with a sliding window of 1024 tokens and 1 with full
attention (MAX's `MultiKVCacheParams` of a `sliding_attention` and a `full_attention`
child), pages of 128 tokens. Three managers, the same bytes, the same trace:

- **mokv, groups**: `mokv.pipelines.load_kv_manager` on MAX's tree (a sliding-window
  group and a full group sharing one budget; docs/groups.md);
- **mokv, no groups**: the same 6 layers as one full-attention cache (what a cache
  without groups holds: every token of every layer);
- **MAX 26.7, Jenga**: MAX's own hybrid manager (`max.pipelines.kv_cache.load_kv_manager`
  on the same tree).

The trace: requests of 8k tokens (8,064 prompt + 128 decoded), whose prompts start with
one of 4 shared system prompts of 4,096 tokens, driven the way MAX's scheduler drives a
manager (claim, alloc, update, step; admitted while `alloc` fits, at most 64 at once;
a running request whose next step does not fit is preempted and queued again). The
figures: peak requests running at once, mean requests running per step, steps to finish
the trace, prefix-hit rate (prompt tokens served from the cache / prompt tokens
admitted), preemptions, and the peak share of the budget in use (`used_share`: MAX's
huge blocks in use, from its `block_count`; mokv's pages that requests own, by bytes,
over the budget's).
The KV tensors are allocated but never written: the bookkeeping does not read them.
"""

from __future__ import annotations

from collections import deque

import numpy as np
from tables import side_table

WINDOW, PAGE, LAYERS, SLIDING_LAYERS = 1024, 128, 6, 5
PROMPT, DECODE, SYSTEM, N_SYSTEMS, MAX_BATCH = 8064, 128, 4096, 4, 64
SHAPE = dict(n_kv_heads=1, head_dim=16)  # small pages: the bookkeeping is what is measured
LAYER_PAGE_BYTES = 2 * PAGE * SHAPE["n_kv_heads"] * SHAPE["head_dim"] * 4  # float32 K and V


def _params(num_layers: int, window: int | None = None):
    from max.dtype import DType
    from max.graph import DeviceRef
    from max.nn.kv_cache import MHAKVCacheParams

    extra = {} if window is None else {"window_size": window}
    return MHAKVCacheParams(dtype=DType.float32, num_layers=num_layers, devices=[DeviceRef.CPU()],
                            page_size=PAGE, enable_prefix_caching=True, **SHAPE, **extra)


def managers(budget_bytes: int) -> dict:
    """The three managers, each given `budget_bytes`."""
    from max.driver import CPU
    from max.engine import InferenceSession
    from max.nn.kv_cache import MultiKVCacheParams
    from max.pipelines.kv_cache import load_kv_manager as max_loader
    from mokv.pipelines import load_kv_manager as mokv_loader

    tree = MultiKVCacheParams.from_params({
        "sliding_attention": _params(SLIDING_LAYERS, WINDOW),
        "full_attention": _params(LAYERS - SLIDING_LAYERS),
    })
    args = dict(max_batch_size=MAX_BATCH, max_seq_len=PROMPT + DECODE + PAGE,
                session=InferenceSession(devices=[CPU()]), available_cache_memory=budget_bytes,
                is_di_enabled=False, model_name="gemma-like", max_num_input_tokens=None)
    return {"mokv, groups": mokv_loader(params=tree, **args),
            "mokv, no groups": mokv_loader(params=_params(LAYERS), **args),
            "MAX 26.7, Jenga": max_loader(params=tree, **args)}


def make_trace(num_requests: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    systems = [rng.integers(3, 30000, SYSTEM) for _ in range(N_SYSTEMS)]
    return [np.concatenate([systems[i % N_SYSTEMS], rng.integers(3, 30000, PROMPT - SYSTEM)])
            for i in range(num_requests)]


def used_share(manager, budget_bytes: int) -> float:
    """The share of the budget in use: MAX's huge blocks (`block_count`), or mokv's
    pages that requests own, each group's by their bytes (a sliding group's page holds 5
    layers, the full group's 1; cached pages without an owner count as free), over the
    budget's bytes."""
    inner = getattr(manager, "manager", None)  # mokv.pipelines.KVCacheManager's own manager
    if inner is None:
        count = manager.block_count()
        return (count.total - count.free) / count.total
    layers = {g.name: g.num_layers for g in inner.params.cache_groups(inner.num_layers)}
    counts = inner.group_page_counts(0)  # (free, the pages the group has now)
    used = sum((total - free) * layers[name] for name, (free, total) in counts.items())
    return used * LAYER_PAGE_BYTES / budget_bytes


def replay(manager, trace: list[np.ndarray], budget_bytes: int) -> dict:
    """Runs the trace to its end on `manager` (MAX's manager interface)."""
    from max.pipelines.context import TextContext, TokenBuffer
    from max.pipelines.kv_cache import InsufficientBlocksError

    waiting = deque(range(len(trace)))
    running: list = []
    steps = preemptions = hit_tokens = prompt_tokens = peak = running_sum = 0
    peak_used = 0.0
    while waiting or running:
        while waiting and len(running) < MAX_BATCH:  # admit while the prefill fits
            ctx = TextContext(max_length=PROMPT + DECODE + PAGE,
                              tokens=TokenBuffer(trace[waiting[0]].astype(np.int64)))
            manager.claim(ctx)
            try:
                manager.alloc(ctx)
            except InsufficientBlocksError:
                manager.release(ctx)
                break
            hit_tokens += ctx.cached_prefix_length
            prompt_tokens += PROMPT
            running.append((waiting.popleft(), ctx))
        if not running:
            raise RuntimeError("one request does not fit the budget")
        steps += 1
        peak, running_sum = max(peak, len(running)), running_sum + len(running)
        peak_used = max(peak_used, used_share(manager, budget_bytes))
        still = []
        for req, ctx in running:
            ctx.update(7)
            manager.step(ctx)
            if ctx.tokens.generated_length >= DECODE:
                manager.release(ctx)
                continue
            try:
                manager.alloc(ctx)
                still.append((req, ctx))
            except InsufficientBlocksError:  # preempted: queued again, its tokens recomputed
                preemptions += 1
                manager.release(ctx)
                waiting.appendleft(req)
        running = still
    return {"peak_running": peak, "mean_running": round(running_sum / steps, 1), "steps": steps,
            "hit_rate": round(hit_tokens / prompt_tokens, 3), "preemptions": preemptions,
            "peak_used_share": round(peak_used, 3)}


def run(quick: bool, progress=None) -> dict:
    num_requests = 24 if quick else 64
    # The budget: 8 requests of 8k tokens in a cache without groups (6 layers of pages).
    budget = 8 * ((PROMPT + DECODE) // PAGE + 1) * LAYERS * LAYER_PAGE_BYTES
    trace = make_trace(num_requests)
    out: dict = {"config": {"layers": f"{SLIDING_LAYERS} sliding : {LAYERS - SLIDING_LAYERS} full",
                            "window": WINDOW, "page_size": PAGE, "prompt": PROMPT, "decode": DECODE,
                            "shared_prefix": SYSTEM, "prefixes": N_SYSTEMS, "requests": num_requests,
                            "budget_MiB": round(budget / 2**20, 1), "max_batch": MAX_BATCH},
                 "managers": {}}
    for name, manager in managers(budget).items():
        try:
            out["managers"][name] = replay(manager, trace, budget)
        except Exception as e:  # noqa: BLE001 - reported beside the others
            out["managers"][name] = {"error": f"{type(e).__name__}: {e}"[:600]}
        manager.shutdown()
        if progress:
            progress()
    return out


def table(r: dict) -> list[str]:
    """The markdown table of `run`'s result."""
    c = r["config"]
    title = (f"A sliding-window model's cache ({c['layers']} layers, window {c['window']}, "
             f"{c['requests']} requests of {c['prompt'] + c['decode']} tokens sharing "
             f"{c['prefixes']} prefixes of {c['shared_prefix']}, {c['budget_MiB']} MiB)")
    columns = ["manager", "peak running", "mean running", "steps", "prefix-hit rate", "preemptions",
               "peak share in use"]
    return side_table(title, columns, r["managers"], lambda s: [
        s["peak_running"], s["mean_running"], s["steps"], f"{s['hit_rate']:.3f}", s["preemptions"],
        f"{s['peak_used_share']:.0%}"], error_chars=160)


if __name__ == "__main__":
    import json
    import sys

    result = run("--quick" in sys.argv)
    print(json.dumps(result, indent=1))
    print("\n".join(table(result)))
