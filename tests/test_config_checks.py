"""Every configuration value is checked where it is given (issue 41): `KVCacheParams`, the
tier configs, `KVEventsConfig` and the managers' keywords refuse what would later fail
(an `OverflowError`, a bare `MemoryError`, an `AttributeError`) or do something else
(bind another port), with a typed error naming the value; a manager refuses the
settings it cannot honour."""

from __future__ import annotations

import math
import re

import mokv
import pytest
from max.driver import CPU
from max.dtype import DType
from max.engine import InferenceSession
from mokv.tiers.host import host_memory_bytes

SHAPE = dict(dtype=DType.float32, n_kv_heads=2, head_dim=8, page_size=4)


def params(**overrides) -> mokv.KVCacheParams:
    return mokv.KVCacheParams(**{**SHAPE, "enable_prefix_caching": True, **overrides})


@pytest.fixture(scope="module")
def session():
    return InferenceSession(devices=[CPU()])


@pytest.mark.parametrize("fields,error,match", [
    (dict(enable_prefix_caching="yes"), TypeError, "enable_prefix_caching.*'yes'"),
    (dict(enable_prefix_caching=1), TypeError, "enable_prefix_caching.*1"),
    (dict(prefix_hash_seed=1.5), ValueError, r"prefix_hash_seed.*1\.5"),
    (dict(prefix_hash_seed=-1), ValueError, "prefix_hash_seed.*-1"),
    (dict(prefix_hash_seed=2**64), ValueError, "prefix_hash_seed.*18446744073709551616"),
    (dict(kv_events="tcp://*:5557"), TypeError, "kv_events.*'tcp://\\*:5557'"),
    (dict(kv_events=mokv.KVEventsConfig(endpoint="tcp://*:65535"), data_parallel_degree=2,
          n_devices=2), ValueError, "replica 1 port 65536"),
    (dict(kv_events=mokv.KVEventsConfig(endpoint="tcp://*:5557",
                                        replay_endpoint="tcp://*:5558"),
          data_parallel_degree=2, n_devices=2), ValueError, "'tcp://\\*:5558'"),
])
def test_kv_cache_params_refuse(fields, error, match):
    with pytest.raises(error, match=match):
        params(**fields)


@pytest.mark.parametrize("endpoint,match", [
    ("tcp://*:99999", "port 99999 is past 65535"),
    ("tcp://*:abc", "tcp://host:port"),
    ("tcp://*", "tcp://host:port"),
    ("tcp://:5557", "tcp://host:port"),
    ("udp://*:5557", "is not a ZMQ address"),
    ("inproc://", "is not a ZMQ address"),
    ("*:5557", "is not a ZMQ address"),
])
def test_events_endpoints_are_zmq_addresses_with_real_ports(endpoint, match):
    with pytest.raises(ValueError, match=re.escape(repr(endpoint)) + ".*" + match):
        mokv.KVEventsConfig(endpoint=endpoint)
    with pytest.raises(ValueError, match="replay_endpoint=" + re.escape(repr(endpoint))):
        mokv.KVEventsConfig(endpoint="inproc://e", replay_endpoint=endpoint)


def test_events_config_refuses_what_zmq_would_refuse_later():
    with pytest.raises(ValueError, match="hwm=2147483648 is past"):
        mokv.KVEventsConfig(hwm=2**31)
    with pytest.raises(ValueError, match="both 'inproc://x'"):
        mokv.KVEventsConfig(endpoint="inproc://x", replay_endpoint="inproc://x")
    with pytest.raises(TypeError, match="endpoint must be a str, got 5557"):
        mokv.KVEventsConfig(endpoint=5557)
    mokv.KVEventsConfig(endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")


@pytest.mark.parametrize("gb,error,match", [
    (math.inf, ValueError, "finite number of GiB > 0, got inf"),
    (math.nan, ValueError, "got nan"),
    (-1, ValueError, "got -1"),
    (True, ValueError, "got True"),
    (1e6, mokv.InsufficientMemoryError, "swap_space_gb=1000000.0 is more than any machine's"),
])
def test_host_tier_size_is_finite_and_below_any_machines_memory(gb, error, match):
    with pytest.raises(error, match=match):
        mokv.HostTierConfig(swap_space_gb=gb)
    with pytest.raises(error, match=match):  # MAX's flat spelling, named too
        params(enable_kvcache_swapping_to_host=True, host_kvcache_swap_space_gb=gb)


def test_a_manager_refuses_a_host_tier_larger_than_its_machine(session):
    memory = host_memory_bytes()
    assert memory > 2**20
    gb = 2 * memory / 2**30
    p = params(tiers=(mokv.HostTierConfig(swap_space_gb=gb),))  # a config for a bigger machine
    with pytest.raises(mokv.InsufficientMemoryError, match=f"swap_space_gb={gb!r} is more than "
                       "this machine's"):
        _paged(session, p)


@pytest.mark.parametrize("url,match", [
    ("redis://h:abc/0", "port is not a number in 1-65535"),
    ("redis://h:99999/0", "port is not a number in 1-65535"),
    ("redis://h:0/0", "port is not a number in 1-65535"),
    ("redis://:6379/0", "no host"),
    ("redis://h:6379/x", "database 'x' is not a number"),
    ("unix://", "socket's path"),
    ("unix:///run/redis.sock?db=a", "Invalid value for 'db'"),
])
def test_remote_urls_are_ones_redis_connects_to_as_written(url, match):
    with pytest.raises(ValueError, match=re.escape(repr(url)) + ".*" + match):
        mokv.RemoteTierConfig(url=url, namespace="m")
    with pytest.raises(ValueError, match=match):
        params(remote_kvcache_url=url, remote_kvcache_namespace="m")


def test_a_remote_urls_password_stays_out_of_the_error():
    with pytest.raises(ValueError, match=r"'redis://u:\*\*\*@h:x/0'") as error:
        mokv.RemoteTierConfig(url="redis://u:secret@h:x/0", namespace="m")
    assert "secret" not in str(error.value)


@pytest.mark.parametrize("url", [
    # Issue 56: the first two printed the password (another scheme; a query option).
    "http://u:PASSWD@h:6379/0", "redis://h:6379/0?password=PASSWD&socket_timeout=x",
    "redis://u:PASSWD@h:99999/0", "rediss://:PASSWD@[::1:6379/0",
    "redis://u:PASS%57D@h:6379/x", "redis://u:PASSWD@h:6379/0?Password=PASSWD&db=x",
])
def test_no_error_or_repr_shows_a_remote_password(url):
    for make in (lambda: mokv.RemoteTierConfig(url=url, namespace="m"),
                 lambda: params(remote_kvcache_url=url, remote_kvcache_namespace="m"),
                 lambda: params(remote_kvcache_url=url)):
        with pytest.raises(ValueError, match=r"\*\*\*") as error:
            make()
        assert "PASSWD" not in str(error.value) and "PASS%57D" not in str(error.value)


def test_a_remote_configs_repr_shows_no_secret():
    config = mokv.RemoteTierConfig(url="redis://u:PASSWD@h:6379/0?password=PASSWD",
                                   namespace="m", mac_key="MACKEY-0123456789")
    shown = [repr(config), repr(params(tiers=(config,)))]
    with pytest.raises(ValueError) as twice:  # an error that shows the configs
        params(tiers=(config, config))
    with pytest.raises(ValueError) as both_ways:
        params(tiers=(config,), remote_kvcache_url="redis://u:PASSWD@h/0")
    shown += [str(twice.value), str(both_ways.value)]
    for text in shown:
        assert "PASSWD" not in text and "MACKEY" not in text and "u:***@h" in text


@pytest.mark.parametrize("timeout", [math.inf, math.nan, 0, -0.5, "1", 1e12, 60.5, True])
def test_remote_timeouts_are_positive_and_at_most_a_minute(timeout):
    # 1e12 s was accepted, and every maybe_reserve then raised OverflowError (issue 56).
    with pytest.raises(ValueError, match=re.escape(
            f"timeout_s must be a number of seconds in (0, 60], got {timeout!r}")):
        mokv.RemoteTierConfig(url="redis://h/0", namespace="m", timeout_s=timeout)
    with pytest.raises(ValueError, match="timeout_s"):
        params(remote_kvcache_url="redis://h/0", remote_kvcache_namespace="m",
               remote_kvcache_timeout_s=timeout)


def _paged(session, p, **keywords):
    return mokv.PagedKVCacheManager(p, 2, 16, 2, [CPU()], session,
                                    16 * p.bytes_per_page(2), **keywords)


def test_the_managers_event_keywords_are_checked(session):
    with pytest.raises(TypeError, match="kv_events_config.*'tcp://\\*:5557'.*zmq_endpoint_base"):
        _paged(session, params(), kv_events_config="tcp://*:5557")
    with pytest.raises(ValueError, match="zmq_endpoint_base='tcp://\\*:99999'.*past 65535"):
        _paged(session, params(), zmq_endpoint_base="tcp://*:99999")
    with pytest.raises(TypeError, match="zmq_endpoint_base must be a str.*5557"):
        _paged(session, params(), zmq_endpoint_base=5557)


CONTINUOUS = [mokv.ContinuousKVCacheManager, mokv.ContinuousBatchingKVCacheManager,
              mokv.MojoContinuousBatchingKVCacheManager]


@pytest.mark.parametrize("manager", CONTINUOUS, ids=lambda m: m.__name__)
@pytest.mark.parametrize("setting,match", [
    (dict(tiers=(mokv.HostTierConfig(swap_space_gb=0.001),)), "cannot honour tiers=.*HostTier"),
    (dict(remote_kvcache_url="redis://h/0", remote_kvcache_namespace="m"),
     "cannot honour tiers=.*RemoteTier"),
    (dict(kv_events=mokv.KVEventsConfig(endpoint="inproc://c")), "cannot honour kv_events="),
])
def test_the_continuous_managers_refuse_what_they_cannot_honour(session, manager, setting,
                                                                 match):
    p = params(cache_strategy="continuous", **setting)
    with pytest.raises(ValueError, match=match):
        manager(p, 2, 16, 2, [CPU()], session)


def test_load_kv_manager_refuses_events_for_the_continuous_strategy(session):
    with pytest.raises(ValueError, match="kv_events_config=.*continuous cache strategy"):
        mokv.load_kv_manager(params(cache_strategy="continuous"), 2, 16, 2, [CPU()], session,
                             kv_events_config=mokv.KVEventsConfig(endpoint="inproc://l"))


@pytest.mark.parametrize("name", ["buffer_steps", "hwm", "max_queue_size"])
def test_events_counts_fit_what_holds_them(name):
    # Issue 56's probe: buffer_steps=2**63 was accepted, then the publisher's deque
    # raised OverflowError when the manager was built.
    with pytest.raises(ValueError, match=f"{name}={2**63} is past the largest, 2147483647"):
        mokv.KVEventsConfig(**{name: 2**63})


@pytest.mark.parametrize("arg,value,error,match", [
    (1, 2**32, ValueError, "max_batch_size must be a positive int up to 2\\*\\*32 - 1"),
    (2, 2**64, ValueError, "max_seq_len must be a positive int up to 2\\*\\*32 - 1"),
    (3, 2**63, ValueError, "num_layers.*9223372036854775808"),
    # A budget past the machine failed in a bare MemoryError or OverflowError.
    (6, 2**63, mokv.InsufficientMemoryError, f"available_cache_memory={2**63} bytes puts"),
    (1, 2**31, mokv.InsufficientMemoryError, "max_batch_size=2147483648.*do not fit"),
])
def test_a_managers_sizes_are_refused_before_they_fail(session, arg, value, error, match):
    p = params()
    args = [p, 2, 16, 2, [CPU()], session, 16 * p.bytes_per_page(2)]
    args[arg] = value
    with pytest.raises(error, match=match):
        mokv.PagedKVCacheManager(*args)


def test_a_cache_shape_no_device_holds_is_insufficient_memory(session):
    # MAX raised a bare ValueError ("Memory allocation failed") or, past 64 bits, a
    # TypeError from its Buffer constructor.
    from mokv.cache.cache_memory import cache_buffer

    for shape in ([2**36], [2**40, 2**30], [2**64]):  # 256 GiB: MAX's allocator refuses it
        with pytest.raises(mokv.InsufficientMemoryError, match=r"a K/V buffer of shape"):
            cache_buffer(DType.float32, shape, CPU())
