"""load_kv_manager: the manager for a `KVCacheParams`, or the null one on virtual devices.

The one place that turns `params.cache_strategy` into a manager; everything downstream
asks the manager (`manager.layout`), never the strategy again. The continuous strategy
gets `ContinuousBatchingKVCacheManager`, which answers the request contract and MAX's
sequence-id flow alike (`claim(n=...)`, `fetch(seq_ids=...)`: what MAX's own
continuous-cache tests call on what their `load_kv_manager` returns).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from max import driver
from max.driver import Device
from max.engine import InferenceSession

from ..config.events import KVEventsConfig
from ..config.params import KVCacheParams, KVCacheStrategy
from .base import KVCacheManager
from .null import NullKVCacheManager
from .paged import PagedKVCacheManager
from .sequences import ContinuousBatchingKVCacheManager


def load_kv_manager(
    params: KVCacheParams,
    max_batch_size: int | None = None,
    max_seq_len: int | None = None,
    num_layers: int | None = None,
    devices: Sequence[Device] = (),
    session: InferenceSession | None = None,
    available_cache_memory: int | None = None,
    page_size: int = 128,
    enable_runtime_checks: bool = False,
    kv_events_config: KVEventsConfig | None = None,
    *,
    max_cache_batch_size: int | None = None,
) -> KVCacheManager:
    """Builds the manager that `params.cache_strategy` names.

    In MAX's virtual-device (compile-only) mode no memory can be used, so a
    `NullKVCacheManager` with the strategy's layout is returned instead.
    `available_cache_memory` is required by the paged strategy, and
    `kv_events_config` (MAX's spelling of `params.kv_events`) applies to it only.
    `max_cache_batch_size` is MAX's earlier name of `max_batch_size` (give one).
    `max_seq_len`, `num_layers` and `session` are required (keywords in MAX's order).
    """
    if max_cache_batch_size is not None:
        if max_batch_size is not None:
            raise TypeError(
                f"max_batch_size={max_batch_size!r} and max_cache_batch_size="
                f"{max_cache_batch_size!r} name the same setting; give one"
            )
        max_batch_size = max_cache_batch_size
    max_batch_size = _required("max_batch_size", max_batch_size)
    max_seq_len = _required("max_seq_len", max_seq_len)
    num_layers = _required("num_layers", num_layers)
    session = _required("session", session)
    if driver.is_virtual_device_mode():
        return NullKVCacheManager(
            params,
            max_batch_size,
            max_seq_len,
            num_layers,
            devices,
            session,
            available_cache_memory or 0,
            page_size,
        )
    if params.cache_strategy is KVCacheStrategy.CONTINUOUS:
        if kv_events_config is not None:
            raise ValueError(
                f"kv_events_config={kv_events_config!r}: the continuous cache strategy "
                "publishes no KV-cache events (they are the paged prefix cache's)"
            )
        return ContinuousBatchingKVCacheManager(
            params, max_batch_size, max_seq_len, num_layers, devices, session
        )
    if available_cache_memory is None:
        raise ValueError("available_cache_memory is required for the paged cache strategy")
    return PagedKVCacheManager(
        params,
        max_batch_size,
        max_seq_len,
        num_layers,
        devices,
        session,
        available_cache_memory,
        page_size=page_size,
        enable_runtime_checks=enable_runtime_checks,
        kv_events_config=kv_events_config,
    )


T = TypeVar("T")


def _required(name: str, value: T | None) -> T:
    """`value`, or TypeError naming the missing argument."""
    if value is None:
        raise TypeError(f"load_kv_manager() needs {name}")
    return value
