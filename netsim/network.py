"""The network model: per-link latency by region, bandwidth, loss,
duplication, reordering jitter and partitions. Pure functions of a seeded RNG."""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass, field

__all__ = ["NetworkModel", "Partition"]

LINK_CACHE = 1 << 18  # links whose latency is kept (about 40 MB when full)


@dataclass(frozen=True)
class Partition:
    """During ``[start_s, end_s)`` nodes on side B can't talk to side A.

    Side B is the peers in ``regions`` if given, else a seeded ``fraction`` of
    the peers present when the simulation starts. Clients are on side A
    unless their region is listed.
    """

    start_s: float
    end_s: float
    fraction: float = 0.5
    regions: tuple[str, ...] = ()


@dataclass
class NetworkModel:
    intra_ms: tuple[float, float] = (5.0, 20.0)
    inter_ms: tuple[float, float] = (50.0, 150.0)
    jitter_ms: float = 2.0  # exponential extra delay per message (mean)
    bandwidth_mbps: float = 1000.0  # per link: transfer time = bytes * 8 / bandwidth
    loss: float = 0.0
    duplicate: float = 0.0
    reorder: float = 0.0  # probability a message gets an extra uniform delay
    reorder_ms: float = 50.0
    partitions: tuple[Partition, ...] = ()
    seed: int = 0
    _links: dict[tuple[str, str], float] = field(default_factory=dict, init=False, repr=False, compare=False)

    def _draw_link(self, ra: str, rb: str, a: str, b: str) -> float:
        lo, hi = self.intra_ms if ra == rb else self.inter_ms
        h = hashlib.blake2b(f"{self.seed}|{a}|{b}".encode(), digest_size=16).digest()
        # two uniforms in (0, 1] from the link's hash, one normal (Box-Muller):
        # a pure function of the link, with no RNG to seed or state to keep
        u1 = (int.from_bytes(h[:8], "big") + 1) / 2.0**64
        u2 = int.from_bytes(h[8:], "big") / 2.0**64
        z = math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)
        # lognormal centred on the geometric mean; the range is +-2 sigma, clipped
        mu = math.log(math.sqrt(lo * hi))
        sigma = math.log(hi / lo) / 4 if hi > lo else 0.0
        return min(max(math.exp(mu + sigma * z), lo), hi) / 1000.0

    def link_unit(self, tag: str, a: str, b: str) -> float:
        """A uniform [0, 1) number fixed per (seed, tag, link): picks the links a
        ``delay`` fault slows without drawing from (and shifting) any RNG."""
        key = (a, b) if a < b else (b, a)
        h = hashlib.blake2b(f"{self.seed}|{tag}|{key[0]}|{key[1]}".encode(), digest_size=8).digest()
        return int.from_bytes(h, "big") / 2.0**64

    def latency(self, a: str, b: str, ra: str, rb: str) -> float:
        """One-way base latency of the (symmetric) link a-b in seconds.

        A pure function of the link's hash, so keeping it changes nothing: a
        swarm of N peers that all talk has N^2/2 links (12.5 M at 5,000), so
        only the links used lately are kept (``LINK_CACHE`` of them; the
        table is emptied when full), which most messages are: renewals,
        results and bids go back and forth on the same links."""
        key = (a, b) if a < b else (b, a)
        d = self._links.get(key)
        if d is None:
            d = self._draw_link(ra, rb, a, b) if a < b else self._draw_link(rb, ra, b, a)
            if len(self._links) >= LINK_CACHE:
                self._links.clear()
            self._links[key] = d
        return d

    def delays(self, rng: random.Random, base: float, nbytes: int) -> list[float]:
        """Delivery delays of one sent message: [] if lost, two if duplicated."""
        if self.loss > 0 and rng.random() < self.loss:
            return []
        n = 2 if self.duplicate > 0 and rng.random() < self.duplicate else 1
        xfer = nbytes * 8.0 / (self.bandwidth_mbps * 1e6)
        out = []
        for _ in range(n):
            d = base + xfer
            if self.jitter_ms > 0:
                d += rng.expovariate(1000.0 / self.jitter_ms)
            if self.reorder > 0 and rng.random() < self.reorder:
                d += rng.uniform(0, self.reorder_ms / 1000.0)
            out.append(d)
        return out
