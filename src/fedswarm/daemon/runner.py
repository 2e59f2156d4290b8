"""Performs a peer core's shard effects on an executor: ``RunShard`` runs
off the event loop, ``SetLevel`` sets the device's clock level, and the
run-time bookkeeping (levels, joules at each level) is ``core.runs.Runs``,
the one helper every world uses. A resumable task's checkpoints, saved on
the executor's worker thread, reach the core as ``ShardProgress`` on the
event loop (``_ProgressRelay``)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import msgpack
import trio

from ..core.events import Input, RunShard, SetLevel, SetPower, SetThroughput, ShardFinished, ShardProgress
from ..core.peer import PeerCore
from ..core.runs import Runs, run_key
from ..core.wire import unpack_params

__all__ = ["ExecutorRunner"]

log = logging.getLogger("fedswarm.runner")


class _ProgressRelay:
    """Carries one run's checkpoints from its worker thread to the core.

    The worker thread (``offer``) only keeps the latest ``(done, state)``
    and, when no hand-over is already pending, asks the trio loop to make
    one (``TrioToken.run_sync_soon``: it does not wait for the loop). A task
    that checkpoints at every small step therefore costs the loop one
    ``ShardProgress`` per loop turn at most, each superseding the ones the
    loop had no time for: the core forwards one per ``checkpoint_min_s``
    anyway, and a later checkpoint carries more progress. ``close`` (on the
    loop, when the run ends, finished or cancelled) drops whatever is still
    pending, so no progress of a run reaches the core after its end.
    """

    def __init__(self, eff: RunShard, deliver: Callable[[Input], object], token: trio.lowlevel.TrioToken) -> None:
        self._eff = eff
        self._deliver = deliver
        self._token = token
        self._lock = threading.Lock()
        self._latest: tuple[float, bytes] | None = None
        self._open = True

    def offer(self, done: float, state: bytes) -> None:
        """The task saved progress (called on the worker thread)."""
        with self._lock:
            if not self._open:
                return
            pending = self._latest is not None
            self._latest = (done, state)
        if not pending:
            try:
                self._token.run_sync_soon(self._hand_over)
            except trio.RunFinishedError:  # the loop is gone: nobody to tell
                pass

    def _hand_over(self) -> None:
        # on the loop; an exception here would end trio.run, so none leaves
        with self._lock:
            latest, self._latest = self._latest, None
            if not self._open or latest is None:
                return
        e = self._eff
        try:
            self._deliver(ShardProgress(e.tenant, e.job_id, e.shard, e.attempt, latest[0], latest[1]))
        except Exception:
            log.exception("handing shard %s/%d's checkpoint to the core failed", e.job_id, e.shard)

    def close(self) -> None:
        with self._lock:
            self._open = False
            self._latest = None


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
        #: hands the core an input and performs its effects: the agent's
        #: ``feed`` once there is one. Measurements (``SetPower``,
        #: ``SetThroughput``) yield no effects; ``ShardProgress`` yields the
        #: ``ShardCheckpoint`` to send, which this default (no agent) drops
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
        """Run one shard: from ``eff.resume`` when it carries a checkpoint
        (for a resumable task), reporting its checkpoints as ``ShardProgress``
        through ``feed`` while it runs."""
        params = unpack_params(eff.params)  # strict limits; never pickle
        relay = _ProgressRelay(eff, lambda inp: self.feed(inp), trio.lowlevel.current_trio_token())
        self.runs.start(self.clock(), eff)
        self._apply()
        try:
            res = await self.executor.run(eff.task, params, eff.shard, resume=eff.resume, left=eff.left,
                                          on_checkpoint=relay.offer)
        finally:
            relay.close()
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
