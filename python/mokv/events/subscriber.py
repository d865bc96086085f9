"""EventSubscriber: receives event batches, keeps them in order, feeds an index.

One SUB socket per `add_source` (a server's replica endpoint, or a bound address many
engines connect to), and a DEALER socket for its replay endpoint, if any. Per stream,
keyed by (server, topic, data_parallel_rank), it keeps `last` (the last seq applied)
and `live` (the last seq seen on the SUB socket):

    live message seq s              meaning                      action
    s <= live                       publisher restarted          drop the source, start over
    s <= last (replayed already)    duplicate                    skip
    s == last + 1 (or first, s==0)  in order                     apply
    s >  last + 1                   gap (or a late start)        replay [last+1, ...] through
                                                                 the DEALER, apply in order
    still a gap after replay        batches lost (dropped by     mid-stream: drop the source
                                    a full queue, or out of      (its set could hold evicted
                                    the replay buffer)           pages); late start: keep the
                                                                 partial set (a subset)

A DEALER, not a REQ socket, asks for replays: a REQ socket accepts only one reply per
request, and a replay is many messages ending with seq -1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
import zmq

from ..config.events import check_endpoint
from .format import END_SEQ, BatchDecoder
from .index import PrefixRouterIndex, Source

MAX_WAIT_S = 3600
"""Longest wait a subscriber takes (`replay_timeout`, `poll`'s `timeout_ms`): an hour. A
router that waits longer for one replay or poll is stuck; and ZMQ's timeout is a C long
of milliseconds, which a huge Python number overflows (an OverflowError, untyped)."""


@dataclass
class _Stream:
    server: str
    sub: zmq.Socket
    replay: zmq.Socket | None
    last: dict[tuple[bytes, int], int] = field(default_factory=dict)
    live: dict[tuple[bytes, int], int] = field(default_factory=dict)


class EventSubscriber:
    """Subscribes to KV-cache event publishers and keeps `index` up to date.

    Args:
        index: where batches go (`PrefixRouterIndex`); any object with `apply(source,
            batch)` and `drop_source(source)` works.
        replay_timeout: seconds to wait for a replay's end marker.
    """

    def __init__(
        self,
        index: PrefixRouterIndex,
        context: zmq.Context | None = None,
        replay_timeout: float = 2.0,
    ) -> None:
        if not callable(getattr(index, "apply", None)) or not callable(
            getattr(index, "drop_source", None)
        ):
            raise TypeError(
                f"index must have apply(source, batch) and drop_source(source), got {index!r}"
            )
        if replay_timeout.__class__ not in (int, float) or not 0 < replay_timeout <= MAX_WAIT_S:
            raise ValueError(
                f"replay_timeout must be a number of seconds in (0, {MAX_WAIT_S}], got "
                f"{replay_timeout!r}"
            )
        self.index = index
        self.replay_timeout = replay_timeout
        self._ctx = context or zmq.Context.instance()
        self._streams: list[_Stream] = []
        self._poller = zmq.Poller()
        self._decoder = BatchDecoder()
        self.num_batches = 0
        self.num_replayed = 0
        self.num_restarts = 0
        self.num_lost_gaps = 0
        self.num_bad = 0

    def add_source(
        self,
        server: str,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        bind: bool = False,
    ) -> None:
        """Subscribes to `endpoint` as `server`: connects to a publisher that binds (the
        default), or with `bind=True` binds it for publishers that connect (llm-d's
        topology, where one socket hears many engines: sources then differ by topic).
        TypeError / ValueError naming an argument that is not what it should be."""
        for name, value in (("server", server), ("topic", topic)):
            if not isinstance(value, str):
                raise TypeError(f"{name} must be a str, got {value!r}")
        if bind.__class__ is not bool:
            raise TypeError(f"bind must be a bool, got {bind!r}")
        check_endpoint("endpoint", endpoint)
        if replay_endpoint is not None:
            check_endpoint("replay_endpoint", replay_endpoint)
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 0)
        sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        (sub.bind if bind else sub.connect)(endpoint)
        replay = None
        if replay_endpoint is not None:
            replay = self._ctx.socket(zmq.DEALER)
            replay.setsockopt(zmq.LINGER, 0)
            replay.connect(replay_endpoint)
        self._streams.append(_Stream(server, sub, replay))
        self._poller.register(sub, zmq.POLLIN)

    def last_seq(self, source: Source, topic: str = "") -> int | None:
        """Seq of the last batch applied for `source` (None: none yet)."""
        server, replica = source
        for s in self._streams:
            if s.server == server and (topic.encode(), replica) in s.last:
                return s.last[(topic.encode(), replica)]
        return None

    def poll(self, timeout_ms: int = 0) -> int:
        """Handles every message that arrives within `timeout_ms`; returns batches applied."""
        if timeout_ms.__class__ is not int or not 0 <= timeout_ms <= MAX_WAIT_S * 1000:
            raise ValueError(
                f"timeout_ms must be an int in [0, {MAX_WAIT_S * 1000}], got {timeout_ms!r}"
            )
        before = self.num_batches
        ready = dict(self._poller.poll(timeout_ms))
        while ready:
            for stream in self._streams:
                if stream.sub in ready:
                    while True:
                        try:
                            frames = stream.sub.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._on_live(stream, frames)
            ready = dict(self._poller.poll(0))
        return self.num_batches - before

    def sync(self) -> None:
        """Asks every replay endpoint for what this subscriber has not applied yet (a
        late subscriber catches up without waiting for the next live batch)."""
        for stream in self._streams:
            if stream.replay is not None:
                lasts = stream.last.values()
                self._replay(stream, min(lasts) + 1 if lasts else 0)

    def close(self) -> None:
        for stream in self._streams:
            self._poller.unregister(stream.sub)
            stream.sub.close()
            if stream.replay is not None:
                stream.replay.close()
        self._streams.clear()

    # --- ordering -------------------------------------------------------------------

    def _decode(self, payload: bytes):
        try:
            return self._decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.num_bad += 1
            return None

    def _on_live(self, stream: _Stream, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.num_bad += 1
            return
        topic, seq = frames[0], int.from_bytes(frames[1], "big")
        batch = self._decode(frames[2])
        if batch is None:
            return
        replica = batch.data_parallel_rank or 0
        key, source = (topic, replica), (stream.server, replica)
        live = stream.live.get(key)
        if live is not None and seq <= live:  # seq went back: a new publisher process
            self.num_restarts += 1
            self.index.drop_source(source)
            stream.last.pop(key, None)
        stream.live[key] = seq
        last = stream.last.get(key)
        if last is not None and seq <= last:
            return  # already applied through a replay
        expected = 0 if last is None else last + 1
        if seq > expected and stream.replay is not None:
            self._replay(stream, expected)
            last = stream.last.get(key)
            if last is not None and seq <= last:
                return
            expected = 0 if last is None else last + 1
        if seq > expected and last is not None:
            # Batches between are gone: the set may hold pages evicted in them.
            self.num_lost_gaps += 1
            self.index.drop_source(source)
        self._apply(stream, key, source, seq, batch)

    def _apply(self, stream: _Stream, key, source: Source, seq: int, batch) -> None:
        self.index.apply(source, batch)
        stream.last[key] = seq
        self.num_batches += 1

    def _replay(self, stream: _Stream, start: int) -> None:
        """Requests the stream's buffered batches from `start` and applies, per (topic,
        replica), those that continue what was applied, in order."""
        sock = stream.replay
        assert sock is not None
        sock.send_multipart((b"", start.to_bytes(8, "big")))
        while sock.poll(int(self.replay_timeout * 1000)):
            frames = sock.recv_multipart()  # [b"", topic, seq, payload]
            if len(frames) != 4 or len(frames[2]) != 8:
                self.num_bad += 1
                continue
            if frames[2] == END_SEQ:
                return
            seq = int.from_bytes(frames[2], "big")
            batch = self._decode(frames[3])
            if batch is None:
                continue
            replica = batch.data_parallel_rank or 0
            key = (frames[1], replica)
            last = stream.last.get(key)
            # In order; or, for a stream never heard live, the oldest batch still buffered.
            if seq == (0 if last is None else last + 1) or (
                last is None and key not in stream.live
            ):
                self._apply(stream, key, (stream.server, replica), seq, batch)
                self.num_replayed += 1
