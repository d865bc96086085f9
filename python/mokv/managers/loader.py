"""load_kv_manager: the manager for a `KVCacheParams`, or the null one on virtual devices.

The one place that turns `params.cache_strategy` into a manager; everything downstream
asks the manager (`manager.layout`), never the strategy again.
"""

from __future__ import annotations

from collections.abc import Sequence

from max import driver
from max.driver import Device
from max.engine import InferenceSession

from ..config.events import KVEventsConfig
from ..config.params import KVCacheParams, KVCacheStrategy
from .base import KVCacheManager
from .continuous import ContinuousKVCacheManager
from .null import NullKVCacheManager
from .paged import PagedKVCacheManager


def load_kv_manager(
    params: KVCacheParams,
    max_batch_size: int,
    max_seq_len: int,
    num_layers: int,
    devices: Sequence[Device],
    session: InferenceSession,
    available_cache_memory: int | None = None,
    page_size: int = 128,
    enable_runtime_checks: bool = False,
    kv_events_config: KVEventsConfig | None = None,
) -> KVCacheManager:
    """Builds the manager that `params.cache_strategy` names.

    In MAX's virtual-device (compile-only) mode no memory can be used, so a
    `NullKVCacheManager` with the strategy's layout is returned instead.
    `available_cache_memory` is required by the paged strategy, and
    `kv_events_config` (MAX's spelling of `params.kv_events`) applies to it only.
    """
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
        return ContinuousKVCacheManager(
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
