"""Replays a synthetic trace through the demo's scheduler, timing only the manager's calls.

The scheduler is `mokv_graphs.Scheduler` (graphs/scheduler.py: reserve, preempt the
newest on shortage, admit with chunked prefill, model, step, release). The replay gives it

- the manager of an adapter (`managers.py`: mokv's, or MAX's behind mokv's method
  names) inside a `TimedManager`, which sums the host time of each phase per step:
  bookkeeping (`external_claim`, `maybe_reserve`, `step`, `release`) and runtime-input
  building (`fetch`), with one `time.perf_counter_ns` pair around each call;
- a stand-in model that runs nothing: it fetches the batch's cache inputs, as a model
  does, and emits `trace.model_token(seed, position)`;
- the trace's arrivals: first turns at their step, a follow-up turn `arrival` steps
  after the turn before it finished;

and counts, through the scheduler's hooks, the prompt tokens the prefix cache supplied
at admission and the pages in use after each step. For the trace's agent sessions it
also counts the session turns (a session's requests after its first) apart, ends each
session after its last request (`manager.end_session`, where the adapter has it), and
follows the sessions' working set: the pages of every open session's context, at peak.
"""

from __future__ import annotations

import collections
import heapq
import time
from dataclasses import dataclass, field

import numpy as np
from mokv_graphs import Request, Scheduler
from serving_trace import Request as TraceRequest
from serving_trace import model_token


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
    turn_prompt_tokens: int = 0  # session turns (not a session's first request), first admission
    turn_tokens_skipped: int = 0
    other_prompt_tokens: int = 0  # requests of no session, first admission
    other_tokens_skipped: int = 0
    session_working_set_pages: int = 0  # peak, over open sessions, of their contexts' pages
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
            "session_turn_hit_rate": self.turn_tokens_skipped / max(self.turn_prompt_tokens, 1),
            "session_turn_prompt_tokens": self.turn_prompt_tokens,
            "session_turn_tokens_saved": self.turn_tokens_skipped,
            "no_session_hit_rate": self.other_tokens_skipped / max(self.other_prompt_tokens, 1),
            "session_working_set_pages": self.session_working_set_pages,
            "prefill_tokens_computed": self.prefill_tokens_computed,
            "preemptions": self.preemptions,
            "peak_pages": self.peak_pages,
            "finished": self.finished,
        }


class TimedManager:
    """Stands in for `manager` in the scheduler, summing the host time of its calls.

    `ns[0]` collects bookkeeping, `ns[1]` runtime-input building; `take()` reads and
    clears them once per step. The wrapper's own call overhead stays outside the timer.
    """

    def __init__(self, manager) -> None:
        self.ns = [0, 0]
        for name in ("external_claim", "maybe_reserve", "step", "release", "end_session"):
            if hasattr(manager, name):
                setattr(self, name, self._timed(getattr(manager, name), phase=0))
        self.fetch = self._timed(manager.fetch, phase=1)

    def _timed(self, call, phase: int):
        ns, clock = self.ns, time.perf_counter_ns

        def timed(*args):
            t0 = clock()
            out = call(*args)
            ns[phase] += clock() - t0
            return out

        return timed

    def take(self) -> tuple[int, int]:
        """(bookkeeping ns, runtime-input ns) since the last call."""
        bookkeeping, runtime = self.ns
        self.ns[:] = [0, 0]
        return bookkeeping, runtime


class _Replay(Scheduler):
    """The scheduler with the trace's stand-in model, counting what `ReplayStats` holds."""

    def __init__(self, adapter, token_budget: int) -> None:
        self.timed = TimedManager(adapter.manager)
        super().__init__(self.timed, self._model, token_budget, adapter.manager.max_batch_size)
        self.adapter = adapter
        self.measured = ReplayStats(adapter.name)
        self.requests: dict = {}  # request id -> its TraceRequest, while it is in the scheduler

    def submit(self, r: TraceRequest) -> None:
        ctx = self.adapter.new_context(r)
        self.requests[ctx.request_id] = r
        self.add(Request(ctx, r.output_len))

    def _model(self, contexts) -> list[int]:
        """Fetches the batch's cache inputs, as a model would, and emits the trace's tokens."""
        self.timed.fetch(contexts)
        tokens = []
        for ctx in contexts:
            r, n, end = self.requests[ctx.request_id], ctx.active_length, ctx.end_idx
            if n > 1 or end <= len(r.prompt):  # prompt rows (recomputed ones too), not decode
                self.measured.prefill_tokens_computed += n
            tokens.append(model_token(r.seed, end))
        return tokens

    def on_admit(self, req: Request) -> None:
        m, end, skipped = self.measured, req.ctx.end_idx, req.ctx.start_idx
        m.prompt_tokens_admitted += end
        m.tokens_skipped += skipped
        if end == req.prompt_len:  # nothing generated yet: the prompt as the trace sent it
            m.first_prompt_tokens += end
            m.first_tokens_skipped += skipped
            r = self.requests[req.ctx.request_id]
            if r.session is not None and r.parent is not None:
                m.turn_prompt_tokens += end
                m.turn_tokens_skipped += skipped
            elif r.session is None:
                m.other_prompt_tokens += end
                m.other_tokens_skipped += skipped

    def on_step(self, batch: list[Request]) -> None:
        self.measured.batch_sizes.append(len(batch))
        self.measured.peak_pages = max(self.measured.peak_pages, self.adapter.used_pages())


def replay(adapter, trace: list[TraceRequest], token_budget: int = 4096,
           page_size: int = 128) -> ReplayStats:
    """Runs `trace` through `adapter` (see `managers.py`) and returns what it measured
    (`page_size`: the pages the sessions' working set is counted in)."""
    return replay_side_by_side([(adapter, trace)], token_budget, page_size)[0]


def replay_side_by_side(runs: list[tuple], token_budget: int = 4096,
                        page_size: int = 128) -> list[ReplayStats]:
    """Runs each `(adapter, trace)` with its own scheduler, step by step side by side
    (step s of every run before step s + 1 of any), as servers that serve at the same
    time: what one run's manager writes to a shared tier, another can find in the
    following steps."""
    states = [_TraceRun(adapter, trace, token_budget, page_size) for adapter, trace in runs]
    step = 0
    while any(state.has_work for state in states):
        for state in states:
            if state.has_work:
                state.advance(step)
        step += 1
    return [state.finish() for state in states]


class _TraceRun:
    """One trace's arrivals and scheduler: `advance` runs one scheduler step."""

    def __init__(self, adapter, trace: list[TraceRequest], token_budget: int,
                 page_size: int) -> None:
        self.scheduler = _Replay(adapter, token_budget)
        self.page_size = page_size
        self.session_pages: dict[str, int] = {}  # open session -> its context's pages
        self.follow_ups: dict[int, list[TraceRequest]] = collections.defaultdict(list)
        self.arrivals: list[tuple[int, int, TraceRequest]] = []  # (step, rid, request): a heap
        for r in trace:
            if r.parent is None:
                self.arrivals.append((r.arrival, r.rid, r))
            else:
                self.follow_ups[r.parent].append(r)
        heapq.heapify(self.arrivals)
        self.steps = 0

    @property
    def has_work(self) -> bool:
        return bool(self.arrivals) or self.scheduler.has_work

    def advance(self, step: int) -> None:
        scheduler, arrivals, stats = self.scheduler, self.arrivals, self.scheduler.measured
        while arrivals and arrivals[0][0] <= step:
            r = heapq.heappop(arrivals)[2]
            scheduler.submit(r)
            if r.session is not None:  # its context: the prompt and the answer to come
                self.session_pages[r.session] = -(-(len(r.prompt) + r.output_len)
                                                  // self.page_size)
                stats.session_working_set_pages = max(stats.session_working_set_pages,
                                                      sum(self.session_pages.values()))
        model_calls = scheduler.stats.steps
        finished = scheduler.step()
        bookkeeping, runtime = scheduler.timed.take()
        if scheduler.stats.steps > model_calls:  # a batch ran: one row of per-step timings
            stats.bookkeeping_ns.append(bookkeeping)
            stats.runtime_ns.append(runtime)
        for req in finished:
            parent = scheduler.requests.pop(req.ctx.request_id)
            for child in self.follow_ups.get(parent.rid, ()):
                heapq.heappush(arrivals, (step + 1 + child.arrival, child.rid, child))
            if parent.session is not None and not self.follow_ups.get(parent.rid):
                del self.session_pages[parent.session]  # its last turn: the session ends
                if hasattr(scheduler.timed, "end_session"):
                    scheduler.timed.end_session(parent.session)
        self.steps = step + 1

    def finish(self) -> ReplayStats:
        stats, scheduler = self.scheduler.measured, self.scheduler
        stats.steps = self.steps
        stats.preemptions = scheduler.stats.preemptions
        stats.finished = scheduler.stats.finished
        return stats
