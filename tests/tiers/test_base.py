"""The tier protocol: every tier offers all of it, and the chain tail hashes each page
once however many tiers read it."""

import inspect

import pytest
from mokv.metrics import KVCacheMetrics, TierMetrics
from mokv.tiers.base import ChainTail, Tier
from mokv.tiers.host import HostTier
from mokv.tiers.remote import RemoteTier


def protocol_members(protocol: type) -> set[str]:
    return {name for name in vars(protocol) if not name.startswith("_")} | set(
        protocol.__annotations__)


@pytest.mark.parametrize("tier", [HostTier, RemoteTier])
def test_every_tier_offers_the_whole_protocol(tier):
    members = protocol_members(Tier)
    assert {"lookup", "load", "store", "reset", "close", "metrics"} <= members
    assert members <= set(dir(tier)), members - set(dir(tier))
    for name in members - set(Tier.__annotations__):
        ours, theirs = (inspect.signature(getattr(cls, name)) for cls in (Tier, tier))
        assert list(ours.parameters) == list(theirs.parameters), name


def test_the_chain_tail_reads_each_page_once():
    read = []

    def rest():
        for i in range(1, 5):
            read.append(i)
            yield i, bytes([i])

    tail = ChainTail((0, b"\0"), rest())
    first = tail.pages(0)
    assert [next(first), next(first)] == [(0, b"\0"), (1, b"\1")]  # a tier stops at a miss
    assert list(tail.pages(1)) == [(i, bytes([i])) for i in range(1, 5)]  # the next goes on
    assert list(tail.pages(3)) == [(3, b"\3"), (4, b"\4")]
    assert list(tail.pages(5)) == []
    assert read == [1, 2, 3, 4]


def test_metrics_sum_by_tier_and_name_the_host_and_remote_tiers():
    host = TierMetrics(cache_tokens=8, used_pages=3, total_pages=10, bytes_stored=5,
                       bytes_loaded=7)
    assert host + host == TierMetrics(16, 6, 20, 10, 14)
    remote = TierMetrics(cache_tokens=4, bytes_loaded=9)
    disk = TierMetrics(cache_tokens=2)
    m = KVCacheMetrics(input_tokens=40, cache_tokens=20,
                       tiers={"host": host, "remote": remote, "disk": disk})
    assert (m.host_cache_tokens, m.host_used_pages, m.host_total_pages) == (8, 3, 10)
    assert (m.bytes_to_host, m.bytes_from_host) == (5, 7)
    assert (m.remote_cache_tokens, m.bytes_from_remote) == (4, 9)
    assert m.device_cache_tokens == 20 - 8 - 4 - 2  # every tier's tokens are not the device's
    assert KVCacheMetrics().host_cache_tokens == KVCacheMetrics().device_cache_tokens == 0
