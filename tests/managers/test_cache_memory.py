"""The cache's K/V buffers on the CPU device are advised onto transparent huge pages."""

import sys
from pathlib import Path

import mokv
import pytest
from max.driver import CPU, Buffer
from max.dtype import DType
from mokv.cache.cache_memory import HUGE_PAGE, advise_huge_pages, aligned_interior

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or not THP_MODE.exists() or "[never]" in THP_MODE.read_text(),
    reason="needs Linux with transparent huge pages not set to 'never'",
)


def _thp_eligible(address: int) -> bool:
    """smaps' THPeligible flag of the mapping that holds `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: "lo-hi perms ..."
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "THPeligible:":
            return line.split()[1] == "1"
    raise AssertionError(f"no mapping holds {address:#x}")


def _big_params(strategy: str) -> mokv.KVCacheParams:
    # One page of 128 tokens x 8 heads x 128 dims, K and V, float32: 1 MiB per layer.
    return mokv.KVCacheParams(
        DType.float32, 8, 128, page_size=128, cache_strategy=mokv.KVCacheStrategy(strategy)
    )


def test_paged_and_continuous_caches_are_advised(session):
    paged = mokv.PagedKVCacheManager(_big_params("paged"), 2, 1024, 1, [CPU()], session,
                                     available_cache_memory=12 << 20)
    continuous = mokv.ContinuousKVCacheManager(_big_params("continuous"), 4, 1024, 1,
                                               [CPU()], session)
    for blocks in (paged.replicas[0].blocks[0], continuous.blocks[0]):
        lo, hi = aligned_interior(blocks)
        assert hi - lo >= 4 * HUGE_PAGE
        assert _thp_eligible(lo) and _thp_eligible(hi - 1)


def test_advice_covers_the_aligned_interior():
    buffer = Buffer(DType.float32, [(6 << 20) + 100], device=CPU())  # 24 MiB and a bit
    assert advise_huge_pages(buffer) is True
    lo, hi = aligned_interior(buffer)
    assert hi - lo >= 11 * HUGE_PAGE
    assert _thp_eligible(lo) and _thp_eligible(hi - 1)


def test_a_buffer_without_a_whole_huge_page_is_left_alone():
    small = Buffer(DType.float32, [1024], device=CPU())
    assert advise_huge_pages(small) is False
