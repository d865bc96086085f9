"""What a remote page is: its layout fingerprint, its Redis key and its value's bytes.

Key (readable, so an operator can `redis-cli --scan --pattern 'mokv:v1:<namespace>:*'`):

    mokv:v1:{namespace}:{fingerprint}:{page hash as 16 hex digits}
    fingerprint = {dtype}.p{page_size}.l{layers}.h{kv heads per device}.d{head_dim}
                  .tp{rank}-{degree}.{prefix hash algorithm}
    e.g. mokv:v1:llama-3.2-1b:bfloat16.p128.l16.h8.d64.tp0-1.xxh3:9f0c1e2d3a4b5c6d

The page hash is mokv's chained page hash (`mokv.cache.hashing`): stable across
processes and machines, and it already includes the cache salt and the hash seed, so
two tenants with different salts never share a key.

Value = a 64-byte header, the page's token ids (int64 little-endian, the bytes the page
hash was computed over), then the page's bytes (the device layout
`[2, layers, page_size, kv heads per device, head_dim]`, C order):

    offset size  field
         0    4  magic b"MKVP"
         4    2  version (1)
         6    2  dtype code (1 float32, 2 bfloat16, 3 float16)
         8   20  shape: 5 x uint32 [2, layers, page_size, heads, head_dim]
        28    8  layout fingerprint digest (xxh3-64 of the fingerprint string)
        36    8  page hash
        44    4  number of tokens (page_size)
        48    8  number of page bytes
        56    8  checksum: xxh3-64 of bytes 0..55, the tokens and the page bytes

`decode` trusts nothing: a value is accepted only if its length, magic, version and
checksum are right, its layout (dtype, shape, fingerprint) is this one, and its page
hash and token ids are exactly the ones asked for. Anything else is a `Rejection`,
which the store counts and treats as a miss.
"""

from __future__ import annotations

import enum
import re
import struct
from dataclasses import dataclass
from functools import cached_property

from max.dtype import DType
from xxhash import xxh3_64, xxh3_64_intdigest

from ..params import CACHE_DTYPES, PREFIX_HASH_ALGORITHMS, KVCacheParams

REMOTE_NAMESPACE = re.compile(r"[A-Za-z0-9._/@+-]{1,200}")
"""A namespace of the store: no ':' or spaces, so that no two keys are ambiguous."""

MAGIC = b"MKVP"
VERSION = 1
KEY_PREFIX = "mokv:v1"
_HEADER = struct.Struct("<4sHH5IQQIQQ")
HEADER_SIZE = _HEADER.size  # 64
_DTYPE_CODES = {DType.float32: 1, DType.bfloat16: 2, DType.float16: 3}
assert set(_DTYPE_CODES) == set(CACHE_DTYPES) and HEADER_SIZE == 64


class Rejection(enum.Enum):
    """Why a value read from the server was not accepted (each one is a miss)."""

    CORRUPT = "corrupt"  # too short, wrong magic or version, or a checksum mismatch
    LAYOUT = "layout"  # a well-formed page of another dtype / shape / fingerprint
    TOKENS = "tokens"  # another page hash or other token ids than the ones asked for


@dataclass(frozen=True)
class RemoteLayout:
    """The shape of one stored page: everything two servers must agree on to share it.

    One layout per device shard: with tensor parallelism each device stores its own
    heads under its own `tp_rank`.
    """

    dtype: DType
    page_size: int
    num_layers: int
    n_kv_heads_per_device: int
    head_dim: int
    tp_rank: int = 0
    tp_degree: int = 1
    prefix_hash: str = "xxh3"

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPE_CODES:
            raise ValueError(f"dtype={self.dtype!r} is not a cache dtype {list(_DTYPE_CODES)}")
        for name in ("page_size", "num_layers", "n_kv_heads_per_device", "head_dim", "tp_degree"):
            value = getattr(self, name)
            if value.__class__ is not int or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.tp_rank.__class__ is not int or not 0 <= self.tp_rank < self.tp_degree:
            raise ValueError(f"tp_rank must be in [0, {self.tp_degree}), got {self.tp_rank!r}")
        if self.prefix_hash not in PREFIX_HASH_ALGORITHMS or self.prefix_hash == "builtin":
            # Python's builtin hash differs between processes: nothing could be shared.
            raise ValueError(
                f"prefix_hash={self.prefix_hash!r}: a shared tier needs a stable hash "
                "('xxh3' or 'sha256')"
            )

    @classmethod
    def from_params(cls, params: KVCacheParams, num_layers: int, tp_rank: int = 0):
        """The layout of device `tp_rank`'s shard of a replica built from `params`."""
        return cls(
            params.dtype,
            params.page_size,
            num_layers,
            params.n_kv_heads_per_device,
            params.head_dim,
            tp_rank,
            params.tensor_parallel_degree,
            params.prefix_hash,
        )

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        """`[2, layers, page_size, kv heads per device, head_dim]`: one device page."""
        return (2, self.num_layers, self.page_size, self.n_kv_heads_per_device, self.head_dim)

    @cached_property
    def page_nbytes(self) -> int:
        n = self.dtype.size_in_bytes
        for dim in self.page_shape:
            n *= dim
        return n

    @cached_property
    def fingerprint(self) -> str:
        return (
            f"{self.dtype.name}.p{self.page_size}.l{self.num_layers}"
            f".h{self.n_kv_heads_per_device}.d{self.head_dim}"
            f".tp{self.tp_rank}-{self.tp_degree}.{self.prefix_hash}"
        )

    @cached_property
    def _digest(self) -> int:
        return xxh3_64_intdigest(self.fingerprint.encode())

    @cached_property
    def value_nbytes(self) -> int:
        """Bytes of one stored value: header, token ids, page."""
        return HEADER_SIZE + 8 * self.page_size + self.page_nbytes

    def key_prefix(self, namespace: str) -> str:
        """`mokv:v1:{namespace}:{fingerprint}:`; ValueError for a namespace that could
        make two keys ambiguous (empty, too long, or with ':' or spaces)."""
        if not isinstance(namespace, str) or not REMOTE_NAMESPACE.fullmatch(namespace):
            raise ValueError(
                f"namespace must be 1-200 characters of [A-Za-z0-9._/@+-], got {namespace!r}"
            )
        return f"{KEY_PREFIX}:{namespace}:{self.fingerprint}:"

    # --- values ---------------------------------------------------------------------

    def new_value(self, page_hash: int, token_bytes: bytes, page) -> bytearray:
        """A value with `token_bytes` and a copy of `page` (any buffer of
        `page_nbytes` contiguous bytes, or an array of `page_shape`) in place and the
        header still blank (`seal` fills it): the one copy a caller pays. ValueError
        naming what does not fit."""
        if page_hash.__class__ is not int or not 0 <= page_hash < 1 << 64:
            raise ValueError(f"page_hash must be an unsigned 64-bit int, got {page_hash!r}")
        if not isinstance(token_bytes, bytes) or len(token_bytes) != 8 * self.page_size:
            raise ValueError(
                f"token_bytes must be {8 * self.page_size} bytes (page_size int64 ids), got "
                f"{type(token_bytes).__name__} of {len(token_bytes)}"
            )
        shape = getattr(page, "shape", None)
        if shape is not None and tuple(shape) != self.page_shape:
            raise ValueError(f"page has shape {tuple(shape)}, expected {self.page_shape}")
        data = memoryview(page)
        if not data.c_contiguous or data.nbytes != self.page_nbytes:
            raise ValueError(
                f"page must be {self.page_nbytes} contiguous bytes, got {data.nbytes} "
                f"(contiguous={data.c_contiguous})"
            )
        value = bytearray(self.value_nbytes)
        tokens_end = HEADER_SIZE + len(token_bytes)
        value[HEADER_SIZE:tokens_end] = token_bytes
        value[tokens_end:] = data.cast("B")
        return value

    def seal(self, value: bytearray, page_hash: int) -> None:
        """Writes the header and the checksum of a `new_value` in place."""
        _HEADER.pack_into(
            value,
            0,
            MAGIC,
            VERSION,
            _DTYPE_CODES[self.dtype],
            *self.page_shape,
            self._digest,
            page_hash,
            self.page_size,
            self.page_nbytes,
            0,
        )
        view = memoryview(value)
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
        for, else why not."""
        if len(value) < HEADER_SIZE:
            return Rejection.CORRUPT
        (magic, version, dtype_code, *fields) = _HEADER.unpack_from(value)
        shape, (digest, stored_hash, num_tokens, num_bytes, checksum) = fields[:5], fields[5:]
        if magic != MAGIC or version != VERSION:
            return Rejection.CORRUPT
        view = memoryview(value)
        check = xxh3_64(view[:56])
        check.update(view[HEADER_SIZE:])
        if check.intdigest() != checksum or len(value) != HEADER_SIZE + 8 * num_tokens + num_bytes:
            return Rejection.CORRUPT
        if (
            dtype_code != _DTYPE_CODES[self.dtype]
            or tuple(shape) != self.page_shape
            or digest != self._digest
            or num_bytes != self.page_nbytes
        ):
            return Rejection.LAYOUT
        tokens_end = HEADER_SIZE + 8 * num_tokens
        if stored_hash != page_hash or view[HEADER_SIZE:tokens_end] != token_bytes:
            return Rejection.TOKENS
        return view[tokens_end:]
