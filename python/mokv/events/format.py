"""The KV-cache event wire format: vLLM's msgspec structs, in both payload forms.

A published message is three ZMQ frames `[topic, seq, payload]`: `seq` an 8-byte
big-endian counter per publisher from 0, `payload` one msgpack `KVEventBatch`:

    batch  = [ts: float, events: list, data_parallel_rank: int]   (a positional array;
             the rank is omitted when None)
    event  = "map" form (default; vLLM #42892):
               {"type": "BlockStored", "block_hashes": [...], ...}
             "array" form (legacy, still decoded by many consumers):
               ["BlockStored", block_hashes, parent_block_hash, ...]
             Fields without a default are always present (nil allowed); defaulted
             fields are omitted when None.

The structs below are declared as vLLM declares them (names, field order, tags,
omit_defaults), so that msgspec writes the same bytes: msgspec picks a map's header from
the struct's field count (a fixmap up to 15 keys, tag included; map16 from 16), so even
the fields mokv never sets (`locality`, ...) matter.

Source: `vllm/distributed/kv_events.py` of the vllm 0.33.0 wheel (PyPI), read directly:
`BlockStored` has 15 fields, block_hashes, parent_block_hash, token_ids, block_size,
lora_id, medium, lora_name (no default), then extra_keys, group_idx, kv_cache_spec_kind,
kv_cache_spec_sliding_window, locality, ownership, session_id, lookahead_token_ids
(default None); `BlockRemoved` has block_hashes, medium, then group_idx, locality,
ownership. vLLM's media there are "GPU", "CPU" and "STORAGE". With vllm installed,
`tests/consumers/` checks these declarations against vLLM's own classes.

The 15th field matters twice: msgspec writes a map16 header (`de000b`) for 15 fields
plus the tag, where 14 would give a fixmap (`8b`); and in the array form it is the 15th
position, which vLLM decodes as `lookahead_token_ids` (a list of token lists per block).
mokv never sets it.

SGLang (sgl-project/sglang #37482, #39991) and consumers that copied older vLLM structs
still decode positional arrays with a 7-element base, which the "array" form serves.
"""

# No `from __future__ import annotations`: msgspec resolves string annotations in module
# globals, which would point both forms' batches at the map-form event classes.
from typing import Any, Literal

import msgspec

PayloadFormat = Literal["map", "array"]

MEDIUM_GPU = "GPU"
"""The primary cache's pages, on every device (vLLM's `MEDIUM_GPU`, which vLLM publishes
for its primary cache on the CPU platform too)."""
MEDIUM_CPU = "CPU"
"""Host-tier copies (vLLM's `MEDIUM_CPU`, for its CPU offloading)."""
MEDIUM_SHARED = "EXTERNAL"
"""Shared-tier (Redis) copies: Dynamo's canonical wire name of its External tier
(`StorageTier::to_kv_medium`; it also reads "SHARED", "REMOTE", "NETWORK" as External)."""
MEDIA = (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_SHARED)
KV_CACHE_SPEC_KIND = "full_attention"
SPEC_KINDS = {
    "full": KV_CACHE_SPEC_KIND,
    "sliding_window": "sliding_window",
    "mla": "mla_attention",
    "recurrent": "mamba",
}
"""vLLM 0.33's `KVCacheSpecKind` value of each group kind of mokv (`CacheGroup.kind`)."""

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The replay socket's end marker: the seq frame of the last reply to a request."""


def _structs(array_like: bool):
    """vLLM's event structs; `array_like` selects the legacy positional form."""

    class KVCacheEvent(
        msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False, tag=True
    ):
        """Base class for all KV cache-related events."""

    class BlockStored(KVCacheEvent):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[tuple[Any, ...] | None] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None
        locality: str | None = None
        ownership: str | None = None
        session_id: str | None = None
        lookahead_token_ids: list[list[int]] | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[int]
        medium: str | None
        group_idx: int | None = None
        locality: str | None = None
        ownership: str | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]
        data_parallel_rank: int | None = None

    return BlockStored, BlockRemoved, AllBlocksCleared, KVEventBatch


BlockStored, BlockRemoved, AllBlocksCleared, KVEventBatch = _structs(array_like=False)
"""The map form (vLLM's current declaration): what mokv decodes into."""

ArrayBlockStored, ArrayBlockRemoved, ArrayAllBlocksCleared, ArrayKVEventBatch = _structs(
    array_like=True
)
"""The legacy positional form."""

KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


SaltedBlockStored = msgspec.defstruct(
    "SaltedBlockStored",
    [("cache_salt", str | None, None)],
    bases=(BlockStored,),
    tag="BlockStored",
)
"""A map-form `BlockStored` with a top-level `cache_salt`, the field SGLang's router reads
(`KVEventsConfig(salt_format="sglang")`). Only encoded: decoders that do not know the key
skip it, and mokv's decoder reads the salt from `extra_keys`."""


_ARRAY_TYPES = {
    BlockStored: ArrayBlockStored,
    BlockRemoved: ArrayBlockRemoved,
    AllBlocksCleared: ArrayAllBlocksCleared,
}


def to_array_form(batch: Any) -> Any:
    """The same `KVEventBatch` with positional (legacy) events."""
    events = [
        _ARRAY_TYPES[type(e)](**{f: getattr(e, f) for f in e.__struct_fields__})
        for e in batch.events
    ]
    return ArrayKVEventBatch(batch.ts, events, batch.data_parallel_rank)


class BatchDecoder:
    """Decodes a payload in either form into map-form structs.

    The event form is recognized from the first event's msgpack type (a map or an
    array); a batch mixes no forms. Unknown event types raise `msgspec.ValidationError`.
    """

    def __init__(self) -> None:
        self._map = msgspec.msgpack.Decoder(KVEventBatch)
        self._array = msgspec.msgpack.Decoder(ArrayKVEventBatch)

    def decode(self, payload: bytes) -> Any:
        """A map-form `KVEventBatch` (msgspec.DecodeError / ValidationError if it is not one)."""
        try:
            return self._map.decode(payload)
        except msgspec.ValidationError:
            legacy = self._array.decode(payload)
        events = [
            next(k for k, v in _ARRAY_TYPES.items() if v is type(e))(
                **{f: getattr(e, f) for f in e.__struct_fields__}
            )
            for e in legacy.events
        ]
        return KVEventBatch(legacy.ts, events, legacy.data_parallel_rank)
