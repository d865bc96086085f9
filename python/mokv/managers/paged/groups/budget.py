"""SharedBudget: one allocation of memory for every cache group of a replica, moved to
the group that needs it (issue 52: MAX 26.7's Jenga pool, vLLM's hybrid allocator).

The memory is `num_slots` slots of `slot_bytes` on each device, the least common
multiple of the groups' page sizes (per device), so a slot holds `ratios[g]` whole pages
of group `g`: group `g`'s buffer is a view of the same allocation with `num_slots *
ratios[g]` pages, and its page `p` lies in slot `p // ratios[g]`. A slot belongs to one
group at a time, or to none (free):

    slot s of group g        pages [s*r, (s+1)*r) of g's pool are g's pages
    every other slot         those pages of g's pool are held by the budget (ref count
                             1, unhashed): g's pool never hands them out

So each group keeps its own exact pool (room, LRU, index, undo), and the budget is one
more owner of the pages of the slots a group does not have. Moving slot `s` from group
`h` to group `g` is `pool_h.claim` of its pages there (evicting the cached ones) and
`pool_g.release` of its pages here (free pages of `g`), both undoable.

Where a group's pages come from when it takes `n` fresh ones (`grants`, then the pool's
own `take`), cheapest first:
    1. its free pages;
    2. free slots, then slots of other groups whose pages are all free (no eviction);
    3. its own cached pages, oldest first (its pool's LRU);
    4. slots of other groups whose pages are all unowned, the least recently used
       first (their cached pages evicted);
taking from another group only what that group does not need for its own `n` (2 never
makes another group evict; 4 only what it can spare with its own cache). So memory
moves to the group under pressure, and a group's cache is evicted by another group only
once that group has none of its own left. The room (`room`, `fits`) is exact for this
order: a group's room is its pool's, plus `ratios[g]` pages per slot the others can
spare.

Slots whose pages a pin holds are never moved.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import ceil, lcm

from ....cache.page_pool import PagePool
from ....errors import InvariantError
from ....undo import UndoLog


def budget_part(pool: PagePool, shared: Sequence[PagePool]) -> int:
    """The pages of `pool` that a share of a replica's pages (`PinConfig.cap`,
    `SessionConfig.cap`) is taken of: all of them, or, for one of the `shared` pools (the
    views of one `SharedBudget`, each as large as the whole memory), a `1 / len(shared)`
    part, so that the groups' shares together stay within the memory's. A pool outside
    the budget (a recurrent state's checkpoint slots) has memory of its own: all of it."""
    if any(p is pool for p in shared):
        return pool.num_pages // len(shared)
    return pool.num_pages


class SharedBudget:
    """The slots of one replica's groups (see the module docstring); `pools[g]` is group
    `g`'s pool of `num_slots * ratios[g]` pages."""

    def __init__(self, pools: Sequence[PagePool], ratios: Sequence[int], num_slots: int) -> None:
        self.pools = list(pools)
        self.ratios = list(ratios)
        self.num_slots = num_slots
        self.owner = [-1] * num_slots
        """The group each slot belongs to, -1: none."""
        self.free_slots = list(range(num_slots - 1, -1, -1))
        """Slots of no group; the last is handed out next."""
        self.num_owned = [0] * len(self.pools)
        self.undo: UndoLog | None = None
        # Every page starts held by the budget (the undo records the pools push here are
        # dropped by the manager's first call: nothing before it can be undone).
        for pool in self.pools:
            pool.claim(range(pool.num_pages))

    # --- queries --------------------------------------------------------------------

    def pages(self, g: int, slot: int) -> range:
        """Group `g`'s pages in `slot`."""
        r = self.ratios[g]
        return range(slot * r, (slot + 1) * r)

    def present(self, g: int) -> int:
        """Pages of group `g` in its slots."""
        return self.num_owned[g] * self.ratios[g]

    def held(self, g: int) -> list[int]:
        """The pages of `g`'s pool the budget holds (the slots `g` does not have)."""
        return [p for s, o in enumerate(self.owner) if o != g for p in self.pages(g, s)]

    @property
    def num_free(self) -> int:
        """Slots' worth of memory that can be handed out now: the free slots and every
        group's free pages (a page of group `g` is `1 / ratios[g]` of a slot), rounded
        down."""
        unit = lcm(*self.ratios)
        pages = sum(pool.num_free * (unit // r) for pool, r in zip(self.pools, self.ratios))
        return len(self.free_slots) + pages // unit

    def _spare(self, h: int, revived: set[int]) -> tuple[list[int], list[int]]:
        """Group `h`'s slots that could move: those whose pages are all free, and those
        whose pages are all unowned (some cached), the least recently used first (by
        the youngest page's place in `h`'s eviction order); none revived by a hit."""
        pool, r = self.pools[h], self.ratios[h]
        rank = pool.eviction_rank()
        blank, cached = [], []
        for s, o in enumerate(self.owner):
            if o != h:
                continue
            youngest = -1
            for p in range(s * r, (s + 1) * r):
                if p in revived or pool.ref_count(p):
                    break
                if pool.page_hash(p) is not None:
                    if p not in rank:  # pinned
                        break
                    youngest = max(youngest, rank[p])
            else:
                if youngest < 0:
                    blank.append(s)
                else:
                    cached.append((youngest, s))
        return blank, [s for _, s in sorted(cached)]

    def grants(
        self, need: int, hits: Sequence[Sequence[int]], extra: Sequence[int] | None = None
    ) -> list[tuple[int, int]] | None:
        """The `(slot, group)` moves that let every group take `hits[g]` and `need` fresh
        pages (and `extra[g]` more: tier pages it loads) with the least eviction (the
        module docstring's order); None if no moves can. Pure."""
        pools, ratios = self.pools, self.ratios
        needs = [need + e for e in extra] if extra is not None else [need] * len(pools)
        blanks = [pool.num_blank for pool in pools]
        wants = [max(0, ceil((n - b) / r)) for n, b, r in zip(needs, blanks, ratios)]
        if not any(wants):  # every group's free pages cover it
            return []
        rooms = [pool.room(h) for pool, h in zip(pools, hits)]
        short = [max(0, ceil((n - room) / r)) for n, room, r in zip(needs, rooms, ratios)]
        # What each group can give: with eviction (its own cache covers its need), and
        # without (its free pages do); only those that can give are scanned.
        cap = [max(0, (room - n) // r) for n, room, r in zip(needs, rooms, ratios)]
        cap_blank = [max(0, (b - n) // r) for n, b, r in zip(needs, blanks, ratios)]
        scan = [bool(cap[h] and (any(short) or cap_blank[h])) for h in range(len(pools))]
        spare = [self._spare(h, set(hits[h])) if scan[h] else ([], []) for h in range(len(pools))]
        free_slots = list(self.free_slots)
        moves: list[tuple[int, int]] = []
        for g, n in enumerate(short):  # 2 then 4: what the group must have
            if n and self._move(g, n, free_slots, spare, cap, cap_blank, moves, True) < n:
                return None
        for g, n in enumerate(wants):  # 2 only: what saves the group evicting its own
            n -= sum(1 for _, to in moves if to == g)
            if n > 0:
                self._move(g, n, free_slots, spare, cap, cap_blank, moves, False)
        return moves

    def _move(
        self,
        g: int,
        n: int,
        free_slots: list[int],
        spare: list[tuple[list[int], list[int]]],
        cap: list[int],
        cap_blank: list[int],
        moves: list[tuple[int, int]],
        evict: bool,
    ) -> int:
        """Plans up to `n` slots for group `g` (free ones, then other groups' all-free
        ones, then, with `evict`, their unowned ones), updating what is left; how many."""
        got = 0
        while got < n and free_slots:
            moves.append((free_slots.pop(), g))
            got += 1
        for source in (0, 1) if evict else (0,):
            for h, slots in enumerate(spare):
                if h == g:
                    continue
                while got < n and slots[source] and cap[h] and (evict or cap_blank[h]):
                    moves.append((slots[source].pop(0), g))
                    cap[h] -= 1
                    if source == 0:
                        cap_blank[h] = max(0, cap_blank[h] - 1)
                    got += 1
        return got

    def room(self, hits: Sequence[Sequence[int]], extra: Sequence[int] | None = None) -> int:
        """The most fresh pages every group could take at once with its `hits[g]` taken
        (each group takes the same number, and `extra[g]` more: tier pages it loads):
        the largest `need` that `grants` meets (negative: not even none). Pure;
        arithmetic, with a scan of a group's slots only where one of several pages could
        move (a slot of one page moves when the page does: the pool's room counts it)."""
        pools, ratios = self.pools, self.ratios
        extra = extra if extra is not None else [0] * len(pools)
        # A group's room for the common `need`: its pool's, less its extra pages.
        rooms = [pool.room(h) - e for pool, h, e in zip(pools, hits, extra)]
        movable: dict[int, int] = {}

        def spare(h: int, need: int) -> int:  # slots group h can give up at `need`
            cap = max(0, (rooms[h] - need) // ratios[h])
            if not cap or ratios[h] == 1 and not pools[h].num_pinned:
                return cap
            if h not in movable:
                movable[h] = sum(map(len, self._spare(h, set(hits[h]))))
            return min(cap, movable[h])

        def meets(need: int) -> bool:
            short = sum(max(0, ceil((need - room) / r)) for room, r in zip(rooms, ratios))
            return short <= len(self.free_slots) + sum(spare(h, need) for h in range(len(pools)))

        lo, hi = min(rooms), max(rooms) + max(ratios) * self.num_slots
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if meets(mid) else (lo, mid - 1)
        return lo

    # --- changes --------------------------------------------------------------------

    def move(self, moves: Sequence[tuple[int, int]]) -> None:
        """Hands each slot to its group (`grants`' moves): its pages leave their old
        group's pool (evicted, held by the budget) and join the new one's, free."""
        if not moves:
            return
        if self.undo is not None:
            self.undo.push(
                self._restore,
                [(s, self.owner[s]) for s, _ in moves],
                list(self.free_slots),
                list(self.num_owned),
            )
        for slot, g in moves:
            old = self.owner[slot]
            if old < 0:
                self.free_slots.remove(slot)
            else:  # the budget holds them there now, their cached pages evicted
                self.pools[old].claim(self.pages(old, slot))
                self.num_owned[old] -= 1
            self.pools[g].release(reversed(self.pages(g, slot)))
            self.owner[slot] = g
            self.num_owned[g] += 1

    def _restore(
        self, owners: list[tuple[int, int]], free_slots: list[int], num_owned: list[int]
    ) -> None:
        for slot, g in owners:
            self.owner[slot] = g
        self.free_slots[:] = free_slots
        self.num_owned[:] = num_owned

    # --- checks ---------------------------------------------------------------------

    def check_invariants(self) -> None:
        """InvariantError unless the free slots are exactly the slots of no group, each
        group's count is its slots', and the pages the budget holds are unhashed (the
        pools check that it holds each once: `JointGroups.check_invariants`)."""
        unowned = sorted(s for s, g in enumerate(self.owner) if g < 0)
        if sorted(self.free_slots) != unowned:
            raise InvariantError(f"free slots {sorted(self.free_slots)}, unowned {unowned}")
        counts = [self.owner.count(g) for g in range(len(self.pools))]
        if counts != self.num_owned:
            raise InvariantError(f"groups own {counts} slots, counted {self.num_owned}")
        for g, pool in enumerate(self.pools):
            hashed = [p for p in self.held(g) if pool.page_hash(p) is not None]
            if hashed:
                raise InvariantError(f"group {g}'s pages {hashed} are hashed but not its")
