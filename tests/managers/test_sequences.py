"""ContinuousBatchingKVCacheManager: MAX's sequence-id flow (seed 002), over the slots of a
request-contract manager that it shares and never mixes ids with."""

import mokv
import numpy as np
import pytest
from max.driver import CPU, Buffer
from max.dtype import DType
from mokv import TextContext

from .conftest import NUM_LAYERS, small_params


@pytest.fixture
def seqs(session):
    params = small_params(cache_strategy="continuous")
    return mokv.ContinuousBatchingKVCacheManager(params, 3, 16, NUM_LAYERS, [CPU()], session)


def test_seed_002_members(seqs):
    assert seqs.block_shape(5) == [5, 2, NUM_LAYERS, 16, 2, 8]
    assert seqs.blocks[0].shape == (3, 2, NUM_LAYERS, 16, 2, 8)
    cls = mokv.ContinuousBatchingKVCacheManager
    assert cls.estimated_memory_size(seqs.params, 3, 16, NUM_LAYERS, []) == 3 * 16 * 256
    (symbols,) = seqs.input_symbols()
    (buffers,) = seqs.fetch(seqs.claim(1))
    assert [(s.dtype, s.rank) for s in symbols] == [(b.dtype, b.rank) for b in buffers]


def test_seed_002_sequence_id_flow(seqs):
    seq_ids = seqs.claim(2)
    assert seq_ids == [0, 1] and seqs.num_free_blocks == 1
    blocks, cache_lengths, lookup_table, is_cache_empty = seqs.fetch(seq_ids)[0]
    assert isinstance(blocks, Buffer) and blocks.dtype == DType.float32
    assert cache_lengths.to_numpy().tolist() == [0, 0]
    assert lookup_table.to_numpy().tolist() == [0, 1]
    assert is_cache_empty.to_numpy().tolist() == [True]
    seqs.step({0: 5, 1: 3})
    seqs.step({0: 1})
    _, cache_lengths, lookup_table, is_cache_empty = seqs.fetch([1, 0])[0]
    assert cache_lengths.to_numpy().tolist() == [3, 6]
    assert lookup_table.to_numpy().tolist() == [1, 0]
    assert is_cache_empty.to_numpy().tolist() == [False]
    assert (seqs.cache_length(0), seqs.cache_length(1)) == (6, 3)
    seqs.release(0)
    assert seqs.claim(1) == [0]
    assert seqs.fetch([0])[0].cache_lengths.to_numpy().tolist() == [0]  # a fresh slot


def test_increment_cache_lengths(seqs):
    inputs = seqs.fetch(seqs.claim(2))
    nxt = seqs.increment_cache_lengths(inputs, np.array([0, 4, 5], dtype=np.uint32))
    assert nxt[0].cache_lengths.to_numpy().tolist() == [4, 1]
    assert nxt[0].is_cache_empty.to_numpy().tolist() == [False]


def test_bad_input_is_rejected_and_changes_nothing(seqs):
    seq_ids = seqs.claim(2)
    seqs.step({seq_ids[0]: 10})
    with pytest.raises(mokv.UnknownRequestError, match="2"):
        seqs.fetch([2])
    with pytest.raises(mokv.BatchTooLargeError, match="2 sequences: 1 of 3"):
        seqs.claim(2)
    with pytest.raises(mokv.SequenceTooLongError, match="sequence 0 holds 10 tokens: 7 new tokens"):
        seqs.step({seq_ids[1]: 1, seq_ids[0]: 7})
    with pytest.raises(ValueError, match="a token count"):
        seqs.step({seq_ids[0]: -5})
    with pytest.raises(ValueError, match="twice"):
        seqs.fetch([seq_ids[0], seq_ids[0]])
    assert seqs.fetch(seq_ids)[0].cache_lengths.to_numpy().tolist() == [10, 0]


def test_request_ids_and_sequence_ids_share_slots_but_never_mix(seqs):
    ctx = TextContext(np.arange(4))
    seqs.requests.external_claim(ctx.request_id)
    (seq_id,) = seqs.claim(1)
    assert seqs.num_free_blocks == seqs.requests.num_free_blocks == 1
    assert seqs.contains(seq_id) and seqs.requests.contains(ctx.request_id)
    (slot,) = seqs.requests.get_req_blocks(ctx.request_id)
    assert not seqs.contains(slot)  # the request's slot is no sequence
    assert seqs.contains(ctx.request_id)  # a str is a request id: the request flow's
    with pytest.raises(mokv.UnknownRequestError):
        seqs.release(slot)
    for call in (seqs.cache_length, lambda s: seqs.step({s: 1})):
        with pytest.raises(TypeError, match="sequence ids are ints"):
            call(ctx.request_id)
    with pytest.raises(TypeError, match="sequence ids are ints"):
        seqs.fetch([ctx.request_id])
    with pytest.raises(TypeError, match="request_id must be a str"):
        seqs.requests.release(seq_id)
    seqs.release(seq_id)
    seqs.release(ctx.request_id)  # the request flow's release, by its id
    assert seqs.num_free_blocks == 3 and not seqs.requests.contains(ctx.request_id)
