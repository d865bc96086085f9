"""RecurrentStateGroup: the recurrent state of a hybrid model's linear-attention or
state-space layers (`RecurrentStateConfig`), beside the attention groups of a replica.

Such a layer's cache is one fixed-size state per request, which every step reads and
overwrites. So the group holds no pages of tokens: each request runs in the *live
block* of its slot, and prefix caching keeps *checkpoints*, copies of a live block taken
where a step ends on a boundary of `checkpoint_every` pages, indexed (in `pool`, a
`PagePool` of checkpoint slots) under the chain hash and tokens of the page that ends
there. Blocks, each one whole state (every region and layer), in every region's buffer:

    block:   0 .. max_requests-1 | max_requests + c (checkpoint c) | the last: zeros
             the live block of      a checkpoint slot of `pool`      (a fresh request's
             each request slot                                       state is copied
                                                                     from it)

A region's buffer is `[num_blocks * num_layers, *row_shape]`: block `b`'s layer `l` is
row `b * num_layers + l`, MAX 26.7's `RecurrentStateRegion.rows_of`, so the graph
inputs are MAX's (`RecurrentLeafInputs`: the pool and each layer's live rows).

The joint prefix hit (`joint.py`). A state is one boundary, not a run: the group serves
a hit of `m` pages when a checkpoint stands at page `m` (`longest_hit`: the last one at
or before the hit the attention groups allow), and the joint hit iterates with the
attention groups' rules until all agree, so it never passes the checkpoint it resumes
from. Taking a hit copies the checkpoint into the live block (`resume`); a request that
starts from its first token gets zeros.

Checkpoints are evicted least recently used first when a new one needs a slot; a hit
touches the one it resumes from. A checkpoint also leaves its slot when every attention
group evicted its boundary page (`boundaries_evicted`: no device hit reaches it). With
a host tier (`host`: `state_host.py`) an evicted one is kept there, and a hit may
resume from it; with a shared tier (`shared`: `state_shared.py`) every one taken is
written through to the store, and a hit may resume from one another manager took. One
whose attention pages were evicted can serve no hit (the attention groups no longer
reach it) and waits for its turn to be evicted. Sessions and pins hold the checkpoint
at each chain's last boundary (`held_in`): it is evicted last, or not while pinned.

All or nothing: every change records its undo (the pool's, and for each copy that
overwrites a state a later rollback could read again -- a continuing request's live
block, an evicted checkpoint -- a host copy of the old state, written back on rollback).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import ClassVar

import numpy as np
from max.driver import CPU, Buffer, Device
from max.nn.kv_cache import RecurrentLeafInputs, RecurrentStateInputsPerDevice

from ....cache.cache_memory import cache_buffer
from ....cache.extra_keys import request_keys
from ....cache.page_pool import PagePool
from ....config.params import KVCacheParams
from ....config.recurrent import RecurrentStateConfig
from ....context import TextGenerationContext
from ....errors import InvariantError, StaleContextError
from ....tiers.stack import TierStack
from ....undo import UndoLog
from ..plans import RequestState
from ..window_tails import TailRule, checkpoint_tail
from .state_host import HostCheckpoints, StoredCheckpoint
from .state_shared import SharedCheckpoint, SharedCheckpoints

Checkpoint = int | StoredCheckpoint | SharedCheckpoint
"""Where a checkpoint stands: a slot of the device pool, a host copy (the host tier's,
or loaded from the shared tier), or the shared tier's, not loaded yet."""


def checkpoint_hit(checkpoints: Sequence[object | None], n: int) -> int:
    """The longest hit of at most `n` pages a state resumes from `checkpoints` (what
    stands after each page of a chain, None where nothing does): up to the last one at
    or before page `n`, 0 when none stands there (a router's reading of the events,
    `mokv.events.PrefixRouterIndex`; `RecurrentStateGroup.longest_hit` also loads)."""
    return next(
        (m for m in range(min(n, len(checkpoints)), 0, -1) if checkpoints[m - 1] is not None), 0
    )


class RecurrentStateGroup:
    """The state layers of one replica: their live blocks, checkpoints and buffers."""

    kind: ClassVar[str] = "recurrent"

    def __init__(
        self,
        config: RecurrentStateConfig,
        page_size: int,
        devices: Sequence[Device],
        max_requests: int,
        undo: UndoLog,
        host: HostCheckpoints | None = None,
        shared: SharedCheckpoints | None = None,
    ) -> None:
        self.config = config
        self.host = host
        """The checkpoints evicted from the device, in the host tier (None without one)."""
        self.shared = shared
        """The checkpoints in the shared tier (None without one): every one taken here is
        written through to it."""
        self.name = config.name
        self.page_size = page_size
        self.devices = devices
        self.max_requests = max_requests
        # A pool has a page at least; with no checkpoints its one slot is never taken.
        self.pool = PagePool(max(1, config.num_checkpoints))
        self.pool.undo = undo
        self.undo = undo
        self.zero_block = max_requests + config.num_checkpoints
        num_blocks = self.zero_block + 1
        self.states: list[list[Buffer]] = [
            [
                cache_buffer(r.dtype, [num_blocks * r.num_layers, *r.row_shape], device)
                for device in devices
            ]
            for r in config.regions
        ]
        """Each region's buffer on each device (see the module docstring)."""
        for buffers, region in zip(self.states, config.regions):
            zeros = []  # any dtype (bfloat16 has no numpy twin), on the buffer's device
            for buffer, device in zip(buffers, devices):  # the zero block
                rows = self._rows(buffer, region.num_layers, self.zero_block)
                zeros.append(Buffer.zeros(shape=rows.shape, dtype=rows.dtype, device=device))
                rows.inplace_copy_from(zeros[-1])
            for device in devices:  # the zeros must outlive the copies
                device.synchronize()
        self.positions = [0] * max_requests
        """The tokens each slot's live state has absorbed (0: a fresh request's)."""
        self.checkpoints_taken = 0
        """Checkpoints taken since the group was built."""

    @property
    def num_blocks(self) -> int:
        return self.zero_block + 1

    def live_block(self, slot: int) -> int:
        """The block request slot `slot` runs in."""
        return slot

    def checkpoint_block(self, checkpoint: int) -> int:
        """The block of checkpoint slot `checkpoint` (a page id of `pool`)."""
        return self.max_requests + checkpoint

    # --- the joint prefix hit (pure) ------------------------------------------------

    def found(self, chain: Sequence[tuple[int, bytes]]) -> list[Checkpoint | None]:
        """The checkpoint standing after each `(hash, token bytes)` page of the chain, on
        the device, else in the host tier, else in the shared tier (probed, not loaded:
        `longest_hit` loads the one it chooses), None where there is none."""
        host, lookup = self.host, self.pool.lookup
        out: list[Checkpoint | None] = []
        for h, data in chain:
            found: Checkpoint | None = lookup(h, data)
            if found is None and host is not None:
                found = host.lookup(h, data)
            out.append(found)
        missing = [i for i, found in enumerate(out) if found is None]
        if self.shared is not None and missing:
            probed = self.shared.probe([chain[i] for i in missing])
            for i, found in zip(missing, probed):
                out[i] = found
        return out

    def longest_hit(self, checkpoints: list[Checkpoint | None], n: int) -> int:
        """The longest hit of at most `n` pages the group can resume: up to the last
        checkpoint at or before page `n`; 0 when none stands there. A shared tier's
        checkpoint it chooses is loaded here, in `checkpoints` (one that fails to load
        becomes None, and the one before it is chosen)."""
        for m in range(min(n, len(checkpoints)), 0, -1):
            found = checkpoints[m - 1]
            if isinstance(found, SharedCheckpoint):
                assert self.shared is not None, "only a shared tier's probe finds one"
                found = checkpoints[m - 1] = self.shared.load(found)
            if found is not None:
                return m
        return 0

    def check_window(self, ctx: TextGenerationContext, req: RequestState) -> None:
        """StaleContextError unless the context continues where the request's state is:
        its `start_idx` is the tokens the live state has absorbed (a context moved by
        `ctx.reset()` without a release would run from a state past its tokens)."""
        position = self.positions[req.slot]
        if ctx.start_idx != position:
            raise StaleContextError(
                f"request {ctx.request_id!r} has start_idx={ctx.start_idx}, but its state "
                f"in {self.name!r} holds {position} tokens: release the request before "
                "ctx.reset()"
            )

    # --- changes --------------------------------------------------------------------

    def resume(self, req: RequestState, checkpoint: Checkpoint | None, num_held: int) -> None:
        """After a reservation of a request that held `num_held` pages: its live block
        takes `checkpoint`'s state (a hit; from the host tier's copy, bit for bit, when
        the device evicted it), or zeros when it starts from its first token (no hit,
        nothing held); a request continuing its own state keeps it."""
        live = self.live_block(req.slot)
        if checkpoint is None:
            if not num_held:
                self._copy(self.zero_block, live, keep_old=False)
            return
        self._set_position(req.slot, len(req.hashes) * self.page_size)  # the hit's end
        if isinstance(checkpoint, StoredCheckpoint):
            if num_held:
                self._keep(live)
            self._restore(live, checkpoint.copies)
            if self.host is not None and not checkpoint.shared:  # it found the checkpoint
                self.host.touch(checkpoint.page_hash)
            return
        assert not isinstance(checkpoint, SharedCheckpoint), "the hit loaded it"
        self.pool.acquire(checkpoint)  # out of the LRU while it is read...
        self._copy(self.checkpoint_block(checkpoint), live, keep_old=num_held > 0)
        self.pool.release([checkpoint])  # ...and back as its most recently used page

    def slide(
        self,
        req: RequestState,
        start_idx: int,
        token_bytes: bytes | None,
        ctx: TextGenerationContext | None = None,
    ) -> bool:
        """After a step that left the request's live state at token `start_idx`: records
        where its state is; when that is a boundary of `checkpoint_every` pages whose page
        is committed (`token_bytes`, None if it is not indexed) and no checkpoint stands
        there yet, copies the live block into a checkpoint slot, indexed under the page's
        chain hash (the checkpoint whose slot it takes goes to the host tier, if any) and
        announced to the pool's events with its parent and the page's keys (`ctx`'s).
        True if it took one."""
        self._set_position(req.slot, start_idx)
        page, rest = divmod(start_idx, self.page_size)
        if (
            rest
            or not page
            or page % self.config.checkpoint_every
            or page > len(req.hashes)
            or token_bytes is None
            or not self.config.num_checkpoints
        ):
            return False
        page_hash = req.hashes[page - 1]
        if self.pool.lookup(page_hash, token_bytes) is not None:
            return False
        # No unused slot left: the oldest checkpoint gives its own (no session keeps one).
        evicted = self.pool.next_evicted()
        old = None if evicted is None else self.pool.page_hash(evicted)
        old_tokens = None if evicted is None else self.pool.page_tokens(evicted)
        taken = self.pool.take((), 1)
        if taken is None:  # every slot is pinned (`held_in`): no checkpoint this time
            return False
        (slot,) = taken
        block = self.checkpoint_block(slot)
        if old is not None and old_tokens is not None:
            copies = self._keep(block)  # the rollback's copy, and the host tier's
            if self.host is not None:
                self.host.store(old, old_tokens, copies)
        self._copy(self.live_block(req.slot), block, keep_old=False)
        if self.shared is not None:  # written through, as committed pages are
            self.shared.store(page_hash, token_bytes, self._host_copy(block))
        parent = req.hashes[page - 2] if page > 1 else None
        keys = None
        if self.pool.events is not None and ctx is not None:
            request = request_keys(ctx)
            keys = request.page(page - 1, self.page_size) if request is not None else None
        self.pool.commit_pages([slot], [page_hash], [token_bytes], [parent], [keys])
        self.pool.release([slot])
        self.undo.push(setattr, self, "checkpoints_taken", self.checkpoints_taken)
        self.checkpoints_taken += 1
        return True

    def boundaries_evicted(self, pools: Sequence[PagePool], page_hashes: list[int]) -> None:
        """The attention groups' pools (`pools`) evicted pages of these hashes: a
        checkpoint at a boundary no group's device holds any more leaves its slot (it
        serves no device hit: the groups need its page), kept by the host tier if there
        is one (the attention pages may come back from their tiers). One a session
        retains or a pin holds stays (it leaves by its pool's own order)."""
        pool = self.pool
        pinned = pool.pinned_hashes if pool.num_pinned else frozenset()
        for page_hash in page_hashes:
            slot = pool.page_of(page_hash)
            if slot is None or pool.ref_count(slot) or pool.is_retained(slot):
                continue
            if page_hash in pinned:
                continue
            if any(p.page_of(page_hash) is not None for p in pools):
                continue
            tokens = pool.page_tokens(slot)
            if self.host is not None and tokens is not None:
                self.host.store(page_hash, tokens, self._host_copy(self.checkpoint_block(slot)))
            pool.drop(slot)

    def release(self, req: RequestState) -> None:
        """The request's slot starts its next request from a fresh state."""
        self._set_position(req.slot, 0)

    def held_in(self, params: KVCacheParams) -> tuple[PagePool, TierStack, TailRule]:
        """What sessions retain and pins hold of the state (`window_tails.py`): in the
        checkpoint pool, each chain's last checkpoint boundary. Its tiers keep theirs by
        their own LRU (an empty stack: the host tier's checkpoints are not retained)."""
        every = self.config.checkpoint_every
        return self.pool, TierStack((), params, 0, self.pool, []), partial(checkpoint_tail, every)

    def close(self) -> None:
        """Closes the shared tier's stores (they send what they queued)."""
        if self.shared is not None:
            self.shared.close()

    def _set_position(self, slot: int, tokens: int) -> None:
        self.undo.push(self.positions.__setitem__, slot, self.positions[slot])
        self.positions[slot] = tokens

    def reset_prefix_cache(self) -> None:
        """Forgets every checkpoint, on the device and in the host tier."""
        self.pool.reset_prefix_cache()
        if self.host is not None:
            self.host.reset()

    def _copy(self, src: int, dst: int, keep_old: bool) -> None:
        """Copies block `src` onto block `dst` in every region and device; with
        `keep_old`, a host copy of `dst`'s state is written back on rollback."""
        if keep_old:
            self._keep(dst)
        for region, buffers in zip(self.config.regions, self.states):
            for buffer in buffers:
                layers = region.num_layers
                self._rows(buffer, layers, dst).inplace_copy_from(self._rows(buffer, layers, src))

    def _keep(self, block: int) -> list[list[Buffer]]:
        """Records the undo of an overwrite of block `block`: a host copy of its state
        (returned; never written), written back on rollback."""
        copies = self._host_copy(block)
        self.undo.push(self._restore, block, copies)
        return copies

    def _host_copy(self, block: int) -> list[list[Buffer]]:
        """Block `block`'s state, copied to host buffers (region, then device)."""
        copies = []
        for region, buffers in zip(self.config.regions, self.states):
            per_device = []
            for buffer in buffers:
                rows = self._rows(buffer, region.num_layers, block)
                host = Buffer(rows.dtype, rows.shape, CPU())
                host.inplace_copy_from(rows)
                per_device.append(host)
            copies.append(per_device)
        for device in self.devices:
            device.synchronize()
        return copies

    def _restore(self, block: int, copies: list[list[Buffer]]) -> None:
        """Writes a `_host_copy` back into block `block` (the undo of a copy)."""
        for region, buffers, hosts in zip(self.config.regions, self.states, copies):
            for buffer, host in zip(buffers, hosts):
                self._rows(buffer, region.num_layers, block).inplace_copy_from(host)
        for device in self.devices:
            device.synchronize()

    @staticmethod
    def _rows(buffer: Buffer, num_layers: int, block: int) -> Buffer:
        """The rows of block `block` (its layers) in a region's buffer."""
        rows = slice(block * num_layers, (block + 1) * num_layers)
        return buffer[(rows,) + (slice(None),) * (buffer.rank - 1)]

    # --- graph inputs and checks ----------------------------------------------------

    def runtime_inputs(self, slots: Sequence[int]) -> list[RecurrentStateInputsPerDevice]:
        """MAX's inputs of the state layers for a batch of request slots, one per device:
        each region's buffer and the `[num_layers, batch]` uint32 rows its layers run in
        (`RecurrentStateParams.get_symbolic_inputs`' types and order)."""
        live = np.array([self.live_block(s) for s in slots], np.uint32)
        inputs = []
        for d, device in enumerate(self.devices):
            leaves = []
            for region, buffers in zip(self.config.regions, self.states):
                layers = np.arange(region.num_layers, dtype=np.uint32)[:, None]
                rows = live[None, :] * np.uint32(region.num_layers) + layers
                ids = Buffer.from_numpy(np.ascontiguousarray(rows)).to(device)
                leaves.append(RecurrentLeafInputs(pool=buffers[d], live_row_ids=ids))
            inputs.append(RecurrentStateInputsPerDevice(leaves=tuple(leaves)))
        return inputs

    def live_state(self, slot: int, region: int = 0, device: int = 0) -> np.ndarray:
        """A host copy of request slot `slot`'s state of one region (`[num_layers,
        *row_shape]`), for checks and tests."""
        rows = self._host_copy(self.live_block(slot))[region][device]
        return rows.to_numpy().copy()

    def check_invariants(self) -> None:
        """InvariantError unless the checkpoint pool's invariants hold and no checkpoint
        is held outside a call."""
        pool = self.pool
        held = sum(pool.ref_count(slot) > 0 for slot in range(pool.num_pages))
        if held:  # (pinned checkpoints are not room, and not held either)
            raise InvariantError(
                f"recurrent state {self.name!r}: {held} checkpoints are held between calls"
            )
        self.pool.check_invariants([])
        if self.host is not None:
            self.host.check_invariants()
