"""Page identity beyond the 64-bit hash (issue 56): a hit is confirmed by the page's
tokens and its extra keys (salt, adapter, images), so pages of different tenants are
never interchangeable even when their chain hashes collide. Every test forces the
collisions with a deliberately weak hash (the tokens alone: the parent, hence the salt's
root, is ignored) and shows no cross-tenant hit on the device, in the host tier or in the
shared tier, while the same tenant still hits."""

import itertools
import os

import mokv
import numpy as np
import pytest
from mokv import MultimodalInput, TextContext
from mokv.cache import hashing
from mokv.cache.extra_keys import KeyedTokens, request_identity
from mokv.remote.codec import PageCodec, Rejection
from mokv.remote.layout import RemoteLayout
from xxhash import xxh3_64_intdigest

from ...remote.conftest import redis_server  # noqa: F401 (fixture)
from ...tiers.test_host import evict_from_device, make_host
from ..conftest import NUM_LAYERS, make_paged, small_params
from .test_extra_keys import found
from .test_extra_keys import serve as serve_keyed

PROMPT = np.arange(9)  # two full pages of 4, then one token
_namespaces = itertools.count()


@pytest.fixture
def weak_hash(monkeypatch):
    """"xxh3" replaced by a hash of the page's tokens alone: every chain's pages collide
    with every other chain's pages of the same tokens, whatever its salt or parent."""

    def tokens_only(parent: int, token_bytes) -> int:
        return xxh3_64_intdigest(bytes(token_bytes))

    monkeypatch.setitem(hashing._ALGORITHMS, "xxh3", tokens_only)


def serve(m, ctx) -> list[int]:
    """Prefills `ctx` (PROMPT) and commits its 2 full pages; returns their hashes."""
    return serve_keyed(m, ctx, num_pages=2)


def test_no_cross_tenant_hit_on_the_device_when_hashes_collide(session, weak_hash):
    m = make_paged(session, num_pages=16)
    a_chain = serve(m, TextContext(PROMPT, "a", cache_salt="tenant-a"))
    for other in (TextContext(PROMPT, "b", cache_salt="tenant-b"),
                  TextContext(PROMPT, "plain"),
                  TextContext(PROMPT, "lora", lora_name="adapter")):
        assert found(m, other) == 0, other.request_id
    assert found(m, TextContext(PROMPT, "a2", cache_salt="tenant-a")) == 8  # same tenant
    # The collision was real: tenant b's chain has tenant a's hashes, and b's own pages
    # stay unindexed beside a's (the index keeps a's), never shared with a's.
    assert serve(m, TextContext(PROMPT, "b2", cache_salt="tenant-b")) == a_chain
    assert found(m, TextContext(PROMPT, "a3", cache_salt="tenant-a")) == 8
    assert found(m, TextContext(PROMPT, "b3", cache_salt="tenant-b")) == 0
    m.check_invariants()


def test_an_unsalted_page_is_never_a_salted_requests_hit(session, weak_hash):
    m = make_paged(session, num_pages=16)
    serve(m, TextContext(PROMPT, "plain"))
    assert found(m, TextContext(PROMPT, "salted", cache_salt="tenant-a")) == 0
    assert found(m, TextContext(PROMPT, "plain2")) == 8


def test_images_are_confirmed_on_the_pages_they_key(session, weak_hash):
    # Tokens 4-7 are an image's placeholders (page 1): the same tokens for every image.
    m = make_paged(session, num_pages=16)
    serve(m, TextContext(PROMPT, "cat", mm_inputs=[MultimodalInput("cat", 4, 4)]))
    dog = TextContext(PROMPT, "dog", mm_inputs=[MultimodalInput("dog", 4, 4)])
    assert found(m, dog) == 4  # page 0 holds no image: truly the same page
    again = TextContext(PROMPT, "cat2", mm_inputs=[MultimodalInput("cat", 4, 4)])
    assert found(m, again) == 8


def test_no_cross_tenant_hit_from_the_host_tier(session, weak_hash):
    m = make_host(session)
    serve(m, TextContext(PROMPT, "A", cache_salt="tenant-a"))
    evict_from_device(m)  # tenant a's pages now live on the host only
    b = TextContext(PROMPT, "B", cache_salt="tenant-b")
    assert found(m, b) == 0
    a2 = TextContext(PROMPT, "A2", cache_salt="tenant-a")
    m.external_claim("A2")
    assert m.maybe_reserve(a2) and a2.start_idx == 8  # loaded from the host
    assert [tier for tier, _, _ in m.replicas[0].pending_loads("A2")] == ["host", "host"]
    m.release("A2")
    m.check_invariants()


def test_no_cross_tenant_hit_from_the_shared_tier(session, weak_hash, redis_server):  # noqa: F811
    namespace = f"identity-{os.getpid()}-{next(_namespaces)}"
    tiers = (mokv.RemoteTierConfig(url=redis_server.url, namespace=namespace),)
    a = make_paged(session, num_pages=6, max_seq_len=24, tiers=tiers)
    b = make_paged(session, num_pages=6, max_seq_len=24, tiers=tiers)
    try:
        serve(a, TextContext(PROMPT, "A", cache_salt="tenant-a"))
        for store in a.replicas[0].tiers.named("remote").stores:
            assert store.flush(10)
        assert found(b, TextContext(PROMPT, "B", cache_salt="tenant-b")) == 0
        assert found(b, TextContext(PROMPT, "plain")) == 0
        rejected = sum(s.metrics.rejected_tokens for s in b.replicas[0].tiers.named("remote").stores)
        assert rejected >= 1  # tenant a's value was read under the colliding key, and refused
        a2 = TextContext(PROMPT, "A2", cache_salt="tenant-a")
        b.external_claim("A2")
        assert b.maybe_reserve(a2) and a2.start_idx == 8  # the same tenant: shared
        b.release("A2")
    finally:
        a.close()
        b.close()


def test_keyed_tokens_equal_only_the_same_bytes_with_the_same_keys():
    data = bytes(range(32))
    a, a2 = KeyedTokens(data, b"a"), KeyedTokens(data, b"a")
    b = KeyedTokens(data, b"b")
    assert a == a2 and not a != a2
    for other in (b, data):
        assert a != other and other != a and not a == other and not other == a
    assert a != bytearray(data)  # (a bytearray or memoryview on the left compares bytes)
    assert [data, a] != [data, b] and [data, a] == [data, a2]  # list compares use them
    assert hash(a) == hash(data) and bytes(a) == data  # the bytes alone, where read
    assert request_identity(None, None) == b""
    assert request_identity("t", None) != request_identity(None, "t")


def test_a_shared_value_names_the_keys_of_its_page(session):
    layout = RemoteLayout.from_params(small_params(), NUM_LAYERS, 0)
    codec = PageCodec(layout, "identity")
    page = np.zeros(layout.page_shape, np.float32)
    tokens = np.arange(4, dtype="<i8").tobytes()
    salted = KeyedTokens(tokens, request_identity("tenant-a", None))
    value = codec.encode(7, salted, page)
    assert isinstance(codec.decode(value, 7, salted), memoryview)
    for asked in (tokens, KeyedTokens(tokens, request_identity("tenant-b", None))):
        assert codec.decode(value, 7, asked) is Rejection.TOKENS
    plain = codec.encode(7, tokens, page)
    assert codec.decode(plain, 7, salted) is Rejection.TOKENS
    assert isinstance(codec.decode(plain, 7, tokens), memoryview)
