"""SessionConfig: agent and chat sessions keep their context in the prefix cache through a
pause (`KVCacheParams.sessions`; the paged manager's `managers/paged/sessions.py`).

An agent's context sits idle while a tool runs; under load plain LRU evicts it and the
next turn recomputes it. A request that names its session (`TextContext(...,
session_id=...)`) leaves its committed pages *retained* when it is released: on the device
and in the host tier they are evicted only after every unretained cached page, until the
session ends (`manager.end_session`), outlives its time-to-live, or its retention would
push all sessions past `max_share` of the replica's pages (the least recently used
session's retention goes first). A retained page is still found and shared by prefix.

Retention never makes `maybe_reserve` fail: a retained page without an owner still counts
as room, and is evicted (last) rather than refused. What the share bounds is the other
side: at least `1 - max_share` of the pages keep plain LRU order for everything else
(shared system prompts, documents, chats without a session).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .base import ParamsView, check_clock, check_share

DEFAULT_TTL_S = 300.0
"""Five minutes, the time-to-live of the hosted prompt caches agents are written against
(a tool call rarely pauses a session longer; `end_session` frees it at once when the
agent is done)."""

DEFAULT_MAX_SHARE = 0.5
"""Half of a replica's device and host pages: the smallest of the shares measured (0.25,
0.5, 0.75, 1) at which the session turns of the agent trace (`benchmarks/bench_managers.py
--sessions`, sessions fitting in device + host pages) reach 90 % of their infinite-cache
bound: 0.25 reached 86 %, 0.5 99 %, more adds under a point. The requests without a
session paid 1.5 points of hit rate against plain LRU at 0.5 (`docs/sessions.md`)."""


@dataclass(frozen=True)
class SessionConfig:
    """Retain the pages of requests that name a session (paged strategy; needs
    `enable_prefix_caching`).

    Attributes:
        ttl_s: seconds a session without a running request keeps its retention after its
            last request was released (> 0; `math.inf`: until `end_session` or the
            share drops it). Checked at the manager's next reservation or release.
        max_share: most of each replica's pages (device and host tier together) that
            sessions may retain, in (0, 1]; past it the least recently used sessions'
            retention is dropped (those sessions stay open, retaining nothing until
            their next release).
        clock: seconds, monotonic (tests inject their own); not compared.
    """

    ttl_s: float = DEFAULT_TTL_S
    max_share: float = DEFAULT_MAX_SHARE
    clock: Callable[[], float] = field(default=time.monotonic, compare=False, repr=False)

    def __post_init__(self) -> None:
        ttl = self.ttl_s
        if ttl.__class__ not in (int, float) or math.isnan(ttl) or not ttl > 0:
            raise ValueError(f"SessionConfig.ttl_s must be a number of seconds > 0, got {ttl!r}")
        check_share("SessionConfig", self.max_share)
        check_clock("SessionConfig", self.clock)

    def check(self, params: ParamsView) -> None:
        """ValueError unless `params` can carry sessions."""
        if not params.enable_prefix_caching:
            raise ValueError(
                "SessionConfig needs enable_prefix_caching: sessions retain committed prefix pages"
            )

    def cap(self, num_pages: int) -> int:
        """Most pages sessions may retain in a replica of `num_pages` device and host pages."""
        return int(self.max_share * num_pages)
