"""Result verification: what the results collected for one shard decide.

A client that checks an untrusted peer's result holds it and asks another
peer for the same shard; each result that comes back is a ``Candidate``.
``settle`` is the pure rule that decides the shard from them:

* a group of equal results *wins* when a trusted peer is in it or it has
  ``quorum`` members; of several such groups the largest (the first of
  equal size) wins. The verdict is ``ACCEPT``: deliver the winner's first
  result; each candidate whose result differs is a ``liar`` (its peer is
  banned, and accused with the winner's results as evidence);
* without a winner, ``max_replicas`` results or more ``FAIL`` the shard
  (no quorum is coming); fewer ``WAIT`` for another opinion.

The client applies the verdict (reputation, bans, accusations, delivery);
``settle`` only reads its arguments.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from .wire import ShardResult

__all__ = ["Candidate", "Verdict", "settle", "ACCEPT", "WAIT", "FAIL"]

ACCEPT = "accept"
WAIT = "wait"
FAIL = "fail"


class Candidate(NamedTuple):
    """A result held for a shard: who returned it, for which attempt, the
    message, and its signed bytes (evidence for an accusation)."""

    peer: str
    attempt: int
    msg: ShardResult
    raw: bytes


@dataclass(frozen=True, slots=True)
class Verdict:
    """What ``settle`` decided: ``outcome`` (``ACCEPT``, ``WAIT`` or
    ``FAIL``); for ``ACCEPT`` the agreeing candidates (``winner``, the
    first is delivered) and those that disagree with them (``liars``), in
    the order they came."""

    outcome: str
    winner: tuple[Candidate, ...] = ()
    liars: tuple[Candidate, ...] = ()

    @property
    def agreeing(self) -> list[str]:
        """The winner's peers, sorted (each earns reputation)."""
        return sorted({c.peer for c in self.winner})


def settle(candidates: Sequence[Candidate], trusted: Collection[str], *, quorum: int, max_replicas: int) -> Verdict:
    """Decide a shard from the results collected for it (see the module
    docstring). ``trusted``: the candidates' peers this client trusts."""
    groups: dict[bytes, list[Candidate]] = {}
    for cand in candidates:
        groups.setdefault(cand.msg.result, []).append(cand)
    winner: list[Candidate] | None = None
    for members in groups.values():
        if any(c.peer in trusted for c in members) or len(members) >= quorum:
            if winner is None or len(members) > len(winner):
                winner = members
    if winner is None:
        return Verdict(FAIL if len(candidates) >= max_replicas else WAIT)
    value = winner[0].msg.result
    return Verdict(ACCEPT, tuple(winner), tuple(c for c in candidates if c.msg.result != value))
