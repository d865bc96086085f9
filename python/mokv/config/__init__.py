"""The ground floor: every configuration mokv takes, and nothing else.

    base.py      the names every layer agrees on (cache dtypes, hash algorithms) and
                 `ParamsView`, what a nested config checks itself against
    params.py    KVCacheParams: the cache's shape, its prefix cache, and the nested
                 configs below; `with_manager_events` (a manager's event keywords)
    tiers.py     TierConfig, HostTierConfig, RemoteTierConfig
    events.py    KVEventsConfig: where and how events are published
    sessions.py  SessionConfig: sessions that retain their pages through a pause
    groups.py    CacheGroupConfig: a model's full-attention and sliding-window groups
    recurrent.py RecurrentStateConfig, StateRegion: linear-attention / state-space state
    quantization.py  KVCacheQuantization: the scales of FP8 pages (MAX's format)
    cache_control.py  PinConfig (pinned prefixes' budget), CacheControl (a request's
                 pin and write policy)
    flat.py      MAX's flat spellings, mapped onto the nested configs

These modules import nothing of mokv above them (only `mokv.errors`); the objects a
config describes (a tier, an event stream, a session table) are built from it through
one registry, `mokv.registry`. A test asserts that mokv's import graph has no circle
(tests/test_structure.py).
"""

from .cache_control import CacheControl, PinConfig
from .events import KVEventsConfig
from .groups import CacheGroupConfig
from .params import KVCacheParams, KVCacheStrategy
from .quantization import KVCacheQuantization
from .recurrent import RecurrentStateConfig, StateRegion
from .sessions import SessionConfig
from .tiers import HostTierConfig, RemoteTierConfig, TierConfig

__all__ = [
    "CacheGroupConfig",
    "CacheControl",
    "HostTierConfig",
    "KVCacheParams",
    "KVCacheQuantization",
    "KVCacheStrategy",
    "KVEventsConfig",
    "PinConfig",
    "RecurrentStateConfig",
    "RemoteTierConfig",
    "SessionConfig",
    "StateRegion",
    "TierConfig",
]
