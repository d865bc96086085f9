"""The seed API behaves as MAX's reference implementation of it (`max==25.7.0`,
`max/kv_cache/paged_cache/`, `null_cache_manager.py`; seeds 000-003).

Each test runs a scenario that was run on MAX 25.7 itself (CPU, a separate virtualenv:
MAX is never a dependency of mokv) and asserts what MAX returned there, quoted in the
test. Where mokv differs on purpose, the test says so and asserts mokv's choice; the
list is in docs/max.md.
"""

import mokv
import numpy as np
import pytest
from max.driver import CPU, Buffer
from mokv import TextContext

from .conftest import NUM_LAYERS, make_paged, small_params


def dp2(session, **kwargs):
    """Two data-parallel replicas of 16 pages, two request slots each."""
    return make_paged(session, data_parallel_degree=2, n_devices=2, **kwargs)


def test_replica_choice_fewest_requests_never_a_full_one(session):
    # MAX 25.7, two replicas of two slots, each new request claimed where recommended:
    # recommend -> 0 1 0 1 (fewest requests); mokv recommended 0 0 0, and the third
    # claim raised BatchTooLargeError.
    m = dp2(session)
    chosen = []
    for _ in range(4):
        ctx = TextContext(np.arange(10))
        chosen.append(m.get_or_recommend_replica(ctx))
        m.external_claim(ctx.request_id, replica_idx=chosen[-1])
    assert chosen == [0, 1, 0, 1]
    # mokv's addition: a cached prefix draws a request to its replica, unless it is full.
    m = dp2(session)
    a = TextContext(np.arange(9))
    m.external_claim(a.request_id, replica_idx=1)
    m.fetch([a])
    a.update(0)
    m.step([a])  # pages 0-3 and 4-7 committed on replica 1
    b = TextContext(np.arange(9))
    assert m.get_or_recommend_replica(b) == 1
    m.external_claim("filler", replica_idx=1)  # replica 1 is full now
    assert m.get_or_recommend_replica(b) == 0
    m.external_claim(b.request_id)  # the default replica is the recommended one
    assert m.get_replica(b) == 0


def test_increment_cache_lengths_takes_maxs_global_row_offsets_and_splits(session):
    # MAX 25.7: a (5 tokens) on replica 0, b (3) on replica 1, fetch(num_steps=2);
    # increment with input_row_offsets [0, 5, 8] and the data-parallel splits [0, 1, 2]
    # -> cache lengths [5] and [3], max_lengths [[1, 6]] and [[1, 4]].
    m = dp2(session)
    a, b = TextContext(np.arange(5)), TextContext(np.arange(3))
    m.external_claim(a.request_id, replica_idx=0)
    m.external_claim(b.request_id, replica_idx=1)
    inputs = m.fetch([a, b], num_steps=2)

    class ModelInputs:
        input_row_offsets = Buffer.from_numpy(np.array([0, 5, 8], dtype=np.uint32))
        data_parallel_splits = m.get_data_parallel_splits([a, b])

    assert ModelInputs.data_parallel_splits.to_numpy().tolist() == [0, 1, 2]
    nxt = m.increment_cache_lengths(inputs, ModelInputs())
    assert [i.cache_lengths.to_numpy().tolist() for i in nxt] == [[5], [3]]
    assert [i.max_lengths.to_numpy().tolist() for i in nxt] == [[[1, 6]], [[1, 4]]]

    class BadSplits(ModelInputs):
        data_parallel_splits = np.array([0, 2, 1], dtype=np.int64)

    with pytest.raises(ValueError, match=r"data_parallel_splits .* got \[0, 2, 1\]"):
        m.increment_cache_lengths(inputs, BadSplits())


def test_max_lengths_are_new_tokens_and_cache_plus_new_tokens(session, paged):
    # MAX 25.7: a first prefill of 5 tokens -> [[5, 5]]; then decoding 3 steps
    # -> [[1, 6], [1, 7], [1, 8]]. mokv gave [[5, 0]] (the cache before the step).
    ctx = TextContext(np.arange(5))
    paged.external_claim(ctx.request_id)
    assert paged.maybe_reserve(ctx)
    assert paged.fetch([ctx])[0].max_lengths.to_numpy().tolist() == [[5, 5]]
    ctx.update(9)
    paged.step([ctx])
    assert paged.maybe_reserve(ctx, num_steps=3)
    max_lengths = paged.fetch([ctx], num_steps=3)[0].max_lengths
    assert max_lengths.to_numpy().tolist() == [[1, 6], [1, 7], [1, 8]]


def test_a_page_duplicated_at_commit_is_freed_for_the_shared_page(session, paged):
    # MAX 25.7: x and y, the same 13 tokens, reserved before either committed, hold
    # [0, 1, 2, 3] and [4, 5, 6, 7]; after the step y holds [0, 1, 2, 7] and 11 of the
    # 16 pages are free (mokv kept [4, 5, 6, 7]: 8 free).
    x, y = TextContext(np.arange(100, 113)), TextContext(np.arange(100, 113))
    for ctx in (x, y):
        paged.external_claim(ctx.request_id)
        assert paged.maybe_reserve(ctx)
    assert [paged.get_req_blocks(c.request_id) for c in (x, y)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    paged.fetch([x, y])
    x.update(1)
    y.update(1)
    paged.step([x, y])
    assert paged.get_req_blocks(y.request_id) == [0, 1, 2, 7]
    assert paged.num_free_blocks == 11
    pool = paged.replicas[0].pool
    assert [pool.ref_count(p) for p in range(8)] == [2, 2, 2, 1, 0, 0, 0, 1]
    (inputs,) = paged.fetch([y])  # the graph reads the shared pages for y now
    assert inputs.lookup_table.to_numpy()[0, :4].tolist() == [0, 1, 2, 7]


def test_the_hit_rate_counts_prompt_tokens_only(session):
    # A 9-token prompt whose first page (3 tokens) is cached, then 8 decode steps.
    # MAX's contract (`KVCacheMetrics`): input_tokens = prompt tokens computed (6),
    # cache_tokens = prompt tokens found (3), cache_hit_rate = 3 / (6 + 3). mokv counted
    # every fetched token plus the hits as input_tokens: 3 / 17. (MAX 25.7's manager
    # itself adds each decode step's token when the scheduler calls maybe_reserve every
    # step, as its TextBatchConstructor does, and then also reads 3 / 17: mokv keeps to
    # the documented meaning on purpose.)
    m = make_paged(session, num_pages=32, page_size=3)
    warm = TextContext(np.arange(200, 204))
    m.external_claim(warm.request_id)
    m.fetch([warm])
    warm.update(1)
    m.step([warm])
    m.release(warm.request_id)
    m.reset_metrics()
    ctx = TextContext(np.concatenate([np.arange(200, 203), np.arange(300, 306)]))
    m.external_claim(ctx.request_id)
    assert m.maybe_reserve(ctx)
    m.fetch([ctx])
    for _ in range(8):
        ctx.update(7)
        m.step([ctx])
        assert m.maybe_reserve(ctx)
        m.fetch([ctx])
    metrics = m.metrics
    assert metrics.cache_hit_rate == pytest.approx(3 / 9)
    assert (metrics.input_tokens, metrics.cache_tokens, metrics.prompt_tokens) == (6, 3, 9)


def test_estimated_memory_size_is_capped_by_what_the_requests_can_fill():
    # MAX 25.7, pages of 4 tokens, max_batch_size=2, max_seq_len=30 (8 pages each):
    # a 10 GiB budget -> 2 * 8 pages' bytes; mokv returned the whole 10 GiB.
    params = small_params()
    page = params.bytes_per_page(NUM_LAYERS)
    cls = mokv.PagedKVCacheManager
    assert cls.estimated_memory_size(params, 2, 30, NUM_LAYERS, 10 * 2**30, [CPU()]) == 16 * page
    # Below the cap: MAX returns the budget as given (10 pages + 7 bytes); mokv, on
    # purpose, the whole pages a manager allocates from it.
    assert cls.estimated_memory_size(params, 2, 30, NUM_LAYERS, 10 * page + 7, [CPU()]) == (
        10 * page
    )
    # Two replicas: each holds one of the two requests, so mokv caps each at 8 pages
    # (MAX 25.7 caps each replica by the global max_batch_size: 32 pages' bytes).
    dp = small_params(data_parallel_degree=2, n_devices=2)
    assert cls.estimated_memory_size(dp, 2, 30, NUM_LAYERS, 10 * 2**30, [CPU()] * 2) == 16 * page


def test_errors_are_also_the_builtins_max_raises(session):
    # MAX 25.7 (`except` clauses ported from MAX must still catch mokv's errors):
    # release / get_req_blocks / get_replica / fetch of an unknown request: KeyError
    # from the paged manager, ValueError from its per-replica manager ("Attempted to
    # release request ID ... but it is not claimed") and the sequence-id flow; a fetch
    # past max_seq_len: RuntimeError; a budget without a page: RuntimeError; an
    # out-of-range replica: IndexError; claiming twice or past the slots: ValueError.
    m = make_paged(session, max_batch_size=1)
    stranger = TextContext(np.arange(3), "stranger")
    for call in (
        lambda: m.release("stranger"),
        lambda: m.get_req_blocks("stranger"),
        lambda: m.get_replica(stranger),
        lambda: m.fetch([stranger]),
    ):
        with pytest.raises(KeyError) as caught:
            call()
        assert isinstance(caught.value, ValueError)
        assert isinstance(caught.value, mokv.UnknownRequestError)
    long = TextContext(np.arange(40))
    m.external_claim(long.request_id)
    with pytest.raises(RuntimeError, match="max_seq_len=32"):
        m.fetch([long])
    with pytest.raises(ValueError, match="already claimed"):
        m.external_claim(long.request_id)
    with pytest.raises(ValueError, match="request slots"):
        m.external_claim("one too many")
    with pytest.raises(IndexError, match="replica_idx=2"):
        dp2(session).external_claim("r", replica_idx=2)
    with pytest.raises(RuntimeError, match="0 page"):
        make_paged(session, num_pages=0)
    assert m.get_req_blocks(long.request_id) == []  # nothing changed


def test_the_sequence_id_flow_of_seeds_002_and_003(session):
    # Seed 002 names fetch's parameter `seq_ids` and raises ValueError for an unknown id;
    # MAX's continuous manager keeps `cache_lengths` (seq id -> tokens; seed 003's
    # field) and the free slots (`slots_remaining`).
    params = small_params(cache_strategy="continuous", enable_prefix_caching=False)
    seqs = mokv.ContinuousBatchingKVCacheManager(params, 3, 16, NUM_LAYERS, [CPU()], session)
    seq_ids = seqs.claim(2)
    assert seqs.slots_remaining == {2} and seqs.num_free_blocks == 1
    seqs.step({seq_ids[0]: 5, seq_ids[1]: 3})
    assert dict(seqs.cache_lengths) == {0: 5, 1: 3}
    (inputs,) = seqs.fetch(seq_ids=[1, 0])
    assert inputs.cache_lengths.to_numpy().tolist() == [3, 5]
    with pytest.raises(TypeError):
        seqs.cache_lengths[0] = 9  # a read-only view
    for call in (lambda: seqs.fetch(seq_ids=[2]), lambda: seqs.release(7),
                 lambda: seqs.step({2: 1})):
        with pytest.raises(ValueError, match="not claimed"):
            call()
    seqs.release(seq_ids[0])
    assert dict(seqs.cache_lengths) == {1: 3} and seqs.slots_remaining == {0, 2}


def test_null_get_req_blocks_is_empty_for_any_request(session):
    # Seed 001 / MAX 25.7: NullKVCacheManager.get_req_blocks("never claimed") -> [].
    null = mokv.NullKVCacheManager(small_params(), 4, 32, NUM_LAYERS, [CPU()], session, 0)
    assert null.get_req_blocks("never claimed") == []
    assert not null.contains("never claimed")  # and it did not claim it



def test_each_replica_has_its_own_graph_dims(session):
    # MAX 25.7 names each replica's per-batch dims apart (replica_0_batch_size, ...), so
    # one graph takes both replicas' inputs with batches of different sizes; mokv named
    # them alike, and such a graph refused to run.
    from max.graph import Graph

    m = dp2(session)
    symbols = m.input_symbols()
    assert [str(s.cache_lengths.shape[0]) for s in symbols] == [
        "replica_0_batch_size", "replica_1_batch_size"]
    a, b, c = (TextContext(np.arange(n)) for n in (3, 4, 5))
    m.external_claim(a.request_id, replica_idx=0)
    for ctx in (b, c):
        m.external_claim(ctx.request_id, replica_idx=1)
    with Graph("two_replicas", input_types=[*symbols[0], *symbols[1]]) as graph:
        graph.output(graph.inputs[1].tensor + 1, graph.inputs[5].tensor + 1)
    model = session.load(graph)
    inputs = m.fetch([a, b, c])
    out = model.execute(*inputs[0], *inputs[1])
    assert [o.to_numpy().tolist() for o in out] == [[1], [1, 1]]
