"""Power model and the choice of a frequency level per shard.

Model
-----
A device at relative clock ``f`` in (0, 1] draws
``P(f) = P_idle + (P_max - P_idle) * f ** alpha`` and runs work at speed
proportional to ``f`` (a shard of ``W`` seconds at f = 1 takes ``W / f``).
The energy charged to a shard is what the device draws while running it,
``E(f) = P(f) * W / f``: with a large idle share, finishing fast and idling
(race-to-idle) wins; with a steep dynamic curve (alpha ~ 2-3), slowing down
wins. ``choose_level`` evaluates every level the device supports that keeps
``P(f)`` under the power cap. With a deadline it takes the level of least
energy that still finishes within ``DEADLINE_MARGIN`` of the time left
(slow-down or race-to-idle, whichever the curve favours; the fastest level if
none does). Without a deadline it takes the cheapest by
``time_weight * finish + lam * (energy + carbon_price * carbon)`` (with
``lam = 0``: the fastest). ``race_to_idle`` always picks f = max allowed.

Carbon grams are ``E / 3.6e6 * carbon_g_kwh``; cost is ``E / 3.6e6 * price``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["PowerModel", "LevelChoice", "choose_level"]

J_PER_KWH = 3.6e6
DEADLINE_MARGIN = 0.8  # a slowed-down shard must finish within this fraction of the time left


@dataclass(frozen=True, slots=True)
class PowerModel:
    idle_w: float
    max_w: float
    alpha: float = 2.5
    cap_w: float = 0.0  # 0 = no cap
    levels: tuple[float, ...] = (1.0,)

    def power(self, f: float) -> float:
        # math.pow, not **: float ** float is typed Any (a negative base gives a complex)
        return self.idle_w + (self.max_w - self.idle_w) * math.pow(f, self.alpha)

    def allowed_levels(self) -> tuple[float, ...]:
        lv = tuple(sorted(f for f in self.levels if self.cap_w <= 0 or self.power(f) <= self.cap_w + 1e-9))
        return lv or (min(self.levels),)

    def energy(self, work_s: float, f: float) -> float:
        return self.power(f) * work_s / f


@dataclass(frozen=True, slots=True)
class LevelChoice:
    level: float
    run_s: float
    energy_j: float
    carbon_g: float


def choose_level(
    model: PowerModel,
    work_s: float,
    *,
    start_s: float = 0.0,
    deadline_s: float | None = None,
    lam: float = 0.0,
    carbon_g_kwh: float = 0.0,
    time_weight: float = 1.0,
    race_to_idle: bool = False,
) -> LevelChoice:
    """Pick the level for a shard of ``work_s`` reference seconds (at f = 1).

    Args:
        start_s: seconds until the shard would start (queue wait).
        deadline_s: seconds from now by which it should finish, if any.
        lam: weight of joules against seconds.
    Returns:
        the chosen level with its run time, energy and carbon. If no level
        meets the deadline, the fastest allowed one.
    """
    levels = model.allowed_levels()
    fastest = levels[-1]
    if race_to_idle:
        f = fastest
    elif deadline_s is not None:
        # the least-energy level that still meets the deadline with a safety
        # margin (the wait is an estimate); none does: the fastest
        budget = DEADLINE_MARGIN * deadline_s
        ok = [x for x in levels if start_s + work_s / x <= budget]
        if ok:
            f = min(ok, key=lambda x: (model.energy(work_s, x) * (1 + carbon_g_kwh / J_PER_KWH * lam), -x))
        else:
            f = fastest
    else:
        best: tuple[float, float] | None = None
        for x in levels:
            e = model.energy(work_s, x)
            cost = time_weight * (start_s + work_s / x) + lam * (e + e / J_PER_KWH * carbon_g_kwh)
            if best is None or cost < best[0] - 1e-12:
                best = (cost, x)
        assert best is not None
        f = best[1]
    e = model.energy(work_s, f)
    return LevelChoice(f, work_s / f, e, e / J_PER_KWH * carbon_g_kwh)
