"""How many pages a paged manager's memory budget buys, and what that lets it hold.

`available_cache_memory` is split evenly between the `data_parallel_degree` replicas;
each replica holds `floor(memory_per_replica / bytes_per_page)` pages, where
`bytes_per_page = page_size * 2 * num_layers * n_kv_heads * head_dim * dtype size`
(`KVCacheParams.bytes_per_page`). A replica's pages live in one `max.driver.Buffer` per
device, each device holding `n_kv_heads_per_device` of the heads; an MLA latent is whole
on every device, so its bytes count once per device (`kv_dim` 1, one head of
`latent_dim + rope_dim`, times `tensor_parallel_degree`). Pure functions (they
allocate nothing): the manager's sizing classmethods, MAX's, call them.

Groups (`KVCacheParams.groups`, `group_slots`). A replica's groups share one budget
(`groups/budget.py`): each device's share is cut into slots of the least common multiple
of the groups' page sizes there, so a slot holds a whole number of pages of any group,
and the manager hands slots to the group that needs them as it runs. What a budget holds
is counted in slots: one request of `max_seq_len` tokens processed in one step (all its
tokens written before they are read) needs `ceil(pages_per_seq / ratio)` slots in each
group, and holds between steps `request_pages` of each group (a sliding-window group
`min(pages_per_seq, pages_in_window + 1)`, MAX 26.7's `blocks_to_reserve`).

mokv does as MAX 26.7's Jenga pool does (its huge blocks are these slots), without its
padding: a slot is the exact least common multiple, so no byte of a page is padding
(`docs/groups.md#memory`; `docs/benchmarks.md` measures both).

Scaled FP8 pages (`KVCacheParams.quantization`) have a scales leaf beside their values.
A slot holds its pages' scales too, in a region of its own after every slot's values
(`SlotGeometry.scale_bytes`), so each group's values and scales stay one contiguous
view each. A page's scales are its values' bytes times `scale size / (granularity *
value size)`, the same factor in every group (the format is the cache's), so the
`ratios[g]` pages of any group fill a slot's scales exactly as they fill its values.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from math import lcm

from max.driver import Device

from ...config.groups import CacheGroupConfig
from ...config.params import KVCacheParams
from ...errors import InsufficientMemoryError
from .inputs import ceil_div


def group_bytes_per_page(params: KVCacheParams, group: CacheGroupConfig) -> int:
    """Bytes of one page of `group` in one replica."""
    return params.group_params(group).bytes_per_page(group.num_layers)


def device_page_bytes(params: KVCacheParams, group: CacheGroupConfig) -> int:
    """Bytes of one page of `group` on one device of a replica: one page of its buffer
    there (`FullAttentionGroup.blocks`: `[pages, kv_dim, layers, page_size, heads on the
    device, head_dim]`)."""
    shape = params.group_params(group)
    return (
        shape.kv_dim
        * group.num_layers
        * shape.page_size
        * shape.n_kv_heads_per_device
        * shape.head_dim
        * shape.dtype.size_in_bytes
    )


def device_scale_bytes(params: KVCacheParams, group: CacheGroupConfig) -> int:
    """Bytes of the scales of one page of `group` on one device (0: no scales): the
    page's values' bytes, with `scales_per_head` scales of their dtype per head."""
    shape = params.group_params(group)
    if shape.quantization is None:
        return 0
    values = device_page_bytes(params, group)
    per_head = shape.head_dim * shape.dtype.size_in_bytes
    return values // per_head * shape.scales_per_head * shape.quantization.scale_dtype.size_in_bytes


def request_pages(group: CacheGroupConfig, pages_per_seq: int, page_size: int) -> int:
    """Pages one request of `pages_per_seq` pages holds in `group` between steps."""
    if group.window_size is None:
        return pages_per_seq
    return min(pages_per_seq, group.pages_in_window(page_size) + 1)


@dataclass(frozen=True)
class SlotGeometry:
    """How a replica's budget is cut for its groups (`groups/budget.py`)."""

    slot_bytes: int
    """Bytes of one slot on one device: the least common multiple of the page sizes
    (their values'), and the scales of scaled pages (`scale_bytes` of them)."""
    ratios: tuple[int, ...]
    """Pages of each group one slot holds."""
    num_slots: int
    scale_bytes: int = 0
    """Bytes of a slot's scales (of `ratios[g]` pages of any group), 0 without scales."""

    @property
    def value_bytes(self) -> int:
        """Bytes of a slot's values."""
        return self.slot_bytes - self.scale_bytes

    def slots_for(self, pages: Sequence[int]) -> int:
        """Slots that hold `pages[g]` pages of each group."""
        return sum(ceil_div(n, r) for n, r in zip(pages, self.ratios))


def group_slots(params: KVCacheParams, num_layers: int, memory: int) -> SlotGeometry:
    """The slots of one replica's share of `memory` (each device holds its share of a
    replica's, `tensor_parallel_degree` of them)."""
    groups = params.cache_groups(num_layers)
    sizes = [device_page_bytes(params, g) for g in groups]
    values = lcm(*sizes)
    ratios = tuple(values // b for b in sizes)
    scales = ratios[0] * device_scale_bytes(params, groups[0])  # any group's (module doc)
    slot = values + scales
    per_device = memory // params.data_parallel_degree // params.tensor_parallel_degree
    return SlotGeometry(slot, ratios, per_device // slot, scales)


def request_slots(
    params: KVCacheParams, num_layers: int, geometry: SlotGeometry, per_seq: int, requests: int
) -> int:
    """Slots `requests` requests of `per_seq` pages hold between steps (at least the
    slots one of them needs in its step)."""
    groups = params.cache_groups(num_layers)
    held = [requests * request_pages(g, per_seq, params.page_size) for g in groups]
    return max(geometry.slots_for([per_seq] * len(groups)), geometry.slots_for(held))


def pages_per_replica(params: KVCacheParams, num_layers: int, memory: int) -> int:
    """`floor(memory / data_parallel_degree / bytes_per_page(num_layers))`."""
    return memory // params.data_parallel_degree // params.bytes_per_page(num_layers)


def replica_pages(
    params: KVCacheParams, num_layers: int, memory: int, max_seq_len: int
) -> tuple[list[int], SlotGeometry | None]:
    """Each group's pages per replica for `memory` bytes (`available_cache_memory`) over
    all devices, and with groups the slots of the budget they share (`groups/budget.py`;
    None for one group); InsufficientMemoryError unless one sequence of `max_seq_len`
    tokens fits."""
    pages_per_seq = ceil_div(max_seq_len, params.page_size)
    if not params.is_hybrid:
        num_pages = pages_per_replica(params, num_layers, memory)
        if num_pages < pages_per_seq:
            raise InsufficientMemoryError(
                f"available_cache_memory={memory} bytes gives {num_pages} page(s) per "
                f"replica; one sequence of max_seq_len={max_seq_len} needs {pages_per_seq} "
                f"(at {params.bytes_per_page(num_layers)} bytes per page)"
            )
        return [num_pages], None
    slots = group_slots(params, num_layers, memory)
    needed = slots.slots_for([pages_per_seq] * len(slots.ratios))
    if needed > slots.num_slots:
        names = [g.name for g in params.groups]
        raise InsufficientMemoryError(
            f"available_cache_memory={memory} bytes gives {slots.num_slots} slot(s) of "
            f"{slots.slot_bytes} bytes per device and replica for groups {names}; one "
            f"sequence of max_seq_len={max_seq_len} needs {needed} ({pages_per_seq} pages "
            f"of each group, {list(slots.ratios)} to a slot)"
        )
    return [slots.num_slots * r for r in slots.ratios], slots


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
    if params.is_hybrid:  # slots: the budget's, or what its requests hold, if fewer
        geometry = group_slots(params, num_layers, available_cache_memory)
        per_seq = ceil_div(max_seq_len, params.page_size)
        slots = request_slots(params, num_layers, geometry, per_seq, ceil_div(max_batch_size, dp))
        per_device = min(geometry.num_slots, slots) * geometry.slot_bytes
        return dp * params.tensor_parallel_degree * per_device
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
    if params.is_hybrid:  # the most requests whose slots the budget holds
        geometry = group_slots(params, num_layers, available_cache_memory)

        def over(n: int) -> bool:  # n requests hold more slots than the budget's
            return request_slots(params, num_layers, geometry, per_seq, n) > geometry.num_slots

        fit = bisect_left(range(geometry.num_slots + 2), True, key=over)
        return max(1, params.data_parallel_degree * (fit - 1))
    pages = pages_per_replica(params, num_layers, available_cache_memory)
    return max(1, params.data_parallel_degree * (pages // per_seq))


def max_supported_sequence_length(
    params: KVCacheParams, num_layers: int, memory_available: int
) -> int:
    """Longest sequence every replica can hold: `pages_per_replica * page_size`.

    Replicas get equal shares of `memory_available`, so the minimum over replicas is
    the value of any one of them; it is a multiple of `page_size`. With groups, the
    longest `max_seq_len` one of whose requests, in one step, the slots hold
    (`group_slots`; found by bisection: a longer one never needs fewer).
    """
    if not params.is_hybrid:
        return pages_per_replica(params, num_layers, memory_available) * params.page_size
    geometry = group_slots(params, num_layers, memory_available)
    num_groups = len(geometry.ratios)

    def short(num_pages: int) -> bool:  # one request of num_pages pages does not fit
        return geometry.slots_for([num_pages] * num_groups) > geometry.num_slots

    bound = geometry.num_slots * max(geometry.ratios) + 2
    return (bisect_left(range(bound), True, key=short) - 1) * params.page_size
