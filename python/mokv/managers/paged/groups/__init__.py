"""The cache groups of a paged replica: sets of layers whose caches are written in
lockstep, each with its own pages.

base.py  CacheGroup: what the replica asks of every group kind (the protocol)
full.py  FullAttentionGroup: layers that read every token before them (today's cache)
"""

from .base import CacheGroup
from .full import FullAttentionGroup

__all__ = ["CacheGroup", "FullAttentionGroup"]
