"""EventPublisher: one replica's page-pool changes, published as vLLM event batches.

Two halves, split by thread:

    scheduling thread                          publisher thread ("mokv-kv-events",
                                                                 every 5 ms)
    PagePool.commit   -> stored(...)  ┐
    PagePool evicts   -> removed(h)   ├ append a tuple to `_pending` (no encoding)
    reset_prefix_cache-> cleared()    ┘
    manager.step      -> end_step()  --- (seq, ts, records) ---> deque (bounded)
                                                                  build structs, msgpack,
                                                                  PUB [topic, seq, payload],
                                                                  keep for replay (ROUTER)

The scheduling thread only appends small tuples and, once per step, hands the list
over: no struct, no token list and no msgpack is built there (the hot-path budget is
+0.5 µs per request-step). `seq` is numbered when a batch is handed over, so a batch
dropped from a full queue leaves a gap that subscribers see (and cannot replay: they
then drop this source's state instead of trusting an incomplete one).

What is published:
- `BlockStored` for each run of pages committed one after another on one hash chain:
  their hashes, the parent of the first (None for a sequence's first page), all their
  token ids (`len == len(block_hashes) * block_size`: full pages only), `block_size`,
  `medium` ("GPU" for the replica's own pages on every device, as vLLM; "CPU" for host-tier
  copies, "EXTERNAL" for the shared tier's), `lora_id` and `lora_name` of the request's
  adapter, `extra_keys` with one entry per page as vLLM 0.33 publishes them (the adapter's
  name, `(identifier, offset in the page)` of each image the page overlaps, and the salt
  of a salted first page in the form `config.salt_format` names; None for a page with
  none: `mokv.cache.extra_keys`), `group_idx` 0, `kv_cache_spec_kind` "full_attention",
  `session_id` of the request's session. One event holds pages of one adapter and
  session only.
- `BlockRemoved` for each evicted hash; `AllBlocksCleared` at startup (batch seq 0)
  and on `reset_prefix_cache`.
- In a cache of several groups (or a sliding window), each group's pages (device and
  tiers) are announced on their own, under the same chain hashes, as vLLM 0.33 does:
  `group_idx` the group's index, `kv_cache_spec_kind` its kind ("full_attention",
  "sliding_window", "mla_attention") and `kv_cache_spec_sliding_window` its window
  (`GroupSpec`); `BlockRemoved` carries `group_idx`. One event holds one group's pages.
- Recurrent-state checkpoints (`KVCacheParams.recurrent`) are one more group after the
  attention groups, of vLLM's state kind "mamba": a `BlockStored` of a boundary page's
  hash, parent and tokens when a checkpoint is taken there on the device, a
  `BlockRemoved` when it leaves its device slot (the host and shared tiers' checkpoints
  are not announced: a router then counts fewer, never more, than the manager finds).
A parent is always a hash this stream announced before (the pool commits a page only
after its parent page was committed or found in the index).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import zmq

from ..cache.extra_keys import EventKeys
from ..config.events import DYNAMO_SALT_PREFIX, KVEventsConfig, binds
from ..registry import BUILDERS
from ..undo import UndoLog
from .format import (
    END_SEQ,
    KV_CACHE_SPEC_KIND,
    MEDIUM_GPU,
    SPEC_KINDS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    SaltedBlockStored,
    to_array_form,
)

_log = logging.getLogger(__name__)
_STORED, _REMOVED, _CLEARED = 0, 1, 2
# The publisher thread wakes on this period rather than being signalled per step: a
# `threading.Event.set` costs the scheduler about a microsecond, and batching its wakeups
# also batches its turns at the GIL. Each step stays its own message; routers see it
# at most this much later.
_POLL_S = 0.005


class EventRecorder:
    """The page pool's sink: records its changes as small tuples, in order.

    `take()` hands the records over; `build_events` turns them into vLLM event structs.
    `EventPublisher` is a recorder that publishes what it takes once per step.

    With an `undo` log (`mokv.undo.UndoLog`, set by the manager) each record also
    records how to take it back, so that a rolled-back manager call announces nothing
    it undid. Records are only handed over (`take`) after a manager call ended.
    """

    def __init__(self) -> None:
        self._pending: list[tuple] = []
        self.undo: UndoLog | None = None

    def _record(self, record: tuple) -> None:
        pending = self._pending
        if self.undo is not None:
            self.undo.push(pending.pop, len(pending))  # newer records are gone or kept
        pending.append(record)

    def stored(
        self, page_hash: int, parent_hash: int | None, token_bytes: bytes, keys: EventKeys | None
    ) -> None:
        """A full page was committed under `page_hash` (parent None: a first page), with
        what events say of it besides its tokens (`keys`)."""
        self._record((_STORED, page_hash, parent_hash, token_bytes, keys))

    def removed(self, page_hash: int) -> None:
        """The page committed under `page_hash` was evicted."""
        self._record((_REMOVED, page_hash))

    def cleared(self) -> None:
        """Every hash was forgotten."""
        self._record((_CLEARED,))

    def take(self) -> list[tuple]:
        """The records since the last call (and forgets them)."""
        records, self._pending = self._pending, []
        return records

    def medium_sink(self, medium: str) -> MediumSink:
        """A sink for another tier of the same replica (the host tier: "CPU") whose
        records carry their own `medium`, in this recorder's order."""
        return MediumSink(self, medium)

    def group_sink(self, group: GroupSpec) -> MediumSink:
        """A sink for the device pages of one cache group of a cache of several, whose
        records carry their group (`medium_sink` of it: that group's tiers). The first
        group's sink records `cleared` for all: the groups are reset together."""
        return MediumSink(self, None, group)


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """What events say of a cache group's pages (vLLM 0.33's `BlockStored.group_idx`,
    `kv_cache_spec_kind`, `kv_cache_spec_sliding_window`; `BlockRemoved.group_idx`)."""

    index: int
    """The group's place among the replica's groups (`CacheGroupConfig` order)."""
    kind: str
    """vLLM's `KVCacheSpecKind` value: "full_attention", "sliding_window",
    "mla_attention"."""
    sliding_window: int | None = None
    """The window in tokens, the query's own included (MAX's and vLLM's count)."""

    @classmethod
    def of(cls, index: int, kind: str, window_size: int | None) -> GroupSpec:
        """The spec of the group `index` of mokv's `kind` ("full", "sliding_window",
        "mla": `CacheGroup.kind`)."""
        return cls(index, SPEC_KINDS[kind], window_size)


class MediumSink:
    """Records stores and removals of one tier (`medium`; None: the recorder's own)
    or one cache group (`group`) into its recorder. `cleared` records nothing but for
    the first group's device pages: the tiers and groups are reset together and the
    recorder's own `cleared` covers them all."""

    def __init__(
        self, recorder: EventRecorder, medium: str | None, group: GroupSpec | None = None
    ) -> None:
        self._recorder = recorder
        self.medium = medium
        self.group = group

    def stored(
        self, page_hash: int, parent_hash: int | None, token_bytes: bytes, keys: EventKeys | None
    ) -> None:
        record = (_STORED, page_hash, parent_hash, token_bytes, keys, self.medium)
        self._recorder._record(record if self.group is None else (*record, self.group))

    def removed(self, page_hash: int) -> None:
        record = (_REMOVED, page_hash, self.medium)
        self._recorder._record(record if self.group is None else (*record, self.group))

    def cleared(self) -> None:
        if self.medium is None and self.group is not None and self.group.index == 0:
            self._recorder.cleared()

    def medium_sink(self, medium: str) -> MediumSink:
        """The sink of one of this group's tiers."""
        return MediumSink(self._recorder, medium, self.group)


TierEvents = EventRecorder | MediumSink
"""Where a tier reports its stores and evictions (`Publishing.publish_to`): a replica's
recorder, or one cache group's sink of it (`EventRecorder.group_sink`)."""


def build_events(
    records: list[tuple], block_size: int, medium: str = MEDIUM_GPU, salt_format: str = "vllm"
) -> list:
    """vLLM event structs for `records` (from `EventRecorder.take`), in order; consecutive
    pages of one chain in one medium, adapter and session are merged into one
    `BlockStored`. A record's own medium (from a `MediumSink`) overrides `medium`. A
    salted first page, which always starts its event, carries its salt as `salt_format`
    says (`KVEventsConfig`)."""
    events: list = []
    # [hashes, parent, token chunks, keys, medium, group] of a BlockStored
    run: list | None = None
    for rec in records:
        kind = rec[0]
        if kind == _STORED:
            page_hash, parent, data, keys = rec[1:5]
            rec_medium = rec[5] or medium if len(rec) > 5 else medium
            group = rec[6] if len(rec) > 6 else None
            if (
                run is not None
                and parent == run[0][-1]
                and rec_medium == run[4]
                and group == run[5]
                and _run_tag(keys) == _run_tag(run[3][0])
            ):
                run[0].append(page_hash)
                run[2].append(data)
                run[3].append(keys)
                continue
            run = [[page_hash], parent, [data], [keys], rec_medium, group]
            events.append(run)
            continue
        run = None
        if kind == _REMOVED:
            group = rec[3] if len(rec) > 3 else None
            events.append(
                BlockRemoved(
                    [rec[1]],
                    rec[2] or medium if len(rec) > 2 else medium,
                    group_idx=0 if group is None else group.index,
                )
            )
        else:
            events.append(AllBlocksCleared())
    for i, e in enumerate(events):
        if isinstance(e, list):
            events[i] = _block_stored(e, block_size, salt_format)
    return events


_NO_TAG = (None, None, None)


def _run_tag(keys: EventKeys | None) -> tuple:
    """What the pages of one `BlockStored` must share (adapter and session)."""
    return _NO_TAG if keys is None else keys.run_tag


def _block_stored(run: list, block_size: int, salt_format: str) -> BlockStored:
    """The `BlockStored` of one run: only its first page can be a salted first page."""
    hashes, parent, chunks, keys, medium, group = run
    first: EventKeys | None = keys[0]
    salt = first.cache_salt if first is not None and parent is None else None
    tagged = DYNAMO_SALT_PREFIX + salt if salt is not None and salt_format == "dynamo" else salt
    extra = [
        None if k is None else k.event_entry(tagged if i == 0 else None) for i, k in enumerate(keys)
    ]
    tokens = np.frombuffer(b"".join(chunks), dtype="<i8").tolist()
    lora_id, lora_name, session = (
        (first.lora_id, first.lora_name, first.session_id) if first is not None else (None,) * 3
    )
    fields: dict[str, Any] = dict(
        extra_keys=extra, group_idx=0, kv_cache_spec_kind=KV_CACHE_SPEC_KIND, session_id=session
    )
    if group is not None:
        fields.update(
            group_idx=group.index,
            kv_cache_spec_kind=group.kind,
            kv_cache_spec_sliding_window=group.sliding_window,
        )
    if salt is not None and salt_format == "sglang":
        return SaltedBlockStored(
            hashes,
            parent,
            tokens,
            block_size,
            lora_id,
            medium,
            lora_name,
            cache_salt=salt,
            **fields,
        )
    return BlockStored(hashes, parent, tokens, block_size, lora_id, medium, lora_name, **fields)


class EventPublisher(EventRecorder):
    """Records one replica's page-pool changes and publishes them once per step.

    Args:
        config: endpoints and limits (see `KVEventsConfig`).
        data_parallel_rank: the replica's index; offsets the endpoints and is written
            into every batch.
        block_size: tokens per page.
        medium: of the replica's own pages: "GPU" on every device, as vLLM publishes
            its primary cache (the host tier's records carry "CPU" themselves).
    """

    def __init__(
        self,
        config: KVEventsConfig,
        data_parallel_rank: int,
        block_size: int,
        medium: str = MEDIUM_GPU,
        context: zmq.Context | None = None,
    ) -> None:
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self.block_size = block_size
        self.medium = medium
        super().__init__()
        self._queue: collections.deque = collections.deque(maxlen=config.max_queue_size)
        self._buffer: collections.deque = collections.deque(maxlen=config.buffer_steps)
        self._next_seq = 0
        self.num_dropped = 0
        """Batches dropped because the queue was full (seen by subscribers as a gap)."""
        self.num_published = 0
        self.num_errors = 0
        """Batches or replay requests the thread failed on (logged)."""
        self._wake = threading.Event()
        self._closing = False
        ctx = context or zmq.Context.instance()
        # Sockets are made here so that a bad address raises in the constructor; after the
        # thread starts only the publisher thread touches them (ZMQ sockets are not
        # thread-safe).
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 500)
        self._replay = None
        try:
            endpoint = config.endpoint_for(data_parallel_rank)
            if binds(endpoint):
                self._pub.bind(endpoint)
                endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self._pub.connect(endpoint)
            self.endpoint = endpoint
            """The address subscribers use (the bound one, with the real port for port 0)."""
            self.replay_endpoint = config.replay_endpoint_for(data_parallel_rank)
            if self.replay_endpoint is not None:
                self._replay = ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(self.replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._topic = config.topic.encode()
        self._encode = msgspec.msgpack.Encoder().encode
        self._array_form = config.payload_format == "array"
        self._thread = threading.Thread(target=self._run, name="mokv-kv-events", daemon=True)
        self._thread.start()
        self.cleared()
        self.end_step()

    # --- scheduling thread --------------------------------------------------------

    def end_step(self) -> None:
        """Hands the events recorded since the last call to the publisher thread as one
        batch (nothing when there are none). Never blocks: a full queue drops its oldest."""
        if not self._pending:
            return
        records = self.take()
        if len(self._queue) == self._queue.maxlen:
            self.num_dropped += 1
        self._queue.append((self._next_seq, time.time(), records))
        self._next_seq += 1

    @property
    def last_seq(self) -> int:
        """Seq of the last batch handed over (-1 before the startup batch)."""
        return self._next_seq - 1

    def close(self, timeout: float = 2.0) -> None:
        """Publishes what is queued (for up to `timeout` seconds), then closes the sockets."""
        if self._closing:
            return
        self.end_step()
        self._closing = True
        self._wake.set()
        self._thread.join(timeout)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close()
        if self._replay is not None:
            self._replay.close()

    # --- the publisher thread -------------------------------------------------------

    def _run(self) -> None:
        while True:
            self._wake.wait(_POLL_S)
            self._wake.clear()
            try:
                while self._queue:
                    seq, ts, records = self._queue.popleft()
                    self._send(seq, ts, records)
                if self._replay is not None:
                    while self._replay.poll(0):
                        self._serve_replay()
            except Exception:  # noqa: BLE001 - the thread must outlive one bad batch
                # A batch that cannot be sent is lost like a dropped one: its seq is a
                # gap that subscribers see. Events are an optimization; serving goes on.
                self.num_errors += 1
                _log.exception("KV-cache event publisher (replica %d)", self.data_parallel_rank)
            if self._closing and not self._queue:
                return

    def _send(self, seq: int, ts: float, records: list[tuple]) -> None:
        events = build_events(records, self.block_size, self.medium, self.config.salt_format)
        batch = KVEventBatch(ts, events, self.data_parallel_rank)
        payload = self._encode(to_array_form(batch) if self._array_form else batch)
        seq_bytes = seq.to_bytes(8, "big")
        self._pub.send_multipart((self._topic, seq_bytes, payload))
        self._buffer.append((seq_bytes, payload))
        self.num_published += 1

    def _serve_replay(self) -> None:
        """Answers one replay request `[identity, b"", start_seq]`: every buffered batch
        with seq >= start_seq as `[identity, b"", topic, seq, payload]`, then the end
        marker `[identity, b"", b"", seq -1, b""]`."""
        sock = self._replay
        assert sock is not None
        frames = sock.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            return
        identity, start = frames[0], int.from_bytes(frames[2], "big")
        for seq_bytes, payload in list(self._buffer):
            if int.from_bytes(seq_bytes, "big") >= start:
                sock.send_multipart((identity, b"", self._topic, seq_bytes, payload))
        sock.send_multipart((identity, b"", b"", END_SEQ, b""))


def open_publishers(
    config: KVEventsConfig, block_size: int, num_replicas: int
) -> list[EventPublisher]:
    """One `EventPublisher` per replica (registered for `KVEventsConfig`). All or
    nothing: if one cannot bind, those opened are closed."""
    publishers: list[EventPublisher] = []
    try:
        for r in range(num_replicas):
            publishers.append(EventPublisher(config, r, block_size))
    except BaseException:
        for p in publishers:
            p.close()
        raise
    return publishers


BUILDERS.register(KVEventsConfig, open_publishers)
