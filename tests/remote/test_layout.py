"""The key format, the value's header, checksum, key space and MAC tag, and the breaker:
no server needed."""

import numpy as np
import pytest
from max.dtype import DType
from mokv import KVCacheParams, RemoteTierConfig
from mokv.remote import CircuitBreaker, PageCodec, Rejection, RemoteLayout
from mokv.remote.codec import HEADER_SIZE, KEYS_DIGEST_SIZE, NO_KEYS, TAG_SIZE, mac_key_id
from xxhash import xxh3_64

from .conftest import SMALL, chain, pages

KEY = b"a secret the servers share"


def test_key_names_namespace_layout_and_hash():
    layout = RemoteLayout(DType.bfloat16, 128, 16, 8, 64, tp_rank=1, tp_degree=2)
    assert layout.key_prefix("meta-llama/Llama-3.2-1B") == (
        "mokv:v4:meta-llama/Llama-3.2-1B:bfloat16.p128.l16.h8.d64.tp1-2.full.xxh3:"
    )
    assert layout.page_shape == (2, 16, 128, 8, 64)
    assert layout.page_nbytes == 2 * 16 * 128 * 8 * 64 * 2
    for bad in ("", "a:b", "a b", "x" * 201, None):
        with pytest.raises(ValueError, match="namespace"):
            layout.key_prefix(bad)


def test_a_mac_key_gets_a_key_space_of_its_own():
    plain, sealed = PageCodec(SMALL, "m"), PageCodec(SMALL, "m", KEY)
    key_id = mac_key_id(KEY)
    assert sealed.key(1) == f"mokv:v4:m:{SMALL.fingerprint}.mac-{key_id}:0000000000000001"
    assert plain.key(1) == f"mokv:v4:m:{SMALL.fingerprint}:0000000000000001"
    assert len(key_id) == 8 and key_id not in KEY.hex()  # names the key, shows none of it
    assert PageCodec(SMALL, "m", b"another secret key").key(1) != sealed.key(1)
    assert PageCodec(SMALL, "m", KEY.decode()).key(1) == sealed.key(1)  # a str key is its UTF-8


def test_layout_from_params_is_one_device_shard():
    params = KVCacheParams(DType.float16, n_kv_heads=8, head_dim=64, page_size=16,
                           n_devices=4, data_parallel_degree=2, prefix_hash="sha256")
    layout = RemoteLayout.from_params(params, num_layers=3, tp_rank=1)
    assert layout == RemoteLayout(DType.float16, 16, 3, 4, 64, 1, 2, "sha256")
    with pytest.raises(ValueError, match="stable hash"):
        RemoteLayout(DType.float32, 4, 1, 1, 1, prefix_hash="builtin")
    with pytest.raises(ValueError, match="tp_rank"):
        RemoteLayout(DType.float32, 4, 1, 1, 1, tp_rank=1)


@pytest.mark.parametrize("mac_key", [None, KEY], ids=["plain", "mac"])
def test_encode_decode_round_trip_is_bit_exact(mac_key):
    codec = PageCodec(SMALL, "m", mac_key)
    (page_hash, tokens), = chain(1)
    page = pages(1)[0]
    value = codec.encode(page_hash, tokens, page)
    tag = TAG_SIZE if mac_key else 0
    assert len(value) == codec.value_nbytes == HEADER_SIZE + 8 * 4 + KEYS_DIGEST_SIZE + page.nbytes + tag
    out = codec.decode(value, page_hash, tokens)
    assert bytes(out) == page.tobytes()
    assert np.array_equal(np.frombuffer(out, np.float32).reshape(SMALL.page_shape), page)


@pytest.mark.parametrize("mac_key", [None, KEY], ids=["plain", "mac"])
def test_every_flipped_byte_is_rejected(mac_key):
    codec = PageCodec(SMALL, "m", mac_key)
    (page_hash, tokens), = chain(1)
    value = codec.encode(page_hash, tokens, pages(1)[0].tobytes())
    for i in range(len(value)):
        bad = bytearray(value)
        bad[i] ^= 0x40
        assert isinstance(codec.decode(bytes(bad), page_hash, tokens), Rejection), i
    for cut in (0, 10, HEADER_SIZE, len(value) - 1):
        assert codec.decode(value[:cut], page_hash, tokens) is Rejection.CORRUPT
    assert codec.decode(value + b"\0", page_hash, tokens) is Rejection.CORRUPT


def test_other_layout_or_other_page_is_rejected():
    (h0, t0), (h1, t1) = chain(2)
    codec = PageCodec(SMALL, "m")
    other = RemoteLayout(DType.float32, 4, 2, 2, 8, tp_rank=1, tp_degree=2)  # same shape
    value = PageCodec(other, "m").encode(h0, t0, pages(1)[0].tobytes())
    assert codec.decode(value, h0, t0) is Rejection.KEYSPACE  # another fingerprint
    wider = RemoteLayout(DType.float16, 4, 2, 2, 16)  # the same number of bytes per page
    value = PageCodec(wider, "m").encode(h0, t0, pages(1)[0].tobytes())
    assert codec.decode(value, h0, t0) is Rejection.LAYOUT
    value = codec.encode(h0, t0, pages(1)[0].tobytes())
    assert codec.decode(value, h1, t0) is Rejection.TOKENS
    assert codec.decode(value, h0, t1) is Rejection.TOKENS


def test_a_value_of_another_namespace_is_refused():
    """The value names its key space: copied under another namespace's key, it is a miss
    (before, its header did not say, and it was served)."""
    (page_hash, tokens), = chain(1)
    value = PageCodec(SMALL, "model-a").encode(page_hash, tokens, pages(1)[0].tobytes())
    assert PageCodec(SMALL, "model-b").decode(value, page_hash, tokens) is Rejection.KEYSPACE
    assert PageCodec(SMALL, "model-a", KEY).decode(value, page_hash, tokens) is Rejection.CORRUPT


def planted(codec: PageCodec, page_hash: int, tokens: bytes, page: bytes) -> bytes:
    """What a writer with Redis access but without the MAC key can make: every field and
    the checksum right, the tag guessed (here: another key's)."""
    return PageCodec(codec.layout, "m", b"not the servers' key").encode(page_hash, tokens, page)


def test_a_mac_refuses_planted_and_moved_values():
    codec = PageCodec(SMALL, "m", KEY)
    (h0, t0), (h1, t1) = chain(2)
    page = pages(1)[0].tobytes()
    fake = bytearray(planted(codec, h0, t0, page))
    fake[28:36] = codec.encode(h0, t0, page)[28:36]  # even with this key space's digest
    fixed = bytes(fake[:56]) + bytes(8) + bytes(fake[64:])  # and its checksum recomputed
    check = xxh3_64(fixed[:56])
    check.update(fixed[HEADER_SIZE:])
    fake[56:64] = check.intdigest().to_bytes(8, "little")
    assert codec.decode(bytes(fake), h0, t0) is Rejection.MAC
    good = codec.encode(h0, t0, page)
    assert bytes(codec.decode(good, h0, t0)) == page
    assert codec.decode(good, h1, t1) is Rejection.TOKENS  # under another page's key
    assert PageCodec(SMALL, "other", KEY).decode(good, h0, t0) is Rejection.KEYSPACE


@pytest.mark.parametrize("mac_key,error,match", [
    (b"short", ValueError, "at least 16 bytes .*got 5"), (12345, TypeError, "got int"),
    ("", ValueError, "got 0"),
])
def test_mac_keys_are_checked_and_never_shown(mac_key, error, match):
    with pytest.raises(error, match=match) as raised:
        PageCodec(SMALL, "m", mac_key)
    assert "short" not in str(raised.value) and "12345" not in str(raised.value)
    with pytest.raises(error, match="RemoteTierConfig.mac_key"):
        RemoteTierConfig(url="redis://h/0", namespace="m", mac_key=mac_key)
    config = RemoteTierConfig(url="redis://h/0", namespace="m", mac_key=KEY)
    assert KEY.decode() not in repr(config) and "mac_key" not in repr(config)


def test_new_value_refuses_what_does_not_fit_and_copies_the_page():
    codec = PageCodec(SMALL, "m")
    (page_hash, tokens), = chain(1)
    page = pages(1)[0]
    with pytest.raises(ValueError, match="shape"):
        codec.new_value(page_hash, tokens, page[:, :1])
    with pytest.raises(ValueError, match="bytes"):
        codec.new_value(page_hash, tokens, page.tobytes()[:-4])
    with pytest.raises(ValueError, match="contiguous"):
        codec.new_value(page_hash, tokens, np.zeros((2, 2, 4, 2, 16), np.float32)[..., ::2])
    with pytest.raises(ValueError, match="token_bytes"):
        codec.new_value(page_hash, tokens[:-8], page)
    with pytest.raises(ValueError, match="page_hash"):
        codec.new_value(-1, tokens, page)
    value, before = codec.new_value(page_hash, tokens, page), page.tobytes()
    page[...] = 0  # the store keeps its own copy
    assert value[HEADER_SIZE:] == tokens + NO_KEYS + before  # no keys: a digest of zeros
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


def test_the_fingerprint_names_the_group_kind():
    window = RemoteLayout(DType.float32, 4, 2, 2, 8, group="sliding_window-1024")
    assert SMALL.group == "full" and SMALL.fingerprint.endswith(".tp0-1.full.xxh3")
    assert window.fingerprint == "float32.p4.l2.h2.d8.tp0-1.sliding_window-1024.xxh3"
    (page_hash, tokens), = chain(1)
    value = PageCodec(window, "m").encode(page_hash, tokens, pages(1)[0])  # the same shape
    assert PageCodec(window, "m").key(page_hash) != PageCodec(SMALL, "m").key(page_hash)
    assert PageCodec(SMALL, "m").decode(value, page_hash, tokens) is Rejection.KEYSPACE
    for bad in ("", "Full", "a.b", "a:b", "x" * 65, None):
        with pytest.raises(ValueError, match="group kind"):
            RemoteLayout(DType.float32, 4, 2, 2, 8, group=bad)
