"""The Mojo manager (mokv.MojoContinuousBatchingKVCacheManager) against the Python one
(mokv.ContinuousBatchingKVCacheManager): one name, one set of calls.

Both are driven with the same random call sequences, bad ids and bad counts included,
and must agree on every result: sequence ids, slots, cache lengths, fetch inputs, the
error type and message of every rejected call (which must change nothing), and the
cache contents written through each one's fetched `blocks`. Inputs neither accepts are
tested against both by tests/managers/test_sequence_conformance.py.
"""

from __future__ import annotations

import random
import threading
from typing import Any

import mokv
import numpy as np
import pytest
from max.driver import CPU

from .conftest import NUM_LAYERS, small_params

MAX_BATCH = 5
MAX_SEQ = 24


@pytest.fixture
def pair(session):
    params = small_params(cache_strategy="continuous")
    args = (params, MAX_BATCH, MAX_SEQ, NUM_LAYERS, [CPU()], session)
    py = mokv.ContinuousBatchingKVCacheManager(*args)
    py.blocks[0].to_numpy()[...] = 0  # `Buffer(...)` is uninitialised; the Mojo cache starts at 0
    return py, mokv.MojoContinuousBatchingKVCacheManager(*args)


def _outcome(fn: Any, *args: Any) -> tuple[str, Any]:
    try:
        return "ok", fn(*args)
    except Exception as exc:  # noqa: BLE001 - the type and the message are compared
        return type(exc).__name__, str(exc)


def _state(m: Any) -> tuple:
    claimed = [s for s in range(-1, MAX_BATCH + 2) if m.contains(s)]
    return tuple(claimed), tuple(m.cache_length(s) for s in claimed), m.num_free_blocks


def _fetched(inputs: Any) -> tuple:
    (x,) = inputs
    return (x.cache_lengths.to_numpy().tolist(), x.lookup_table.to_numpy().tolist(),
            bool(x.is_cache_empty.to_numpy()[0]))


def _random_ids(rng: random.Random, claimed: list[int], released: list[int]) -> list[int]:
    ids = rng.sample(claimed, rng.randint(0, len(claimed)))
    roll = rng.random()
    if roll < 0.1:
        ids.append(rng.choice([-1, MAX_BATCH, 99] + released))  # unknown id
    elif roll < 0.15 and ids:
        ids.append(ids[0])  # duplicate
    return ids


@pytest.mark.parametrize("seed", range(12))
def test_same_calls_same_results(pair, seed: int) -> None:
    py, mj = pair
    rng = random.Random(seed)
    released: list[int] = []
    for _ in range(250):
        claimed = [s for s in range(MAX_BATCH) if py.contains(s)]
        before = _state(mj)
        op = rng.choice(["claim", "claim", "step", "step", "fetch", "release", "release"])
        if op == "claim":
            n = rng.choice([-1, 0, 1, 1, 2, 3, MAX_BATCH + 1])
            a, b = _outcome(py.claim, n), _outcome(mj.claim, n)
        elif op == "step":
            ids = _random_ids(rng, claimed, released)
            counts = [rng.choice([-1, 0, 1, 1, 2, 5, MAX_SEQ // 2, MAX_SEQ + 1]) for _ in ids]
            batch = dict(zip(ids, counts))
            a, b = _outcome(py.step, batch), _outcome(mj.step, batch)
        elif op == "fetch":
            ids = _random_ids(rng, claimed, released)
            a, b = _outcome(py.fetch, ids), _outcome(mj.fetch, ids)
            if a[0] == b[0] == "ok":
                assert _fetched(a[1]) == _fetched(b[1]), ids
                # Write random K/V rows through each manager's fetched blocks, at the
                # positions the next step would commit; both caches must match.
                blocks = [a[1][0].blocks.to_numpy(), b[1][0].blocks.to_numpy()]
                lengths, slots, _ = _fetched(a[1])
                for slot, length in zip(slots, lengths):
                    end = min(MAX_SEQ, length + rng.randint(1, 3))
                    rows = rng.random() + np.arange(end - length, dtype=np.float32)
                    for blk in blocks:
                        blk[slot, :, :, length:end] = rows[:, None, None]
                a, b = ("ok", None), ("ok", None)
        else:
            seq_id = rng.choice(claimed + released + [-1, MAX_BATCH]) if claimed or released else 0
            a, b = _outcome(py.release, seq_id), _outcome(mj.release, seq_id)
            if a[0] == "ok":
                released.append(seq_id)
        assert a == b, (op, a, b)
        if a[0] != "ok":
            assert _state(mj) == before, f"{op} raised {a[0]} but changed the Mojo manager"
        assert _state(py) == _state(mj)
        assert py.num_free_blocks == mj.num_free_blocks
    np.testing.assert_array_equal(py.blocks[0].to_numpy(), mj.blocks_array)
    assert mj.blocks_array.any()  # the comparison saw writes


def test_blocks_are_the_mojo_memory_without_a_copy(pair) -> None:
    _, mj = pair
    assert mj.blocks_array.ctypes.data == mj._native.blocks_address()
    assert mj.blocks_array.shape == (MAX_BATCH, 2, NUM_LAYERS, MAX_SEQ, 2, 8)
    (x,) = mj.fetch(mj.claim(1))
    x.blocks.to_numpy()[0, 1, 0, 3] = 5.0  # through the fetched Buffer
    assert (mj.blocks_array[0, 1, 0, 3] == 5.0).all()


def test_errors_are_typed_and_name_the_value(pair) -> None:
    _, mj = pair
    (seq_id,) = mj.claim(1)
    with pytest.raises(mokv.UnknownRequestError) as unknown:
        mj.release(3)
    assert unknown.value.request_id == 3 and isinstance(unknown.value, KeyError)
    with pytest.raises(mokv.BatchTooLargeError, match="cannot claim 5 sequences: 4 of 5"):
        mj.claim(5)
    with pytest.raises(mokv.SequenceTooLongError, match=f"{MAX_SEQ + 1} new tokens would pass"):
        mj.step({seq_id: MAX_SEQ + 1})
    with pytest.raises(ValueError, match="wrote -3 tokens"):
        mj.step({seq_id: -3})
    with pytest.raises(ValueError, match="claim"):
        mj.claim(0)
    with pytest.raises(ValueError, match="appears twice"):
        mj.fetch([seq_id, seq_id])
    mj.release(seq_id)
    with pytest.raises(mokv.UnknownRequestError):
        mj.release(seq_id)  # double release
    assert mj.num_free_blocks == MAX_BATCH and mj.seq_id_counter == 1


def test_threads_never_share_a_slot(pair) -> None:
    """Python threads claim, fetch, step and release at once (the Mojo calls drop the GIL)."""
    _, mj = pair
    owner: dict[int, int] = {}
    guard = threading.Lock()
    problems: list[str] = []
    counts = [0] * 8

    def worker(w: int) -> None:
        rng = random.Random(w)
        for _ in range(400):
            try:
                ids = mj.claim(rng.randint(1, 2))
            except mokv.BatchTooLargeError:
                continue
            with guard:
                for s in ids:
                    if s in owner:
                        problems.append(f"slot {s} granted to {w} while {owner[s]} holds it")
                    owner[s] = w
            lengths = dict.fromkeys(ids, 0)
            for step in range(rng.randint(1, 4)):
                (x,) = mj.fetch(ids)
                if x.cache_lengths.to_numpy().tolist() != [lengths[s] for s in ids]:
                    problems.append(f"worker {w}: {x.cache_lengths.to_numpy()} != {lengths}")
                grow = {s: (5 if step == 0 else 1) for s in ids}
                mj.step(grow)
                for s in ids:
                    lengths[s] += grow[s]
            with guard:
                for s in ids:
                    del owner[s]
            for s in ids:
                mj.release(s)
            counts[w] += len(ids)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert problems == []
    assert mj.num_free_blocks == MAX_BATCH
    assert mj.seq_id_counter == sum(counts) > 0
