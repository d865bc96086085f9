"""One continuous-batching scheduler loop, driving any KV cache manager through an adapter.

Per step (no model runs: the "model" appends `trace.model_token`):

1. running requests reserve the pages of their next step (`maybe_reserve` / `alloc`);
   when pages run out, the newest running request is preempted (released, its context
   reset, put back at the head of the queue) as MAX's and vLLM's schedulers do;
2. waiting requests are admitted in order while the batch and the token budget allow:
   claim, reserve the whole prompt (this is where the prefix cache moves the start
   index), then chunk the prompt to the remaining token budget;
3. `fetch` / `runtime_inputs` builds the graph inputs of the batch;
4. every context is updated with its token, then `step` commits full pages;
5. finished requests are released; follow-up turns arrive after their think time.

Only manager calls sit inside the timers: bookkeeping (claim, reserve, step, release)
and runtime-input building (fetch) are timed separately, per step, with
`time.perf_counter_ns` around whole phases so the timer costs little.
"""

from __future__ import annotations

import collections
import heapq
import time
from dataclasses import dataclass, field

import numpy as np

from trace import Request, model_token


@dataclass
class _Live:
    req: Request
    ctx: object
    prompt_len: int  # original prompt length: finished once end == prompt_len + output_len
    admitted: bool = False


@dataclass
class ReplayStats:
    """What one replay measured; per-step arrays hold one value per scheduled step."""

    manager: str
    bookkeeping_ns: list[int] = field(default_factory=list)
    runtime_ns: list[int] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)
    prompt_tokens_admitted: int = 0
    tokens_skipped: int = 0
    first_prompt_tokens: int = 0
    first_tokens_skipped: int = 0
    prefill_tokens_computed: int = 0
    preemptions: int = 0
    peak_pages: int = 0
    steps: int = 0
    finished: int = 0

    def summary(self) -> dict:
        bs = np.maximum(np.array(self.batch_sizes, dtype=np.float64), 1)
        bk = np.array(self.bookkeeping_ns) / bs / 1e3
        rt = np.array(self.runtime_ns) / bs / 1e3
        total = bk + rt
        n = float(np.sum(self.batch_sizes)) or 1.0
        pct = lambda a, q: round(float(np.percentile(a, q)), 3) if len(a) else None  # noqa: E731
        return {
            "manager": self.manager,
            "request_steps": int(n),
            "steps": self.steps,
            "us_per_request_step": {"median": pct(total, 50), "p99": pct(total, 99),
                                    "mean": round(float((np.sum(self.bookkeeping_ns) + np.sum(self.runtime_ns)) / n / 1e3), 3)},
            "bookkeeping_us": {"median": pct(bk, 50), "p99": pct(bk, 99),
                               "mean": round(float(np.sum(self.bookkeeping_ns) / n / 1e3), 3)},
            "runtime_inputs_us": {"median": pct(rt, 50), "p99": pct(rt, 99),
                                  "mean": round(float(np.sum(self.runtime_ns) / n / 1e3), 3)},
            "hit_rate": self.tokens_skipped / max(self.prompt_tokens_admitted, 1),
            "first_admission_hit_rate": self.first_tokens_skipped / max(self.first_prompt_tokens, 1),
            "prefill_tokens_computed": self.prefill_tokens_computed,
            "preemptions": self.preemptions,
            "peak_pages": self.peak_pages,
            "finished": self.finished,
        }


def replay(adapter, trace: list[Request], max_batch: int, token_budget: int = 4096,
           max_steps: int | None = None) -> ReplayStats:
    """Runs `trace` through `adapter` (see `managers.py`) and returns what it measured."""
    A, pc = adapter, time.perf_counter_ns
    stats = ReplayStats(adapter.name)
    children: dict[int, list[Request]] = collections.defaultdict(list)
    arrivals: list[tuple[int, int]] = []
    for r in trace:
        if r.parent is None:
            arrivals.append((r.arrival, r.rid))
        else:
            children[r.parent].append(r)
    heapq.heapify(arrivals)
    by_id = {r.rid: r for r in trace}
    waiting: collections.deque[_Live] = collections.deque()
    running: list[_Live] = []
    step = 0
    while arrivals or waiting or running:
        if max_steps is not None and step >= max_steps:
            break
        while arrivals and arrivals[0][0] <= step:
            r = by_id[heapq.heappop(arrivals)[1]]
            waiting.append(_Live(r, A.new_context(r), len(r.prompt)))
        bk = 0
        # 1. pages for the running requests' next step; preempt the newest on shortage.
        i = 0
        while i < len(running):
            t0 = pc()
            ok = A.reserve(running[i].ctx)
            bk += pc() - t0
            if ok:
                i += 1
                continue
            victim = running.pop()
            t0 = pc()
            A.release(victim.ctx)
            bk += pc() - t0
            A.reset(victim.ctx)
            victim.admitted = False
            waiting.appendleft(victim)
            stats.preemptions += 1
        # 2. batch: running requests first (decode, then prompt chunks), then admissions.
        batch, budget = [], token_budget
        for live in running:
            n = A.active(live.ctx)
            if n > budget:
                if budget <= 0 or n == 1:
                    continue
                A.chunk(live.ctx, budget)
                n = budget
            batch.append(live)
            budget -= n
        while waiting and len(running) < max_batch and budget > 0:
            live = waiting[0]
            t0 = pc()
            ok = A.claim(live.ctx)
            if ok:
                before = A.start(live.ctx)
                ok = A.reserve(live.ctx)
                if not ok:
                    A.release(live.ctx)
            bk += pc() - t0
            if not ok:
                break
            waiting.popleft()
            skipped = A.start(live.ctx) - before
            end = A.end(live.ctx)
            stats.prompt_tokens_admitted += end
            stats.tokens_skipped += skipped
            if end == live.prompt_len and not live.admitted and before == 0:
                stats.first_prompt_tokens += end
                stats.first_tokens_skipped += skipped
            live.admitted = True
            running.append(live)
            n = A.active(live.ctx)
            if n > budget:
                A.chunk(live.ctx, budget)
                n = budget
            batch.append(live)
            budget -= n
        if not batch:
            step += 1
            continue
        ctxs = [live.ctx for live in batch]
        # 3. graph inputs.
        t0 = pc()
        A.fetch(ctxs)
        rt = pc() - t0
        # 4. the "model", then commit.
        for live in batch:
            n = A.active(live.ctx)
            if n > 1 or A.end(live.ctx) <= live.prompt_len:
                stats.prefill_tokens_computed += n
            A.update(live.ctx, model_token(live.req.seed, A.end(live.ctx)))
        t0 = pc()
        A.step(ctxs)
        bk += pc() - t0
        stats.peak_pages = max(stats.peak_pages, A.used_pages())
        # 5. finished requests leave; their follow-up turns get an arrival time.
        done = [l for l in running if A.end(l.ctx) >= l.prompt_len + l.req.output_len]
        if done:
            t0 = pc()
            for live in done:
                A.release(live.ctx)
            bk += pc() - t0
            keep = {id(l) for l in done}
            running = [l for l in running if id(l) not in keep]
            stats.finished += len(done)
            for live in done:
                for child in children.get(live.req.rid, ()):
                    heapq.heappush(arrivals, (step + 1 + child.arrival, child.rid))
        stats.bookkeeping_ns.append(bk)
        stats.runtime_ns.append(rt)
        stats.batch_sizes.append(len(batch))
        step += 1
    stats.steps = step
    return stats
