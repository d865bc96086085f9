"""An agent that pauses from seconds to an hour while a batch job fills the cache: the
agent's prefix-hit rate and TTFT with pins and write policies (docs/cache-control.md),
against plain LRU, session retention alone and MAX 26.7's own manager, in one run.

The trace (on a fake clock: an hour passes in milliseconds): the owner's agent takes
turns on a growing context (a 128-token system prompt, each turn its answer and a tool's
output, 20-40 tokens), pausing 2 s to 59 min 50 s between turns. During each pause the
batch job sends pairs of unrelated 1000-token prompts, one pair per 30 s of pause (at
most 40), each pair run together when its pages fit (then it holds all of the 128 device
pages of 16 tokens) and one after the other when they do not. Requests run whole
(prefill, one token, release); the owner's alone.

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

PAGE, PAGES, MAX_SEQ = 16, 128, 2048
PAUSES_S = (2.0, 15.0, 60.0, 300.0, 900.0, 1800.0, 3590.0)
PREFILL_S_PER_TOKEN = 1e-4
BATCH_TOKENS, BATCH_EVERY_S, BATCH_CAP = 1000, 30.0, 40


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


class Req:
    """What `MaxPaged.new_context` reads of a trace request."""

    def __init__(self, rid: int, prompt: np.ndarray) -> None:
        self.rid, self.prompt, self.session = rid, prompt, None


def _context(adapter, rid: int, prompt: np.ndarray, control=None, session=None):
    if isinstance(adapter, MaxPaged):
        return adapter.new_context(Req(rid, prompt))
    return mokv.TextContext(prompt, f"r{rid}", session_id=session, cache_control=control)


def _serve(adapter, contexts: list) -> tuple[list[int], float]:
    """Runs `contexts` whole, together as far as their pages fit (the rest after them);
    (cached tokens of each, host seconds)."""
    t0, m, cached = time.perf_counter(), adapter.manager, []
    waiting = list(contexts)
    while waiting:
        batch = []
        for ctx in list(waiting):
            m.external_claim(ctx.request_id)
            if m.maybe_reserve(ctx):
                batch.append(ctx)
                waiting.remove(ctx)
            else:
                m.release(ctx.request_id)
        assert batch, "one request always fits"
        cached += [ctx.start_idx for ctx in batch]
        m.fetch(batch)
        for ctx in batch:
            ctx.update(1)
        m.step(batch)
        for ctx in batch:
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
    rid, cached_sum, prompt_sum, bound, ttft = 0, 0, 0, 0, []
    for turn in range(turns):
        # the most a turn can find: the full pages the turn before committed
        bound += len(context) // PAGE * PAGE if turn else 0
        context = np.r_[context, rng.integers(3, 30000, int(rng.integers(20, 41)))]
        rid += 1
        session = "owner" if "sessions" in name else None
        (cached,), host_s = _serve(adapter, [_context(adapter, rid, context, owner, session)])
        if turn:
            cached_sum, prompt_sum = cached_sum + cached, prompt_sum + len(context)
            ttft.append(host_s + (len(context) - cached) * PREFILL_S_PER_TOKEN)
        pause = PAUSES_S[turn % len(PAUSES_S)]
        num_batch = min(BATCH_CAP, 1 + int(pause // BATCH_EVERY_S))
        for _ in range(num_batch):  # the batch job's pairs of requests, over the pause
            clock.now += pause / (num_batch + 1)
            rid += 2
            prompts = rng.integers(3, 30000, (2, BATCH_TOKENS))
            _serve(adapter, [_context(adapter, rid - i, p, batch) for i, p in enumerate(prompts)])
        clock.now += pause / (num_batch + 1)
    ms = np.array(ttft) * 1e3
    out = {"owner_hit_rate": round(cached_sum / prompt_sum, 4),
           "owner_hit_rate_bound": round(bound / prompt_sum, 4),
           "ttft_ms_p50": round(float(np.median(ms)), 2),
           "ttft_ms_p99": round(float(np.percentile(ms, 99)), 2)}
    if name != "max-paged":
        out["cache_control"] = vars(adapter.manager.metrics.cache_control)
    return out


RUNS = ("max-paged", "mokv-lru", "mokv-sessions", "mokv-read-only", "mokv-pins",
        "mokv-pins+read-only")


def run(quick: bool, progress=None) -> dict:
    turns = 14 if quick else 28
    runs: dict[str, dict] = {}
    out = {"turns": turns, "pages": PAGES, "page_size": PAGE, "pauses_s": PAUSES_S,
           "prefill_s_per_token": PREFILL_S_PER_TOKEN, "runs": runs}
    for name in RUNS:
        runs[name] = run_one(name, turns)
        if progress:
            progress()
    return out


def table(out: dict) -> list[str]:
    """The markdown table of `run`'s results."""
    bound = next(iter(out["runs"].values()))["owner_hit_rate_bound"]
    lines = [f"### An agent pausing 2 s to 1 h beside a batch job ({out['turns']} turns, "
             f"{out['pages']} device pages of {out['page_size']}; hit-rate bound {bound})", "",
             "| run | owner's prefix-hit rate | TTFT p50 ms | TTFT p99 ms | pinned pages | "
             "batch pages withheld |", "|---|---|---|---|---|---|"]
    for name, r in out["runs"].items():
        control = r.get("cache_control", {})
        lines.append(f"| {name} | {r['owner_hit_rate']:.3f} | {r['ttft_ms_p50']} | "
                     f"{r['ttft_ms_p99']} | {control.get('pinned_pages', '-')} | "
                     f"{control.get('withheld_pages', '-')} |")
    return lines + [""]


if __name__ == "__main__":
    import json

    print(json.dumps(run(quick=False), indent=1))
