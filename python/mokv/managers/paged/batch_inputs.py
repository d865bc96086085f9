"""BatchInputs: the graph inputs a replica hands out for a batch, and the prompt tokens
they process.

`fetch` asks each replica for its requests' lookup table, cache lengths and max lengths
on each device, in batch order (`PageTable.inputs`, through the first group, or every
group's through the joint hit, `groups/joint.py`); every request holds its pages by
then. The prompt tokens those inputs make the model process are counted here
(`input_tokens`, `mokv.metrics.prompt_tokens_in`: a request's prompt ends where its
first inputs found its context's end). With `enable_runtime_checks`, `check_tables`
verifies beforehand that no table lets a step write a page it must not.
"""

from __future__ import annotations

from max.driver import Buffer

from ...context import RequestID, TextGenerationContext
from ...layouts.paged import PagedInputs
from ...metrics import prompt_tokens_in
from ...undo import UndoLog
from .plans import RequestState
from .replica_parts import ReplicaParts


class BatchInputs:
    """One replica's graph inputs over its `parts` (see the module docstring); `undo` is
    the manager's log."""

    def __init__(self, parts: ReplicaParts, undo: UndoLog) -> None:
        self.group = parts.groups[0]
        self.joint = parts.joint
        self.undo = undo
        self.input_tokens = 0
        """Prompt tokens the inputs handed out made the model process."""

    def runtime_inputs(
        self, batch: list[TextGenerationContext], reqs: list[RequestState], num_steps: int
    ) -> list[PagedInputs[Buffer, Buffer]]:
        """The lookup table, cache lengths and max lengths on each device of `batch`,
        whose requests are `reqs` (each holding its pages already)."""
        slots = [req.slot for req in reqs]
        starts = [ctx.start_idx for ctx in batch]
        actives = [ctx.active_idx - start for ctx, start in zip(batch, starts)]
        if self.joint is not None:
            inputs = self.joint.runtime_inputs(slots, starts, actives, num_steps)
        else:
            inputs = self.group.runtime_inputs(slots, starts, actives, num_steps)
        self.undo.push(setattr, self, "input_tokens", self.input_tokens)
        for req, ctx, start, active in zip(reqs, batch, starts, actives):
            if req.prompt_end < 0:
                self.undo.push(setattr, req, "prompt_end", -1)
                req.prompt_end = ctx.end_idx
            self.input_tokens += prompt_tokens_in(start, start + active, req.prompt_end)
        return inputs

    def check_tables(
        self,
        batch: list[TextGenerationContext],
        requests: dict[RequestID, RequestState],
        num_steps: int,
    ) -> None:
        """InvariantError unless the tables `runtime_inputs` hands out for `batch` are
        safe (`FullAttentionGroup.check_write_windows`)."""
        if self.joint is not None:
            self.joint.check_write_windows(batch, requests, num_steps)
            return
        self.group.check_write_windows(
            (
                ctx.request_id,
                requests[ctx.request_id].pages,
                ctx.start_idx,
                ctx.active_idx + num_steps - 1,
            )
            for ctx in batch
        )
