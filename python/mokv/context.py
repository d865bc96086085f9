"""Request contexts: the token state of one request, as a KV cache manager sees it.

A context's tokens are split by three indices:

    tokens:  | in the KV cache      | active this step      | not yet fed     |
             0                  start_idx             active_idx          end_idx

- `start_idx`   tokens whose K/V are already in the cache (processed, or reused
                from the prefix cache);
- `active_idx`  end of the window the model processes this step; usually `end_idx`,
                smaller while a long prompt is prefilled in chunks;
- `end_idx`     all tokens known so far (prompt + generated).

`update(token)` ends a step: the active window moves into the cache and, unless a
prompt chunk was just processed, the new token is appended and becomes the next
window. `reset()` undoes everything in the cache after preemption: the generated
tokens fold into the prompt and will be recomputed (or found in the prefix cache).

Besides its tokens, a request may carry what else keys its prefix-cache pages (the
typed extra keys of `mokv.cache.extra_keys`: its cache salt, LoRA adapter and images)
the agent session it belongs to (`session_id`, see `mokv.SessionConfig`) and what it
asks of the cache (`cache_control`, a `mokv.CacheControl`: a pin, a write policy). A
manager reads them with `getattr`, so a context without them is an unsalted,
adapter-free, text-only request of no session that writes every page.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Protocol, runtime_checkable

import numpy as np

from .config.cache_control import CacheControl


class RequestID(str):
    """Identifier of one request; `RequestID()` makes a fresh random one."""

    __slots__ = ()

    def __new__(cls, value: str | None = None) -> RequestID:
        if value is None:
            return super().__new__(cls, uuid.uuid4().hex)
        if not isinstance(value, str):  # str(5) would make an id "5" of any object
            raise TypeError(f"a RequestID is made of a str, got {type(value).__name__} {value!r}")
        return super().__new__(cls, value)

    def __repr__(self) -> str:
        return f"RequestID({str.__repr__(self)})"


@dataclass(frozen=True, slots=True)
class MultimodalInput:
    """One image (or other non-text input) of a prompt: what its placeholder tokens
    stand for, so that the prefix cache tells two images apart (an image's placeholder
    token ids are the same for every image).

    Attributes:
        identifier: the input's content hash (any stable string: vLLM's `mm_hash`,
            a SHA-256 of the image bytes); equal inputs must have equal identifiers.
        offset: index of its first placeholder token in the prompt (>= 0).
        length: its number of placeholder tokens (>= 1).
    """

    identifier: str
    offset: int
    length: int

    def __post_init__(self) -> None:
        if not isinstance(self.identifier, str) or not self.identifier:
            raise TypeError(
                f"MultimodalInput.identifier must be a non-empty str, got {self.identifier!r}"
            )
        for name, low in (("offset", 0), ("length", 1)):
            value = getattr(self, name)
            if value.__class__ is not int or value < low:
                raise ValueError(f"MultimodalInput.{name} must be an int >= {low}, got {value!r}")

    @property
    def end(self) -> int:
        """One past its last placeholder token."""
        return self.offset + self.length


@runtime_checkable
class TextGenerationContext(Protocol):
    """What a KV cache manager reads from, and writes to, a request.

    Optional members, read with `getattr` (absent means None or empty): `lora_name`
    (str) and `lora_id` (int) of the request's LoRA adapter, `mm_inputs` (a sequence of
    `MultimodalInput`, by offset), `session_id` (str). See `TextContext`.
    """

    @property
    def request_id(self) -> RequestID: ...

    @property
    def tokens(self) -> np.ndarray:
        """All known token ids, `tokens[:end_idx]`."""
        ...

    @property
    def start_idx(self) -> int: ...

    @property
    def active_idx(self) -> int: ...

    @property
    def end_idx(self) -> int: ...

    @property
    def active_length(self) -> int: ...

    @property
    def cache_salt(self) -> str | None:
        """Isolates the request's prefix-cache pages: requests share pages only when their
        salts are equal (None or "": the unsalted cache, as in vLLM). Set by the server
        (tenant, auth layer), never taken from a caller; managers read it through
        `mokv.cache.extra_keys.hash_inputs`, which refuses any other type."""
        ...

    def active_idx_after_skip(self, num_tokens: int) -> int:
        """Where the active window would end after `skip_cached_prefix(num_tokens)`
        (pure: the manager asks before it reserves memory for that window)."""
        ...

    def skip_cached_prefix(self, num_tokens: int) -> None:
        """Marks the first `num_tokens` tokens as found in the prefix cache and moves the
        active window past them (called by a manager after a prefix hit)."""
        ...

    def update(self, new_token: int) -> None: ...


def token_ids(tokens: object, allow_empty: bool = False) -> np.ndarray:
    """`tokens` as a 1-D int64 array of ids in [0, 2**63) (non-empty unless
    `allow_empty`); TypeError / ValueError naming the problem and the values otherwise:
    never a silent truncation of floats, a flattening, or an id that wraps around. What
    a context's prompt and a router's query (`PrefixRouterIndex.match`) must be."""
    array = np.asarray(tokens)
    if array.dtype == object:  # Python ints past int64 land here
        raise ValueError(f"tokens must be token ids in [0, 2**63), got {_shown(tokens)}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise TypeError(
            f"tokens must be integer token ids, got {_shown(tokens)} (dtype {array.dtype})"
        )
    if array.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {array.shape}")
    if array.size == 0:
        if allow_empty:
            return np.zeros(0, dtype=np.int64)
        raise ValueError("a TextContext needs at least one prompt token")
    if array.min() < 0 or (array.dtype == np.uint64 and array.max() >= 2**63):
        bad = array[(array < 0) | (array >= 2**63)] if array.dtype != np.uint64 else array
        raise ValueError(f"tokens must be token ids in [0, 2**63), got {bad[:4].tolist()}")
    return array.astype(np.int64)


def _shown(value: object, limit: int = 80) -> str:
    """`value`'s repr, cut to `limit` characters (an error names a prompt, not all of it)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def check_cache_salt(value: object) -> str | None:
    """`value` as a context's `cache_salt`: a str or None (TypeError otherwise, a falsy
    one included: `0` or `b""` must not mean "no tenant")."""
    if value is not None and not isinstance(value, str):
        raise TypeError(f"cache_salt must be a str or None, got {value!r}")
    return value


def check_name(name: str, value: object) -> str | None:
    """`value` as a context's `lora_name` or `session_id`: a non-empty str or None."""
    if value is not None and (not isinstance(value, str) or not value):
        raise TypeError(f"{name} must be a non-empty str or None, got {value!r}")
    return value


def check_cache_control(value: object) -> CacheControl | None:
    """`value` as a context's `cache_control`: a `mokv.CacheControl` or None."""
    if value is not None and not isinstance(value, CacheControl):
        raise TypeError(f"cache_control must be a mokv.CacheControl or None, got {value!r}")
    return value


def check_lora_id(value: object, lora_name: str | None) -> int | None:
    """`value` as a context's `lora_id`: an int >= 0 (bool excluded) or None, and only
    with a `lora_name` (the name keys the pages, the id is only published)."""
    if value is None:
        return None
    if value.__class__ is not int or value < 0:
        raise TypeError(f"lora_id must be an int >= 0 or None, got {value!r}")
    if lora_name is None:
        raise ValueError(f"lora_id={value} needs a lora_name (the name keys the pages)")
    return value


def multimodal_inputs(inputs: object, num_tokens: int) -> tuple[MultimodalInput, ...]:
    """`inputs` as a tuple of `MultimodalInput`s ordered by offset, not overlapping and
    within the first `num_tokens` tokens (the prompt); TypeError / ValueError naming the
    offending input otherwise. Checked where a context is given it and again where a
    manager or a router reads it (a context's field may be set at any time)."""
    if inputs is None or isinstance(inputs, (str, bytes)) or not isinstance(inputs, Sequence):
        raise TypeError(
            f"mm_inputs must be a sequence of mokv.MultimodalInput, got "
            f"{type(inputs).__name__} {_shown(inputs)}"
        )
    images = tuple(inputs)
    end = 0
    for image in images:
        if not isinstance(image, MultimodalInput):
            raise TypeError(f"mm_inputs holds {_shown(image)}; each must be a mokv.MultimodalInput")
        if image.offset < end:
            raise ValueError(
                f"mm_inputs must be ordered by offset and not overlap: {image!r} starts "
                f"before token {end}, where the one before it ends"
            )
        if image.end > num_tokens:
            raise ValueError(f"{image!r} ends past the prompt's {num_tokens} tokens")
        end = image.end
    return images


def check_max_length(value: object, num_tokens: int) -> int | None:
    """`value` as a context's `max_length`: None or an int (bool excluded) at least
    `num_tokens`, the tokens it holds already."""
    if value is not None and (value.__class__ is not int or value < max(num_tokens, 1)):
        raise ValueError(
            f"max_length must be None or an int >= {max(num_tokens, 1)} (the tokens the "
            f"context holds), got {value!r}"
        )
    return value


class TextContext:
    """A concrete request context over a growing numpy buffer of token ids.

    Args:
        tokens: the prompt's token ids: a 1-D integer array-like of ids >= 0, at least one.
        request_id: defaults to a fresh `RequestID()`.
        max_length: optional cap on `end_idx` (prompt + generated tokens), at least the
            prompt's length.
        cache_salt: isolates the prefix cache per tenant (see
            `TextGenerationContext.cache_salt`); set by the server, never by a caller.
        lora_name: the LoRA adapter the request runs under (None: the base model).
            Every page of the request is keyed by it: requests under different
            adapters never share pages, and a name must always denote the same
            adapter weights (load new weights under a new name).
        lora_id: the adapter's integer id, as vLLM's `lora_int_id`: published in
            KV-cache events (`BlockStored.lora_id`), not hashed; needs `lora_name`.
        mm_inputs: the prompt's images (`MultimodalInput`s), ordered by offset, not
            overlapping, within the prompt: each page that a placeholder range
            overlaps is keyed by that image.
        session_id: the agent or chat session the request belongs to: with
            `KVCacheParams.sessions` set, its pages stay retained after `release`
            until the session ends (`mokv.SessionConfig`).
        cache_control: a pin of the request's prefix at its release, and what it may
            write into the cache (`mokv.CacheControl`); None: no pin, every page.

    `max_length` and the keys (`cache_salt`, `lora_name`, `lora_id`, `mm_inputs`,
    `session_id`, `cache_control`) may be set later; each is checked when set, as here (TypeError /
    ValueError naming the value, the context unchanged).
    """

    __slots__ = (
        "_request_id",
        "_buf",
        "_start",
        "_active",
        "_end",
        "_prompt_len",
        "_max_length",
        "_cache_salt",
        "_lora_name",
        "_lora_id",
        "_mm_inputs",
        "_session_id",
        "_cache_control",
    )

    def __init__(
        self,
        tokens: np.ndarray | list[int],
        request_id: RequestID | str | None = None,
        max_length: int | None = None,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        lora_id: int | None = None,
        mm_inputs: Sequence[MultimodalInput] = (),
        session_id: str | None = None,
        cache_control: CacheControl | None = None,
    ) -> None:
        # Every field is checked before any is set: a bad one leaves no half-built context.
        check_cache_salt(cache_salt)
        check_cache_control(cache_control)
        check_name("lora_name", lora_name)
        check_name("session_id", session_id)
        check_lora_id(lora_id, lora_name)
        prompt = token_ids(tokens)
        check_max_length(max_length, prompt.size)
        images = multimodal_inputs(mm_inputs, prompt.size)
        self._request_id = RequestID(request_id) if request_id is not None else RequestID()
        self._buf = np.empty(max(16, 2 * prompt.size), dtype=np.int64)
        self._buf[: prompt.size] = prompt
        self._start = 0
        self._end = self._active = self._prompt_len = int(prompt.size)
        # The keys, checked above (the setters would check them again).
        self._max_length, self._cache_salt, self._lora_name = max_length, cache_salt, lora_name
        self._lora_id, self._mm_inputs, self._session_id = lora_id, images, session_id
        self._cache_control = cache_control

    # The fields a server may set after construction are checked when set, as when given
    # to `__init__`: a salt of `0` or an image span past the prompt is refused there, not
    # read as "no tenant" or found wrong later. (A manager checks them again when it reads
    # them: `mokv.cache.extra_keys.hash_inputs`, since any context type may carry them.)

    def _set_max_length(self, value: int | None) -> None:
        self._max_length = check_max_length(value, self._end)

    def _set_cache_salt(self, value: str | None) -> None:
        self._cache_salt = check_cache_salt(value)

    def _set_lora_name(self, value: str | None) -> None:
        check_name("lora_name", value)
        if value is None and self._lora_id is not None:
            raise ValueError(
                f"lora_name=None with lora_id={self._lora_id}: set lora_id to None first"
            )
        self._lora_name = value

    def _set_lora_id(self, value: int | None) -> None:
        self._lora_id = check_lora_id(value, self._lora_name)

    def _set_mm_inputs(self, value: Sequence[MultimodalInput]) -> None:
        self._mm_inputs = multimodal_inputs(value, self._prompt_len)

    def _set_session_id(self, value: str | None) -> None:
        self._session_id = check_name("session_id", value)

    def _set_cache_control(self, value: CacheControl | None) -> None:
        self._cache_control = check_cache_control(value)

    max_length = property(
        attrgetter("_max_length"), _set_max_length, doc="Cap on `end_idx`, or None."
    )
    cache_control = property(
        attrgetter("_cache_control"),
        _set_cache_control,
        doc="What the request asks of the cache (`mokv.CacheControl`), or None.",
    )
    cache_salt = property(
        attrgetter("_cache_salt"),
        _set_cache_salt,
        doc="The tenant's salt (`TextGenerationContext.cache_salt`), or None.",
    )
    lora_name = property(
        attrgetter("_lora_name"), _set_lora_name, doc="The LoRA adapter's name, or None."
    )
    lora_id = property(
        attrgetter("_lora_id"), _set_lora_id, doc="The adapter's integer id, or None."
    )
    mm_inputs = property(
        attrgetter("_mm_inputs"), _set_mm_inputs, doc="The prompt's images, by offset."
    )
    session_id = property(
        attrgetter("_session_id"), _set_session_id, doc="The agent session, or None."
    )

    def __repr__(self) -> str:
        return (
            f"TextContext({self._request_id!r}, start_idx={self._start}, "
            f"active_idx={self._active}, end_idx={self._end})"
        )

    # The managers read these on every request of every step: a property over
    # `attrgetter` runs in C, ~10 ns (a third) less than a Python getter.
    request_id = property(attrgetter("_request_id"), doc="The request's `RequestID`.")
    start_idx = property(attrgetter("_start"), doc="Tokens already in the KV cache.")
    active_idx = property(attrgetter("_active"), doc="End of this step's active window.")
    end_idx = property(attrgetter("_end"), doc="All tokens known so far.")
    current_length = property(attrgetter("_end"), doc="`end_idx` (MAX's name).")

    @property
    def tokens(self) -> np.ndarray:
        return self._buf[: self._end]

    @property
    def active_length(self) -> int:
        return self._active - self._start

    @property
    def next_tokens(self) -> np.ndarray:
        """The token ids the model processes this step."""
        return self._buf[self._start : self._active]

    @property
    def prompt_length(self) -> int:
        """Tokens that are prompt (after a `reset`, this includes earlier generated tokens)."""
        return self._prompt_len

    @property
    def generated_tokens(self) -> np.ndarray:
        return self._buf[self._prompt_len : self._end]

    @property
    def is_chunked(self) -> bool:
        """True while the active window stops short of the known tokens."""
        return self._active < self._end

    def chunk(self, max_tokens: int) -> None:
        """Limits this step's active window to at most `max_tokens` tokens (chunked prefill)."""
        if max_tokens.__class__ is not int or max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
        self._active = min(self._end, self._start + max_tokens)

    def active_idx_after_skip(self, num_tokens: int) -> int:
        """Where `skip_cached_prefix(num_tokens)` would end the active window: the window
        keeps its length (a prompt chunk stays a chunk), holds at least one token (the
        model must run on the last token to produce the next one), and stops at `end_idx`.
        """
        if num_tokens.__class__ is not int or not self._start <= num_tokens < self._end:
            raise ValueError(
                f"cannot skip to {num_tokens!r}: must be an int in [start_idx={self._start}, "
                f"end_idx={self._end})"
            )
        return min(self._end, num_tokens + max(self._active - self._start, 1))

    def skip_cached_prefix(self, num_tokens: int) -> None:
        """Moves `start_idx` to `num_tokens`, the first tokens having been found in the
        prefix cache; the window ends at `active_idx_after_skip(num_tokens)`."""
        self._active = self.active_idx_after_skip(num_tokens)
        self._start = num_tokens

    def update(self, new_token: int) -> None:
        """Ends a step: the active window is now in the cache.

        After the last chunk of a prompt (or a decode step) `new_token` is appended and
        becomes the next active window; after an intermediate prompt chunk it is
        ignored, since the model's output there is not a sampled token.
        """
        if self._active < self._end:
            self._start = self._active
            self._active = self._end
            return
        if (
            not isinstance(new_token, (int, np.integer))
            or isinstance(new_token, bool)
            or not (0 <= new_token < 2**63)
        ):
            raise ValueError(f"new_token must be a token id in [0, 2**63), got {new_token!r}")
        if self._max_length is not None and self._end >= self._max_length:
            raise ValueError(f"request {self._request_id!r} reached max_length={self._max_length}")
        if self._end == self._buf.size:
            self._buf = np.concatenate([self._buf, np.empty_like(self._buf)])
        self._buf[self._end] = new_token
        self._start = self._active
        self._end += 1
        self._active = self._end

    def reset(self) -> None:
        """Forgets the cache after preemption: everything becomes prompt, to be recomputed."""
        self._start = 0
        self._active = self._end
        self._prompt_len = self._end
