"""What every KV cache manager shares: argument checks and the newer method names.

MAX renamed parts of the manager interface between releases (seed 000 vs seed 001);
mokv offers both spellings, with the newer names defined once here in terms of the
older ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from max.driver import Device
from max.engine import InferenceSession

from ..context import RequestID, TextGenerationContext
from ..errors import InsufficientPagesError
from ..params import KVCacheParams


def check_devices(params: KVCacheParams, devices: Sequence[Device]) -> list[Device]:
    devices = list(devices)
    bad = [d for d in devices if not isinstance(d, Device)]
    if bad:
        raise TypeError(f"devices must be max.driver.Device objects, got {bad[0]!r}")
    if len(devices) != params.n_devices:
        raise ValueError(f"got {len(devices)} device(s) but params.n_devices={params.n_devices}")
    return devices


def check_page_size(params: KVCacheParams, page_size: int) -> None:
    """The constructor's `page_size` must agree with the params unless left at 128."""
    if page_size != 128 and page_size != params.page_size:
        raise ValueError(
            f"page_size={page_size} disagrees with params.page_size={params.page_size}; "
            "set it in KVCacheParams"
        )


def check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


class KVCacheManager:
    """Base of the managers: fields, argument checks, newer method names."""

    def __init__(
        self,
        params: KVCacheParams,
        max_batch_size: int,
        max_seq_len: int,
        num_layers: int,
        devices: Sequence[Device],
        session: InferenceSession,
    ) -> None:
        if not isinstance(params, KVCacheParams):
            raise TypeError(f"params must be a mokv.KVCacheParams, got {type(params).__name__}")
        check_positive(max_batch_size=max_batch_size, max_seq_len=max_seq_len, num_layers=num_layers)
        self.params = params
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.num_layers = num_layers
        self.devices = check_devices(params, devices)
        self.session = session

    @staticmethod
    def _check_num_steps(num_steps: int) -> None:
        if num_steps.__class__ is not int or num_steps < 1:  # on every step: kept cheap
            raise ValueError(f"num_steps must be a positive int, got {num_steps!r}")

    # Newer names of the same operations (seed 001).

    def claim(self, request_id: RequestID, replica_idx: int | None = None) -> Any:
        """Same as `external_claim`."""
        return self.external_claim(request_id, replica_idx)  # type: ignore[attr-defined]

    def alloc(self, data: TextGenerationContext, num_steps: int = 1) -> None:
        """`maybe_reserve`, raising `InsufficientPagesError` instead of returning False."""
        if not self.maybe_reserve(data, num_steps):  # type: ignore[attr-defined]
            raise InsufficientPagesError(
                f"not enough free pages to hold request {data.request_id!r} for {num_steps} step(s)"
            )

    def get_runtime_inputs(self, batch: Sequence[Any], num_steps: int = 1) -> Any:
        """Same as `fetch`."""
        return self.fetch(batch, num_steps)  # type: ignore[attr-defined]

    def get_symbolic_inputs(
        self, devices: Sequence[Device] | None = None, num_layers: int | None = None
    ) -> Any:
        """Same as `input_symbols`."""
        return self.input_symbols(devices, num_layers)  # type: ignore[attr-defined]

    # The host-memory page tier is not available yet: no host pages exist.

    @property
    def total_num_host_pages(self) -> int:
        return 0

    @property
    def host_committed_block_pct(self) -> float:
        return 0.0
