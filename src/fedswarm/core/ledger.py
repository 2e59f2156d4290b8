"""Tenant ledger: exponentially decayed GPU-seconds per tenant, as a CRDT.

Theory of operation
-------------------
Each peer counts the work it ran for each tenant. A decayed counter
``u(t) = sum_i w_i * exp(-(t - t_i) / tau)`` is not monotone, so it cannot be
merged with ``max``. We store instead the *undecayed, time-weighted* sum
``c = sum_i w_i * exp(t_i / tau)``, which only grows; ``u(t) = c * exp(-t/tau)``.
To keep it finite for wall-clock times (``t / tau`` is ~5e5 for Unix time and
tau = 1 h) the counter is kept in the log domain: ``L = log c``, updated with
``logaddexp``.

The replicated state is a map ``(tenant, peer) -> L`` where only ``peer``
ever increases its own entries. Merge is entry-wise ``max``: commutative,
associative and idempotent, so rows may arrive in any order, duplicated or
relayed (a state-based G-counter of max-registers). A tenant's usage is the
sum over peers; its share is usage / total usage.

Rows travel inside each peer's signed ``PeerState`` (its own row only), so a
peer cannot inflate or erase another peer's counts.
"""

from __future__ import annotations

import math
from bisect import insort
from typing import Iterator

__all__ = ["Ledger", "NEG_INF"]

NEG_INF = -1e300  # log(0) stand-in that msgpack and validators accept as finite


def _logaddexp(a: float, b: float) -> float:
    if a < b:
        a, b = b, a
    if b <= NEG_INF:
        return a
    return a + math.log1p(math.exp(b - a))


class Ledger:
    """Per-tenant decayed usage, merged across peers without coordination."""

    def __init__(self, tau_s: float = 3600.0, max_rows: int = 100_000) -> None:
        if tau_s <= 0:
            raise ValueError("tau_s must be positive")
        self.tau_s = tau_s
        self.max_rows = max_rows
        self._version = 0
        # the entries, (tenant, peer) -> log counter, grouped as ``usage``
        # reads them: the tenants in order, each tenant's values by peer, and
        # its peers in order (kept sorted as keys arrive: sorting every entry
        # after each change was half of ``usage``'s cost at 1,000 peers)
        self._tenants: list[str] = []
        self._vals: dict[str, dict[str, float]] = {}
        self._peers: dict[str, list[str]] = {}
        self._n = 0  # entries in all
        self._shares_key: tuple[float, int] | None = None
        self._shares_val: dict[str, float] = {}

    # -- local updates -----------------------------------------------------

    def add(self, peer: str, tenant: str, gpu_s: float, now: float) -> None:
        """Record ``gpu_s`` GPU-seconds run by ``peer`` for ``tenant`` at ``now``."""
        if gpu_s <= 0:
            return
        val = math.log(gpu_s) + now / self.tau_s
        self._set(tenant, peer, _logaddexp(self._get(tenant, peer), val))

    def _get(self, tenant: str, peer: str) -> float:
        vals = self._vals.get(tenant)
        return NEG_INF if vals is None else vals.get(peer, NEG_INF)

    def _set(self, tenant: str, peer: str, val: float) -> None:
        """Enter ``val`` for ``(tenant, peer)``, and count a change."""
        vals = self._vals.get(tenant)
        if vals is None:
            vals = self._vals[tenant] = {}
            self._peers[tenant] = []
            insort(self._tenants, tenant)
        if peer not in vals:
            insort(self._peers[tenant], peer)
            self._n += 1
        vals[peer] = val
        self._version += 1

    def _items(self) -> Iterator[tuple[tuple[str, str], float]]:
        """Every entry, by (tenant, peer)."""
        for tenant in self._tenants:
            vals = self._vals[tenant]
            for peer in self._peers[tenant]:
                yield (tenant, peer), vals[peer]

    # -- replication -------------------------------------------------------

    def row(self, peer: str, limit: int = 64) -> dict[str, float]:
        """``peer``'s own entries (tenant -> log counter), the ``limit`` largest."""
        items = [(t, self._vals[t][peer]) for t in self._tenants if peer in self._vals[t]]
        items.sort(key=lambda kv: (-kv[1], kv[0]))
        return dict(items[:limit])

    def merge_row(self, peer: str, row: dict[str, float]) -> None:
        for tenant, val in row.items():
            if val > self._get(tenant, peer):
                self._set(tenant, peer, val)
        if self._n > self.max_rows:
            self._prune()

    def merge(self, other: "Ledger") -> None:
        """State-based merge: entry-wise max."""
        for (tenant, peer), val in other._items():
            if val > self._get(tenant, peer):
                self._set(tenant, peer, val)

    def _prune(self) -> None:
        # keep the largest entries (equal ones by (tenant, peer)); a pruned
        # entry is a negligible one
        keep = sorted(self._items(), key=lambda kv: -kv[1])[: self.max_rows // 2]
        self._tenants, self._vals, self._peers, self._n = [], {}, {}, 0
        for (tenant, peer), val in keep:
            self._set(tenant, peer, val)

    # -- queries -----------------------------------------------------------

    def usage(self, now: float) -> dict[str, float]:
        """Decayed GPU-seconds per tenant at ``now`` (sorted iteration order)."""
        out: dict[str, float] = {}
        shift = now / self.tau_s
        exp = math.exp
        for tenant in self._tenants:
            # summed in (tenant, peer) order, as one pass over the sorted entries would
            vals = self._vals[tenant]
            total, counted = 0.0, False
            for peer in self._peers[tenant]:
                x = vals[peer] - shift
                if x > -700:
                    total += exp(x)
                    counted = True
            if counted:
                out[tenant] = total
        return out

    def shares(self, now: float) -> dict[str, float]:
        """Each tenant's share of the decayed usage (memoised per ``(now, version)``;
        callers must not mutate the result)."""
        key = (now, self._version)
        if key != self._shares_key:
            usage = self.usage(now)
            total = sum(usage.values())
            self._shares_val = {t: u / total for t, u in usage.items()} if total > 0 else {}
            self._shares_key = key
        return self._shares_val

    def state(self) -> dict[tuple[str, str], float]:
        return dict(self._items())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Ledger) and self._vals == other._vals

    def __repr__(self) -> str:
        return f"<Ledger {len(self._tenants)} tenants, {self._n} entries>"
