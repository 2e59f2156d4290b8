"""Performs a peer core's shard effects on an executor: ``RunShard`` runs
off the event loop, ``SetLevel`` sets the device's clock level, and the
run-time bookkeeping (levels, joules at each level) is ``core.runs.Runs``,
the one helper every world uses."""

from __future__ import annotations

import time
from typing import Any, Callable

import msgpack

from ..core.events import Input, RunShard, SetLevel, SetPower, SetThroughput, ShardFinished
from ..core.peer import PeerCore
from ..core.runs import Runs, run_key
from ..core.wire import unpack_params

__all__ = ["ExecutorRunner"]


class ExecutorRunner:
    """Runs ``RunShard`` effects on a ``ShardExecutor`` (torch, off the loop).

    Clock levels: the device runs at the highest level any running shard
    asks for (``SetLevel`` raises one mid-run) or the served LLM span asks
    for (``set_span_level``, the block server's ``on_level``); the executor
    applies it through NVML where it may. Energy is the executor's measurement if it
    has one (NVML), else the power model at each level for the time spent
    at it.
    """

    def __init__(self, executor: Any, core: PeerCore, clock: Callable[[], float] = time.monotonic) -> None:
        self.executor = executor
        self.core = core
        self.clock = clock
        #: hands the core its measurements (``SetPower``, ``SetThroughput``;
        #: they yield no effects): the agent's ``feed`` once there is one
        self.feed: Callable[[Input], object] = lambda inp: core.handle(time.time(), inp)
        #: the running shards' levels and joules at earlier levels
        self.runs = Runs(lambda level: self.core.config.power.power(level), per_gpu=False)
        #: the clock level the block server's span core chose (``SetSpanLevel``); None: no span
        self.span_level: float | None = None

    @property
    def device_level(self) -> float:
        """The level the device is asked for: the highest of the running
        shards' and the served span's (full clock when neither asks)."""
        if self.span_level is None:
            return self.runs.max_level()
        return max(self.runs.max_level(default=0.0), self.span_level)

    def set_span_level(self, level: float) -> None:
        """The served span's clock level (``start_block_server(on_level=...)``)."""
        if not 0 < level <= 1:
            raise ValueError("level must be in (0, 1]")
        self.span_level = level
        self._apply()

    def _apply(self) -> None:
        want = self.device_level
        if want != getattr(self.executor, "level", 1.0):
            self.executor.set_level(want)
        # the draw the peer gossips: the power model at the running level, idle when nothing runs
        pm = self.core.config.power
        self.feed(SetPower(pm.power(want) if self.runs else pm.idle_w))

    def set_level(self, eff: SetLevel) -> None:
        if self.runs.set_level(self.clock(), eff) is not None:
            self._apply()

    async def run_shard(self, eff: RunShard) -> ShardFinished:
        params = unpack_params(eff.params)  # strict limits; never pickle
        self.runs.start(self.clock(), eff)
        self._apply()
        try:
            res = await self.executor.run(eff.task, params, eff.shard)
        finally:
            ended = self.runs.end(self.clock(), run_key(eff))
            self._apply()
        energy = res.energy_joules
        if energy is None:
            energy = ended.energy_j if ended is not None else 0.0
        thr = self.executor.throughput().get(eff.task)
        if thr:
            self.feed(SetThroughput(eff.task, thr))
        result = msgpack.packb(res.result, use_bin_type=True)
        return ShardFinished(eff.tenant, eff.job_id, eff.shard, eff.attempt, True, result, run_s=res.wall_seconds, energy_j=energy)
