"""What a paged replica's `step` commits: the pages its requests filled.

`plan_commit` works out, without changing anything, which of a batch's pages became
full since their last step and their hash chain; the replica's `commit` then indexes
them in its group (`FullAttentionGroup.commit_pages`, which shares duplicates) and hands
the new ones to its tiers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ...cache.extra_keys import request_keys
from ...context import RequestID, TextGenerationContext
from .plans import CommitPlan, RequestState
from .prefix import PrefixChains

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
