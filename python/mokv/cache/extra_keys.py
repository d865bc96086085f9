"""Typed extra keys: what besides its token ids keys a page in the prefix cache, and what
KV-cache events say about it.

One mechanism for every key, as vLLM's `extra_keys` (vllm 0.33
`vllm/v1/core/kv_cache_utils.py`, `generate_block_hash_extra_keys`): each key is typed
(tagged) and scoped to the pages it affects.

    key                    scope                          mixed into
    cache salt             every page of the request      the root of its hash chain
    LoRA adapter (name)    every page of the request      the root of its hash chain
    image (content hash,   the pages its placeholder      the hash of each of those
      offset, length)        tokens overlap                 pages

A key of every page is mixed into the chain's root once (`chain_root`): every page's
hash inherits it through the chain, as the salt always did, and a chain with no page
keys is still hashed in one native call. A page key is mixed into the hash of exactly
the pages it overlaps: such a page's hash is `H(H(parent, keys), tokens)` where an
unkeyed page's is `H(parent, tokens)` (`hashing.iter_page_hashes(page_keys=...)`), its
keys encoded with type tags and lengths (`hashing.encode_extra_keys`), so no two
different key sets encode alike. Requests with different salts, adapters or images
never share a page those keys affect; requests with equal ones do.

A hit is confirmed by the keys themselves, not only by hashes: a keyed page's token
bytes are a `KeyedTokens`, which equals only the same tokens with the same keys, so
that pages of different tenants (salts), adapters or images are never interchangeable,
even if their 64-bit hashes collide (`keyed_pages`).

`hash_inputs(ctx)` is the one function that reads, from a request, everything that
enters its page hashes besides the tokens (None when nothing does): a cache of a
request's hash chain must be keyed on it. `request_keys(ctx)` adds what events carry
but hashes do not (the adapter's id, the session) and gives each page's `EventKeys`.

Events carry the keys as vLLM 0.33 publishes them (`to_event_extra_keys`): one
`extra_keys` entry per page, a tuple of the LoRA name (on every page of an adapter's
request), `(identifier, offset in the page)` of each image the page overlaps, and the
salt (first page only), or None when the page has none; `lora_name` / `lora_id` and
`session_id` on the event.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import NamedTuple

from ..context import (
    MultimodalInput,
    check_cache_salt,
    check_lora_id,
    check_name,
    multimodal_inputs,
)
from .hashing import encode_extra_keys, keyed_root

LORA_TAG = "lora"
MM_TAG = "mm"
SALT_TAG = "cache_salt"


class HashInputs(NamedTuple):
    """Everything but the tokens that enters a request's page hashes (hashable)."""

    cache_salt: str | None
    lora_name: str | None
    mm_inputs: tuple[MultimodalInput, ...]


def hash_inputs(ctx: object) -> HashInputs | None:
    """What keys `ctx`'s pages besides its tokens, or None for an unsalted, adapter-free,
    text-only request. The empty salt is no salt (as in vLLM).

    Each key is checked here, where every manager reads it, whatever the context's type
    (TypeError / ValueError naming it; `mokv.context`'s checks): a salt or an adapter of
    another type, a falsy one included (`0`, `b""`), never means "no tenant", and image
    spans lie in order within the context's tokens."""
    salt = getattr(ctx, "cache_salt", None)
    lora = getattr(ctx, "lora_name", None)
    images = getattr(ctx, "mm_inputs", ())
    if (
        salt is None
        and lora is None
        and (images is None or images.__class__ is tuple and not images)
    ):
        return None  # most requests: three reads, no check
    check_cache_salt(salt)
    check_name("lora_name", lora)
    if images is not None:
        images = multimodal_inputs(images, ctx.end_idx)  # type: ignore[attr-defined]
    if not salt and lora is None and not images:
        return None
    return HashInputs(salt or None, lora, images or ())


def chain_root(
    algorithm: str,
    seed: int,
    cache_salt: str | None,
    lora_name: str | None,
    page_format: str = "",
) -> int:
    """The parent hash of the first page of a request with this salt and adapter:
    `hashing.keyed_root` of their tagged values (a salt alone gives the root it always
    gave, so salted pages keep their hashes), in pages of `page_format`."""
    return keyed_root(algorithm, seed, _tagged(cache_salt, lora_name), page_format)


def _tagged(cache_salt: str | None, lora_name: str | None) -> tuple[str, ...]:
    """(tag, value, ...) of the request-wide keys given (TypeError for a value not a str)."""
    keys: tuple[str, ...] = ()
    for tag, value in ((SALT_TAG, cache_salt), (LORA_TAG, lora_name)):
        if value is not None:
            if not isinstance(value, str):
                raise TypeError(f"{tag} must be a str or None, got {value!r}")
            keys += (tag, value)
    return keys


def page_keys(
    images: tuple[MultimodalInput, ...], page_size: int, first_page: int, end_page: int
) -> dict[int, bytes]:
    """The encoded keys of the pages `[first_page, end_page)` that an image overlaps (page
    index -> bytes): per image, its tag, identifier, offset from the page's first token
    (negative when it began on an earlier page; vLLM's form) and length."""
    keys: dict[int, list[str | int]] = {}
    for image in images:
        lo = max(image.offset // page_size, first_page)
        hi = min((image.end - 1) // page_size + 1, end_page)
        for page_idx in range(lo, hi):
            offset = image.offset - page_idx * page_size
            keys.setdefault(page_idx, []).extend((MM_TAG, image.identifier, offset, image.length))
    return {page_idx: encode_extra_keys(*k) for page_idx, k in keys.items()}


class KeyedTokens(bytes):
    """The token bytes of a page that extra keys key too (a salt, an adapter, images),
    carrying those keys: equal only to the same bytes with the same keys.

    A hit is confirmed by comparing the page's stored token bytes with the request's
    (the device index, the host tier, the chain memo, `PagePool.lookup`): with the keys
    in the comparison, it confirms them too, exactly, whatever the page hashes. Two
    tenants' pages with equal tokens whose 64-bit chain hashes collide are never
    interchangeable: a page of another salt, adapter or image set, or of none, compares
    unequal (an unkeyed page's bytes are plain `bytes`, which never equal these). The
    shared tier, whose values outlive the process, stores a digest of the keys beside
    the tokens (`mokv.remote.codec`).

    Why a `bytes` subclass and not a column of keys beside each pool's tokens: every
    place that compares tokens compares keys with no change of its own, and plain
    requests keep plain bytes, at no cost. Python gives a subclass's `__eq__` / `__ne__`
    precedence when the other operand is plain `bytes`, on either side. Anything that
    reads the bytes (events, copies into values) sees the tokens alone, and so does a
    `memoryview` or `bytearray` compared with them from the left (the pools hold `bytes`;
    the shared tier, which compares a value's memoryview, compares the keys' digest apart).
    """

    # A bytes subclass cannot declare slots: the keys live in the instance dict.

    def __new__(cls, data: bytes, extra_keys: bytes) -> KeyedTokens:
        tokens = super().__new__(cls, data)
        tokens.extra_keys = extra_keys
        return tokens

    extra_keys: bytes
    """The page's encoded keys (`keyed_pages`): never empty."""

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, (bytes, bytearray)):
            return NotImplemented  # a memoryview compares the bytes alone
        return getattr(other, "extra_keys", None) == self.extra_keys and bytes.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    __hash__ = bytes.__hash__

    def __repr__(self) -> str:
        return f"KeyedTokens({bytes.__repr__(self)}, extra_keys={self.extra_keys!r})"


@functools.lru_cache(maxsize=4096)
def request_identity(cache_salt: str | None, lora_name: str | None) -> bytes:
    """The encoded keys every page of a request with this salt and adapter carries (b""
    for neither), tagged as in `chain_root`."""
    keys = _tagged(cache_salt, lora_name)
    return encode_extra_keys(*keys) if keys else b""


def keyed_pages(
    pages: list[tuple[int, bytes]],
    inputs: HashInputs,
    image_keys: Mapping[int, bytes] | None,
    first_page: int,
) -> list[tuple[int, bytes]]:
    """`pages` ((hash, token bytes) of a request's pages from page `first_page` on) with
    each page's bytes a `KeyedTokens` of its keys: the request's salt and adapter, then
    the images it overlaps (`image_keys`, as `page_keys` gives them). A page with no key
    keeps its plain bytes."""
    base = request_identity(inputs.cache_salt, inputs.lora_name)
    out = []
    for page_idx, (page_hash, data) in enumerate(pages, start=first_page):
        keys = base + image_keys.get(page_idx, b"") if image_keys else base
        out.append((page_hash, KeyedTokens(data, keys) if keys else data))
    return out


class EventKeys(NamedTuple):
    """What a `BlockStored` event says about one page besides its hash, parent and
    tokens (None instead of an `EventKeys` when it says nothing)."""

    cache_salt: str | None
    """The request's salt, on a sequence's first page only."""
    lora_name: str | None
    lora_id: int | None
    images: tuple[tuple[str, int], ...]
    """(identifier, offset from the page's first token) of each image it overlaps."""
    session_id: str | None

    def event_entry(self, salt_entry: str | None) -> tuple | None:
        """The page's `extra_keys` entry as vLLM 0.33 publishes it: the LoRA name, the
        images' pairs, then the salt (as `salt_entry`, its router's form); None if empty."""
        entry: tuple = (self.lora_name,) if self.lora_name is not None else ()
        entry += self.images
        if salt_entry is not None:
            entry += (salt_entry,)
        return entry or None

    @property
    def run_tag(self) -> tuple[str | None, int | None, str | None]:
        """What every page of one `BlockStored` event must share."""
        return self.lora_name, self.lora_id, self.session_id


class RequestKeys(NamedTuple):
    """A request's keys, as events carry them (from `request_keys`)."""

    inputs: HashInputs | None
    lora_id: int | None
    session_id: str | None

    def page(self, page_idx: int, page_size: int) -> EventKeys | None:
        """The `EventKeys` of the request's page `page_idx`, or None if it has none."""
        salt = lora = None
        images: tuple[tuple[str, int], ...] = ()
        inputs = self.inputs
        if inputs is not None:
            lora = inputs.lora_name
            salt = inputs.cache_salt if page_idx == 0 else None
            start, end = page_idx * page_size, (page_idx + 1) * page_size
            images = tuple(
                (image.identifier, image.offset - start)
                for image in inputs.mm_inputs
                if image.offset < end and image.end > start
            )
        if salt is None and lora is None and not images and self.session_id is None:
            return None
        return EventKeys(
            salt, lora, self.lora_id if lora is not None else None, images, self.session_id
        )


def request_keys(ctx: object) -> RequestKeys | None:
    """`ctx`'s keys for events (None when it has none): `hash_inputs(ctx)`, its adapter's
    id and its `session_id` (vLLM 0.33 publishes the request's session on its stores),
    each checked as `hash_inputs` checks its keys: a manager calls it before it first
    reserves a request, so that a bad key changes nothing."""
    inputs = hash_inputs(ctx)
    session_id = check_name("session_id", getattr(ctx, "session_id", None))
    lora_id = getattr(ctx, "lora_id", None)
    if lora_id is not None:
        check_lora_id(lora_id, inputs.lora_name if inputs is not None else None)
    if inputs is None and session_id is None:
        return None
    return RequestKeys(inputs, lora_id, session_id)
