"""MAX's flat configuration spellings, mapped onto mokv's nested configs in this one place
(the manager's two event keywords: `mokv.config.params.with_manager_events`).

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

import functools
from dataclasses import fields
from typing import Any

from .tiers import HostTierConfig, RemoteTierConfig, TierConfig, redacted_urls

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
    return repr(redacted_urls(value)) if name == "remote_kvcache_url" else repr(value)


def accepts_flat_spellings(cls: type) -> type:
    """Lets `cls(...)` take MAX's flat keywords, which `nest_flat_spellings` maps onto
    the nested fields before the dataclass's own `__init__` sees them."""
    names = {f.name for f in fields(cls)}
    dataclass_init = cls.__init__  # type: ignore[misc]

    @functools.wraps(dataclass_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if not names.issuperset(kwargs):
            kwargs = nest_flat_spellings(kwargs)
        dataclass_init(self, *args, **kwargs)

    cls.__init__ = __init__  # type: ignore[misc]
    return cls
