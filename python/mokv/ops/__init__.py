"""Checked graph wrappers of the mokv custom ops, and the kernel package path.

Every wrapper validates dtype, rank, static dims and devices at graph-build time and
raises ValueError/TypeError naming the argument; then it emits one custom op.
Pass `kernels_path()` as `custom_extensions=[...]` to every `max.graph.Graph` using them.
"""

from .attention import flash_attention
from .extension import kernels_path
from .kv_cache import store_kv
from .matmul import fused_qkv_matmul, rope_freqs_cis

__all__ = ["flash_attention", "fused_qkv_matmul", "kernels_path", "rope_freqs_cis", "store_kv"]
