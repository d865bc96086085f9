"""The paged manager's random-operation machine (tests/managers/paged/test_stateful.py),
with events: after every operation, the events recorded so far, encoded and decoded as on
the wire and applied to a router index, rebuild exactly the pool's own hash index (and the
host tier's, with one); every BlockStored holds full pages only and a parent the stream
announced since its last AllBlocksCleared (a reset under running requests would break
that: it is refused)."""

import msgspec
from hypothesis import settings
from hypothesis.stateful import invariant
from mokv.events import (
    AllBlocksCleared,
    BatchDecoder,
    BlockStored,
    EventRecorder,
    PrefixRouterIndex,
    build_events,
)
from mokv.events.format import KVEventBatch

from tests.managers.paged import test_stateful as base


class EventsMixin:
    """The events a replica's pool and tiers record, checked after every operation."""

    def __init__(self):
        super().__init__()
        self.recorder = EventRecorder()
        self.m.replicas[0].publish_to(self.recorder)
        self.index = PrefixRouterIndex(page_size=self.m.page_size)
        self.announced: set[int] = set()
        self.decode = BatchDecoder().decode

    @invariant()
    def events_rebuild_the_pool_index(self):
        events = build_events(self.recorder.take(), self.m.page_size)
        batch = self.decode(msgspec.msgpack.encode(KVEventBatch(0.0, events, 0)))
        for e in batch.events:
            if isinstance(e, AllBlocksCleared):
                self.announced.clear()  # a parent must be announced since the last clear
            if isinstance(e, BlockStored):
                assert len(e.token_ids) == len(e.block_hashes) * e.block_size
                assert e.parent_block_hash is None or e.parent_block_hash in self.announced
                parents = [e.parent_block_hash, *e.block_hashes[:-1]]
                assert all(h != p for h, p in zip(e.block_hashes, parents))
                self.announced.update(e.block_hashes)
        self.index.apply(("m", 0), batch)
        replica = self.m.replicas[0]
        assert self.index.hashes(("m", 0), "device") == replica.pool.indexed_hashes()
        host = replica.tiers.named("host")
        host_hashes = set() if host is None else host.pool.indexed_hashes()
        assert self.index.hashes(("m", 0), "host") == host_hashes


class EventsMachine(EventsMixin, base.PagedManagerMachine):
    pass


class HostEventsMachine(EventsMixin, base.HostTierMachine):
    pass


def test_events_track_the_pool_through_random_operations(session):
    base.SESSION = session
    run = EventsMachine.TestCase
    run.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
    run().runTest()


def test_events_track_both_tiers_through_random_operations(session):
    base.SESSION = session
    run = HostEventsMachine.TestCase
    run.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)
    run().runTest()
