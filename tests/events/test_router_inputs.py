"""A router index and a subscriber refuse what they would mangle (issue 41): a page size
that is not a positive int (0 was a ZeroDivisionError at the first query), query tokens
that are floats (truncated into a match), 2-D, negative or past int64 (an
OverflowError), a salt that is not a str; and a subscriber's addresses, timeouts and
index are checked when given. Each with a typed error naming the value."""

import math

import numpy as np
import pytest
from mokv import MultimodalInput
from mokv.events import EventSubscriber, KVEventBatch, PrefixRouterIndex, build_events
from mokv.events.publisher import EventRecorder

from tests.events.test_publisher import hashes


@pytest.mark.parametrize("page_size,match", [
    (0, r"page_size must be a positive int below 2\*\*32, got 0"), (-4, "got -4"),
    (4.0, "got 4.0"), (True, "got True"), ("4", "got '4'"), (None, "got None"),
    (2**63, f"got {2**63}"),  # a query then raised numpy's "Maximum allowed dimension"
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
    (np.arange(9, dtype=np.float64), TypeError, r"integer token ids, got array\(\[0\., 1\..*\(dtype float64\)"),
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
    for timeout in (0, -1, math.inf, math.nan, "2", 1e12, 3601):
        with pytest.raises(ValueError, match=f"replay_timeout.*got {timeout!r}"):
            EventSubscriber(PrefixRouterIndex(page_size=4), replay_timeout=timeout)
    subscriber = EventSubscriber(PrefixRouterIndex(page_size=4))
    for timeout_ms in (1.5, -1, 2**63, True):
        with pytest.raises(ValueError, match=rf"timeout_ms must be an int in \[0, 3600000\], got {timeout_ms!r}"):
            subscriber.poll(timeout_ms)
    subscriber.close()


@pytest.mark.parametrize("keys,error,match", [
    # Issue 56: a tuple for an image raised an AttributeError; bad spans were accepted.
    (dict(mm_inputs=[("x", 0, 4)]), TypeError, r"mm_inputs holds \('x', 0, 4\)"),
    (dict(mm_inputs=[MultimodalInput("a", 4, 4), MultimodalInput("b", 0, 2)]), ValueError,
     "ordered by offset"),
    (dict(mm_inputs=[MultimodalInput("a", 0, 4), MultimodalInput("b", 3, 4)]), ValueError,
     "not overlap"),
    (dict(mm_inputs=[MultimodalInput("a", 6, 4)]), ValueError, "ends past the prompt's 9"),
    (dict(cache_salt=b""), TypeError, "cache_salt must be a str or None, got b''"),
    (dict(lora_name=0), TypeError, "lora_name must be a non-empty str or None, got 0"),
])
@pytest.mark.parametrize("query", ["match", "scores", "best", "page_hashes"])
def test_a_querys_keys_are_checked_as_a_contexts(keys, error, match, query):
    index = an_index_holding_the_first_two_pages()
    with pytest.raises(error, match=match):
        getattr(index, query)(np.arange(9), **keys)


def test_a_query_of_strings_is_named():
    index = an_index_holding_the_first_two_pages()
    with pytest.raises(TypeError, match=r"integer token ids, got \['a'\] \(dtype <U1\)"):
        index.match(["a"])
