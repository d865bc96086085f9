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

Sources read for `BlockStored` (through the `search` tools, Nov 2026):
- vllm/distributed/kv_events.py in karen-sy/vllm @ f7d935a063c5c69e40825bd667fc36d09d63fa1e
  (a fork carrying upstream main with vLLM #51381, merged, which added `session_id`):
  14 fields, block_hashes ... lora_name, extra_keys, group_idx, kv_cache_spec_kind,
  kv_cache_spec_sliding_window, locality, ownership, session_id. Third-party decoders
  that copy vLLM main (e.g. a fixture "copied from kv_events.py at main (f4eccdadef)")
  show the same 14. `BlockRemoved`: block_hashes, medium, group_idx, locality, ownership.
- vllm-project/vllm @ 0181ea3173e53eea8cf04a86891488e3dc89bb34 (the stored upstream
  copy, older): the first 11 of those, in the same order.
- vLLM #55487 / #55488 (typed `extra_keys`) add `event_version` to `BlockStored`. A vLLM
  test of that change (found by content; the index names no repository for it) has
  locality, session_id and event_version and asserts "the current schema (15 declared
  fields + tag) encodes with a map16 header". The issue index shows #55488 closed; one
  kv_events.py copy from before session_id puts `event_version: int = 1` after
  lora_name. Its place in today's vLLM is unverified: it is appended last here.
- SGLang (sgl-project/sglang #37482, #39991) still sends positional arrays with a
  7-element base, which the "array" form below decodes.

The shared note's golden vector (map16 header `de000b`) needs exactly 15 fields, which
is what #55488's schema has; vLLM main's 14 would give a fixmap (`8b`). Decoders ignore
the header's size, and a None field is omitted on the wire, so only the header byte
depends on the 15th field; mokv never sets it.
"""

# No `from __future__ import annotations`: msgspec resolves string annotations in module
# globals, which would point both forms' batches at the map-form event classes.
from typing import Any, Literal

import msgspec

PayloadFormat = Literal["map", "array"]
PAYLOAD_FORMATS = ("map", "array")

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
KV_CACHE_SPEC_KIND = "full_attention"

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
        event_version: int | None = None

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
