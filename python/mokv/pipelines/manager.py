"""KVCacheManager: MAX 26.7's paged manager interface, answered by a mokv cache.

MAX's scheduler (`max.serve`), its pipelines and `max.pipelines.lib.generate` drive a
KV cache through `PagedKVCacheManagerInterface`, with MAX's request contexts. This class
is that interface over a mokv `PagedKVCacheManager`: each MAX context is read through
`MaxContextView` (mokv's request protocol over MAX's token buffer), and every member
answers from mokv's state:

    MAX calls                       mokv does
    claim / contains / release      external_claim / contains / release
    alloc(ctx) -> KVTransfer        maybe_reserve (MAX's InsufficientBlocksError when the
                                    pages do not fit, nothing changed); on a request's
                                    first admission sets ctx.cached_prefix_length (what
                                    `usage.cached_tokens` reports) and its external part
    runtime_inputs(batches, ...)    fetch, in MAX's input form (layouts/max_paged.py),
                                    honouring graph capture's max_cache_length and
                                    batch_characteristics
    step(ctx)                       step: the pages the step filled become prefixes
    get_prefix_cache_hit_counts     per replica: device pages, then the replica's own
                                    tiers' pages continuing them
    block_count / pressure_pct      the replica's free and total pages
    take/get_metrics_aggregated     mokv's counters in MAX's KVCacheMetrics, since the
                                    last take (mokv's own counters keep counting)

Cache groups (MAX's `MultiKVCacheParams`, or a `window_size`): `runtime_inputs` returns
MAX's tree for the same params, an `OrderedDict` of each child's tuple of
`KVCacheInputsPerDevice` (a single windowed cache: its tuple), every group's from
mokv's `fetch`; `get_req_blocks_per_leaf` names each group's row by MAX's leaf id,
with the pad page below a window as MAX has its null block there; `pressure_pct` is
the fullest group's, as MAX's is the fullest leaf's.

Where mokv differs on purpose (docs/serve.md):
- mokv's tier loads are copies made at `runtime_inputs`, before the graph runs, so no
  transfer is ever in flight between scheduler steps: `alloc` returns a completed
  transfer, `poll_transfers` has nothing to drain, `pending_transfers_exist` is False.
- `alloc_dummy` (data-parallel padding) holds one real page for the dummy where MAX maps
  it onto a null page mokv does not have; a full pool refuses it
  (InsufficientBlocksError).
- `block_count` of a cache of groups counts the slots of the budget its groups share
  (MAX: its Jenga pool's huge blocks, the null block among them), free ones as slots'
  worth of free pages.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from max.driver import Buffer
from max.dtype import DType
from max.engine import InferenceSession
from max.nn.kv_cache import BatchCharacteristics, KVCacheInputsPerDevice
from max.nn.kv_cache.cache_params import KVCacheBuffer, MultiKVCacheBuffer, RecurrentStateBuffer
from max.nn.kv_cache.metrics import KVCacheMetrics as MaxKVCacheMetrics
from max.pipelines.kv_cache import (
    BlockCount,
    ByteCount,
    InsufficientBlocksError,
    PagedKVCacheManagerInterface,
)
from max.pipelines.kv_cache.kv_connector import CompletedTransfer, KVTransfer
from max.pipelines.kv_cache.paged_kv_cache import PrefixCacheHits

from ..config.params import KVCacheParams
from ..layouts.max_paged import LOOKUP_PAD_PAGE, DispatchShape, max_runtime_inputs
from ..managers.paged import PagedKVCacheManager
from ..metrics import KVCacheMetrics
from .context_view import MaxContextView
from .params import max_leaves, max_num_layers, max_state, mla_q_heads, n_kv_heads

logger = logging.getLogger("mokv.pipelines")

_COUNTERS = (
    "input_tokens",
    "cache_tokens",
    "device_blocks_served",
    "h2d_bytes_copied",
    "d2h_bytes_copied",
)
"""The fields of MAX's KVCacheMetrics that mokv counts."""


class KVCacheManager(PagedKVCacheManagerInterface):
    """MAX's paged manager interface over a mokv `PagedKVCacheManager`.

    Args:
        params: MAX's params of the model's cache (MAX's pipeline reads them back).
        manager: the mokv manager holding the cache, shaped as `params` says.
        model_name: the served model's name (a request naming another names a LoRA
            adapter, whose pages are keyed apart).
        max_num_input_tokens: MAX's chunked-prefill budget (a prompt is reserved one
            budget at a time), or None.
    """

    def __init__(
        self,
        params: Any,
        manager: PagedKVCacheManager,
        model_name: str = "",
        max_num_input_tokens: int | None = None,
    ) -> None:
        if not isinstance(manager, PagedKVCacheManager):
            raise TypeError(f"manager must be a mokv PagedKVCacheManager, got {manager!r}")
        groups = manager.params.cache_groups(manager.num_layers)
        leaves = max_leaves(params)

        def shape(p: Any, heads: int, layers: int, window: int | None) -> tuple:
            return (p.dtype, heads, p.head_dim, p.page_size, layers, window)

        mine = [
            shape(p, p.n_kv_heads, g.num_layers, g.window_size)
            for g in groups
            for p in [manager.params.group_params(g)]
        ]
        theirs = [
            shape(leaf, n_kv_heads(leaf), leaf.num_layers, leaf.window_size) for _, leaf in leaves
        ]
        kinds = (
            [g.kind == "mla" for g in groups],
            [mla_q_heads(leaf) is not None for _, leaf in leaves],
        )
        if kinds[0] != kinds[1]:
            raise ValueError(
                f"the mokv cache's groups are {[g.kind for g in groups]}; MAX's params are "
                f"{[type(leaf).__name__ for _, leaf in leaves]}"
            )
        if mine != theirs:
            raise ValueError(
                f"the mokv cache holds (dtype, n_kv_heads, head_dim, page_size, num_layers, "
                f"window_size) = {mine}; MAX's params say {theirs}"
            )
        self.params = params
        self.manager = manager
        self._model_name = model_name
        self._max_num_input_tokens = max_num_input_tokens
        self._leaf_ids = [leaf.leaf_id(f"{key}." if key else "") for key, leaf in leaves]
        self._keys = [key for key, _ in leaves]
        state = max_state(params)
        self._state_key = state[0] if state is not None else None
        self._tree_keys = list(params.children) if state is not None else self._keys
        self._heads = [manager.params.group_params(g).n_kv_heads_per_device for g in groups]
        self._mla_q_heads = [mla_q_heads(leaf) for _, leaf in leaves]
        self._taken = MaxKVCacheMetrics()
        self._reset_pending = False

    @classmethod
    def create(
        cls,
        max_params: Any,
        params: KVCacheParams,
        *,
        max_batch_size: int,
        max_seq_len: int,
        session: InferenceSession,
        available_cache_memory: int,
        model_name: str = "",
        max_num_input_tokens: int | None = None,
    ) -> KVCacheManager:
        """A mokv manager of `params` on the devices of MAX's `max_params`, behind MAX's
        interface (`max_batch_size`: all replicas together)."""
        manager = PagedKVCacheManager(
            params,
            max_batch_size,
            max_seq_len,
            max_num_layers(max_params),
            [ref.to_device() for ref in max_params.devices],
            session,
            available_cache_memory,
            page_size=params.page_size,
        )
        return cls(max_params, manager, model_name, max_num_input_tokens)

    def _view(self, ctx: Any) -> MaxContextView:
        return MaxContextView(ctx, self._max_num_input_tokens, self._model_name)

    # --- requests -------------------------------------------------------------------

    def claim(self, ctx: Any, replica_idx: int = 0) -> None:
        self.manager.external_claim(self._view(ctx).request_id, replica_idx)

    def contains(self, ctx: Any) -> bool:
        return self.manager.contains(self._view(ctx).request_id)

    def release(self, ctx: Any) -> None:
        self.manager.release(self._view(ctx).request_id)

    def alloc(self, ctx: Any) -> KVTransfer:
        """Reserves the request's next step, moving its window past a cached prefix.
        MAX's InsufficientBlocksError, nothing changed, when the pages do not fit."""
        view = self._view(ctx)
        first_admission = view.start_idx == 0
        tiered = first_admission and bool(self.manager.params.tiers)
        tier_tokens = self._tier_cache_tokens() if tiered else 0
        if not self.manager.maybe_reserve(view):
            raise InsufficientBlocksError(
                f"not enough free pages for request {view.request_id}: "
                f"{self.manager.num_free_blocks} free"
            )
        if first_admission:  # MAX's rule: the cached prefix is reported once per request
            ctx.cached_prefix_length = view.start_idx
            ctx.cached_prefix_external_length = (
                self._tier_cache_tokens() - tier_tokens if tiered else 0
            )
        return CompletedTransfer()

    def _tier_cache_tokens(self) -> int:
        """Prompt tokens the tiers have supplied so far."""
        return sum(tier.cache_tokens for tier in self.manager.metrics.tiers.values())

    def alloc_dummy(self, ctx: Any, replica_idx: int = 0) -> None:
        """Claims a padding request on `replica_idx` and gives it one page of its own
        (mokv has no null page): MAX's padder makes a decode row whose cache claims a
        token it never wrote, so the page is reserved as if from token 0. A full pool
        refuses it (InsufficientBlocksError, nothing changed)."""
        view = _PaddingView(ctx, self._max_num_input_tokens, self._model_name)
        self.manager.external_claim(view.request_id, replica_idx)
        if not self.manager.maybe_reserve(view):
            self.manager.release(view.request_id)
            raise InsufficientBlocksError(f"no free page for the padding request {ctx.request_id}")

    def step(self, ctx: Any) -> None:
        self.manager.step([self._view(ctx)])

    def runtime_inputs(
        self,
        batches: Sequence[Sequence[Any]],
        *,
        max_cache_length: int | None = None,
        batch_characteristics: BatchCharacteristics | None = None,
    ) -> Any:
        """The graph inputs of per-replica batches, one entry per device, replica-major;
        for MAX's `MultiKVCacheParams`, an `OrderedDict` of each child's (its key, in
        MAX's order), every group's from one `fetch`.

        Graph capture (MAX's device graphs on GPUs) replays a graph built for an upper
        bound: `max_cache_length` widens the lookup table to that many tokens' pages,
        and `batch_characteristics` gives the batch size and lengths the attention
        dispatch is resolved for (ValueError if the real batch exceeds them)."""
        views = [self._view(ctx) for batch in batches for ctx in batch]
        fetched = self.manager.fetch(views)
        lookup_pages = None
        if max_cache_length is not None:
            if max_cache_length < 1:
                raise ValueError(f"max_cache_length must be positive, got {max_cache_length}")
            lookup_pages = -(-max_cache_length // self.manager.page_size)
        shape = None
        if batch_characteristics is not None:
            bc = batch_characteristics
            shape = DispatchShape(bc.batch_size, bc.max_prompt_length, bc.max_cache_valid_length)
        per_group = len(fetched) // len(self._heads)
        trees = [
            tuple(
                max_runtime_inputs(f, heads, lookup_pages, shape, q_heads)
                for f in fetched[g * per_group : (g + 1) * per_group]
            )
            for g, (heads, q_heads) in enumerate(zip(self._heads, self._mla_q_heads))
        ]
        if self._keys == [None]:
            return trees[0]
        inputs = OrderedDict(zip(self._keys, trees))
        if self._state_key is not None:  # the state layers' inputs, at their key's place
            inputs[self._state_key] = tuple(self.manager.state_inputs(views))
        return OrderedDict((key, inputs[key]) for key in self._tree_keys)

    def runtime_inputs_for_leaf(
        self,
        batches: Sequence[Sequence[Any]],
        *,
        max_cache_length: int | None = None,
        batch_characteristics: BatchCharacteristics | None = None,
    ) -> tuple[KVCacheInputsPerDevice[Buffer, Buffer], ...]:
        """`runtime_inputs`' per-device entries, every group's in turn (as MAX's:
        `max.tree.leaves` of its tree)."""
        inputs = self.runtime_inputs(
            batches, max_cache_length=max_cache_length, batch_characteristics=batch_characteristics
        )
        if isinstance(inputs, tuple):
            return inputs
        return tuple(device for group in inputs.values() for device in group)

    def poll_transfers(self) -> None:
        """No transfer to drain (mokv's tier loads complete inside `runtime_inputs`); a
        prefix-cache reset that had to wait for running requests is retried here, as MAX's
        scheduler calls this at every iteration."""
        if self._reset_pending:
            self.reset_prefix_cache()

    def pending_transfers_exist(self, replica_idx: int = 0) -> bool:
        """False: no mokv transfer outlives the call that made it."""
        return False

    # --- what a request holds, and what the cache holds --------------------------------

    def get_prefix_cache_hit_counts(self, ctx: Any) -> list[PrefixCacheHits]:
        """Per replica, the request's prefix in its device pages, then in the replica's
        own tiers after them (a shared tier serves every replica alike, and is not
        asked). Changes nothing."""
        view = self._view(ctx)
        return [
            PrefixCacheHits(device_blocks=device, external_blocks=tiers)
            for device, tiers in self.manager.prefix_hit_pages(view)
        ]

    def get_req_blocks_per_leaf(self, ctx: Any) -> dict[str, list[int]]:
        """Each group's page ids by MAX's leaf id, the pad page below a window; for
        scaled FP8 pages each group's scales leaf too (MAX's `<leaf>/scales`), with the
        same page ids (mokv's scales share them)."""
        rows = self.manager.get_req_blocks_per_group(self._view(ctx).request_id).values()
        suffixes = ("", "/scales") if self.manager.params.quantization is not None else ("",)
        return {
            leaf_id + suffix: [LOOKUP_PAD_PAGE] * first + pages
            for leaf_id, (first, pages) in zip(self._leaf_ids, rows)
            for suffix in suffixes
        }

    def num_req_blocks(self, ctx: Any) -> int:
        """The request's length in pages (every group's row is as long)."""
        rows = self.manager.get_req_blocks_per_group(self._view(ctx).request_id)
        first, pages = next(iter(rows.values()))
        return first + len(pages)

    def block_count(self, replica_idx: int = 0) -> BlockCount:
        free, total = self.manager.page_counts(replica_idx)
        return BlockCount(free=free, total=total)

    def pressure_pct(self, replica_idx: int = 0) -> float:
        """The fullest group's page occupancy, in [0, 100] (MAX: the fullest leaf's); for
        groups sharing one budget, the budget's (a group has the slots it needs)."""
        if self.manager.params.is_hybrid:
            return self.block_count(replica_idx).used_pct
        counts = self.manager.group_page_counts(replica_idx).values()
        return max(BlockCount(free=free, total=total).used_pct for free, total in counts)

    def host_byte_count(self) -> ByteCount:
        metrics = self.manager.metrics
        if not metrics.host_total_pages:
            return ByteCount(free=0, total=0)
        page = self.manager.params.bytes_per_page(self.manager.num_layers)
        total = metrics.host_total_pages * page
        return ByteCount(free=total - metrics.host_used_pages * page, total=total)

    def disk_byte_count(self) -> ByteCount:
        """mokv has no disk tier."""
        return ByteCount(free=0, total=0)

    def get_device_buffer(self, replica_idx: int) -> KVCacheBuffer | MultiKVCacheBuffer:
        """The replica's page buffers, MAX's tree of them for a `MultiKVCacheParams`."""
        buffers = [
            KVCacheBuffer(
                leaf_id=leaf_id,
                replicates_kv_across_tp=False,
                values=self.manager.device_buffers(replica_idx, g),
                scales=self.manager.device_scales(replica_idx, g),
            )
            for g, leaf_id in enumerate(self._leaf_ids)
        ]
        if self._keys == [None]:
            return buffers[0]
        children: dict[Any, Any] = dict(zip(self._keys, buffers))
        states = self.manager.replicas[replica_idx].states
        if states is not None and self._state_key is not None:
            # MAX's view of a state pool: each region's blocks as rows of bytes.
            children[self._state_key] = RecurrentStateBuffer(
                pages={
                    region.leaf_id: [
                        b.view(DType.uint8, [states.num_blocks, region.bytes_per_state])
                        for b in pools
                    ]
                    for region, pools in zip(states.config.regions, states.states)
                }
            )
        return MultiKVCacheBuffer(children={key: children[key] for key in self._tree_keys})

    @property
    def effective_max_seq_length(self) -> int | None:
        """The longest request an empty replica holds: all the pages of its smallest
        full-attention group; None with windows alone (MAX: no length exhausts them)."""
        groups = self.manager.params.cache_groups(self.manager.num_layers)
        counts = self.manager.group_page_counts(0)
        full = [counts[g.name][1] for g in groups if g.window_size is None]
        return min(full) * self.manager.page_size if full else None

    # --- metrics and lifetime ---------------------------------------------------------

    def get_metrics_aggregated(self) -> MaxKVCacheMetrics:
        """mokv's counters in MAX's form, since the last `take_metrics_aggregated`."""
        now = _as_max_metrics(self.manager.metrics, self.manager.page_size)
        return MaxKVCacheMetrics(
            **{name: getattr(now, name) - getattr(self._taken, name) for name in _COUNTERS}
        )

    def take_metrics_aggregated(self) -> MaxKVCacheMetrics:
        taken = self.get_metrics_aggregated()
        self._taken = _as_max_metrics(self.manager.metrics, self.manager.page_size)
        return taken

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix, device and tiers. mokv resets only while no
        request holds pages (so that the event stream never names a parent it cleared):
        until then the reset stays pending and `poll_transfers` retries it."""
        if self.manager.reset_prefix_cache():
            self._reset_pending = False
        elif not self._reset_pending:
            self._reset_pending = True
            logger.info("mokv: the prefix-cache reset waits until no request holds pages")

    def shutdown(self) -> None:
        self.manager.close()


def _as_max_metrics(metrics: KVCacheMetrics, page_size: int) -> MaxKVCacheMetrics:
    return MaxKVCacheMetrics(
        input_tokens=metrics.input_tokens,
        cache_tokens=metrics.cache_tokens,
        device_blocks_served=metrics.device_cache_tokens // page_size,
        h2d_bytes_copied=metrics.bytes_from_host,
        d2h_bytes_copied=metrics.bytes_to_host,
    )


class _PaddingView(MaxContextView):
    """A padding request's view at its first reservation: its cache starts empty."""

    __slots__ = ()

    @property
    def start_idx(self) -> int:
        return 0
