"""``peer start``: one peer of a real swarm, on py-libp2p, executing on torch.

``serve_peer(options)`` wires the concrete parts around the core: the key
file, the profile, a ``Libp2pTransport``, a ``ShardExecutor``, the trio
``Agent``, and the metrics/status HTTP server. It prints one line with its
full multiaddr once it accepts connections, and on SIGINT/SIGTERM leaves
gracefully (stop bidding, hand back queued shards, let running ones finish
within ``grace_s``, hand back the rest, tell the swarm) and returns.
"""

from __future__ import annotations

import json
import logging
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import msgpack
import trio

from .core.events import RunShard, SetLevel, ShardFinished
from .core.identity import Identity, load_or_create_key
from .core.peer import PeerCore
from .core.wire import unpack_params
from .profiles import load_profile
from .runtime.agent import Agent

__all__ = ["PeerOptions", "serve_peer", "ExecutorRunner", "JsonLogFormatter"]

log = logging.getLogger("fedswarm.daemon")


@dataclass
class PeerOptions:
    profile: str
    listen: str = "/ip4/127.0.0.1/tcp/0"
    bootstrap: list[str] = field(default_factory=list)
    key: str | None = None
    data_dir: str = ".fedswarm"
    metrics_port: int | None = None
    grace_s: float = 10.0
    serve_model: str | None = None
    blocks: str | None = None
    torch_threads: int | None = None
    membership: str | None = None
    federations: list[str] = field(default_factory=list)


class ExecutorRunner:
    """Runs ``RunShard`` effects on a ``ShardExecutor`` (torch, off the loop).

    Clock levels: the device runs at the highest level any running shard
    asks for (``SetLevel`` raises one mid-run); the executor applies it
    through NVML where it may. Energy is the executor's measurement if it
    has one (NVML), else the power model at each level for the time spent
    at it.
    """

    def __init__(self, executor: Any, core: PeerCore, clock: Callable[[], float] = time.monotonic) -> None:
        self.executor = executor
        self.core = core
        self.clock = clock
        #: running shard -> [level, since, joules so far at earlier levels]
        self._levels: dict[tuple[str, str, int, int], list[float]] = {}

    def _apply(self) -> None:
        want = max((v[0] for v in self._levels.values()), default=1.0)
        if want != getattr(self.executor, "level", 1.0):
            self.executor.set_level(want)

    def set_level(self, eff: SetLevel) -> None:
        cur = self._levels.get((eff.tenant, eff.job_id, eff.shard, eff.attempt))
        if cur is None:
            return
        now = self.clock()
        cur[2] += self.core.config.power.power(cur[0]) * (now - cur[1])
        cur[0], cur[1] = eff.level, now
        self._apply()

    async def run_shard(self, eff: RunShard) -> ShardFinished:
        params = unpack_params(eff.params)  # strict limits; never pickle
        key = (eff.tenant, eff.job_id, eff.shard, eff.attempt)
        self._levels[key] = [eff.level, self.clock(), 0.0]
        self._apply()
        try:
            res = await self.executor.run(eff.task, params, eff.shard)
        finally:
            level, since, earlier = self._levels.pop(key)
            self._apply()
        energy = res.energy_joules
        if energy is None:
            energy = earlier + self.core.config.power.power(level) * max(self.clock() - since, 0.0)
        thr = self.executor.throughput().get(eff.task)
        if thr:
            self.core.set_throughput(eff.task, thr)
        result = msgpack.packb(res.result, use_bin_type=True)
        return ShardFinished(eff.tenant, eff.job_id, eff.shard, eff.attempt, True, result, run_s=res.wall_seconds, energy_j=energy)


class JsonLogFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        extra = getattr(record, "fields", None)
        if isinstance(extra, dict):
            out.update(extra)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def _event(msg: str, **fields: Any) -> None:
    log.info(msg, extra={"fields": fields})


async def serve_peer(opts: PeerOptions, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> int:
    from .net.libp2p import open_libp2p_transport
    from .runtime.executor import ShardExecutor

    if opts.torch_threads:
        import torch

        torch.set_num_threads(opts.torch_threads)
    data_dir = Path(opts.data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    identity: Identity = load_or_create_key(opts.key or data_dir / "peer.key")
    profile = load_profile(opts.profile)
    t0 = time.monotonic()
    async with open_libp2p_transport(identity, opts.listen, bootstrap=tuple(opts.bootstrap)) as transport:
        boot_ids = []
        for addr in opts.bootstrap:
            try:
                with trio.fail_after(10):
                    boot_ids.append(await transport.connect(addr))
            except Exception as exc:  # an unreachable bootstrap is logged, not fatal
                _event("bootstrap unreachable", addr=addr, error=repr(exc))
        config = profile.peer_config(
            addrs=tuple(transport.listen_addrs()),
            bootstrap=tuple(boot_ids),
            membership=Path(opts.membership).read_bytes() if opts.membership else b"",
            federations=frozenset(opts.federations),
        )
        core = PeerCore(identity, config, random.Random())
        # no constant power model: without NVML the runner charges the
        # profile's power curve at each shard's clock level
        executor = ShardExecutor(slots=config.slots)
        agent = Agent(core, transport, runner=ExecutorRunner(executor, core))
        serving = None
        # signals are caught before readiness is announced: a SIGTERM right
        # after the "listening" line must still mean a graceful leave
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:
                await nursery.start(agent.run)
                if opts.serve_model:
                    from .llm_serving import start_block_server

                    if (opts.blocks or "").startswith("auto") and boot_ids:
                        # let gossip show which blocks the swarm already serves (bounded)
                        with trio.move_on_after(3 * config.gossip_interval_s):
                            while len(core.view) < 2:
                                await agent._changed()
                            await trio.sleep(config.gossip_interval_s)
                    serving = await start_block_server(transport, core, opts.serve_model, opts.blocks)
                if opts.metrics_port is not None:
                    port = await nursery.start(_serve_metrics, opts.metrics_port, agent)
                    print(f"fedswarm metrics on http://127.0.0.1:{port}/metrics", flush=True)
                    _event("metrics listening", url=f"http://127.0.0.1:{port}/metrics")
                for addr in transport.listen_addrs():
                    print(f"fedswarm peer listening on {addr}", flush=True)
                _event(
                    "peer started",
                    peer=identity.peer_id,
                    profile=profile.name,
                    addrs=transport.listen_addrs(),
                    bootstrap=len(boot_ids),
                    startup_s=round(time.monotonic() - t0, 3),
                    serving=serving,
                )
                task_status.started(transport.listen_addrs())
                async for signum in signals:
                    _event("leaving", signal=signal.Signals(signum).name, leases=len(core.leases))
                    break
                await agent.leave(grace_s=opts.grace_s)
                _event(
                    "left",
                    shards_run=core.stats["shards_run"],
                    handed_back=core.stats["shards_handed_back"],
                    results_pending=len(core.outbox),
                )
                nursery.cancel_scope.cancel()
    return 0


async def _serve_metrics(port: int, agent: Agent, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    from .metrics import serve_http

    await serve_http(port, agent, task_status=task_status)


def setup_logging(fmt: str = "json", level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLogFormatter() if fmt == "json" else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    quiet_libraries()


def quiet_libraries() -> None:
    """py-libp2p logs every failed dial as an error; fedswarm maps those to
    ``PeerUnreachable`` and counts them, so the library's own log is muted.

    py-libp2p resets its logger when first imported, so import it first.
    """
    import libp2p  # noqa: F401

    for noisy in ("libp2p", "multiaddr", "async_service"):
        logging.getLogger(noisy).setLevel(logging.CRITICAL)
