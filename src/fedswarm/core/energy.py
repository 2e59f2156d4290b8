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
``P(f)`` under the power cap and meets the deadline, and takes the cheapest
by ``time_weight * finish + lam * (energy + carbon_price * carbon)``. With no
deadline and ``lam > 0`` that is the energy-optimal level subject to the
caller's time weight; ``race_to_idle`` picks f = max allowed.

Carbon grams are ``E / 3.6e6 * carbon_g_kwh``; cost is ``E / 3.6e6 * price``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PowerModel", "LevelChoice", "choose_level"]

J_PER_KWH = 3.6e6


@dataclass(frozen=True, slots=True)
class PowerModel:
    idle_w: float
    max_w: float
    alpha: float = 2.5
    cap_w: float = 0.0  # 0 = no cap
    levels: tuple[float, ...] = (1.0,)

    def power(self, f: float) -> float:
        return self.idle_w + (self.max_w - self.idle_w) * f**self.alpha

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
    if race_to_idle:
        f = levels[-1]
        e = model.energy(work_s, f)
        return LevelChoice(f, work_s / f, e, e / J_PER_KWH * carbon_g_kwh)
    best: tuple[float, float] | None = None
    for f in levels:
        run = work_s / f
        if deadline_s is not None and start_s + run > deadline_s and f != levels[-1]:
            continue
        e = model.energy(work_s, f)
        cost = time_weight * (start_s + run) + lam * (e + e / J_PER_KWH * carbon_g_kwh)
        if best is None or cost < best[0] - 1e-12:
            best = (cost, f)
    assert best is not None
    f = best[1]
    if deadline_s is not None and start_s + work_s / f > deadline_s:
        f = levels[-1]
    e = model.energy(work_s, f)
    return LevelChoice(f, work_s / f, e, e / J_PER_KWH * carbon_g_kwh)
