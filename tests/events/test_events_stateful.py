"""The paged manager's random-operation machine (tests/managers/paged/test_stateful.py),
with events: after every operation, the events recorded so far, encoded and decoded as on
the wire and applied to a router index, rebuild exactly the pool's own hash index; every
BlockStored holds full pages only and a parent the stream announced before."""

import msgspec
from hypothesis import settings
from hypothesis.stateful import invariant
from mokv.events import BatchDecoder, BlockStored, EventRecorder, PrefixRouterIndex, build_events
from mokv.events.format import KVEventBatch

from tests.managers.paged import test_stateful as base


class EventsMachine(base.PagedManagerMachine):
    def __init__(self):
        super().__init__()
        self.recorder = EventRecorder()
        self.m.replicas[0].pool.events = self.recorder
        self.index = PrefixRouterIndex(page_size=self.m.page_size)
        self.announced: set[int] = set()
        self.decode = BatchDecoder().decode

    @invariant()
    def events_rebuild_the_pool_index(self):
        events = build_events(self.recorder.take(), self.m.page_size, "CPU")
        batch = self.decode(msgspec.msgpack.encode(KVEventBatch(0.0, events, 0)))
        for e in batch.events:
            if isinstance(e, BlockStored):
                assert len(e.token_ids) == len(e.block_hashes) * e.block_size
                assert e.parent_block_hash is None or e.parent_block_hash in self.announced
                parents = [e.parent_block_hash, *e.block_hashes[:-1]]
                assert all(h != p for h, p in zip(e.block_hashes, parents))
                self.announced.update(e.block_hashes)
        self.index.apply(("m", 0), batch)
        assert self.index.hashes(("m", 0)) == self.m.replicas[0].pool.indexed_hashes()


def test_events_track_the_pool_through_random_operations(session):
    base.SESSION = session
    run = EventsMachine.TestCase
    run.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
    run().runTest()
