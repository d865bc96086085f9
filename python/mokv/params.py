"""The old home of `KVCacheParams`, kept for code that imports it from here; the config
types live in `mokv.config` (the ground floor)."""

from .config.base import CACHE_DTYPES, PREFIX_HASH_ALGORITHMS
from .config.params import KVCacheParams, KVCacheStrategy

__all__ = ["CACHE_DTYPES", "PREFIX_HASH_ALGORITHMS", "KVCacheParams", "KVCacheStrategy"]
