"""A mokv paged manager in MAX 26.7's own model pipelines, behind MAX's manager interface.

MAX 26.7's `TextGenerationPipeline` (and `max.pipelines.lib.generate`) drive their KV
cache through `max.pipelines.kv_cache.PagedKVCacheManagerInterface`, with MAX's own
request contexts (`max.pipelines.context.TextContext`):

    claim(ctx, replica_idx)   alloc(ctx) -> KVTransfer   runtime_inputs([[ctx, ...], ...])
    ... the model runs on the inputs, ctx.update(token) ...   step(ctx)   release(ctx)

`MaxPipelineKVCacheManager` answers those calls with a mokv `PagedKVCacheManager`: each
MAX context is read through `MaxContextView` (mokv's context protocol over MAX's token
buffer), and `runtime_inputs` is mokv's `fetch` in MAX's form (`layouts/max_paged.py`).
Put it in place of the pipeline's own manager:

    pipeline._kv_manager = MaxPipelineKVCacheManager.for_pipeline(pipeline, session)

MAX's pipeline code is imported only when this class is used (it needs MAX's serving
dependencies: `transformers`, `huggingface_hub`, `av`, ...). Chunked prefill with a
prefix hit past the chunk is refused (`MaxContextView.active_idx_after_skip`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from max.engine import InferenceSession

from ..context import RequestID
from ..params import KVCacheParams
from .paged import PagedKVCacheManager


class MaxContextView:
    """mokv's `TextGenerationContext` over a MAX 26.7 `TextContext`: its indices are
    MAX's token buffer's (`processed_length`, `current_position`, `len`), live."""

    __slots__ = ("ctx",)

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx

    @property
    def request_id(self) -> RequestID:
        return RequestID(str(self.ctx.request_id))

    @property
    def tokens(self) -> np.ndarray:
        return np.asarray(self.ctx.tokens.all)

    @property
    def start_idx(self) -> int:
        return int(self.ctx.tokens.processed_length)

    @property
    def active_idx(self) -> int:
        return int(self.ctx.tokens.current_position)

    @property
    def end_idx(self) -> int:
        return len(self.ctx.tokens)

    @property
    def active_length(self) -> int:
        return int(self.ctx.tokens.active_length)

    @property
    def cache_salt(self) -> str | None:
        return getattr(self.ctx, "cache_salt", None)

    def active_idx_after_skip(self, num_tokens: int) -> int:
        """MAX's rule (`TokenBuffer.skip_processing`): the window keeps its end, so a
        hit must leave at least one token of it; ValueError otherwise (a chunk whose
        tokens are all cached: MAX's own manager does not let that happen either)."""
        if not self.start_idx <= num_tokens < self.active_idx:
            raise ValueError(
                f"cannot skip to {num_tokens}: MAX's context keeps its window "
                f"[{self.start_idx}, {self.active_idx}) and must process one token of it"
            )
        return self.active_idx

    def skip_cached_prefix(self, num_tokens: int) -> None:
        self.active_idx_after_skip(num_tokens)
        self.ctx.tokens.skip_processing(num_tokens - self.start_idx)

    def update(self, new_token: int) -> None:
        self.ctx.update(new_token)


class MaxPipelineKVCacheManager:
    """The calls MAX 26.7's text-generation pipeline makes on its KV cache manager,
    answered by a mokv `PagedKVCacheManager` (`manager`).

    Args:
        manager: the mokv manager holding the cache; its shape must be the model's.
        params: MAX's `KVCacheParams` of the model (the pipeline reads `page_size` and
            the draft-token counts from it).
    """

    def __init__(self, manager: PagedKVCacheManager, params: Any) -> None:
        if not isinstance(manager, PagedKVCacheManager):
            raise TypeError(f"manager must be a mokv PagedKVCacheManager, got {manager!r}")
        mine = manager.params
        theirs = (params.dtype, params.n_kv_heads, params.head_dim, params.page_size)
        if (mine.dtype, mine.n_kv_heads, mine.head_dim, mine.page_size) != theirs:
            raise ValueError(
                f"the mokv cache holds (dtype, n_kv_heads, head_dim, page_size) = "
                f"{(mine.dtype, mine.n_kv_heads, mine.head_dim, mine.page_size)}; the model "
                f"needs {theirs}"
            )
        self.manager = manager
        self.params = params

    @classmethod
    def for_pipeline(
        cls, pipeline: Any, session: InferenceSession, available_cache_memory: int | None = None
    ) -> MaxPipelineKVCacheManager:
        """A mokv manager shaped like `pipeline`'s model (its `kv_params`, batch size and
        sequence length), with prefix caching as the model's params ask, on the CPU or
        the devices of the model; by default as many pages as a full batch of full
        sequences needs."""
        from max.driver import Device

        model = pipeline._pipeline_model
        kv = model.kv_params
        params = KVCacheParams(
            dtype=kv.dtype,
            n_kv_heads=kv.n_kv_heads,
            head_dim=kv.head_dim,
            page_size=kv.page_size,
            enable_prefix_caching=kv.enable_prefix_caching,
            data_parallel_degree=kv.data_parallel_degree,
            n_devices=len(kv.devices),
        )
        devices: list[Device] = [ref.to_device() for ref in kv.devices]
        max_batch_size, max_seq_len = pipeline.max_batch_size, model.max_seq_len
        if available_cache_memory is None:
            available_cache_memory = PagedKVCacheManager.estimated_memory_size(
                params, max_batch_size, max_seq_len, kv.num_layers, 2**62, devices
            )
        manager = PagedKVCacheManager(
            params,
            max_batch_size,
            max_seq_len,
            kv.num_layers,
            devices,
            session,
            available_cache_memory,
            page_size=kv.page_size,
        )
        return cls(manager, kv)

    def claim(self, ctx: Any, replica_idx: int = 0) -> None:
        self.manager.external_claim(MaxContextView(ctx).request_id, replica_idx)

    def contains(self, ctx: Any) -> bool:
        return self.manager.contains(MaxContextView(ctx).request_id)

    def alloc(self, ctx: Any) -> Any:
        """Reserves the request's next step (moving its window past a cached prefix);
        MAX's `InsufficientBlocksError` when the pages do not fit, nothing changed."""
        from max.pipelines.kv_cache import InsufficientBlocksError
        from max.pipelines.kv_cache.kv_connector import CompletedTransfer

        if not self.manager.maybe_reserve(MaxContextView(ctx)):
            raise InsufficientBlocksError(
                f"not enough free pages for request {ctx.request_id}: "
                f"{self.manager.num_free_blocks} free"
            )
        return CompletedTransfer()

    def runtime_inputs(
        self, batches: Sequence[Sequence[Any]], **dispatch_shape: Any
    ) -> tuple[Any, ...]:
        """`fetch` of the per-replica batches in MAX's form, one entry per device.
        MAX's graph-capture arguments (`max_cache_length`, `batch_characteristics`)
        are not supported."""
        if any(value is not None for value in dispatch_shape.values()):
            raise ValueError(f"graph-capture dispatch shapes are not supported: {dispatch_shape}")
        views = [MaxContextView(ctx) for batch in batches for ctx in batch]
        return tuple(self.manager.max_inputs(self.manager.fetch(views)))

    def step(self, ctx: Any) -> None:
        self.manager.step([MaxContextView(ctx)])

    def release(self, ctx: Any) -> None:
        self.manager.release(MaxContextView(ctx).request_id)

    def reset_prefix_cache(self) -> None:
        self.manager.reset_prefix_cache()

    def shutdown(self) -> None:
        self.manager.close()
