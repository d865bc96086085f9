"""Mokv: KV-cache views and kernels for MAX graphs.

Modules:
  types       `KVCacheStaticParams`, the `KVCacheT` / `KVCollectionT` traits, dtype codes.
  continuous  `ContinuousBatchingKVCache` and its collection (one slot per sequence).
  paged       `PagedKVCache` and its collection (fixed-size pages from a shared pool).
  kernels/    store_kv, fused_qkv_matmul (+RoPE) and flash_attention, generic over the traits.
  ops         the `@register` structs that expose the kernels to the graph compiler.
  manager     `ContinuousBatchingKVCacheManager`: owns a continuous cache, thread-safe.
  slots       `ContinuousBatchingSlotTable`: the manager's slot state behind a spin lock.
"""
