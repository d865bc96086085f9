"""Page-level bookkeeping of the paged cache: the page pool and prefix hashing."""
