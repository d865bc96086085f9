"""MAX's flat configuration spellings (mokv/config/flat.py) give exactly the nested
params, and nothing else in mokv reads them."""

import dataclasses
import re
from pathlib import Path

import mokv
import pytest
from max.driver import CPU
from max.dtype import DType
from mokv.config.flat import FLAT_SPELLINGS
from mokv.config.params import with_manager_events

SHAPE = dict(dtype=DType.float32, n_kv_heads=2, head_dim=8, page_size=4,
             enable_prefix_caching=True)
HOST = dict(enable_kvcache_swapping_to_host=True, host_kvcache_swap_space_gb=0.5,
            host_kvcache_min_hits=2)
REMOTE = dict(remote_kvcache_url="redis://10.0.0.5:6379/0", remote_kvcache_namespace="llama",
              remote_kvcache_timeout_s=1.5)
HOST_TIER = mokv.HostTierConfig(swap_space_gb=0.5, min_hits=2)
REMOTE_TIER = mokv.RemoteTierConfig(url="redis://10.0.0.5:6379/0", namespace="llama",
                                    timeout_s=1.5)


@pytest.mark.parametrize("flat,tiers", [
    (HOST, (HOST_TIER,)),
    (REMOTE, (REMOTE_TIER,)),
    ({**REMOTE, **HOST}, (HOST_TIER, REMOTE_TIER)),  # the host tier first, as always
    (dict(enable_kvcache_swapping_to_host=True, host_kvcache_swap_space_gb=3),
     (mokv.HostTierConfig(swap_space_gb=3),)),
    (dict(remote_kvcache_url="unix:///run/redis.sock", remote_kvcache_namespace="m"),
     (mokv.RemoteTierConfig(url="unix:///run/redis.sock", namespace="m"),)),
    # As before: the host settings mean nothing with the tier off, nor the remote ones
    # without a URL.
    (dict(enable_kvcache_swapping_to_host=False, host_kvcache_swap_space_gb=3), ()),
    (dict(remote_kvcache_url=None, remote_kvcache_namespace="m"), ()),
])
def test_flat_and_nested_spellings_give_equal_params(flat, tiers):
    params = mokv.KVCacheParams(**SHAPE, **flat)
    assert params == mokv.KVCacheParams(**SHAPE, tiers=tiers)
    assert params.tiers == tiers


def test_flat_spellings_through_dataclasses_replace():
    base = mokv.KVCacheParams(**SHAPE)
    assert dataclasses.replace(base, **HOST) == mokv.KVCacheParams(**SHAPE, tiers=(HOST_TIER,))
    with_remote = mokv.KVCacheParams(**SHAPE, tiers=(REMOTE_TIER,))
    assert dataclasses.replace(with_remote, **HOST).tiers == (HOST_TIER, REMOTE_TIER)
    with pytest.raises(ValueError, match="the remote tier is given twice"):
        dataclasses.replace(with_remote, **REMOTE)


def test_errors_name_the_flat_spelling():
    with pytest.raises(ValueError, match=r"swap_space_gb must be a finite number of GiB > 0, "
                                         r"got None "
                                         r"\(flat spellings given: enable_kvcache_swapping_to_"
                                         r"host=True; .*host_kvcache_swap_space_gb -> swap_space"):
        mokv.KVCacheParams(**SHAPE, enable_kvcache_swapping_to_host=True)
    with pytest.raises(ValueError, match="namespace.*got None.*remote_kvcache_namespace -> "):
        mokv.KVCacheParams(**SHAPE, remote_kvcache_url="redis://h/0")
    with pytest.raises(ValueError, match="HostTierConfig needs enable_prefix_caching"):
        mokv.KVCacheParams(**{**SHAPE, "enable_prefix_caching": False}, **HOST)
    with pytest.raises(TypeError, match="host_kvcache_swap_space"):
        mokv.KVCacheParams(**SHAPE, host_kvcache_swap_space=1)  # a typo is no spelling
    with pytest.raises(TypeError, match="tiers holds 'host'"):
        mokv.KVCacheParams(**SHAPE, tiers=("host",))
    with pytest.raises(ValueError, match="two 'host' tiers"):
        mokv.KVCacheParams(**SHAPE, tiers=(HOST_TIER, mokv.HostTierConfig(1)))


def test_manager_keywords_give_params_kv_events(session):
    base = mokv.KVCacheParams(**SHAPE)
    events = mokv.KVEventsConfig(endpoint="inproc://mokv-compat")
    nested = dataclasses.replace(base, kv_events=events)
    assert with_manager_events(base, "inproc://mokv-compat", None) == nested
    assert with_manager_events(base, None, events) == nested
    assert with_manager_events(base, "inproc://mokv-compat", events) == nested
    assert with_manager_events(nested, None, events) is nested
    assert with_manager_events(base, None, None) is base
    with pytest.raises(ValueError, match="zmq_endpoint_base='inproc://a' disagrees"):
        with_manager_events(base, "inproc://a", events)
    with pytest.raises(ValueError, match="disagree with params.kv_events"):
        with_manager_events(nested, "inproc://other", None)
    with pytest.raises(ValueError, match="prefix_hash='builtin'"):
        with_manager_events(dataclasses.replace(base, prefix_hash="builtin"), None, events)
    memory = 16 * base.bytes_per_page(2)
    m = mokv.PagedKVCacheManager(base, 2, 16, 2, [CPU()], session, memory,
                                 zmq_endpoint_base="inproc://mokv-compat")
    try:
        assert m.params == nested and len(m.kv_event_publishers) == 1
    finally:
        m.close()


def test_only_the_compat_module_reads_flat_spellings():
    """Internal code reads the nested form: no attribute of a flat name anywhere else."""
    package = Path(mokv.__file__).parent
    flat = re.compile(r"\.({})\b".format("|".join(sorted(FLAT_SPELLINGS))))
    readers = [
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if path.name != "flat.py" and flat.search(path.read_text())
    ]
    assert readers == []
