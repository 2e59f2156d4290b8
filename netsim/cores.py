"""Thin netsim subclasses of the cores that add exact caches, nothing else.

``View.live(now)`` and ``Ledger.shares(now)`` are called once per queued
lease from ``PeerCore._prio`` (O(view) and O(ledger log ledger) each), and
``_swarm_slots`` sums the live view each time. We swap in subclasses that
keep a version counter bumped by every mutation and memoise those queries
by ``(now, version)``: exact, so results are unchanged (a test runs a
scenario with and without them and compares the JSON bytes).
"""

from __future__ import annotations

from typing import Any

from fedswarm.core.client import ClientCore
from fedswarm.core.ledger import Ledger
from fedswarm.core.peer import PeerCore
from fedswarm.core.view import View, ViewEntry

__all__ = ["SimPeerCore", "SimClientCore", "CachedView", "CachedLedger"]


class CachedView(View):
    def __init__(self, self_id: str, max_size: int = 1024) -> None:
        super().__init__(self_id, max_size)
        self.version = 0
        self._live_key: tuple[float, int] | None = None
        self._live_val: list[ViewEntry] = []

    def merge(self, *a: Any, **kw: Any) -> bool:
        news = super().merge(*a, **kw)
        if news:
            self.version += 1
        return news

    def expire(self, *a: Any, **kw: Any) -> list[str]:
        dead = super().expire(*a, **kw)
        if dead:
            self.version += 1
        return dead

    def remove(self, *a: Any, **kw: Any) -> None:
        self.version += 1
        super().remove(*a, **kw)

    def live(self, now: float) -> list[ViewEntry]:
        key = (now, self.version)
        if key != self._live_key:
            self._live_val = super().live(now)
            self._live_key = key
        return self._live_val


class CachedLedger(Ledger):
    def __init__(self, tau_s: float = 3600.0, max_rows: int = 100_000) -> None:
        super().__init__(tau_s, max_rows)
        self.version = 0
        self._shares_key: tuple[float, int] | None = None
        self._shares_val: dict[str, float] = {}

    def add(self, *a: Any, **kw: Any) -> None:
        self.version += 1
        super().add(*a, **kw)

    def merge_row(self, *a: Any, **kw: Any) -> None:
        self.version += 1
        super().merge_row(*a, **kw)

    def merge(self, *a: Any, **kw: Any) -> None:
        self.version += 1
        super().merge(*a, **kw)

    def _prune(self, *a: Any, **kw: Any) -> None:
        self.version += 1
        super()._prune(*a, **kw)

    def shares(self, now: float) -> dict[str, float]:
        key = (now, self.version)
        if key != self._shares_key:
            self._shares_val = super().shares(now)
            self._shares_key = key
        return self._shares_val


def _install_caches(node: Any) -> None:
    assert len(node.view) == 0 and not node.ledger.state(), "install caches before start()"
    node.view = CachedView(node.id, node.view.max_size)
    node.ledger = CachedLedger(node.ledger.tau_s, node.ledger.max_rows)


class SimPeerCore(PeerCore):
    def __init__(self, *a: Any, fast: bool = True, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self._slots_key: tuple[float, int] | None = None
        self._slots_val = 0.0
        if fast:
            _install_caches(self)

    def _swarm_slots(self, now: float) -> float:
        view = self.view
        if not isinstance(view, CachedView):
            return super()._swarm_slots(now)
        key = (now, view.version)
        if key != self._slots_key:
            self._slots_val = super()._swarm_slots(now)
            self._slots_key = key
        return self._slots_val


class SimClientCore(ClientCore):
    def __init__(self, *a: Any, fast: bool = True, **kw: Any) -> None:
        super().__init__(*a, **kw)
        if fast:
            _install_caches(self)
