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
none does). With ``rerun_reserve_s`` set (a peer's ``rerun_room``, off by
default) a level below the fastest must also leave room for one re-run:
see ``leaves_rerun_room``. Without a deadline it takes the cheapest by
``time_weight * finish + lam * (energy + carbon_price * carbon)`` (with
``lam = 0``: the fastest). ``race_to_idle`` always picks f = max allowed.

Carbon grams are ``E / 3.6e6 * carbon_g_kwh``; cost is ``E / 3.6e6 * price``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["PowerModel", "LevelChoice", "choose_level", "leaves_rerun_room", "meets_deadline"]

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


def leaves_rerun_room(
    work_s: float, run_s: float, fastest: float, *, start_s: float, deadline_s: float, reserve_s: float
) -> bool:
    """Whether a shard of ``work_s`` reference seconds, started in
    ``start_s`` and run for ``run_s``, could still be run once more at the
    ``fastest`` level after a crash at the very end of that run and meet
    its deadline: ``start_s + run_s + reserve_s + work_s / fastest <=
    deadline_s``.

    ``reserve_s`` is the time for the crash to be noticed: a crashed peer
    sends no renewal, and its client re-auctions the shard when the lease it
    last granted lapses, at most that lease after the crash. Near the end of
    a run that lease is the one the award named (a client grants more only
    to a renewal with a long way to go), so the peer passes
    ``Award.lease_s`` from its last award. A slowed-down shard saves
    energy at the price of a longer window for a crash to strike; the check
    keeps that window short enough that one crash does not cost the
    deadline (``docs/evaluation.md``: on window a/40 at 1,000 peers three
    shards slowed to the 0.6 clock lost their peer 0.4 to 3 s before the end
    and missed their deadlines; at full clock they would have finished 45 s
    before the crash). The sum is
    held to the deadline itself, not to ``DEADLINE_MARGIN`` of it: the margin
    is there for the error of the wait estimate, which ``start_s`` already
    carries into this sum, and a crash at the last moment of a run is the
    worst case, not the expected one. Assumed: the re-run starts at once, on
    a device as fast as this one at its fastest level (a slower one, or a
    queue, needs more). One crash, not two.
    """
    return start_s + run_s + reserve_s + work_s / fastest <= deadline_s


def meets_deadline(work_s: float, run_s: float, slowed: bool, fastest: float, *, start_s: float,
                   deadline_s: float, reserve_s: float | None) -> bool:
    """The level rule's test of one level for a shard with a deadline: run
    for ``run_s`` after ``start_s``, it ends within ``DEADLINE_MARGIN`` of
    ``deadline_s``, and, when ``slowed`` below the ``fastest`` level with a
    ``reserve_s`` given (``rerun_room``), it leaves room for a re-run
    (``leaves_rerun_room``). ``choose_level`` keeps the levels that pass; a
    peer asks again before a slowed shard starts."""
    return start_s + run_s <= DEADLINE_MARGIN * deadline_s and (
        not slowed or reserve_s is None
        or leaves_rerun_room(work_s, run_s, fastest, start_s=start_s, deadline_s=deadline_s, reserve_s=reserve_s))


@dataclass(slots=True, init=False)
class LevelChoice:
    """Not frozen, so that its ``__init__`` can be written out: compiled by
    mypyc, the dataclass's runs as Python, about 5x slower, and a choice is
    made for every bid and award. Nothing assigns to it."""

    level: float
    run_s: float
    energy_j: float
    carbon_g: float

    def __init__(self, level: float, run_s: float, energy_j: float, carbon_g: float) -> None:
        self.level = level
        self.run_s = run_s
        self.energy_j = energy_j
        self.carbon_g = carbon_g


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
    rerun_reserve_s: float | None = None,
) -> LevelChoice:
    """Pick the level for a shard of ``work_s`` reference seconds (at f = 1).

    Args:
        start_s: seconds until the shard would start (queue wait).
        deadline_s: seconds from now by which it should finish, if any.
        lam: weight of joules against seconds.
        rerun_reserve_s: with a deadline, a level below the fastest must
            also leave room for a re-run at the fastest level after a crash
            noticed this many seconds later (``leaves_rerun_room``); None:
            no such check (the baselines' rule, and ``rerun_room = false``).
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
        ok = [x for x in levels if meets_deadline(work_s, work_s / x, x != fastest, fastest, start_s=start_s,
                                                  deadline_s=deadline_s, reserve_s=rerun_reserve_s)]
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
