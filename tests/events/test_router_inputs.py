"""A router index and a subscriber refuse what they would mangle (issue 41): a page size
that is not a positive int (0 was a ZeroDivisionError at the first query), query tokens
that are floats (truncated into a match), 2-D, negative or past int64 (an
OverflowError), a salt that is not a str; and a subscriber's addresses, timeouts and
index are checked when given. Each with a typed error naming the value."""

import math

import numpy as np
import pytest
from mokv.events import EventSubscriber, KVEventBatch, PrefixRouterIndex, build_events
from mokv.events.publisher import EventRecorder

from tests.events.test_publisher import hashes


@pytest.mark.parametrize("page_size,match", [
    (0, "page_size must be a positive int, got 0"), (-4, "got -4"), (4.0, "got 4.0"),
    (True, "got True"), ("4", "got '4'"), (None, "got None"),
])
def test_page_size_is_a_positive_int(page_size, match):
    with pytest.raises(ValueError, match=match):
        PrefixRouterIndex(page_size=page_size)


@pytest.mark.parametrize("seed", [-1, 2**64, 1.5, None])
def test_the_seed_is_a_64_bit_int(seed):
    with pytest.raises(ValueError, match=f"prefix_hash_seed must be an int in \\[0, 2\\*\\*64\\), got {seed!r}"):
        PrefixRouterIndex(page_size=4, prefix_hash_seed=seed)


def an_index_holding_the_first_two_pages():
    index = PrefixRouterIndex(page_size=4)
    recorder = EventRecorder()
    parent = None
    for h in hashes(range(8)):
        recorder.stored(h, parent, b"\0" * 32, None)
        parent = h
    index.apply(("s", 0), KVEventBatch(0.0, build_events(recorder.take(), 4), 0))
    assert index.match(np.arange(9)) == {("s", 0): 2}
    return index


@pytest.mark.parametrize("tokens,error,match", [
    (np.arange(9, dtype=np.float64), TypeError, "integer token ids, got dtype float64"),
    ([0.0, 1.0, 2.0, 3.0, 4.0], TypeError, "dtype float64"),
    (np.arange(8).reshape(2, 4), ValueError, "one-dimensional, got shape \\(2, 4\\)"),
    ([0, 1, 2, -3, 4], ValueError, "\\[-3\\]"),
    ([0, 1, 2, 2**64], ValueError, "18446744073709551616"),
    (np.array([0, 1, 2**63], dtype=np.uint64), ValueError, "9223372036854775808"),
])
@pytest.mark.parametrize("query", ["match", "scores", "best", "page_hashes"])
def test_queries_take_integer_token_ids_only(tokens, error, match, query):
    index = an_index_holding_the_first_two_pages()
    with pytest.raises(error, match=match):
        getattr(index, query)(tokens)


def test_a_query_names_a_salt_that_is_not_a_str():
    index = an_index_holding_the_first_two_pages()
    with pytest.raises(TypeError, match="cache_salt must be a str or None, got 7"):
        index.match(np.arange(9), cache_salt=7)
    assert index.match([]) == {("s", 0): 0}  # an empty query holds no page


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(endpoint="tcp://127.0.0.1:99999"), ValueError, "port 99999 is past 65535"),
    (dict(endpoint="udp://x:1"), ValueError, "not a ZMQ address"),
    (dict(endpoint="inproc://x", replay_endpoint="tcp://*"), ValueError, "replay_endpoint="),
    (dict(endpoint="inproc://x", topic=b"kv"), TypeError, "topic must be a str, got b'kv'"),
    (dict(endpoint="inproc://x", bind="yes"), TypeError, "bind must be a bool, got 'yes'"),
])
def test_a_subscribers_sources_are_checked(kwargs, error, match):
    subscriber = EventSubscriber(PrefixRouterIndex(page_size=4))
    with pytest.raises(error, match=match):
        subscriber.add_source("server", **kwargs)
    assert subscriber._streams == []  # nothing half-added
    subscriber.close()


def test_a_subscribers_index_timeouts_and_polls_are_checked():
    with pytest.raises(TypeError, match="index must have apply"):
        EventSubscriber(object())
    for timeout in (0, -1, math.inf, math.nan, "2"):
        with pytest.raises(ValueError, match=f"replay_timeout.*got {timeout!r}"):
            EventSubscriber(PrefixRouterIndex(page_size=4), replay_timeout=timeout)
    subscriber = EventSubscriber(PrefixRouterIndex(page_size=4))
    with pytest.raises(ValueError, match="timeout_ms must be an int >= 0, got 1.5"):
        subscriber.poll(1.5)
    subscriber.close()
