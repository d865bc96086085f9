"""MokvOptions: what mokv adds to a MAX model's cache (tiers, KV-cache events, sessions),
and the `--mokv-config FILE` that `mokv serve` reads them from.

MAX's params say the cache's shape and MAX's own settings; these say what only mokv
has. The file is YAML (JSON is YAML too), one section per feature, each section the
keyword arguments of mokv's config class of the same feature:

    host_tier:             # mokv.HostTierConfig
      swap_space_gb: 2
    remote_tier:           # mokv.RemoteTierConfig (a Redis server several servers share)
      url: redis://127.0.0.1:6379/0
      namespace: tiny-llama
    kv_events:             # mokv.KVEventsConfig (vLLM's wire format over ZMQ)
      endpoint: tcp://*:5557
    sessions:              # mokv.SessionConfig (dkv_cache_hint {"session_id": ...})
      ttl_s: 600
    pins:                  # mokv.PinConfig (a request's cache_control pins its prompt)
      max_share: 0.5
    state_checkpoints:     # a hybrid model's state checkpoints (docs/recurrent.md)
      checkpoint_every: 1
      num_checkpoints: 64

Every key is checked: an unknown section or keyword is an error naming it, never a
setting silently dropped.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import Any

from ..config.cache_control import PinConfig
from ..config.events import KVEventsConfig
from ..config.recurrent import StateCheckpointConfig
from ..config.sessions import SessionConfig
from ..config.tiers import HostTierConfig, RemoteTierConfig, TierConfig
from ..errors import MokvError

SECTIONS: dict[str, type] = {
    "host_tier": HostTierConfig,
    "remote_tier": RemoteTierConfig,
    "kv_events": KVEventsConfig,
    "sessions": SessionConfig,
    "pins": PinConfig,
    "state_checkpoints": StateCheckpointConfig,
}
"""The sections of a mokv config file and the config class each one builds."""


class MokvConfigError(MokvError, ValueError):
    """A `--mokv-config` file that mokv cannot honour. The message names the section
    and key, never a value (a section may hold a Redis password)."""


@dataclass(frozen=True)
class MokvOptions:
    """mokv's features on a cache whose shape MAX's params give.

    Attributes:
        tiers: the tiers below the device pages, fastest first (`mokv.KVCacheParams.tiers`).
        kv_events: publish the prefix cache's changes (`mokv.KVCacheParams.kv_events`).
        sessions: retain sessions' pages through a pause (`mokv.KVCacheParams.sessions`).
        pins: let requests pin their prompt (`mokv.KVCacheParams.pins`; docs/serve.md).
        state_checkpoints: a hybrid model's state checkpoints (docs/recurrent.md); None:
            every page, `DEFAULT_CHECKPOINTS` of them.
    """

    tiers: tuple[TierConfig, ...] = ()
    kv_events: KVEventsConfig | None = None
    sessions: SessionConfig | None = None
    pins: PinConfig | None = None
    state_checkpoints: StateCheckpointConfig | None = None

    @classmethod
    def from_mapping(cls, sections: Any, source: str = "the mokv config") -> MokvOptions:
        """Options from a mapping of section name to keyword arguments (a parsed file)."""
        if sections is None:
            return cls()
        if not isinstance(sections, dict):
            raise MokvConfigError(
                f"{source} must be a mapping of sections, got a {type(sections).__name__}"
            )
        unknown = sorted(set(sections) - set(SECTIONS))
        if unknown:
            raise MokvConfigError(
                f"{source} has unknown section(s) {unknown}; the sections are {sorted(SECTIONS)}"
            )
        built: dict[str, Any] = {}
        for name, config_class in SECTIONS.items():
            if name not in sections:
                continue
            kwargs = sections[name] if sections[name] is not None else {}
            if not isinstance(kwargs, dict):
                raise MokvConfigError(
                    f"{source}: section {name!r} must be a mapping, got a {type(kwargs).__name__}"
                )
            known = {f.name for f in dataclasses.fields(config_class) if f.init}
            extra = sorted(set(kwargs) - known)
            if extra:
                raise MokvConfigError(
                    f"{source}: section {name!r} has unknown key(s) {extra}; "
                    f"{config_class.__name__} takes {sorted(known)}"
                )
            try:
                built[name] = config_class(**kwargs)
            except (TypeError, ValueError) as e:
                raise MokvConfigError(f"{source}: section {name!r}: {e}") from e
        tiers = tuple(built[t] for t in ("host_tier", "remote_tier") if t in built)
        return cls(
            tiers,
            built.get("kv_events"),
            built.get("sessions"),
            built.get("pins"),
            built.get("state_checkpoints"),
        )

    @classmethod
    def from_file(cls, path: str | PathLike[str]) -> MokvOptions:
        """Options from a YAML (or JSON) file; MokvConfigError naming what is wrong."""
        import yaml

        try:
            text = Path(path).read_text()
        except OSError as e:
            raise MokvConfigError(f"cannot read the mokv config {str(path)!r}: {e}") from e
        try:
            sections = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise MokvConfigError(f"the mokv config {str(path)!r} is not YAML: {e}") from e
        return cls.from_mapping(sections, source=f"the mokv config {str(path)!r}")
