"""Checked graph wrappers of the mokv custom ops, and the kernel package path.

Every wrapper takes the cache collection first, validates dtype, rank, static dims and
devices at graph-build time (raising ValueError/TypeError naming the argument), and
emits one custom op. The collection's fetcher (`mokv.FetchPagedKVCacheCollection`, ...)
adds mokv's kernel package to the graph, so no `custom_extensions` are needed.
"""

from ..mojo_package import kernels_path
from .attention import flash_attention
from .cpu_paths import portable_cpu_paths
from .kv_cache import store_kv
from .matmul import fused_qkv_matmul, rope_freqs_cis
from .mla import mla_attention, mla_store

__all__ = [
    "flash_attention",
    "fused_qkv_matmul",
    "kernels_path",
    "mla_attention",
    "mla_store",
    "rope_freqs_cis",
    "store_kv",
    "portable_cpu_paths",
]
