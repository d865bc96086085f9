"""How many pages a paged manager's memory budget buys, and what that lets it hold.

`available_cache_memory` is split evenly between the `data_parallel_degree` replicas;
each replica holds `floor(memory_per_replica / bytes_per_page)` pages, where
`bytes_per_page = page_size * 2 * num_layers * n_kv_heads * head_dim * dtype size`
(`KVCacheParams.bytes_per_page`). A replica's pages live in one `max.driver.Buffer` per
device, each device holding `n_kv_heads_per_device` of the heads. Pure functions (they
allocate nothing): the manager's sizing classmethods, MAX's, call them.
"""

from __future__ import annotations

from collections.abc import Sequence

from max.driver import Device

from ...config.params import KVCacheParams
from ...errors import InsufficientMemoryError
from .inputs import ceil_div


def pages_per_replica(params: KVCacheParams, num_layers: int, memory: int) -> int:
    """`floor(memory / data_parallel_degree / bytes_per_page(num_layers))`."""
    return memory // params.data_parallel_degree // params.bytes_per_page(num_layers)


def check_devices_hold(params: KVCacheParams, memory: int, devices: Sequence[Device]) -> None:
    """InsufficientMemoryError unless each device can hold its share of `memory` (a
    replica's share, split over its devices), read from MAX's `Device.stats`: a budget
    past the machine would fail later, in a bare MemoryError of the page bookkeeping or
    MAX's allocator. A device that reports no total is not checked."""
    share = memory // params.data_parallel_degree // params.tensor_parallel_degree
    for device in devices:
        total = device.stats.get("total_memory") if hasattr(device, "stats") else None
        if isinstance(total, int) and total > 0 and share > total:
            raise InsufficientMemoryError(
                f"available_cache_memory={memory} bytes puts {share} on {device}, which "
                f"has {total} in all"
            )


def estimated_memory_size(
    params: KVCacheParams,
    max_batch_size: int,
    max_seq_len: int,
    num_layers: int,
    available_cache_memory: int,
) -> int:
    """Bytes the cache needs for these arguments: per replica, the pages of the
    budget or, if fewer, the pages its requests can fill, all at `max_seq_len`.

    `data_parallel_degree * min(pages_per_replica, ceil(max_batch_size /
    data_parallel_degree) * ceil(max_seq_len / page_size)) * bytes_per_page`.
    MAX 25.7 caps by `max_batch_size * ceil(max_seq_len / page_size)` pages as well;
    mokv differs on purpose twice: it rounds the budget down to whole pages (the
    bytes a manager given that budget allocates), and with several replicas it caps
    each by the requests that replica can hold, not by `max_batch_size` (MAX's
    figure is `data_parallel_degree` times too large there).
    """
    dp = params.data_parallel_degree
    pages = pages_per_replica(params, num_layers, available_cache_memory)
    needed = ceil_div(max_batch_size, dp) * ceil_div(max_seq_len, params.page_size)
    return dp * min(pages, needed) * params.bytes_per_page(num_layers)


def infer_optimal_batch_size(
    params: KVCacheParams,
    max_seq_len: int,
    num_layers: int,
    available_cache_memory: int,
) -> int:
    """Most requests of `max_seq_len` tokens that fit at once, at least 1.

    `max(1, data_parallel_degree * floor(pages_per_replica / ceil(max_seq_len / page_size)))`.
    """
    pages = pages_per_replica(params, num_layers, available_cache_memory)
    per_seq = ceil_div(max_seq_len, params.page_size)
    return max(1, params.data_parallel_degree * (pages // per_seq))


def max_supported_sequence_length(
    params: KVCacheParams, num_layers: int, memory_available: int
) -> int:
    """Longest sequence every replica can hold: `pages_per_replica * page_size`.

    Replicas get equal shares of `memory_available`, so the minimum over replicas is
    the value of any one of them; it is a multiple of `page_size`.
    """
    return pages_per_replica(params, num_layers, memory_available) * params.page_size
