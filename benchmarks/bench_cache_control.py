"""An agent that pauses from seconds to an hour while a batch job fills the cache: the
agent's prefix-hit rate and TTFT with pins and write policies (docs/cache-control.md),
against plain LRU, session retention alone and MAX 26.7's own manager, in one run.

The trace (on a fake clock: an hour passes in milliseconds): the owner's agent takes
turns on a growing context (a 128-token system prompt, each turn its answer and a tool's
output, 40-90 tokens), pausing 2 s to 59 min 50 s between turns. During each pause the
batch job sends unrelated 384-token prompts, one per 30 s of pause (at most 40), which
cycle the 96 device pages (pages of 16 tokens) several times over in a long pause.
Requests run one at a time, whole (prefill, one token, release).

TTFT is modeled: the manager's host time for the turn's calls (measured) plus its
computed prompt tokens at `PREFILL_S_PER_TOKEN`, the prefill rate of a 7-8B model on one
H100 (~10k tokens/s); the hit rate is the share of the owner's prompt tokens (turns after
the first) the cache supplied.
"""

from __future__ import annotations

import time

import mokv
import numpy as np
from managers import MaxPaged, MokvPaged

PAGE, PAGES, MAX_SEQ = 16, 96, 2048
PAUSES_S = (2.0, 15.0, 60.0, 300.0, 900.0, 1800.0, 3590.0)
PREFILL_S_PER_TOKEN = 1e-4
BATCH_TOKENS, BATCH_EVERY_S, BATCH_CAP = 384, 30.0, 40


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


class Req:
    """What `MaxPaged.new_context` reads of a trace request."""

    def __init__(self, rid: int, prompt: np.ndarray) -> None:
        self.rid, self.prompt, self.session = rid, prompt, None


def _serve(adapter, rid: int, prompt: np.ndarray, control=None, session=None) -> tuple[int, float]:
    """(cached tokens, host seconds) of one whole request."""
    t0 = time.perf_counter()
    if isinstance(adapter, MaxPaged):
        ctx = adapter.new_context(Req(rid, prompt))
    else:
        ctx = mokv.TextContext(prompt, f"r{rid}", session_id=session, cache_control=control)
    m = adapter.manager
    m.external_claim(ctx.request_id)
    assert m.maybe_reserve(ctx), "one request always fits"
    cached = ctx.start_idx
    m.fetch([ctx])
    ctx.update(1)
    m.step([ctx])
    m.release(ctx.request_id)
    return cached, time.perf_counter() - t0


def run_one(name: str, turns: int, seed: int = 0) -> dict:
    clock = Clock()
    kw: dict = {}
    owner = batch = None
    if "sessions" in name:
        kw["sessions"] = mokv.SessionConfig(clock=clock)
    if "pins" in name:
        kw["pins"] = mokv.PinConfig(clock=clock)
        owner = mokv.CacheControl(pin_ttl_s=3600.0)
    if "read-only" in name:
        batch = mokv.CacheControl(write="read_only")
    adapter = (MaxPaged if name == "max-paged" else MokvPaged)(PAGES, 2, MAX_SEQ, PAGE, **kw)
    rng = np.random.default_rng(seed)
    context = rng.integers(3, 30000, 128)
    rid, cached_sum, prompt_sum, ttft = 0, 0, 0, []
    for turn in range(turns):
        context = np.r_[context, rng.integers(3, 30000, int(rng.integers(40, 91)))]
        rid += 1
        cached, host_s = _serve(adapter, rid, context, owner, "owner" if "sessions" in name else None)
        if turn:
            cached_sum, prompt_sum = cached_sum + cached, prompt_sum + len(context)
            ttft.append(host_s + (len(context) - cached) * PREFILL_S_PER_TOKEN)
        pause = PAUSES_S[turn % len(PAUSES_S)]
        num_batch = min(BATCH_CAP, 1 + int(pause // BATCH_EVERY_S))
        for _ in range(num_batch):  # the batch job's requests, spread over the pause
            clock.now += pause / (num_batch + 1)
            rid += 1
            _serve(adapter, rid, rng.integers(3, 30000, BATCH_TOKENS), batch)
        clock.now += pause / (num_batch + 1)
    ms = np.array(ttft) * 1e3
    out = {"owner_hit_rate": round(cached_sum / prompt_sum, 4),
           "ttft_ms_p50": round(float(np.median(ms)), 2),
           "ttft_ms_p99": round(float(np.percentile(ms, 99)), 2)}
    if name != "max-paged":
        out["cache_control"] = vars(adapter.manager.metrics.cache_control)
    return out


RUNS = ("max-paged", "mokv-lru", "mokv-sessions", "mokv-read-only", "mokv-pins",
        "mokv-pins+read-only")


def run(quick: bool, progress=None) -> dict:
    turns = 14 if quick else 28
    out = {"turns": turns, "pages": PAGES, "page_size": PAGE, "pauses_s": PAUSES_S,
           "prefill_s_per_token": PREFILL_S_PER_TOKEN, "runs": {}}
    for name in RUNS:
        out["runs"][name] = run_one(name, turns)
        if progress:
            progress()
    return out


if __name__ == "__main__":
    import json

    print(json.dumps(run(quick=False), indent=1))
