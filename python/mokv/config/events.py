"""KVEventsConfig: where and how a paged manager publishes its KV-cache events."""

from __future__ import annotations

from dataclasses import dataclass

from .base import ParamsView

PAYLOAD_FORMATS = ("map", "array")
"""`KVEventsConfig.payload_format`: tagged maps (current vLLM, SGLang) or vLLM's legacy
positional arrays (`mokv.events.format`)."""

ZMQ_SCHEMES = ("tcp", "ipc", "inproc")
"""Transports of `KVEventsConfig.endpoint` and `replay_endpoint`."""

MAX_PORT = 65535
MAX_HWM = 2**31 - 1
"""ZMQ's high-water mark is a C int; the buffer and queue lengths are held to the same
bound (a C ssize_t past it would overflow, and no publisher keeps 2**31 batches)."""

SALT_FORMATS = ("vllm", "dynamo", "sglang")
"""How a salted first page carries its cache salt (`KVEventsConfig.salt_format`)."""

DYNAMO_SALT_PREFIX = "dynamo-cache-salt:"
"""The tag NVIDIA Dynamo's router strips from an `extra_keys` entry to find a page's cache
namespace (ai-dynamo/dynamo lib/kv-router, `DYNAMO_CACHE_SALT_PREFIX`); an untagged entry
is not a salt to it."""


@dataclass(frozen=True)
class KVEventsConfig:
    """Event publishing settings; the defaults are vLLM's `KVEventsConfig`.

    Attributes:
        endpoint: ZMQ address of the PUB socket. Bound when it contains `*` or `::` or
            starts with `ipc://` / `inproc://` (the engine is the stable end, Dynamo's
            topology); connected otherwise (the router binds, llm-d's topology).
        replay_endpoint: ZMQ address of the ROUTER socket that resends buffered batches
            to subscribers that missed some; None: no replay.
        buffer_steps: batches kept for replay (the last ones).
        hwm: ZMQ high-water mark of the PUB socket (messages queued per subscriber).
        max_queue_size: batches waiting for the publisher thread; when full the oldest
            is dropped (and counted), the scheduler never blocks.
        topic: first frame of every message (llm-d accepts only `kv@<pod>@<model>`).
        payload_format: "map" (events as tagged maps: current vLLM and SGLang) or
            "array" (the legacy positional events).
        salt_format: how the first page of a salted sequence carries its cache salt:
            "vllm" (vLLM's form: `extra_keys` entry `(salt,)`), "dynamo" (`extra_keys`
            entry `("dynamo-cache-salt:" + salt,)`, the only salt NVIDIA Dynamo's router
            reads) or "sglang" (vLLM's form plus a top-level `cache_salt` field, which
            SGLang's router reads; map payloads only). Page hashes are the same in
            every form.

    Data-parallel replica `r` publishes on `endpoint_for(r)`: the tcp port plus `r`
    (port 0, "any free port", stays 0), or the address with `_dp{r}` appended for
    `inproc://` and `ipc://`; the replay endpoint is offset the same way.
    """

    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    payload_format: str = "map"
    salt_format: str = "vllm"

    def __post_init__(self) -> None:
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"{name} must be a str, got {getattr(self, name)!r}")
        if self.replay_endpoint is not None and not isinstance(self.replay_endpoint, str):
            raise TypeError(f"replay_endpoint must be a str or None, got {self.replay_endpoint!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
            if value > MAX_HWM:
                raise ValueError(f"{name}={value} is past the largest, {MAX_HWM} (a C int's)")
        if self.payload_format not in PAYLOAD_FORMATS:
            raise ValueError(
                f"payload_format={self.payload_format!r} is not one of {PAYLOAD_FORMATS}"
            )
        if self.salt_format not in SALT_FORMATS:
            raise ValueError(f"salt_format={self.salt_format!r} is not one of {SALT_FORMATS}")
        if self.salt_format == "sglang" and self.payload_format != "map":
            raise ValueError(
                "salt_format='sglang' adds a top-level cache_salt field, which only the map "
                f"payload has; got payload_format={self.payload_format!r}"
            )
        check_endpoint("endpoint", self.endpoint)
        if self.replay_endpoint is not None:
            check_endpoint("replay_endpoint", self.replay_endpoint)
        self.check_replicas(1)

    def check(self, params: ParamsView) -> None:
        """ValueError unless every replica of `params` gets its own valid addresses
        (called by `KVCacheParams.__post_init__`)."""
        self.check_replicas(params.data_parallel_degree)

    def check_replicas(self, num_replicas: int) -> None:
        """ValueError unless replicas `0 .. num_replicas - 1` each get valid addresses
        (tcp ports up to 65535) and no two sockets the same one (port 0 aside)."""
        seen: dict[str, str] = {}
        for replica in range(num_replicas):
            for name, address in (
                ("endpoint", self.endpoint_for(replica)),
                ("replay_endpoint", self.replay_endpoint_for(replica)),
            ):
                if address is None or address.endswith(":0"):
                    continue
                where = f"{name} of replica {replica}"
                if address in seen:
                    raise ValueError(
                        f"the {where} and the {seen[address]} are both {address!r}: each "
                        "socket needs its own address"
                    )
                seen[address] = where

    def endpoint_for(self, replica: int) -> str:
        """The PUB address of data-parallel replica `replica`."""
        return offset_endpoint(self.endpoint, replica)

    def replay_endpoint_for(self, replica: int) -> str | None:
        """The replay (ROUTER) address of data-parallel replica `replica`, if any."""
        return (
            None if self.replay_endpoint is None else offset_endpoint(self.replay_endpoint, replica)
        )


def check_endpoint(name: str, endpoint: object) -> None:
    """TypeError / ValueError naming `endpoint` unless it is a ZMQ address mokv can use:
    `tcp://host:port` (port 0-65535; 0: any free port), `ipc://path` or
    `inproc://name`."""
    if not isinstance(endpoint, str):
        raise TypeError(f"{name} must be a str (a ZMQ address), got {endpoint!r}")
    scheme, sep, address = endpoint.partition("://")
    if not sep or scheme not in ZMQ_SCHEMES or not address:
        raise ValueError(
            f"{name}={endpoint!r} is not a ZMQ address: tcp://host:port, ipc://path or "
            "inproc://name"
        )
    if scheme == "tcp":
        host, colon, port = address.rpartition(":")
        if not colon or not host or not (port.isascii() and port.isdigit()):
            raise ValueError(f"{name}={endpoint!r}: a tcp address is tcp://host:port")
        if int(port) > MAX_PORT:
            raise ValueError(
                f"{name}={endpoint!r}: port {port} is past {MAX_PORT} (ZMQ would bind another)"
            )


def offset_endpoint(endpoint: str, replica: int) -> str:
    """`endpoint` moved to replica `replica`: tcp port + replica, else a `_dp{r}` suffix.
    ValueError when the port would pass 65535."""
    if replica == 0:
        return endpoint
    if endpoint.startswith(("inproc://", "ipc://")):
        return f"{endpoint}_dp{replica}"
    base, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"cannot offset {endpoint!r} for replica {replica}: no tcp port")
    if int(port) == 0:
        return endpoint
    if int(port) + replica > MAX_PORT:
        raise ValueError(
            f"{endpoint!r} gives data-parallel replica {replica} port {int(port) + replica}, "
            f"past {MAX_PORT}: use a lower port"
        )
    return f"{base}:{int(port) + replica}"


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind wildcard, IPv6-any, ipc and inproc addresses; connect the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
