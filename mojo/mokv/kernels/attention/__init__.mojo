"""Causal GQA flash attention over a KV cache layer (see flash_attention.mojo)."""

from .flash_attention import flash_attention
