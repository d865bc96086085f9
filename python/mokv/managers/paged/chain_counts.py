"""Hash chains that several holders hold at once, counted per hash: sessions retain theirs
(`sessions.py`), pins pin theirs (`pins.py`). A hash is retained (pinned) in the pool
while its count is above zero, and the distinct hashes stay within a cap."""

from __future__ import annotations

from collections.abc import Iterable

from ...errors import InvariantError


def count_chains(chains: Iterable[tuple[int, ...]]) -> dict[int, int]:
    """Hash -> how many of `chains` hold it (a chain holding a hash twice counts once)."""
    counted: dict[int, int] = {}
    for chain in chains:
        for h in set(chain):
            counted[h] = counted.get(h, 0) + 1
    return counted


def check_counts(
    holders: str,
    chains: Iterable[tuple[int, ...]],
    count: dict[int, int],
    pooled: frozenset[int],
    cap: int,
) -> None:
    """InvariantError unless `count` is what `chains` hold, the pool holds exactly those
    hashes (`pooled`) and they stay within `cap`; `holders` names them ("sessions
    retain", "pins hold")."""
    counted = count_chains(chains)
    if counted != count or pooled != count.keys():
        raise InvariantError(
            f"{holders} {len(counted)} hashes, counted {len(count)}, the pool {len(pooled)}"
        )
    if len(count) > cap:
        raise InvariantError(f"{holders} {len(count)} pages, past {cap}")
