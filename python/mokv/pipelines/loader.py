"""`load_kv_manager`: MAX 26.7's loader, with its signature, building a mokv cache.

It reads MAX's params into mokv's (`params.py`: what is refused, how cache groups map)
and builds a mokv `PagedKVCacheManager` behind MAX's manager interface
(`KVCacheManager`, manager.py).
"""

from __future__ import annotations

from typing import Any

from max.driver import is_virtual_device_mode
from max.engine import InferenceSession

from ..config.params import KVCacheParams
from ..errors import InsufficientMemoryError
from .manager import KVCacheManager
from .options import MokvOptions
from .params import mokv_params, refuse


def load_kv_manager(
    params: Any,
    max_batch_size: int | None,
    max_seq_len: int,
    session: InferenceSession,
    available_cache_memory: int | None,
    is_di_enabled: bool,
    model_name: str,
    max_num_input_tokens: int | None,
    *,
    options: MokvOptions | None = None,
) -> KVCacheManager:
    """A mokv cache behind MAX's manager interface, for MAX's `params` (MAX 26.7's
    `max.pipelines.kv_cache.load_kv_manager`'s signature; `options`: mokv's tiers,
    events and sessions).

    `max_batch_size` is per data-parallel replica, as MAX's scheduler counts it, and
    `available_cache_memory` the bytes of all devices, as MAX's memory plan gives
    them: mokv's pool takes all of it, as MAX's own does. UnsupportedMaxParamsError for
    what mokv does not hold (module docstring); ValueError for a missing budget.
    """
    kv_params = mokv_params(params, options, is_di_enabled)
    if is_virtual_device_mode():
        raise refuse(
            "a cache on virtual (compile-only) devices: build the graph on "
            "mokv.NullKVCacheManager's input symbols instead"
        )
    if available_cache_memory is None or max_batch_size is None:
        raise ValueError(
            f"available_cache_memory={available_cache_memory!r} and "
            f"max_batch_size={max_batch_size!r} must come from MAX's memory plan"
        )
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size!r}")
    available_cache_memory -= state_bytes(kv_params, max_batch_size, available_cache_memory)
    return KVCacheManager.create(
        params,
        kv_params,
        max_batch_size=max_batch_size * params.data_parallel_degree,
        max_seq_len=max_seq_len,
        session=session,
        available_cache_memory=available_cache_memory,
        model_name=model_name,
        max_num_input_tokens=max_num_input_tokens,
    )


def state_bytes(params: KVCacheParams, max_batch_size: int, available: int) -> int:
    """Bytes the state layers take of the budget (none without them): per replica a
    live block per request, the checkpoints and the zero block, each one state on each
    of its devices (`groups/state.py`). InsufficientMemoryError when they leave no
    bytes for the attention pages."""
    state = params.recurrent
    if state is None:
        return 0
    blocks = max_batch_size + state.num_checkpoints + 1
    total = params.n_devices * blocks * state.bytes_per_state
    if total >= available:
        raise InsufficientMemoryError(
            f"the recurrent state {state.name!r} takes {total} bytes ({blocks} states of "
            f"{state.bytes_per_state} bytes per device: max_batch_size={max_batch_size}, "
            f"num_checkpoints={state.num_checkpoints}) of available_cache_memory="
            f"{available}, leaving none for the attention pages"
        )
    return total


load_kv_manager.mokv_loader = True  # type: ignore[attr-defined]  # seams.check_seams
