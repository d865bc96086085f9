"""Soak test: a long random run of good and bad calls against one paged manager.

    python benchmarks/soak.py [--ops 1000000] [--seed 0] [--check-every 1000]

Requests with shared prefixes are claimed, reserved, fetched, stepped (with chunked
prefill), preempted (release + reset), reset without a release (which must be refused),
and released; between them come bad calls (unknown ids, duplicates in a batch, double
claims, bad step counts), each of which must raise a typed error and change nothing.
The pool's invariants are checked every `--check-every` operations and at the end,
where every page must be free or cached again. Prints the operation counts and rate.
"""

import argparse
import random
import time
from collections import Counter

import mokv
import numpy as np
from max.driver import CPU
from max.dtype import DType
from max.engine import InferenceSession

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--ops", type=int, default=1_000_000)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--check-every", type=int, default=1000)
args = parser.parse_args()

PAGES, PAGE, MAX_LEN = 24, 4, 40
params = mokv.KVCacheParams(DType.float32, 1, 16, page_size=PAGE, enable_prefix_caching=True)
m = mokv.PagedKVCacheManager(params, 8, MAX_LEN, 1, [CPU()], InferenceSession(devices=[CPU()]),
                             PAGES * params.bytes_per_page(1), page_size=PAGE)
rng = random.Random(args.seed)
prefixes = [[1, 2, 3, 4, 5, 6, 7, 8], [9] * 6, [1, 2, 3, 4], []]
running: dict[mokv.RequestID, mokv.TextContext] = {}
counts: Counter = Counter()


def expect(error: type[BaseException], call) -> None:
    before = (m.num_free_blocks, sorted((r, tuple(m.get_req_blocks(r))) for r in running))
    try:
        call()
    except error:
        counts["rejected"] += 1
    else:
        raise SystemExit(f"{call} did not raise {error.__name__}")
    assert (m.num_free_blocks, sorted((r, tuple(m.get_req_blocks(r))) for r in running)) == before


start = time.perf_counter()
for op in range(args.ops):
    kind = rng.random()
    ctx = running[rng.choice(list(running))] if running else None
    if ctx is None or kind < 0.12 and len(running) < 8:
        tokens = rng.choice(prefixes) + [rng.randrange(4) for _ in range(rng.randrange(1, 12))]
        ctx = mokv.TextContext(np.array(tokens), request_id=f"r{op}")
        m.external_claim(ctx.request_id)
        running[ctx.request_id] = ctx
        counts["claim"] += 1
    elif kind < 0.55:
        batch = sorted(rng.sample(list(running.values()), rng.randrange(1, len(running) + 1)),
                       key=lambda c: c.request_id)
        batch = [c for c in batch if c.end_idx + 2 <= MAX_LEN]
        for c in batch:
            if rng.random() < 0.3:
                c.chunk(rng.randrange(1, 8))
        try:
            m.fetch(batch)
        except mokv.InsufficientPagesError:
            counts["no_room"] += 1
            continue
        for c in batch:
            c.update(rng.randrange(4))
        m.step(batch)
        counts["step"] += 1
    elif kind < 0.7:
        counts["reserve_ok" if m.maybe_reserve(ctx, rng.randrange(1, 3)) else "no_room"] += 1
    elif kind < 0.8:
        running.pop(ctx.request_id)
        m.release(ctx.request_id)
        counts["release"] += 1
        if ctx.end_idx + 2 <= MAX_LEN and rng.random() < 0.5 and len(running) < 8:  # preempt
            ctx.reset()
            m.external_claim(ctx.request_id)
            running[ctx.request_id] = ctx
            counts["preempt"] += 1
    elif kind < 0.85:
        ctx.reset()  # without a release: refused once its pages are committed
        try:
            m.maybe_reserve(ctx)
            counts["reset_own_pages"] += 1
        except mokv.StaleContextError:
            running.pop(ctx.request_id)
            m.release(ctx.request_id)
            counts["reset_refused"] += 1
    else:
        stranger = mokv.TextContext([1], request_id="stranger")
        bad = rng.randrange(5)
        if bad == 0:
            expect(mokv.UnknownRequestError, lambda: m.step([ctx, stranger]))
        elif bad == 1:
            expect(ValueError, lambda: m.fetch([ctx, ctx]))
        elif bad == 2:
            expect(mokv.AlreadyClaimedError, lambda: m.external_claim(ctx.request_id))
        elif bad == 3:
            expect(ValueError, lambda: m.maybe_reserve(ctx, 0))
        else:
            expect(mokv.UnknownRequestError, lambda: m.release(mokv.RequestID("stranger")))
    if op % args.check_every == 0:
        m.check_invariants()
for rid in list(running):
    m.release(rid)
m.check_invariants()
assert m.num_free_blocks == PAGES, "pages were lost"
elapsed = time.perf_counter() - start
print(f"{args.ops} operations in {elapsed:.1f} s ({args.ops / elapsed / 1e3:.0f} k ops/s); "
      f"invariants held, every page came back")
print(dict(sorted(counts.items())))
