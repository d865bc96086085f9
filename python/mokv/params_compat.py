"""MAX's flat configuration spellings, mapped onto mokv's nested configs in this one place.

`KVCacheParams` holds the cache's shape and prefix cache; its tiers and events are
nested configs. The flat keywords of MAX's `KVCacheParams` and of its manager are still
accepted, and mean exactly the nested form:

    flat spelling                                nested form
    KVCacheParams(enable_kvcache_swapping_to_host=True,
                  host_kvcache_swap_space_gb=G,  tiers=(HostTierConfig(swap_space_gb=G,
                  host_kvcache_min_hits=N)                             min_hits=N), ...)
    KVCacheParams(remote_kvcache_url=U,          tiers=(..., RemoteTierConfig(url=U,
                  remote_kvcache_namespace=S,                             namespace=S,
                  remote_kvcache_timeout_s=T)                             timeout_s=T))
    PagedKVCacheManager(..., zmq_endpoint_base=E)   params.kv_events=KVEventsConfig(endpoint=E)
    PagedKVCacheManager(..., kv_events_config=C)    params.kv_events=C
    load_kv_manager(..., kv_events_config=C)        params.kv_events=C

As before, the host settings mean nothing unless `enable_kvcache_swapping_to_host` is
true, nor the remote ones without a URL. A flat host tier goes before the tiers given
nested, a flat remote tier after them (the order the flat form always had). Giving one
tier both ways is a ValueError; so are events given twice with different settings.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .events.config import KVEventsConfig, check_endpoint
from .params import KVCacheParams
from .tiers.base import TierConfig
from .tiers.host import HostTierConfig
from .tiers.remote import RemoteTierConfig, redacted_url

HOST_SPELLINGS = {
    "host_kvcache_swap_space_gb": "swap_space_gb",
    "host_kvcache_min_hits": "min_hits",
}
"""Flat keyword -> `HostTierConfig` field (on with `enable_kvcache_swapping_to_host`)."""

REMOTE_SPELLINGS = {
    "remote_kvcache_url": "url",
    "remote_kvcache_namespace": "namespace",
    "remote_kvcache_timeout_s": "timeout_s",
}
"""Flat keyword -> `RemoteTierConfig` field (on with a `remote_kvcache_url`)."""

FLAT_SPELLINGS = frozenset({"enable_kvcache_swapping_to_host", *HOST_SPELLINGS, *REMOTE_SPELLINGS})


def nest_flat_spellings(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`KVCacheParams` keywords with the flat spellings replaced by nested tier configs
    (other keywords are passed on as they are). Raises naming the flat spelling."""
    rest = {k: v for k, v in kwargs.items() if k not in FLAT_SPELLINGS}
    flat = {k: v for k, v in kwargs.items() if k in FLAT_SPELLINGS}
    nested = list(rest.get("tiers", ()))
    host = remote = None
    if flat.get("enable_kvcache_swapping_to_host"):
        host = _config(HostTierConfig, HOST_SPELLINGS, flat, swap_space_gb=None)
    if flat.get("remote_kvcache_url") is not None:
        remote = _config(RemoteTierConfig, REMOTE_SPELLINGS, flat, namespace=None)
    for config in (host, remote):
        if config is not None and any(isinstance(t, type(config)) for t in nested):
            raise ValueError(
                f"the {config.name} tier is given twice: in tiers={tuple(nested)!r} and by "
                f"the flat spellings {sorted(flat)}; give one"
            )
    if host is not None or remote is not None:
        tiers: list[TierConfig] = [host] if host is not None else []
        tiers += nested
        tiers += [remote] if remote is not None else []
        rest["tiers"] = tuple(tiers)
    return rest


def _config(cls: type, spellings: dict[str, str], flat: dict[str, Any], **required: Any) -> Any:
    """`cls` from the flat keywords in `spellings` (`required` fields default to None,
    for the config's own check to name); its error also names the flat spellings."""
    fields = dict(required)
    fields.update({field: flat[name] for name, field in spellings.items() if name in flat})
    try:
        return cls(**fields)
    except (TypeError, ValueError) as e:
        given = ", ".join(f"{name}={_shown(name, value)}" for name, value in flat.items())
        mapping = ", ".join(f"{name} -> {field}" for name, field in spellings.items())
        raise type(e)(
            f"{e} (flat spellings given: {given}; they map to {cls.__name__} as {mapping})"
        ) from None


def _shown(name: str, value: Any) -> str:
    """A flat setting as an error shows it: a URL without its passwords."""
    return repr(redacted_url(value)) if name == "remote_kvcache_url" else repr(value)


def with_manager_events(
    params: KVCacheParams, zmq_endpoint_base: str | None, kv_events_config: KVEventsConfig | None
) -> KVCacheParams:
    """`params` with the events of a manager's keywords in `params.kv_events` (checked
    against the params' replicas)."""
    config = kv_events_config
    if config is not None and not isinstance(config, KVEventsConfig):
        raise TypeError(
            f"kv_events_config must be a mokv.KVEventsConfig or None, got {config!r}"
            + ("; for an address alone use zmq_endpoint_base" if isinstance(config, str) else "")
        )
    if zmq_endpoint_base is not None:
        check_endpoint("zmq_endpoint_base", zmq_endpoint_base)
        if config is None:
            config = KVEventsConfig(endpoint=zmq_endpoint_base)
        elif config.endpoint != zmq_endpoint_base:
            raise ValueError(
                f"zmq_endpoint_base={zmq_endpoint_base!r} disagrees with "
                f"kv_events_config.endpoint={config.endpoint!r}; set one"
            )
    if config is None or config == params.kv_events:
        return params
    if params.kv_events is not None:
        raise ValueError(
            f"the manager's events {config!r} disagree with params.kv_events="
            f"{params.kv_events!r}; set one"
        )
    return dataclasses.replace(params, kv_events=config)
