"""The cache tiers below a paged replica's device pages.

    base.py       the protocol (`Tier`), a tier's config (`TierConfig`), the chain tail
    host.py       HostTierConfig, HostTier: host memory, written through at commit
    host_pool.py  HostPagePool: the host tier's index and LRU over leaves
    remote.py     RemoteTierConfig, RemoteTier: a Redis server that managers share,
                  over `mokv.remote`

Kept free of imports: `mokv.params` reads `base.TierConfig`, and the tiers import
`mokv.params`.
"""
