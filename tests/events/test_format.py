"""The wire format: the note's golden vector byte for byte, both payload forms, and
batches decoded with structs declared the way vLLM declares them."""

from typing import Any

import msgspec
from mokv.events.format import (
    AllBlocksCleared,
    BatchDecoder,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    to_array_form,
)

GOLDEN = bytes.fromhex(
    "93cb3ff8000000000000" "93" "de000b"
    "a4" + b"type".hex() + "ab" + b"BlockStored".hex()
    + "ac" + b"block_hashes".hex() + "91cfffffffffffffffff"
    + "b1" + b"parent_block_hash".hex() + "c0"
    + "a9" + b"token_ids".hex() + "9401020304"
    + "aa" + b"block_size".hex() + "04"
    + "a7" + b"lora_id".hex() + "c0"
    + "a6" + b"medium".hex() + "a3" + b"GPU".hex()
    + "a9" + b"lora_name".hex() + "c0"
    + "aa" + b"extra_keys".hex() + "91c0"
    + "a9" + b"group_idx".hex() + "00"
    + "b2" + b"kv_cache_spec_kind".hex() + "ae" + b"full_attention".hex()
    + "84" + "a4" + b"type".hex() + "ac" + b"BlockRemoved".hex()
    + "ac" + b"block_hashes".hex() + "9107" + "a6" + b"medium".hex() + "a3" + b"GPU".hex()
    + "a9" + b"group_idx".hex() + "00"
    + "81" + "a4" + b"type".hex() + "b0" + b"AllBlocksCleared".hex()
    + "00"
)


def golden_batch():
    return KVEventBatch(
        ts=1.5,
        events=[
            BlockStored([2**64 - 1], None, [1, 2, 3, 4], 4, None, "GPU", None,
                        extra_keys=[None], group_idx=0, kv_cache_spec_kind="full_attention"),
            BlockRemoved([7], "GPU", group_idx=0),
            AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )


def test_golden_vector_map_form():
    assert msgspec.msgpack.encode(golden_batch()) == GOLDEN


def test_golden_vector_array_form():
    # The legacy form: events are positional arrays led by the tag, every field present.
    encoded = msgspec.msgpack.encode(to_array_form(golden_batch()))
    assert encoded.hex() == (
        "93cb3ff800000000000093"
        "dc0010ab" + b"BlockStored".hex() + "91cfffffffffffffffffc0940102030404c0a3"
        + b"GPU".hex() + "c091c000ae" + b"full_attention".hex() + "c0c0c0c0c0"
        "96ac" + b"BlockRemoved".hex() + "9107a3" + b"GPU".hex() + "00c0c0"
        "91b0" + b"AllBlocksCleared".hex() + "00"
    )
    assert BatchDecoder().decode(encoded) == golden_batch()
    assert BatchDecoder().decode(GOLDEN) == golden_batch()


def test_batch_without_rank_encodes_as_vllm_declares_it():
    # msgspec 0.22 writes a trailing nil for a None rank even with omit_defaults on an
    # array-like struct; vLLM's declaration writes the same bytes, which is what counts.
    encoded = msgspec.msgpack.encode(KVEventBatch(2.0, []))
    assert encoded == msgspec.msgpack.encode(VKVEventBatch(2.0, []))
    assert BatchDecoder().decode(encoded).data_parallel_rank is None


# Declared as vLLM 0.33.0 declares them (vllm/distributed/kv_events.py of the PyPI wheel),
# independently of mokv; tests/consumers/ compares with vLLM's own classes where installed.
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class VBlockStored(KVCacheEvent, tag="BlockStored"):
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


class VBlockRemoved(KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class VAllBlocksCleared(KVCacheEvent, tag="AllBlocksCleared"):
    pass


class VKVEventBatch(EventBatch):
    events: list[VBlockStored | VBlockRemoved | VAllBlocksCleared]


def decode_like_vllm(payload: bytes) -> VKVEventBatch:
    return msgspec.msgpack.Decoder(VKVEventBatch).decode(payload)


def test_vllm_structs_decode_the_golden_vector():
    batch = decode_like_vllm(GOLDEN)
    stored, removed, cleared = batch.events
    assert stored.block_hashes == [2**64 - 1] and stored.token_ids == [1, 2, 3, 4]
    assert stored.extra_keys == [None] and stored.kv_cache_spec_kind == "full_attention"
    assert removed.block_hashes == [7] and isinstance(cleared, VAllBlocksCleared)
    assert batch.data_parallel_rank == 0


def test_events_are_declared_as_vllm_033_declares_them():
    # Names, order and tags: the 15th BlockStored field is lookahead_token_ids.
    for mine, theirs in ((BlockStored, VBlockStored), (BlockRemoved, VBlockRemoved),
                         (AllBlocksCleared, VAllBlocksCleared)):
        assert mine.__struct_fields__ == theirs.__struct_fields__
        assert mine.__struct_config__.tag == theirs.__struct_config__.tag
    assert BlockStored.__struct_fields__[14] == "lookahead_token_ids"


class VArrayBlockStored(VBlockStored, array_like=True, tag="BlockStored"):
    pass


def test_lookahead_token_ids_decode_in_both_forms():
    # vLLM 0.33 with lookahead hashing publishes one token list per block in the 15th
    # field: in the array form that position is read positionally, so a decoder that
    # declares another field there rejects the batch.
    fields = dict(extra_keys=[None], group_idx=0, kv_cache_spec_kind="full_attention",
                  lookahead_token_ids=[[5, 6]])
    stored = VBlockStored([9], None, [1, 2, 3, 4], 4, None, "GPU", None, **fields)
    array = VArrayBlockStored([9], None, [1, 2, 3, 4], 4, None, "GPU", None, **fields)
    for event in (stored, array):
        payload = msgspec.msgpack.encode(EventBatch(1.0, [event], 0))
        (decoded,) = BatchDecoder().decode(payload).events
        assert decoded.lookahead_token_ids == [[5, 6]] and decoded.block_hashes == [9]
