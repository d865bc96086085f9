"""What a paged replica's `step` commits: the pages its requests filled.

`plan_commit` works out, without changing anything, which of a batch's pages became
full since their last step and their hash chain; a `PageCommitter` (the replica's)
then indexes them in its groups (`FullAttentionGroup.commit_pages`, which shares
duplicates; `JointGroups.commit_pages` with several) and hands the new ones to their
tiers, and counts what the requests' write policies kept out of the index.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ...cache.extra_keys import request_keys
from ...context import RequestID, TextGenerationContext
from ...tiers.base import CommittedPages
from ...undo import UndoLog
from .plans import CommitPlan, RequestState
from .prefix import PrefixChains
from .replica_parts import ReplicaParts
from .take import truncate

NOTHING = CommitPlan([], [], [], [], [], [], [])
"""Read only: a step that commits nothing."""


def plan_commit(
    batch: Sequence[TextGenerationContext],
    requests: dict[RequestID, RequestState],
    find: Callable[[RequestID], RequestState],
    chains: PrefixChains,
    keyed: bool,
) -> CommitPlan:
    """The pages of `batch` that became full since their last step, with their hashes
    (pure; StaleContextError for a context whose cache does not fit its pages).
    `requests` are the replica's (`find` raises for an id it lacks); `keyed`: events or
    tiers read what each page's `EventKeys` say.

    Every request is checked first; the columns are built only for those with pages
    to commit (at large pages, most steps have none). A request's write policy
    (`CacheControl.write`) caps the pages it commits; those it keeps out are counted
    (`CommitPlan.withheld`)."""
    ps, caching = chains.page_size, chains.params.enable_prefix_caching
    todo: list[tuple[TextGenerationContext, RequestState, int, int]] = []
    withheld: list[tuple[RequestState, int]] = []
    for ctx in batch:
        try:  # `_request`, inlined: once per request per step
            req = requests[ctx.request_id]
        except (KeyError, TypeError):
            req = find(ctx.request_id)  # raises
        start = ctx.start_idx
        first, num_full = len(req.hashes), start // ps
        if num_full < first or start > len(req.pages) * ps:
            req.check_window(ctx, ps)
        if num_full > first and caching:
            control = req.control  # read only when pages fill: most steps fill none
            if control is not None and control.write != "all":
                limit = max(first, int(control.write_limit_pages(ps)))
                if num_full - limit > req.num_withheld:
                    withheld.append((req, num_full - limit))
                num_full = min(num_full, limit)
            if num_full > first:
                todo.append((ctx, req, first, num_full))
    if not todo:
        return CommitPlan([], [], [], [], [], [], [], withheld) if withheld else NOTHING
    plans, owners = [], []
    page_ids, hashes, datas, parents, keys = [], [], [], [], []
    for ctx, req, first, num_full in todo:
        parent = req.hashes[-1] if req.hashes else None  # for events: None on a first page
        request = request_keys(ctx) if keyed else None
        chain, _ = chains.pages(ctx, req, num_full)
        new_hashes = []
        for page_idx, (page_hash, data) in enumerate(chain, start=first):
            owners.append((req, page_idx))
            page_ids.append(req.pages[page_idx])
            hashes.append(page_hash)
            datas.append(data)
            parents.append(parent)
            keys.append(request.page(page_idx, ps) if request is not None else None)
            new_hashes.append(page_hash)
            parent = page_hash
        plans.append((req, new_hashes))
    return CommitPlan(plans, owners, page_ids, hashes, datas, parents, keys, withheld)


class PageCommitter:
    """Applies one replica's commit plans (see the module docstring) over its `parts`;
    `undo` is the manager's log."""

    def __init__(self, parts: ReplicaParts, undo: UndoLog) -> None:
        self.undo = undo
        self.groups = parts.groups
        self.group = parts.groups[0]
        self.joint = parts.joint
        self.group_tiers = parts.group_tiers
        self._tiered = bool(parts.group_tiers[0])
        self.withheld_pages = 0
        """Pages the requests' write policies kept out of the index."""

    def commit(self, plan: CommitPlan) -> None:
        """Indexes the planned pages in one all-or-nothing pool call, moves each request
        off the pages that duplicate an indexed one (`FullAttentionGroup.commit_pages`),
        then hands the newly indexed pages to every tier (`Tier.store`: after the device
        commit, so a tier's failure can only leave that tier with fewer pages)."""
        indexed: list[list[bool]] = []
        if plan.withheld:
            self._withhold(plan.withheld)
        if plan.page_ids:
            if self.joint is not None:
                indexed = self.joint.commit_pages(plan)
            else:
                indexed = [self.group.commit_pages(plan)]
        for req, new_hashes in plan.requests:
            self.undo.push(
                truncate, self.group, req, len(req.pages), len(req.hashes), len(req.loads)
            )
            req.hashes.extend(new_hashes)
        if not self._tiered:
            return
        # Every tier hears every step (a host tier's `min_hits` stores at any step).
        indexed = indexed or [[] for _ in self.group_tiers]
        for stack, group, group_indexed in zip(self.group_tiers, self.groups, indexed):
            new = [i for i, ok in enumerate(group_indexed) if ok]
            page_ids = plan.page_ids if group is self.group else None
            stack.store(
                CommittedPages(
                    [
                        page_ids[i]
                        if page_ids is not None
                        else group.row(plan.owners[i][0])[plan.owners[i][1]]
                        for i in new
                    ],
                    [plan.hashes[i] for i in new],
                    [plan.datas[i] for i in new],
                    [plan.parents[i] for i in new],
                    [plan.keys[i] for i in new],
                )
            )

    def _withhold(self, withheld: list[tuple[RequestState, int]]) -> None:
        """Counts the pages write policies newly kept out of the index."""
        self.undo.push(setattr, self, "withheld_pages", self.withheld_pages)
        for req, num_pages in withheld:
            self.undo.push(setattr, req, "num_withheld", req.num_withheld)
            self.withheld_pages += num_pages - req.num_withheld
            req.num_withheld = num_pages
