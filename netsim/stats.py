"""Metric helpers: Jain's index, finish-time fairness rho, time averages,
and deterministic float rounding for the results JSON."""

from __future__ import annotations

import bisect
import math
from typing import Any

from fedswarm.core.fairness import alone_time

__all__ = ["jain", "rho", "StepFn", "round_floats"]


def jain(xs: list[float]) -> float:
    """Jain's fairness index ``(sum x)^2 / (n * sum x^2)``; 1.0 for an empty or all-zero list."""
    xs = [float(x) for x in xs]
    if not xs:
        return 1.0
    sq = sum(x * x for x in xs)
    if sq <= 0:
        return 1.0
    return sum(xs) ** 2 / (len(xs) * sq)


def rho(jct_s: float, work_s: float, shards: int, gpus: int, chain: bool, capacity: float, tenants: float) -> tuple[float, float]:
    """Finish-time fairness: ``(rho, t_alone)``.

    ``t_alone = alone_time(work_s, shards, gpus, chain, capacity, tenants)``:
    the job alone on a 1/``tenants`` share of ``capacity`` reference slots.
    ``tenants`` may be fractional (a time average); ``alone_time`` divides by
    it, so we pass the share as a capacity with one tenant.
    """
    share = capacity / max(tenants, 1.0)
    t_alone = alone_time(work_s, shards, gpus, chain, share, 1)
    return jct_s / t_alone, t_alone


class StepFn:
    """A right-continuous piecewise-constant function of time, built in time order."""

    def __init__(self, t0: float = 0.0, v0: float = 0.0) -> None:
        self.ts = [t0]
        self.vs = [v0]
        self.cum = [0.0]  # integral from ts[0] to ts[i]

    @classmethod
    def from_points(cls, ts: list[float], vs: list[float]) -> "StepFn":
        """The function whose change points are ``ts`` and values ``vs``, as
        another one's ``ts`` and ``vs`` hold them (a part of a split run
        hands its own over: netsim.parallel)."""
        f = cls(ts[0], vs[0])
        f.ts, f.vs = list(ts), list(vs)
        for k in range(1, len(f.ts)):
            f.cum.append(f.cum[-1] + f.vs[k - 1] * (f.ts[k] - f.ts[k - 1]))
        return f

    def set(self, t: float, v: float) -> None:
        if t < self.ts[-1]:
            raise ValueError("StepFn.set: time went backwards")
        if v == self.vs[-1]:
            return
        if t == self.ts[-1]:
            self.vs[-1] = v
            return
        self.cum.append(self.cum[-1] + self.vs[-1] * (t - self.ts[-1]))
        self.ts.append(t)
        self.vs.append(v)

    @property
    def value(self) -> float:
        return self.vs[-1]

    def _integral_to(self, t: float) -> float:
        i = bisect.bisect_right(self.ts, t) - 1
        if i < 0:
            return 0.0
        return self.cum[i] + self.vs[i] * (t - self.ts[i])

    def mean(self, a: float, b: float) -> float:
        if b <= a:
            i = max(bisect.bisect_right(self.ts, a) - 1, 0)
            return self.vs[i]
        return (self._integral_to(b) - self._integral_to(a)) / (b - a)


def round_floats(x: Any, digits: int = 6) -> Any:
    """Round every float to ``digits`` significant digits (NaN/inf -> None)."""
    if isinstance(x, float):
        if not math.isfinite(x):
            return None
        if x == 0:
            return 0.0
        return float(f"{x:.{digits}g}")
    if isinstance(x, dict):
        return {str(k): round_floats(v, digits) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [round_floats(v, digits) for v in x]
    return x
