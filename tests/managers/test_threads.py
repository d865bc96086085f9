"""Several threads share one manager: no page or slot is lost or handed out twice."""

from __future__ import annotations

import random
import sys
import threading

import mokv
import pytest
from max.driver import CPU
from mokv import TextContext

from .conftest import NUM_LAYERS, make_paged, small_params

NUM_THREADS, ROUNDS = 6, 150


def _worker(manager, seed: int, errors: list, prefixes: list[list[int]]) -> None:
    rng = random.Random(seed)
    try:
        for i in range(ROUNDS):
            ctx = TextContext(rng.choice(prefixes) + [rng.randrange(3) for _ in range(rng.randrange(1, 6))],
                              request_id=f"t{seed}-{i}")
            try:
                manager.external_claim(ctx.request_id)
            except mokv.BatchTooLargeError:
                continue
            try:
                for _ in range(rng.randrange(1, 5)):
                    if not manager.maybe_reserve(ctx):
                        break
                    manager.fetch([ctx])
                    ctx.update(rng.randrange(3))
                    manager.step([ctx])
            finally:
                manager.release(ctx.request_id)
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        errors.append(exc)


@pytest.mark.parametrize("kind", ["paged", "continuous"])
def test_threads_share_a_manager(session, kind):
    if kind == "paged":
        manager = make_paged(session, num_pages=10, max_batch_size=4, max_seq_len=32)
        total = 10
    else:
        manager = mokv.ContinuousKVCacheManager(
            small_params(cache_strategy="continuous"), 4, 32, NUM_LAYERS, [CPU()], session
        )
        total = 4
    prefixes = [[1, 2, 3, 4, 5, 6, 7, 8], [2] * 9, []]
    errors: list = []
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter allows
    try:
        threads = [threading.Thread(target=_worker, args=(manager, s, errors, prefixes))
                   for s in range(NUM_THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old_interval)
    assert not errors, errors[:3]
    assert manager.num_free_blocks == total  # every page (slot) came back
    if kind == "paged":
        manager.check_invariants()
        assert manager.replicas[0].num_free_slots == 4  # every request slot came back
