"""A small continuous-batching scheduler: admission, chunked prefill, preemption.

Each `step()` builds one ragged batch under a token budget and runs the model once:

    budget: |decode 1|decode 1|decode 1| prefill chunk of A | chunk of new B |  <= token_budget
             running requests, oldest first  ----------------> newly admitted

1. Running requests: decoding ones take one token each, then prefilling ones take a
   chunk of what is left of the budget. Each asks the manager for the pages of its
   window (`maybe_reserve`); when pages run out, the most recently admitted request
   is preempted (`release` + `ctx.reset()`, back to the front of the queue) and the
   reservation is retried.
2. Waiting requests are admitted, in order, while budget, batch slots and pages last
   (`external_claim` + `maybe_reserve`, which also finds a cached prefix).
3. One model call; `ctx.update(argmax)`; `manager.step(batch)` commits full pages to the
   prefix cache; requests that have their tokens are released.

The policy follows vLLM v1 and nano-vllm (decode first, LIFO preemption, recompute on
resume); a preempted request usually finds its own pages again in the prefix cache.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import mokv

ModelFn = Callable[[Sequence[mokv.TextContext]], np.ndarray]
"""Runs one batch (fetching its cache inputs) and returns logits `[batch, vocab]`."""


@dataclass(eq=False)
class Request:
    """A prompt to continue with `max_new_tokens` greedy tokens."""

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
        return self.output.size >= self.max_new_tokens


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
        model: the `ModelFn` (e.g. `DecoderModel.step`).
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

    def _preempt(self, req: Request, batch: list[Request]) -> int:
        """Releases `req`'s cache and requeues it first; returns the budget it gave back."""
        returned = req.ctx.active_length if req in batch else 0
        if req in batch:
            batch.remove(req)
        self.running.remove(req)
        self.manager.release(req.ctx.request_id)
        req.ctx.reset()
        self.waiting.appendleft(req)
        self.stats.preemptions += 1
        return returned

    def _schedule(self) -> list[Request]:
        batch: list[Request] = []
        budget = self.token_budget
        for req in sorted(self.running, key=lambda r: r.ctx.active_length > 1):
            if req not in self.running or budget == 0:
                continue  # preempted by an earlier request, or no budget left this step
            req.ctx.chunk(budget)
            while not self.manager.maybe_reserve(req.ctx):
                victim = self.running[-1]
                budget += self._preempt(victim, batch)
                if victim is req:
                    break
            else:
                batch.append(req)
                budget -= req.ctx.active_length
        while self.waiting and budget > 0 and len(self.running) < self.max_batch_size:
            req = self.waiting[0]
            self.manager.external_claim(req.ctx.request_id)
            req.ctx.chunk(budget)
            if not self.manager.maybe_reserve(req.ctx):
                self.manager.release(req.ctx.request_id)
                if not self.running:
                    raise mokv.InsufficientPagesError(
                        f"request {req.ctx.request_id!r} ({req.ctx.end_idx} tokens) does not "
                        "fit in the cache even alone; give the manager more pages"
                    )
                break
            self.waiting.popleft()
            self.running.append(req)
            batch.append(req)
            budget -= req.ctx.active_length
        return batch

    def step(self) -> list[Request]:
        """Runs one batch; returns the requests that finished in it (already released)."""
        batch = self._schedule()
        if not batch:
            return []
        contexts = [req.ctx for req in batch]
        logits = self.model(contexts)
        self.stats.steps += 1
        self.stats.computed_tokens += sum(ctx.active_length for ctx in contexts)
        for ctx, row in zip(contexts, logits):
            was_last_chunk = not ctx.is_chunked
            ctx.update(int(np.argmax(row)))
            self.stats.generated_tokens += was_last_chunk
        self.manager.step(contexts)
        finished = [req for req in batch if req.done]
        for req in finished:
            self.running.remove(req)
            self.manager.release(req.ctx.request_id)
        self.stats.finished += len(finished)
        return finished
