"""The run-time bookkeeping of the shards a peer runs: one helper for every driver.

A core tells its driver to run a shard (``RunShard``), to change the clock
level of a running one (``SetLevel``) and to stop one (``CancelShard``). What
a driver must remember between those effects is the same everywhere (the
trio agent's executor runners, netsim, ``testing.MiniSwarm``): when the run
began, the run as last set (its level and expected run time), the segment at
the current level and the joules of the earlier segments. ``Runs`` keeps
that, sans IO, and does the arithmetic once:

* ``start(now, RunShard)``: a run begins (one already running under the same
  key ends first, unfinished, and is returned);
* ``set_level(now, SetLevel)``: the current segment is charged at its level
  and a new one begins; returns the run, whose ``left(now)`` is the run time
  still to go (the core's new ``run_s`` counts from the run's start);
* ``end(now, key)``: the run ends (finished, cancelled, lost); returns an
  ``Ended`` with the run's first start and total joules.

Energy of a segment: ``power(level) * seconds * gpus`` (``gpus``: the run's
devices, at least 1, or 1 when ``per_gpu`` is False: an executor that
measures the whole device). ``busy_s`` and ``busy_j`` sum the closed segments
(device-seconds and joules). Each ``start`` and ``set_level`` gives the run a
new ``gen``: a driver that schedules a finish event for a run checks with
``is_current(key, gen)`` that the run was not ended or re-timed since.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Iterator

from .events import CancelShard, RunShard, SetLevel, ShardFinished

__all__ = ["RunKey", "run_key", "Run", "Ended", "Runs"]

#: (tenant, job id, shard, attempt): what names one run of a shard
RunKey = tuple[str, str, int, int]


def run_key(e: RunShard | SetLevel | CancelShard | ShardFinished) -> RunKey:
    """The key of the run an effect (or its ``ShardFinished``) is about."""
    return (e.tenant, e.job_id, e.shard, e.attempt)


def _no_power(level: float) -> float:
    return 0.0


@dataclass(slots=True)
class Run:
    """A shard running here."""

    #: the run as last set: ``level`` and ``run_s`` follow ``SetLevel``
    effect: RunShard
    #: when the run began
    began: float
    #: when the current segment (at ``effect.level``) began
    since: float
    #: joules of the earlier segments
    earlier_j: float
    #: changes on each ``start`` / ``set_level``
    gen: int
    #: the devices a segment's energy is multiplied by
    gpus: int

    @property
    def key(self) -> RunKey:
        return run_key(self.effect)

    def left(self, now: float) -> float:
        """Run time still to go at ``now`` (``effect.run_s`` counts from ``began``)."""
        return max(self.effect.run_s - (now - self.began), 0.0)


@dataclass(frozen=True, slots=True)
class Ended:
    """A run that ended: its last setting, first start and total joules."""

    effect: RunShard
    began: float
    ended: float
    energy_j: float
    gpus: int

    @property
    def key(self) -> RunKey:
        return run_key(self.effect)

    @property
    def seconds(self) -> float:
        """Wall time from the run's start to its end (0 if the clock went back)."""
        return max(self.ended - self.began, 0.0)


class Runs:
    """The runs of one peer (or one executor) by key. See the module docstring.

    Args:
        power: watts per device at a clock level, read when a segment closes
            (e.g. ``lambda lv: core.config.power.power(lv)``); 0 W by default.
        per_gpu: multiply a segment's energy and busy time by the run's
            devices (``max(gpus, 1)``); False counts each run once.
    """

    def __init__(self, power: Callable[[float], float] = _no_power, *, per_gpu: bool = True) -> None:
        self.power = power
        self.per_gpu = per_gpu
        self._runs: dict[RunKey, Run] = {}
        self._gen = 0
        #: device-seconds and joules of closed segments (ended runs and
        #: segments closed by ``set_level``)
        self.busy_s = 0.0
        self.busy_j = 0.0

    # -- reads ---------------------------------------------------------

    def __len__(self) -> int:
        return len(self._runs)

    def __contains__(self, key: object) -> bool:
        return key in self._runs

    def __iter__(self) -> Iterator[RunKey]:
        """The keys of the running shards, sorted (a deterministic order)."""
        return iter(sorted(self._runs))

    def get(self, key: RunKey) -> Run | None:
        return self._runs.get(key)

    def is_current(self, key: RunKey, gen: int) -> bool:
        """Whether ``key`` still runs as set when it was given ``gen``."""
        run = self._runs.get(key)
        return run is not None and run.gen == gen

    def max_level(self, default: float = 1.0) -> float:
        """The highest level any running shard asks for (``default`` if none)."""
        return max((r.effect.level for r in self._runs.values()), default=default)

    # -- transitions ---------------------------------------------------

    def _charge(self, run: Run, now: float) -> float:
        """Close ``run``'s current segment at ``now``; its joules."""
        elapsed = max(now - run.since, 0.0)
        energy = self.power(run.effect.level) * elapsed * run.gpus
        self.busy_s += elapsed * run.gpus
        self.busy_j += energy
        return energy

    def start(self, now: float, e: RunShard) -> Ended | None:
        """A run of ``e`` begins at ``now``. A run under the same key ends
        first (unfinished) and is returned; None otherwise."""
        key = run_key(e)
        old = self.end(now, key) if key in self._runs else None
        self._gen += 1
        gpus = max(e.gpus, 1) if self.per_gpu else 1
        self._runs[key] = Run(e, now, now, 0.0, self._gen, gpus)
        return old

    def set_level(self, now: float, e: SetLevel) -> Run | None:
        """The run changes level at ``now``: the segment so far is charged at
        the old level. Returns the re-timed run (``left(now)``: the run time
        still to go), or None if no such run is here (ignore the effect)."""
        run = self._runs.get(run_key(e))
        if run is None:
            return None
        run.earlier_j = run.earlier_j + self._charge(run, now)
        run.since = now
        run.effect = replace(run.effect, level=e.level, run_s=e.run_s)
        self._gen += 1
        run.gen = self._gen
        return run

    def end(self, now: float, key: RunKey) -> Ended | None:
        """The run ends at ``now`` (finished, cancelled or lost); None if it
        is not here."""
        run = self._runs.pop(key, None)
        if run is None:
            return None
        energy = run.earlier_j + self._charge(run, now)
        return Ended(run.effect, run.began, now, energy, run.gpus)

    def end_all(self, now: float) -> list[Ended]:
        """Every run ends at ``now`` (the peer crashed or left), in key order."""
        return [e for k in sorted(self._runs) if (e := self.end(now, k)) is not None]
