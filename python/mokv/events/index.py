"""PrefixRouterIndex: what each cache holds, by tier, rebuilt from events, asked by prefix.

A source is one publisher: `(server, replica)`, a server's data-parallel replica. For
each, the index keeps the page hashes its events say are cached now, per tier (the
event's `medium`, see `TIER_OF_MEDIUM`):

    BlockStored       adds its block_hashes to its medium's tier
    BlockRemoved      removes its block_hashes from its medium's tier
    AllBlocksCleared  empties every tier of the source

A router hashes the full pages of `tokens` the way the servers do (same algorithm, seed,
page size, salt, LoRA adapter and images; see `mokv.cache.hashing` and
`mokv.cache.extra_keys`) and asks, per source:

    match(tokens)   the leading pages the source holds in any tier (a source holding
                    pages 3 and 4 of a prompt but not page 0 holds 0: a cache serves
                    prefixes only)
    scores(tokens)  the same pages, each weighted by the best tier holding it:
                    device 1.0, host `host_weight`, shared `shared_weight`

so a replica holding a prefix on its device outscores one that would load it back from
host memory, which outscores one that would fetch it from the shared store. This is
llm-d's LongestPrefixScorer (llm-d/llm-d-kv-cache pkg/kvcache/kvblock_scorer.go: per
page the best weight among the pod's tiers, summed over the longest prefix) with
NVIDIA Dynamo's default weights (ai-dynamo/dynamo lib/kv-router/src/scheduling/
config.rs: `host_cache_hit_weight` 0.75, `disk_cache_hit_weight` 0.25 for its disk and
external tiers, the device 1.0). llm-d's defaults are GPU 1.0 and CPU 0.8.

Presence (`shared=`, a `SharedPresence` such as a `mokv.remote.RemotePageStore` of the
servers' shared tier): events tell which pages a source stored in the shared tier, but
every server of the tier can load every page in it, and the store evicts without a
word. With `shared`, a query that some source's own tiers do not cover in full also
asks the store which of its leading pages it holds now (one batched EXISTS per store
server, at most `SHARED_PROBE_PAGES` pages, bounded by the store's timeout and circuit
breakers: a failing store holds nothing), and those pages count for every source at
`shared_weight`, below its own device and host pages (issue 58 cites routers that ask
a shared tier: Dynamo PR #7536, LMCache #4352).

A source with recurrent-state layers announces its checkpoints as a group of kind
"mamba" (a hash there: a state checkpoint after that page); its joint hit ends at the
last checkpoint the attention groups reach (`checkpoint_hit`), as its manager's does.

Pins (`mokv.CacheControl.pin_ttl_s`, docs/cache-control.md) are not in vLLM's event
format; the router learns them from the requests it routes: `note_pin(source, tokens,
ttl_s)` when it sends a request that asks for a pin to `source`. A pinned page stays on
its source (device or host tier) until the pin's deadline, whatever evicts around it, so
`best` prefers, before any score, the source whose live pins hold the most leading pages
of a prompt (a pin renewed by a later request lives on; the server's budget may have
granted less, which a router cannot see). A pin lives while `clock() < deadline`;
`AllBlocksCleared` (the server's `reset_prefix_cache`) ends a source's pins.

Invariant: after a source's events up to seq N are applied in order, its device tier
equals the publishing pool's `indexed_hashes()` and its host tier the host pool's, as
they were when batch N was handed over. The shared tier holds what the source stored
there; the server evicts without telling anyone, so it may hold pages already gone.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Protocol, cast

from ..cache.extra_keys import chain_root, page_keys
from ..cache.hashing import page_hash_fn, page_hashes
from ..config.base import STABLE_ALGORITHMS
from ..context import (
    MultimodalInput,
    check_cache_salt,
    check_name,
    multimodal_inputs,
    token_ids,
)
from ..managers.paged.groups.full import run_hit
from ..managers.paged.groups.joint import longest_joint_hit
from ..managers.paged.groups.sliding import window_hit
from ..managers.paged.groups.state import checkpoint_hit
from .format import SPEC_KINDS, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

SLIDING_WINDOW = SPEC_KINDS["sliding_window"]
RECURRENT = SPEC_KINDS["recurrent"]
"""vLLM's kind of a state group's blocks ("mamba"): a hash in it is a checkpoint of
the recurrent state after that page (`KVCacheParams.recurrent`, docs/recurrent.md)."""

Source = tuple[str, int]
"""(server name, data-parallel replica)."""

TIERS = ("device", "host", "shared")

SHARED_PROBE_PAGES = 2048
"""Most leading pages of one query asked of `PrefixRouterIndex.shared` (one pipelined
EXISTS each: about a millisecond per thousand on loopback)."""


class SharedPresence(Protocol):
    """What a router asks a shared tier (`mokv.remote.RemotePageStore` is one)."""

    def holds(self, page_hashes: Sequence[int]) -> int:
        """How many leading pages of `page_hashes` the tier holds now; 0 on any failure,
        in bounded time."""
        ...


TIER_OF_MEDIUM = {
    "GPU": "device",
    "DEVICE": "device",
    "CPU": "host",
    "CPU_PINNED": "host",
    "CPU_TIER1": "host",
    "CPU_TIER2": "shared",
    "DISK": "shared",
    "NVME": "shared",
    "STORAGE": "shared",
    "EXTERNAL": "shared",
    "NETWORK": "shared",
    "REMOTE": "shared",
    "SHARED": "shared",
}
"""The tier of each `medium` a publisher may send: Dynamo's reading
(`StorageTier::from_kv_medium`), with its disk and external tiers both "shared" (they
weigh the same there). An event without a medium is a device event, as for Dynamo and
llm-d; one with another medium is ignored (counted in `num_ignored`)."""


class PrefixRouterIndex:
    """Per source and tier, the cached page hashes; per query, what each source holds.

    Args:
        page_size: the servers' page size; stores of another `block_size` are ignored
            (and counted in `num_ignored`), as their hashes cannot match.
        prefix_hash: the servers' `KVCacheParams.prefix_hash` ("xxh3" or "sha256").
        prefix_hash_seed: the servers' `KVCacheParams.prefix_hash_seed`.
        host_weight: what a page in host memory ("CPU") is worth against one on the
            device (1.0): loading it back costs a copy, recomputing it a prefill.
        shared_weight: the same for a page in the shared store ("EXTERNAL"); at most
            `host_weight`.
        shared: the servers' shared tier, asked on each query which of its pages it
            holds (see the module's docstring); None: only the events say.
        clock: seconds, monotonic, for pins' deadlines (tests inject their own).

    Raises:
        ValueError: a `page_size` that is not a positive int, an unknown `prefix_hash`,
            a `prefix_hash_seed` outside [0, 2**64), or weights outside
            `0 <= shared_weight <= host_weight <= 1`.

    A query's tokens must be a 1-D sequence of integer token ids in [0, 2**63), as a
    context's (`mokv.context.token_ids`: floats, 2-D arrays, negative or huge ids are a
    TypeError / ValueError naming them, never truncated into a match), its `cache_salt`
    a str or None, its `lora_name` a non-empty str or None and its `mm_inputs` ordered,
    non-overlapping `MultimodalInput`s within the tokens, as a context's.
    """

    def __init__(
        self,
        page_size: int,
        prefix_hash: str = "xxh3",
        prefix_hash_seed: int = 0,
        host_weight: float = 0.75,
        shared_weight: float = 0.25,
        shared: SharedPresence | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        if page_size.__class__ is not int or not 1 <= page_size < 2**32:
            # A server's pages hold at most 2**32 - 1 tokens (uint32 cache lengths).
            raise ValueError(f"page_size must be a positive int below 2**32, got {page_size!r}")
        if prefix_hash not in STABLE_ALGORITHMS:
            raise ValueError(f"prefix_hash={prefix_hash!r} is not one of {STABLE_ALGORITHMS}")
        if prefix_hash_seed.__class__ is not int or not 0 <= prefix_hash_seed < 2**64:
            raise ValueError(
                f"prefix_hash_seed must be an int in [0, 2**64), got {prefix_hash_seed!r}"
            )
        for name, weight in (("host_weight", host_weight), ("shared_weight", shared_weight)):
            if weight.__class__ not in (int, float) or not 0 <= weight <= 1:
                raise ValueError(f"{name} must be a number in [0, 1], got {weight!r}")
        if shared_weight > host_weight:
            raise ValueError(
                f"shared_weight={shared_weight} is above host_weight={host_weight}: a page "
                "from the shared store costs more to load than one from host memory"
            )
        if shared is not None and not callable(getattr(shared, "holds", None)):
            raise TypeError(f"shared must have a holds(page_hashes) method, got {shared!r}")
        if not callable(clock):
            raise TypeError(f"clock must be callable, got {clock!r}")
        self.page_size = page_size
        self.prefix_hash = prefix_hash
        self.prefix_hash_seed = prefix_hash_seed
        self.weights = {"device": 1.0, "host": float(host_weight), "shared": float(shared_weight)}
        self.shared = shared
        self._hash_fn = page_hash_fn(prefix_hash)
        self._roots: dict[tuple[str | None, str | None], int] = {}
        # source -> cache group (`group_idx`) -> tier -> hashes; and each group's
        # window (`kv_cache_spec_sliding_window` of its stores; None: every page)
        self._sources: dict[Source, dict[int, dict[str, set[int]]]] = {}
        self._windows: dict[Source, dict[int, int | None]] = {}
        self._states: dict[Source, set[int]] = {}  # groups of checkpoints ("mamba")
        self._pins: dict[Source, dict[int, float]] = {}  # pinned hash -> deadline
        self.clock = clock
        self.num_ignored = 0

    @property
    def sources(self) -> list[Source]:
        return list(self._sources)

    def hashes(self, source: Source, tier: str | None = None, group: int | None = None) -> set[int]:
        """The hashes `source` holds in `tier` ("device", "host", "shared"), or in any
        tier, in cache group `group` (`group_idx`), or in any group (a copy)."""
        if tier is not None and tier not in TIERS:
            raise ValueError(f"tier={tier!r} is not one of {TIERS}")
        groups = self._sources.get(source, {})
        return set().union(
            *(
                held
                for g, tiers in groups.items()
                if group is None or g == group
                for t, held in tiers.items()
                if tier is None or t == tier
            )
        )

    def windows(self, source: Source) -> dict[int, int | None]:
        """Each cache group of `source` its events named, with its sliding window in
        tokens (None: a group that needs every page of a prefix)."""
        return dict(self._windows.get(source, {}))

    def apply(self, source: Source, batch: KVEventBatch) -> None:
        """Applies one batch of `source`'s events, in order."""
        groups = self._sources.setdefault(source, {})
        windows = self._windows.setdefault(source, {})
        states = self._states.setdefault(source, set())
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                for tiers in groups.values():
                    for held in tiers.values():
                        held.clear()
                self._pins.pop(source, None)
                continue
            if not isinstance(event, BlockStored | BlockRemoved):
                continue
            tier = TIER_OF_MEDIUM.get(event.medium) if event.medium is not None else "device"
            if (
                tier is None
                or isinstance(event, BlockStored)
                and event.block_size != self.page_size
            ):
                self.num_ignored += 1
                continue
            group = event.group_idx or 0
            by_tier = groups.get(group)
            if by_tier is None:
                by_tier = groups[group] = {t: set() for t in TIERS}
                windows[group] = None
            if isinstance(event, BlockStored):
                if event.kv_cache_spec_kind == SLIDING_WINDOW:
                    windows[group] = event.kv_cache_spec_sliding_window
                elif event.kv_cache_spec_kind == RECURRENT:
                    states.add(group)
                by_tier[tier].update(event.block_hashes)
            else:
                by_tier[tier].difference_update(event.block_hashes)

    def drop_source(self, source: Source) -> None:
        """Forgets everything about `source` (after a restart or an unrecoverable gap)."""
        self._sources.pop(source, None)
        self._windows.pop(source, None)
        self._states.pop(source, None)
        self._pins.pop(source, None)

    def note_pin(
        self,
        source: Source,
        tokens,
        ttl_s: float,
        cache_salt: str | None = None,
        *,
        lora_name: str | None = None,
        mm_inputs: Sequence[MultimodalInput] = (),
        num_tokens: int | None = None,
    ) -> None:
        """The router sent `tokens` to `source` asking for a pin of `ttl_s` seconds (of
        its first `num_tokens` tokens; None: all): their full pages are pinned there
        until `clock() + ttl_s` (a later deadline already noted stands)."""
        if ttl_s.__class__ not in (int, float) or not ttl_s > 0:
            raise ValueError(f"ttl_s must be a number of seconds > 0, got {ttl_s!r}")
        hashes = self.page_hashes(tokens, cache_salt, lora_name, mm_inputs)
        if num_tokens is not None:
            hashes = hashes[: num_tokens // self.page_size]
        deadline = self.clock() + ttl_s
        pins = self._pins.setdefault(source, {})
        for h in hashes:
            pins[h] = max(pins.get(h, deadline), deadline)

    def pinned_pages(self, hashes: Sequence[int]) -> dict[Source, int]:
        """For each source with live pins, how many leading pages of `hashes` (a prompt's
        `page_hashes`) they hold (ended pins are forgotten here: expiry is lazy)."""
        now = self.clock()
        for source, pins in list(self._pins.items()):
            for h in [h for h, deadline in pins.items() if deadline <= now]:
                del pins[h]
            if not pins:
                del self._pins[source]
        out = {}
        for source, pins in self._pins.items():
            n = 0
            while n < len(hashes) and hashes[n] in pins:
                n += 1
            out[source] = n
        return out

    def page_hashes(
        self,
        tokens,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        mm_inputs: Sequence[MultimodalInput] = (),
    ) -> list[int]:
        """The hashes of the full pages of `tokens` with `cache_salt` (None or "": none),
        under the LoRA adapter `lora_name`, with the images `mm_inputs`, as servers compute
        them (`TextContext` takes the same keys)."""
        tokens = token_ids(tokens, allow_empty=True)
        check_cache_salt(cache_salt)
        check_name("lora_name", lora_name)
        images = multimodal_inputs(mm_inputs, len(tokens))
        key = (cache_salt or None, lora_name)
        root = self._roots.get(key)
        if root is None:
            root = chain_root(self.prefix_hash, self.prefix_hash_seed, *key)
            self._roots[key] = root
        keys = page_keys(images, self.page_size, 0, len(tokens) // self.page_size)
        return page_hashes(tokens, self.page_size, root, self._hash_fn, keys)

    def match(
        self,
        tokens,
        cache_salt: str | None = None,
        tiers: tuple[str, ...] = TIERS,
        *,
        lora_name: str | None = None,
        mm_inputs: Sequence[MultimodalInput] = (),
    ) -> dict[Source, int]:
        """For each source, how many leading full pages of `tokens` (with this salt,
        adapter and images) it holds in any of `tiers` (e.g. `("device",)`: what it
        holds on its device)."""
        if not set(tiers) <= set(TIERS):
            raise ValueError(f"tiers={tiers!r} are not all in {TIERS}")
        hashes = self.page_hashes(tokens, cache_salt, lora_name, mm_inputs)
        return {s: len(w) for s, w in self._page_weights(hashes, tiers).items()}

    def scores(
        self,
        tokens,
        cache_salt: str | None = None,
        *,
        lora_name: str | None = None,
        mm_inputs: Sequence[MultimodalInput] = (),
    ) -> dict[Source, float]:
        """For each source, its leading pages of `tokens` (see `match`), each weighted by
        the best tier that holds it (device 1.0, host `host_weight`, shared
        `shared_weight`), summed."""
        hashes = self.page_hashes(tokens, cache_salt, lora_name, mm_inputs)
        return {s: sum(w) for s, w in self._page_weights(hashes).items()}

    def best(
        self,
        tokens,
        cache_salt: str | None = None,
        *,
        lora_name: str | None = None,
        mm_inputs: Sequence[MultimodalInput] = (),
    ) -> tuple[Source | None, float]:
        """The source with the highest `scores` for `tokens`, and its score ((None, 0.0)
        when no source holds the first page), a source whose live pins hold more leading
        pages first (`note_pin`); ties go to the source added first."""
        hashes = self.page_hashes(tokens, cache_salt, lora_name, mm_inputs)
        scores = {s: sum(w) for s, w in self._page_weights(hashes).items()}
        pinned = self.pinned_pages(hashes)
        source = max(scores, key=lambda s: (pinned.get(s, 0), scores[s]), default=None)
        return (source, scores[source]) if source is not None and scores[source] else (None, 0.0)

    def _page_weights(
        self, hashes: list[int], tiers: tuple[str, ...] = TIERS
    ) -> dict[Source, list[float]]:
        """Per source, the weight of each leading page of `hashes` it holds in `tiers`
        (its best tier's; a page only the shared store holds weighs `shared_weight`).
        The store is asked only when some source's own tiers stop short."""
        order = sorted(tiers, key=self.weights.__getitem__, reverse=True)
        out = self._walk(hashes, order, 0)
        if (
            self.shared is not None
            and "shared" in tiers
            and any(len(weights) < len(hashes) for weights in out.values())
        ):
            out = self._walk(hashes, order, self.shared.holds(hashes[:SHARED_PROBE_PAGES]))
        return out

    def _walk(self, hashes: list[int], order: list[str], present: int) -> dict[Source, list[float]]:
        """`_page_weights` with the shared store holding the first `present` pages. A
        source of several cache groups (or a window) holds the joint hit
        (`_joint_weights`)."""
        out = {}
        for source, groups in self._sources.items():
            windows = self._windows[source]
            if len(groups) > 1 or any(windows.values()):
                out[source] = self._joint_weights(
                    hashes, order, present, groups, windows, self._states[source]
                )
                continue
            held = next(iter(groups.values()), None)
            weights = []
            for i, h in enumerate(hashes):
                tier = next((t for t in order if h in held[t]), None) if held else None
                if tier is None and i < present:
                    tier = "shared"
                if tier is None:
                    break
                weights.append(self.weights[tier])
            out[source] = weights
        return out

    def _joint_weights(
        self,
        hashes: list[int],
        order: list[str],
        present: int,
        groups: dict[int, dict[str, set[int]]],
        windows: dict[int, int | None],
        states: set[int],
    ) -> list[float]:
        """The weights of the pages of the longest prefix of `hashes` every group of a
        source can serve, as its manager finds it (`groups/joint.py`): a full group needs
        every page of it, a sliding group only the pages its window reads before the
        prefix's end, a state group (`states`) a checkpoint at its end (the prefix ends
        at the last one the attention groups reach). A page weighs the least, over the
        attention groups that need it, of each one's best tier (the slowest copy is the
        one the request waits for); the shared store's `present` pages (attention pages)
        count in every attention group."""
        shapes, found = [], []
        for g, held in groups.items():
            weights: list[float | None] = []
            for i, h in enumerate(hashes):
                tier = next((t for t in order if h in held[t]), None)
                if tier is None and i < present and g not in states:
                    tier = "shared"
                weights.append(None if tier is None else self.weights[tier])
            window = windows.get(g)
            shapes.append(
                None if g in states else 0 if window is None else -(-(window - 1) // self.page_size)
            )
            found.append(weights)
        pages = [cast(list[int | None], f) for f in found]  # the rules read None or not
        rules = [
            partial(checkpoint_hit, p)
            if k is None
            else partial(run_hit, p)
            if not k
            else partial(window_hit, p, pages_in_window=k)
            for p, k in zip(pages, shapes)
        ]
        n = longest_joint_hit(rules, len(hashes))
        return [
            min(
                cast(float, f[i])
                for f, k in zip(found, shapes)
                if k is not None and (not k or i >= n - k)
            )
            for i in range(n)
        ]
