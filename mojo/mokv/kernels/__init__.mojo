"""Kernels generic over `KVCollectionT`; the `@register` wrappers live in mokv/ops.mojo."""
