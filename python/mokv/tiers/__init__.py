"""The cache tiers below a paged replica's device pages.

    base.py       the protocol (`Tier`), the hits and pages it trades, the chain tail
    stack.py      TierStack: one replica's tiers in lookup order, driven as one
    host.py       HostTier: host memory, written through at commit
    host_pool.py  HostPagePool: the host tier's index and LRU over leaves
    remote.py     RemoteTier: a Redis server that managers share, over `mokv.remote`

The configs (`HostTierConfig`, `RemoteTierConfig`) are `mokv.config.tiers`; each tier
module registers its builder for its config (`mokv.registry`), and this package imports
them, so that whoever builds tiers (`stack.py`, a module of this package) finds every
builder registered whatever else its process imported.
"""

from . import host, remote

__all__ = ["host", "remote"]
