"""The trio shell around the sans-IO cores.

``serve_core`` is the only event loop of a peer or client: it feeds what the
transport delivers and what the executor finishes into the core, performs
the effects the core returns, and sleeps until the core's next deadline.
The same loop drives any ``core.contract.Core``: ``PeerCore`` (daemon,
tests) and ``ClientCore`` (``fedswarm.client``).

Concurrency: one nursery per agent. Sends run as short tasks bounded by a
``trio.CapacityLimiter`` so a slow or dead peer never stalls the loop; each
running shard runs in its own task under its own cancel scope, its torch
work in a worker thread (``ShardRunner``).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import trio

from ..core.contract import Core
from ..core.events import (
    CancelShard,
    Effect,
    HandBackRunning,
    Input,
    Leave,
    MessageReceived,
    Publish,
    RunShard,
    Send,
    SetLevel,
    ShardFinished,
)
from ..core.runs import RunKey, run_key
from ..errors import TransportError
from .ports import Transport

__all__ = ["Agent", "ShardRunner", "WallClock", "TrioClock", "AgentStats"]

log = logging.getLogger("fedswarm.agent")


class ShardRunner(Protocol):
    """Runs one shard; returns the ``ShardFinished`` to feed back.

    A runner whose task saves progress hands each checkpoint to the core as
    a ``ShardProgress`` through the agent's ``feed``, on the loop (never
    from the task's thread), and none after ``run_shard`` returned or was
    cancelled (``daemon.runner.ExecutorRunner`` does so)."""

    async def run_shard(self, eff: RunShard) -> ShardFinished: ...


class WallClock:
    """Unix time: what peers on different hosts can compare."""

    def now(self) -> float:
        return time.time()


class TrioClock:
    """trio's clock plus an offset (virtual time under ``MockClock``)."""

    def __init__(self, offset: float = 1_700_000_000.0) -> None:
        self.offset = offset

    def now(self) -> float:
        return trio.current_time() + self.offset


@dataclass
class AgentStats:
    msgs_in: int = 0
    msgs_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    send_failures: int = 0
    by_kind_out: dict[str, int] = field(default_factory=dict)


class Agent:
    """Drives one core over one transport.

    Args:
        core: any ``Core`` (a ``PeerCore`` or ``ClientCore``).
        transport: any ``runtime.ports.Transport``.
        runner: executes ``RunShard`` effects (peers only).
        clock: object with ``now()``; ``WallClock`` by default.
        on_effect: called for client-side effects (``ShardDelivered``,
            ``JobFinished``) and anything the agent does not perform itself.
    """

    def __init__(
        self,
        core: Core,
        transport: Transport,
        *,
        runner: ShardRunner | None = None,
        clock: Any = None,
        on_effect: Callable[[Effect], None] | None = None,
        max_concurrent_sends: int = 64,
    ) -> None:
        self.core = core
        self.transport = transport
        self.runner = runner
        self.clock = clock or WallClock()
        self.on_effect = on_effect
        self.stats = AgentStats()
        self._wake = trio.Event()
        self._progress = trio.Event()
        self._send_limiter = trio.CapacityLimiter(max_concurrent_sends)
        #: the cancel scope of each shard running here (by ``core.runs.run_key``)
        self._running: dict[RunKey, trio.CancelScope] = {}
        self._addrs: dict[str, tuple[str, ...]] = {}  # what the transport was told per peer
        self._sends_in_flight = 0
        self._nursery: trio.Nursery | None = None
        self._stopped = trio.Event()
        self.started = trio.Event()
        #: observers of what the loop does, for metrics: each is called as
        #: ``fn(name, fields)`` with name ``"bid"`` (``latency_s``: a call
        #: for bids in, its bid out) or ``"shard"`` (``tenant``, ``run_s``,
        #: ``energy_j``, ``ok``: a shard finished here). Must not raise.
        self.observers: list[Callable[[str, dict[str, Any]], None]] = []

    # ------------------------------------------------------------------

    def now(self) -> float:
        return float(self.clock.now())

    def feed(self, inp: Input) -> list[Effect]:
        """Hand an input to the core and perform its effects (sync, no await).
        Returns the effects (e.g. the ``JobAccepted`` of a ``Submit``)."""
        effects = self.core.handle(self.now(), inp)
        self._perform(effects)
        return effects

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Run until cancelled (or ``stop()``)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for topic in self.core.topics:
                await self.transport.subscribe(topic)
            self._perform(self.core.start(self.now()))
            nursery.start_soon(self._receive_loop)
            nursery.start_soon(self._timer_loop)
            self.started.set()
            task_status.started()
            await self._stopped.wait()
            nursery.cancel_scope.cancel()

    def stop(self) -> None:
        self._stopped.set()

    async def leave(self, grace_s: float = 10.0) -> None:
        """A peer's graceful leave: stop bidding, hand back queued shards, let
        running ones finish for up to ``grace_s``, hand back the rest, then
        wait (bounded) for results to be acknowledged."""
        core = self.core
        self.feed(Leave())
        with trio.move_on_after(grace_s):
            while not core.idle:
                await self.wait_progress()
        if not core.idle:
            self.feed(HandBackRunning())
        await self.drain(1.0)

    async def drain(self, timeout: float) -> None:
        """Wait (at most ``timeout``) until every queued send has been tried."""
        with trio.move_on_after(timeout):
            while self._sends_in_flight:
                await self.wait_progress()

    async def wait_progress(self) -> None:
        """Wait until the core next produces effects, or 0.5 s (for callers
        that poll the core's state: re-check it after each return)."""
        ev = self._progress
        with trio.move_on_after(0.5):
            await ev.wait()

    # ------------------------------------------------------------------

    async def _receive_loop(self) -> None:
        while True:
            inc = await self.transport.receive()
            self.stats.msgs_in += 1
            self.stats.bytes_in += len(inc.data)
            t0 = time.perf_counter()
            effects = self.core.handle(self.now(), MessageReceived(inc.sender, inc.data, inc.topic))
            if self.observers and any(isinstance(e, Send) and e.kind == "Bid" for e in effects):
                self._observe("bid", {"latency_s": time.perf_counter() - t0})
            self._perform(effects)

    def _observe(self, name: str, fields: dict[str, Any]) -> None:
        for fn in self.observers:
            try:
                fn(name, fields)
            except Exception:  # an observer's bug must not stop the loop
                log.exception("observer failed")

    async def _timer_loop(self) -> None:
        while True:
            deadline = self.core.next_deadline()
            delay = deadline - self.now()
            if delay > 0:
                self._wake = trio.Event()
                with trio.move_on_after(min(delay, 3600.0)):
                    await self._wake.wait()
                continue
            self._perform(self.core.poll(self.now()))
            await trio.lowlevel.checkpoint()

    def _perform(self, effects: list[Effect]) -> None:
        nursery = self._nursery
        assert nursery is not None, "agent not running"
        for e in effects:
            if isinstance(e, Send):
                self.stats.msgs_out += 1
                self.stats.bytes_out += len(e.data)
                self.stats.by_kind_out[e.kind] = self.stats.by_kind_out.get(e.kind, 0) + 1
                self._sends_in_flight += 1
                self._learn_addrs(e)
                nursery.start_soon(self._send, e.to, e.data)
            elif isinstance(e, Publish):
                nursery.start_soon(self._publish, e.topic, e.data)
            elif isinstance(e, RunShard):
                nursery.start_soon(self._run_shard, e)
            elif isinstance(e, CancelShard):
                scope = self._running.pop(run_key(e), None)
                if scope is not None:
                    scope.cancel()
            elif isinstance(e, SetLevel):
                set_level = getattr(self.runner, "set_level", None)
                if set_level is not None:
                    set_level(e)
            elif self.on_effect is not None:
                self.on_effect(e)
        self._wake.set()
        self._progress.set()
        self._progress = trio.Event()

    def _learn_addrs(self, e: Send) -> None:
        """Tell the transport how to dial a peer (the addresses the core sent with)."""
        if not e.addrs or self._addrs.get(e.to) == e.addrs:
            return
        self._addrs[e.to] = e.addrs
        self.transport.add_peer_addrs(e.to, list(e.addrs))

    async def _send(self, to: str, data: bytes) -> None:
        try:
            async with self._send_limiter:
                await self.transport.send(to, data)
        except TransportError as exc:
            self.stats.send_failures += 1
            log.debug("send to %s failed: %s", to[:16], exc)
        finally:
            self._sends_in_flight -= 1
            if not self._sends_in_flight:
                self._progress.set()
                self._progress = trio.Event()

    async def _publish(self, topic: str, data: bytes) -> None:
        try:
            await self.transport.publish(topic, data)
        except TransportError as exc:
            log.debug("publish failed: %s", exc)

    async def _run_shard(self, eff: RunShard) -> None:
        key = run_key(eff)
        with trio.CancelScope() as scope:
            self._running[key] = scope
            try:
                if self.runner is None:
                    fin = ShardFinished(eff.tenant, eff.job_id, eff.shard, eff.attempt, False, error="no executor")
                else:
                    fin = await self.runner.run_shard(eff)
            except Exception as exc:  # a task's failure is the shard's, never the agent's
                log.warning("shard %s/%d failed: %r", eff.job_id, eff.shard, exc)
                fin = ShardFinished(eff.tenant, eff.job_id, eff.shard, eff.attempt, False, error=repr(exc)[:500])
            if self._running.pop(key, None) is not None:
                if self.observers:
                    self._observe("shard", {"tenant": eff.tenant, "run_s": fin.run_s, "energy_j": fin.energy_j,
                                            "ok": fin.ok})
                self._perform(self.core.handle(self.now(), fin))


async def wait_for(predicate: Callable[[], bool], *, poll_s: float = 0.01, timeout: float = math.inf) -> None:
    """Wait (bounded) until ``predicate()`` holds, checking every ``poll_s``."""
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(poll_s)

