"""MAX's other spellings of the manager operations, defined once over the contract.

MAX renamed parts of its manager interface between releases; mokv answers to both.
Everything here is a thin alias of a `KVCacheManager` member (see base.py), so a
manager implements the contract and gets these for free. The other compatibility
pieces: the continuous cache's sequence-id flow (`claim(n) -> seq_ids`, ...) is its own
class, `ContinuousBatchingKVCacheManager` (sequences.py), and MAX's flat configuration
spellings are mapped in `mokv.params_compat`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from max.driver import Device

from ..context import RequestID, TextGenerationContext
from ..errors import InsufficientPagesError
from .base import KVCacheManager


class MaxManagerAPI:
    """The MAX names of `external_claim`, `maybe_reserve`, `fetch` and `input_symbols`,
    and the host-tier counters (0 for a manager without a host tier)."""

    def claim(self: KVCacheManager, request_id: RequestID, replica_idx: int | None = None) -> Any:
        """Same as `external_claim`."""
        return self.external_claim(request_id, replica_idx)

    def alloc(self: KVCacheManager, data: TextGenerationContext, num_steps: int = 1) -> None:
        """`maybe_reserve`, raising `InsufficientPagesError` instead of returning False."""
        if not self.maybe_reserve(data, num_steps):
            raise InsufficientPagesError(
                f"not enough free pages to hold request {data.request_id!r} for {num_steps} step(s)"
            )

    def get_runtime_inputs(
        self: KVCacheManager, batch: Sequence[TextGenerationContext], num_steps: int = 1
    ) -> list[Any]:
        """Same as `fetch`."""
        return self.fetch(batch, num_steps)

    def get_symbolic_inputs(
        self: KVCacheManager, devices: Sequence[Device] | None = None, num_layers: int | None = None
    ) -> list[Any]:
        """Same as `input_symbols`."""
        return self.input_symbols(devices, num_layers)

    def max_input_symbols(
        self: KVCacheManager, devices: Sequence[Device] | None = None, num_layers: int | None = None
    ) -> list[Any]:
        """`input_symbols` in the form MAX's own paged graph ops take: one
        `max.nn.kv_cache.KVCacheInputsPerDevice` of graph types per device (its
        `max.tree.leaves` are the graph's cache inputs; `mokv.max_cache_values` turns
        those values back into MAX's `PagedCacheValues`). Paged caches only."""
        from ..layouts.max_paged import max_input_symbols

        _check_paged(self)
        return [max_input_symbols(s) for s in self.input_symbols(devices, num_layers)]

    def max_inputs(self: KVCacheManager, fetched: Sequence[Any]) -> list[Any]:
        """A `fetch` result in the form MAX's own paged graph ops take, to match
        `max_input_symbols` (the same cache buffers, plus host scalars; nothing is read
        back from a device). Paged caches only."""
        from ..layouts.max_paged import max_runtime_inputs

        _check_paged(self)
        heads = self.params.n_kv_heads_per_device
        return [max_runtime_inputs(inputs, heads) for inputs in fetched]

    @property
    def total_num_host_pages(self) -> int:
        """Pages of the host-memory tier: 0 (the paged manager overrides this)."""
        return 0

    @property
    def host_committed_block_pct(self) -> float:
        """Fraction of host pages holding committed prefixes: 0.0 (no host tier)."""
        return 0.0


def _check_paged(manager: KVCacheManager) -> None:
    """TypeError unless the manager's cache is paged (MAX 26.7's graph ops have no
    continuous-batching attention)."""
    if manager.layout.name != "paged":
        raise TypeError(
            f"MAX's graph ops take a paged cache; this manager's layout is {manager.layout.name!r}"
        )
