"""How many pages a paged manager's memory budget buys, and what that lets it hold.

`available_cache_memory` is split evenly between the `data_parallel_degree` replicas;
each replica holds `floor(memory_per_replica / bytes_per_page)` pages, where
`bytes_per_page = page_size * 2 * num_layers * n_kv_heads * head_dim * dtype size`
(`KVCacheParams.bytes_per_page`). A replica's pages live in one `max.driver.Buffer` per
device, each device holding `n_kv_heads_per_device` of the heads; an MLA latent is whole
on every device, so its bytes count once per device (`kv_dim` 1, one head of
`latent_dim + rope_dim`, times `tensor_parallel_degree`). Pure functions (they
allocate nothing): the manager's sizing classmethods, MAX's, call them.

Groups (`KVCacheParams.groups`, `group_pages`). Each group has a pool of its own, so a
replica's memory is split between them when the manager is built:

    1. every group first gets `ceil(max_seq_len / page_size)` pages: one request of
       `max_seq_len` tokens processed in one step (all its tokens written before they
       are read) fits any empty pool;
    2. the rest is shared in proportion to the bytes one request of `max_seq_len`
       tokens holds in each group between steps: a full group its every page, a
       sliding-window group `min(pages_per_seq, pages_in_window + 1)` (MAX 26.7's
       `blocks_to_reserve`), so that every group runs out at about the same number of
       requests.

mokv differs from MAX 26.7 on purpose: MAX's Jenga pool lets any group take any huge
block, so memory moves to the group under pressure; mokv's shares are fixed (each
pool's accounting stays exact, and no group evicts another's prefix pages), at the
price of step 1's pages per group (`docs/benchmarks.md` measures both).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

from max.driver import Device

from ...config.groups import CacheGroupConfig
from ...config.params import KVCacheParams
from ...errors import InsufficientMemoryError
from .inputs import ceil_div


def group_bytes_per_page(params: KVCacheParams, group: CacheGroupConfig) -> int:
    """Bytes of one page of `group` in one replica."""
    return params.group_params(group).bytes_per_page(group.num_layers)


def request_pages(group: CacheGroupConfig, pages_per_seq: int, page_size: int) -> int:
    """Pages one request of `pages_per_seq` pages holds in `group` between steps."""
    if group.window_size is None:
        return pages_per_seq
    return min(pages_per_seq, group.pages_in_window(page_size) + 1)


def group_pages(params: KVCacheParams, num_layers: int, max_seq_len: int, memory: int) -> list[int]:
    """Pages of each group of one replica (the module docstring's split; with one full
    group, `pages_per_replica`). A budget below step 1's pages is split by step 2
    alone, which leaves some group short of one request (the manager then refuses it)."""
    if not params.is_hybrid:
        return [pages_per_replica(params, num_layers, memory)]
    groups = params.cache_groups(num_layers)
    per_replica = memory // params.data_parallel_degree
    per_seq = ceil_div(max_seq_len, params.page_size)
    sizes = [group_bytes_per_page(params, g) for g in groups]
    shares = [request_pages(g, per_seq, params.page_size) * b for g, b in zip(groups, sizes)]
    floor = per_seq * sum(sizes)
    if per_replica < floor:
        return [per_replica * share // sum(shares) // b for share, b in zip(shares, sizes)]
    rest = per_replica - floor
    return [per_seq + rest * share // sum(shares) // b for share, b in zip(shares, sizes)]


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
    if params.is_hybrid:  # per group: its pages, or what its requests hold, if fewer
        groups = params.cache_groups(num_layers)
        split = group_pages(params, num_layers, max_seq_len, available_cache_memory)
        per_seq = ceil_div(max_seq_len, params.page_size)
        reqs = ceil_div(max_batch_size, dp)
        return dp * sum(
            min(n, max(per_seq, reqs * request_pages(g, per_seq, params.page_size)))
            * group_bytes_per_page(params, g)
            for g, n in zip(groups, split)
        )
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
    per_seq = ceil_div(max_seq_len, params.page_size)
    if params.is_hybrid:  # the group that runs out first
        groups = params.cache_groups(num_layers)
        split = group_pages(params, num_layers, max_seq_len, available_cache_memory)
        fit = min(n // request_pages(g, per_seq, params.page_size) for g, n in zip(groups, split))
        return max(1, params.data_parallel_degree * fit)
    pages = pages_per_replica(params, num_layers, available_cache_memory)
    return max(1, params.data_parallel_degree * (pages // per_seq))


def max_supported_sequence_length(
    params: KVCacheParams, num_layers: int, memory_available: int
) -> int:
    """Longest sequence every replica can hold: `pages_per_replica * page_size`.

    Replicas get equal shares of `memory_available`, so the minimum over replicas is
    the value of any one of them; it is a multiple of `page_size`. With groups, the
    longest `max_seq_len` whose split (`group_pages`) gives every group step 1's pages
    (found by bisection: a longer one never needs fewer).
    """
    if not params.is_hybrid:
        return pages_per_replica(params, num_layers, memory_available) * params.page_size
    ps = params.page_size

    def short(num_pages: int) -> bool:  # some group lacks one request of num_pages pages
        split = group_pages(params, num_layers, num_pages * ps, memory_available)
        return min(split) < num_pages

    bound = memory_available // params.data_parallel_degree // ps + 2
    return (bisect_left(range(bound), True, key=short) - 1) * ps
