"""A continuous-batching scheduler: admission, chunked prefill, preemption.

Each `step()` builds one ragged batch under a token budget and runs the model once:

    budget: |decode 1|decode 1|decode 1| prefill chunk of A | chunk of new B |  <= token_budget
             running requests, oldest first  ----------------> newly admitted

1. Running requests, oldest first, hold the pages of their next window
   (`maybe_reserve`): one decode token, or what is left of the prompt. When pages run
   out, the most recently admitted request is preempted (`release` + `ctx.reset()`,
   back to the front of the queue) and the reservation is retried.
2. The batch: running requests, oldest first, each prompt chunked to what is left of
   the budget. Oldest first is decode first: a prompt gets budget only after every
   older request's window, so it finishes after theirs, and the running list is always
   decoding requests followed by prefilling ones. Then waiting requests are admitted,
   in order, while budget, batch slots and pages last (`external_claim` + `maybe_reserve`
   of the whole prompt, which also finds a cached prefix), and chunked in turn.
3. One model call gives each request its next token; `ctx.update(token)`;
   `manager.step(batch)` commits full pages to the prefix cache; requests that have
   their tokens are released.

The policy follows vLLM v1 (decode first, LIFO preemption, recompute on resume) and, in
reserving a whole prompt at admission before chunking it, MAX's TextBatchConstructor
(claim -> alloc -> chunk to the budget); a preempted request usually finds its own pages
again in the prefix cache.

The scheduler only calls `external_claim`, `maybe_reserve`, `step` and `release` on the
manager and reads contexts through `mokv.TextContext`'s names, so anything with those
members can stand in for either: the benchmark (benchmarks/replay.py) times a manager
behind a wrapper and drives MAX's own manager through an adapter. `on_admit` and
`on_step` are the hooks where a subclass observes a run.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mokv
import numpy as np

ModelFn = Callable[[Sequence[mokv.TextContext]], Sequence[int]]
"""Runs one batch (fetching its cache inputs) and returns each context's next token id."""


def greedy(logits_fn: Callable[[Sequence[mokv.TextContext]], np.ndarray]) -> ModelFn:
    """The `ModelFn` of a model that returns logits `[batch, vocab]` (e.g. `DecoderModel.step`):
    each context's most likely next token."""
    return lambda batch: np.argmax(logits_fn(batch), axis=1)


@dataclass(eq=False)
class Request:
    """A prompt to continue with `max_new_tokens` tokens."""

    ctx: mokv.TextContext
    max_new_tokens: int
    prompt_len: int = field(init=False)

    def __post_init__(self) -> None:
        self.prompt_len = self.ctx.end_idx  # ctx.reset() moves ctx.prompt_length; this stays

    @property
    def output(self) -> np.ndarray:
        """Tokens generated so far."""
        return self.ctx.tokens[self.prompt_len :]

    @property
    def done(self) -> bool:
        return self.ctx.end_idx - self.prompt_len >= self.max_new_tokens


@dataclass
class SchedulerStats:
    steps: int = 0
    computed_tokens: int = 0  # rows the model processed (prefill chunks + decode tokens)
    generated_tokens: int = 0
    preemptions: int = 0
    finished: int = 0


class Scheduler:
    """Drives a mokv manager and a model over a changing set of requests.

    Args:
        manager: a paged or continuous-batching mokv manager.
        model: the `ModelFn` (e.g. `greedy(DecoderModel.step)`).
        token_budget: most rows per model call (the chunked-prefill chunk limit).
        max_batch_size: most requests running at once (default: the manager's).
    """

    def __init__(
        self, manager: Any, model: ModelFn, token_budget: int = 256,
        max_batch_size: int | None = None,
    ) -> None:
        self.manager = manager
        self.model = model
        self.max_batch_size = max_batch_size or manager.max_batch_size
        if token_budget < self.max_batch_size:
            raise ValueError(
                f"token_budget={token_budget} must cover one decode token for each of "
                f"max_batch_size={self.max_batch_size} requests"
            )
        self.token_budget = token_budget
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order; the last is preempted first
        self.stats = SchedulerStats()

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # Hooks for subclasses that observe a run (the benchmark counts through them).

    def on_admit(self, req: Request) -> None:
        """`req` was claimed and its prompt reserved. It came in with an empty cache (new,
        or reset after preemption), so `req.ctx.start_idx` is the prefix the cache supplied."""

    def on_step(self, batch: list[Request]) -> None:
        """The model ran `batch` and the manager committed it; the finished requests in it
        are released right after this."""

    def _preempt(self, req: Request) -> None:
        """Releases `req`'s cache and requeues it first, to be recomputed."""
        self.manager.release(req.ctx.request_id)
        req.ctx.reset()
        self.waiting.appendleft(req)
        self.stats.preemptions += 1

    def _reserve_running(self) -> None:
        """Holds every running request's next window, preempting the newest while short."""
        i = 0
        while i < len(self.running):
            if self.manager.maybe_reserve(self.running[i].ctx):
                i += 1
            else:
                self._preempt(self.running.pop())

    def _admit(self, req: Request) -> bool:
        """Claims the first waiting request and reserves its prompt; False: no room now."""
        request_id = req.ctx.request_id
        self.manager.external_claim(request_id)
        if not self.manager.maybe_reserve(req.ctx):
            self.manager.release(request_id)
            if not self.running:
                raise mokv.InsufficientPagesError(
                    f"request {request_id!r} ({req.ctx.end_idx} tokens) does not "
                    "fit in the cache even alone; give the manager more pages"
                )
            return False
        self.running.append(self.waiting.popleft())
        self.on_admit(req)
        return True

    @staticmethod
    def _take(req: Request, budget: int, batch: list[Request]) -> int:
        """Adds `req` to `batch`, its window chunked to `budget`; returns the tokens it takes."""
        req.ctx.chunk(budget)
        batch.append(req)
        return req.ctx.active_length

    def _schedule(self) -> list[Request]:
        self._reserve_running()
        batch: list[Request] = []
        budget = self.token_budget
        for req in self.running:
            if budget == 0:
                break
            budget -= self._take(req, budget, batch)
        while self.waiting and budget > 0 and len(self.running) < self.max_batch_size:
            req = self.waiting[0]
            if not self._admit(req):
                break
            budget -= self._take(req, budget, batch)
        return batch

    def step(self) -> list[Request]:
        """Runs one batch; returns the requests that finished in it (already released)."""
        batch = self._schedule()
        if not batch:
            return []
        contexts = [req.ctx for req in batch]
        self.stats.computed_tokens += sum(ctx.active_length for ctx in contexts)
        next_tokens = self.model(contexts)
        self.stats.steps += 1
        for ctx, token in zip(contexts, next_tokens):
            self.stats.generated_tokens += not ctx.is_chunked  # a prompt's last chunk samples too
            ctx.update(int(token))
        self.manager.step(contexts)
        self.on_step(batch)
        finished = [req for req in batch if req.done]
        for req in finished:
            self.running.remove(req)
            self.manager.release(req.ctx.request_id)
        self.stats.finished += len(finished)
        return finished
