"""Causal GQA flash attention over a KV cache layer on the CPU (see flash_attention.mojo)."""

from .flash_attention import flash_attention
