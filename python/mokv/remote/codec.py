"""PageCodec: the stored value of a page in one key space (a namespace, a layout and,
optionally, a MAC key), and the checks a value must pass to be served.

Value = a 64-byte header, the page's token ids (int64 little-endian, the bytes the page
hash was computed over), the digest of the page's extra keys (32 bytes: SHA-256 of the
keys of a `KeyedTokens` page, its tenant's salt, its adapter and images; zeros for a
page without), the page's bytes (the device layout `[2, layers, page_size, kv heads per
device, head_dim]`, C order; a scaled FP8 page's scales follow its values,
`RemoteLayout.scales_shape` float32), then, with a MAC key, a 32-byte tag:

    offset size  field
         0    4  magic b"MKVP"
         4    2  version (3)
         6    2  dtype code (1 float32, 2 bfloat16, 3 float16, 4 float8_e4m3fn; 0 a
                 recurrent-state checkpoint, whose regions have their own dtypes)
         8   20  shape: 5 x uint32 [2, layers, page_size, heads, head_dim] (a
                 checkpoint's: [0, regions, page_size, tp rank, tp degree])
        28    8  key space digest: xxh3-64 of the key prefix (`RemoteLayout.key_prefix`:
                 the namespace, the layout fingerprint, the MAC key's id)
        36    8  page hash
        44    4  number of tokens (page_size)
        48    8  number of page bytes
        56    8  checksum: xxh3-64 of bytes 0..55 and everything after the header
        64       tokens, keys digest, page bytes
       end-32   32  tag (MAC key only): HMAC-SHA256 with the key of the key prefix,
                 bytes 0..55, the tokens, the keys digest and the page bytes

A recurrent state's checkpoint (`StateLayout`) is stored the same way under the chain
hash and tokens of its boundary page: its "page bytes" are one device shard's state,
region after region (each `[layers, *row_shape]` of its dtype, C order).

`decode` trusts nothing: a value is accepted only if its length, magic, version and
checksum are right, its layout (dtype, shape) is this one, it names this key space (a
value copied under another namespace's or layout's key is refused), its page hash,
token ids and keys digest are exactly the ones asked for (another tenant's page whose
hash collides is a miss, as on the device) and, with a MAC key, its tag is right.
Anything else is a `Rejection`, which the store counts and treats as a miss.

What each check stops. The checksum finds corruption; it is no signature: whoever can
write the server can compute it. Without a MAC key such a writer can plant a page under
any hash with any bytes, and every server serves it. With one (shared by the servers,
kept from everyone else), a value passes only if a holder of the key sealed it for
that namespace, layout, page hash and tokens: a writer without the key can delete or
corrupt values (misses), or copy a sealed value to another key (refused: the tag
covers the key prefix and the page hash), but not make one. The MAC costs one
HMAC-SHA256 pass over the value on each side (`benchmarks/bench_remote_mac.py`).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import struct
from functools import cached_property

from xxhash import xxh3_64, xxh3_64_intdigest

from ..config.tiers import mac_key_bytes
from .layout import RemoteLayout, StateLayout

MAGIC = b"MKVP"
VERSION = 3  # 3: the keys digest after the tokens
_HEADER = struct.Struct("<4sHH5IQQIQQ")
HEADER_SIZE = _HEADER.size  # 64
TAG_SIZE = 32
KEYS_DIGEST_SIZE = 32
NO_KEYS = bytes(KEYS_DIGEST_SIZE)
"""The keys digest of a page without extra keys."""
assert HEADER_SIZE == 64


class Rejection(enum.Enum):
    """Why a value read from the server was not accepted (each one is a miss)."""

    CORRUPT = "corrupt"  # too short, wrong magic or version, or a checksum mismatch
    LAYOUT = "layout"  # a well-formed page of another dtype or shape
    KEYSPACE = "keyspace"  # sealed for another namespace, layout fingerprint or MAC key
    TOKENS = "tokens"  # another page hash, other token ids or other extra keys than asked for
    MAC = "mac"  # a tag that the MAC key did not make: a planted or altered value


def mac_key_id(mac_key: bytes) -> str:
    """8 hex digits naming a MAC key in keys: a keyed digest, which says nothing of the
    key but tells keys apart (a rotated key gets a key space of its own)."""
    return hmac.digest(mac_key, b"mokv remote key id", "sha256")[:4].hex()


def keys_digest(token_bytes: bytes) -> bytes:
    """What a value stores of its page's extra keys: SHA-256 of a `KeyedTokens` page's
    keys (`mokv.cache.extra_keys`), `NO_KEYS` for plain token bytes. A cryptographic
    digest, since values outlive the process: two key sets that differ never give one
    digest in practice, accidentally or by design."""
    keys = getattr(token_bytes, "extra_keys", None)
    return NO_KEYS if not keys else hashlib.sha256(keys).digest()


class PageCodec:
    """Values of `layout`'s pages under `namespace`, sealed with `mac_key` if given."""

    def __init__(
        self, layout: RemoteLayout | StateLayout, namespace: str, mac_key: bytes | str | None = None
    ) -> None:
        if not isinstance(layout, (RemoteLayout, StateLayout)):
            raise TypeError(f"layout must be a RemoteLayout or a StateLayout, got {layout!r}")
        self.layout = layout
        self._mac_key = mac_key_bytes(mac_key)
        key_id = None if self._mac_key is None else mac_key_id(self._mac_key)
        self.key_prefix = layout.key_prefix(namespace, key_id)
        """Every key of this key space starts with it (`key`)."""
        self._prefix_bytes = self.key_prefix.encode()
        self._digest = xxh3_64_intdigest(self._prefix_bytes)
        self._tag_size = 0 if self._mac_key is None else TAG_SIZE

    @property
    def sealed(self) -> bool:
        """Whether values carry a MAC tag."""
        return self._mac_key is not None

    def key(self, page_hash: int) -> str:
        """The Redis key of a page."""
        return f"{self.key_prefix}{page_hash:016x}"

    @cached_property
    def value_nbytes(self) -> int:
        """Bytes of one stored value: header, token ids, page, tag."""
        return (
            HEADER_SIZE
            + 8 * self.layout.page_size
            + KEYS_DIGEST_SIZE
            + self.layout.page_nbytes
            + self._tag_size
        )

    def new_value(self, page_hash: int, token_bytes: bytes, page) -> bytearray:
        """A value with `token_bytes`, their keys' digest (`keys_digest`) and a copy of
        `page` in place, and the header and tag still blank (`seal` fills them): the one
        copy a caller pays. `page`: any buffer of `page_nbytes` contiguous bytes, an
        array of `page_shape`, or a tuple of contiguous buffers whose bytes follow each
        other (a scaled page's values and scales, copied in turn). ValueError naming
        what does not fit."""
        layout = self.layout
        if page_hash.__class__ is not int or not 0 <= page_hash < 1 << 64:
            raise ValueError(f"page_hash must be an unsigned 64-bit int, got {page_hash!r}")
        if not isinstance(token_bytes, bytes) or len(token_bytes) != 8 * layout.page_size:
            raise ValueError(
                f"token_bytes must be {8 * layout.page_size} bytes (page_size int64 ids), "
                f"got {type(token_bytes).__name__} of {len(token_bytes)}"
            )
        shape = getattr(page, "shape", None)
        if shape is not None and tuple(shape) != layout.page_shape:
            raise ValueError(f"page has shape {tuple(shape)}, expected {layout.page_shape}")
        parts = [memoryview(p) for p in (page if isinstance(page, tuple) else (page,))]
        nbytes = sum(part.nbytes for part in parts)
        if not all(part.c_contiguous for part in parts) or nbytes != layout.page_nbytes:
            raise ValueError(
                f"page must be {layout.page_nbytes} contiguous bytes, got {nbytes} "
                f"(contiguous={all(part.c_contiguous for part in parts)})"
            )
        value = bytearray(self.value_nbytes)
        tokens_end = HEADER_SIZE + len(token_bytes)
        start = tokens_end + KEYS_DIGEST_SIZE
        value[HEADER_SIZE:tokens_end] = token_bytes
        value[tokens_end:start] = keys_digest(token_bytes)
        for part in parts:
            value[start : start + part.nbytes] = part.cast("B")
            start += part.nbytes
        return value

    def seal(self, value: bytearray, page_hash: int) -> None:
        """Writes the header, the tag and the checksum of a `new_value` in place."""
        layout = self.layout
        _HEADER.pack_into(
            value,
            0,
            MAGIC,
            VERSION,
            layout.dtype_code,
            *layout.header_shape,
            self._digest,
            page_hash,
            layout.page_size,
            layout.page_nbytes,
            0,
        )
        view = memoryview(value)
        if self._mac_key is not None:
            view[-TAG_SIZE:] = self._tag(view)
        checksum = xxh3_64(view[:56])
        checksum.update(view[HEADER_SIZE:])
        value[56:HEADER_SIZE] = checksum.intdigest().to_bytes(8, "little")

    def encode(self, page_hash: int, token_bytes: bytes, page) -> bytes:
        """The stored value of a page (`new_value`, then `seal`)."""
        value = self.new_value(page_hash, token_bytes, page)
        self.seal(value, page_hash)
        return bytes(value)

    def decode(self, value: bytes, page_hash: int, token_bytes: bytes) -> memoryview | Rejection:
        """The page bytes of `value` (a zero-copy view) if it is exactly the page asked
        for, sealed for this key space, else why not (cheapest checks first)."""
        layout = self.layout
        if len(value) < HEADER_SIZE:
            return Rejection.CORRUPT
        (magic, version, dtype_code, *fields) = _HEADER.unpack_from(value)
        shape, (digest, stored_hash, num_tokens, num_bytes, checksum) = fields[:5], fields[5:]
        if magic != MAGIC or version != VERSION:
            return Rejection.CORRUPT
        view = memoryview(value)
        check = xxh3_64(view[:56])
        check.update(view[HEADER_SIZE:])
        size = HEADER_SIZE + 8 * num_tokens + KEYS_DIGEST_SIZE + num_bytes + self._tag_size
        if check.intdigest() != checksum or len(value) != size:
            return Rejection.CORRUPT
        if (
            dtype_code != layout.dtype_code
            or tuple(shape) != layout.header_shape
            or num_bytes != layout.page_nbytes
        ):
            return Rejection.LAYOUT
        if digest != self._digest:
            return Rejection.KEYSPACE
        tokens_end = HEADER_SIZE + 8 * num_tokens
        page_start = tokens_end + KEYS_DIGEST_SIZE
        if (
            stored_hash != page_hash
            or view[HEADER_SIZE:tokens_end] != token_bytes
            or view[tokens_end:page_start] != keys_digest(token_bytes)
        ):
            return Rejection.TOKENS
        if self._mac_key is not None and not hmac.compare_digest(self._tag(view), view[-TAG_SIZE:]):
            return Rejection.MAC
        return view[page_start : page_start + num_bytes]

    def _tag(self, view: memoryview) -> bytes:
        """HMAC-SHA256 of the key prefix, the header's first 56 bytes, the tokens, the keys
        digest and the page (everything but the checksum and the tag)."""
        assert self._mac_key is not None
        mac = hmac.new(self._mac_key, self._prefix_bytes, "sha256")
        mac.update(view[:56])
        mac.update(view[HEADER_SIZE:-TAG_SIZE])
        return mac.digest()
