"""The key format, the value's header and checksum, and the breaker: no server needed."""

import numpy as np
import pytest
from max.dtype import DType
from mokv import KVCacheParams
from mokv.remote import CircuitBreaker, Rejection, RemoteLayout
from mokv.remote.layout import HEADER_SIZE

from .conftest import SMALL, chain, pages


def test_key_names_namespace_layout_and_hash():
    layout = RemoteLayout(DType.bfloat16, 128, 16, 8, 64, tp_rank=1, tp_degree=2)
    assert layout.key_prefix("meta-llama/Llama-3.2-1B") == (
        "mokv:v1:meta-llama/Llama-3.2-1B:bfloat16.p128.l16.h8.d64.tp1-2.xxh3:"
    )
    assert layout.page_shape == (2, 16, 128, 8, 64)
    assert layout.page_nbytes == 2 * 16 * 128 * 8 * 64 * 2
    for bad in ("", "a:b", "a b", "x" * 201, None):
        with pytest.raises(ValueError, match="namespace"):
            layout.key_prefix(bad)


def test_layout_from_params_is_one_device_shard():
    params = KVCacheParams(DType.float16, n_kv_heads=8, head_dim=64, page_size=16,
                           n_devices=4, data_parallel_degree=2, prefix_hash="sha256")
    layout = RemoteLayout.from_params(params, num_layers=3, tp_rank=1)
    assert layout == RemoteLayout(DType.float16, 16, 3, 4, 64, 1, 2, "sha256")
    with pytest.raises(ValueError, match="stable hash"):
        RemoteLayout(DType.float32, 4, 1, 1, 1, prefix_hash="builtin")
    with pytest.raises(ValueError, match="tp_rank"):
        RemoteLayout(DType.float32, 4, 1, 1, 1, tp_rank=1)


def test_encode_decode_round_trip_is_bit_exact():
    (page_hash, tokens), = chain(1)
    page = pages(1)[0]
    value = SMALL.encode(page_hash, tokens, page)
    assert len(value) == SMALL.value_nbytes == HEADER_SIZE + 8 * 4 + page.nbytes
    out = SMALL.decode(value, page_hash, tokens)
    assert bytes(out) == page.tobytes()
    assert np.array_equal(np.frombuffer(out, np.float32).reshape(SMALL.page_shape), page)


def test_every_flipped_byte_is_rejected():
    (page_hash, tokens), = chain(1)
    value = SMALL.encode(page_hash, tokens, pages(1)[0].tobytes())
    for i in range(len(value)):
        bad = bytearray(value)
        bad[i] ^= 0x40
        assert isinstance(SMALL.decode(bytes(bad), page_hash, tokens), Rejection), i
    for cut in (0, 10, HEADER_SIZE, len(value) - 1):
        assert SMALL.decode(value[:cut], page_hash, tokens) is Rejection.CORRUPT
    assert SMALL.decode(value + b"\0", page_hash, tokens) is Rejection.CORRUPT


def test_other_layout_or_other_page_is_rejected():
    (h0, t0), (h1, t1) = chain(2)
    other = RemoteLayout(DType.float32, 4, 2, 2, 8, tp_rank=1, tp_degree=2)  # same bytes
    value = other.encode(h0, t0, pages(1)[0].tobytes())
    assert SMALL.decode(value, h0, t0) is Rejection.LAYOUT
    value = SMALL.encode(h0, t0, pages(1)[0].tobytes())
    assert SMALL.decode(value, h1, t0) is Rejection.TOKENS
    assert SMALL.decode(value, h0, t1) is Rejection.TOKENS


def test_new_value_refuses_what_does_not_fit_and_copies_the_page():
    (page_hash, tokens), = chain(1)
    page = pages(1)[0]
    with pytest.raises(ValueError, match="shape"):
        SMALL.new_value(page_hash, tokens, page[:, :1])
    with pytest.raises(ValueError, match="bytes"):
        SMALL.new_value(page_hash, tokens, page.tobytes()[:-4])
    with pytest.raises(ValueError, match="contiguous"):
        SMALL.new_value(page_hash, tokens, np.zeros((2, 2, 4, 2, 16), np.float32)[..., ::2])
    with pytest.raises(ValueError, match="token_bytes"):
        SMALL.new_value(page_hash, tokens[:-8], page)
    with pytest.raises(ValueError, match="page_hash"):
        SMALL.new_value(-1, tokens, page)
    value, before = SMALL.new_value(page_hash, tokens, page), page.tobytes()
    page[...] = 0  # the store keeps its own copy
    assert value[HEADER_SIZE:] == tokens + before
    assert value[:HEADER_SIZE] == bytes(HEADER_SIZE)  # sealed later, on the writer thread


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_breaker_opens_after_threshold_and_lets_one_trial_through():
    clock = Clock()
    breaker = CircuitBreaker(failure_threshold=2, cooldown_s=5.0, clock=clock)
    breaker.failure()
    assert breaker.allow() and breaker.state == "closed"
    breaker.failure()
    assert breaker.state == "open" and breaker.trips == 1
    assert not breaker.allow() and breaker.refused == 1
    clock.now = 5.0
    assert breaker.state == "half-open"
    assert breaker.allow()  # the trial
    assert not breaker.allow()  # only one at a time
    breaker.failure()  # the trial failed: open again for a whole cooldown
    assert breaker.trips == 2 and breaker.state == "open"
    clock.now = 9.9
    assert not breaker.allow()
    clock.now = 10.0
    assert breaker.allow()
    breaker.success()
    assert breaker.state == "closed" and breaker.allow() and breaker.allow()
