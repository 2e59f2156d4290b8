"""The client library: submit jobs to a swarm and collect their results.

Trio code::

    async with open_swarm_client(["/ip4/127.0.0.1/tcp/4001/p2p/12D3Koo..."]) as client:
        job = await client.submit(JobRequest("tensor-map", shards=8, params={"seed": 1}))
        async for out in job.results():     # ShardOutput as each shard lands
            print(out.shard, out.peer, out.result)

Scripts and notebooks use the blocking facade::

    with BlockingClient(["/ip4/.../p2p/..."]) as client:
        outputs = client.run(JobRequest("tensor-map", shards=8), timeout=60)

A client is a tenant: its Ed25519 key signs its jobs, and only it can cancel
them. Errors: ``JobFailed`` (a shard failed too often), ``JobTimeout``,
``JobCancelled``, ``PeerUnreachable`` (no bootstrap peer answered).
"""

from __future__ import annotations

import math
import queue
import random
import threading
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Callable, Iterator, Sequence

import msgpack
import trio

from .core.client_core import ClientCore, JobRequest
from .core.config import ClientConfig
from .core.events import CancelJob, Effect, JobAccepted, JobFinished, ShardDelivered, Submit
from .core.identity import Identity
from .errors import JobCancelled, JobFailed, JobTimeout, PeerUnreachable
from .runtime.agent import Agent, WallClock
from .runtime.ports import Transport

__all__ = [
    "JobRequest",
    "ShardOutput",
    "JobHandle",
    "Client",
    "open_client",
    "open_swarm_client",
    "BlockingClient",
]


@dataclass(frozen=True, slots=True)
class ShardOutput:
    """One shard's result as delivered (exactly once) to the client."""

    job_id: str
    shard: int
    peer: str
    attempt: int
    result: Any
    energy_j: float
    gpu_s: float

    def as_json(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "shard": self.shard,
            "peer": self.peer,
            "attempt": self.attempt,
            "result": _jsonable(self.result),
            "energy_j": round(self.energy_j, 6),
            "gpu_s": round(self.gpu_s, 6),
        }


def _jsonable(v: Any) -> Any:
    if isinstance(v, bytes):
        return v.hex()
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return v


def _decode_result(raw: bytes) -> Any:
    if not raw:
        return None
    try:
        return msgpack.unpackb(raw, raw=False, strict_map_key=False, max_ext_len=0)
    except Exception:
        return raw


@dataclass
class JobHandle:
    """A submitted job: its progress, results as they land, and its end."""

    job_id: str
    shards: int
    _client: "Client"
    outputs: dict[int, ShardOutput] = field(default_factory=dict)
    error: str | None = None
    finished: bool = False
    _event: trio.Event = field(default_factory=trio.Event)

    @property
    def done(self) -> int:
        return len(self.outputs)

    def record(self, e: ShardDelivered | JobFinished) -> None:
        """Take a delivered shard (the first per shard counts) or the job's end."""
        if isinstance(e, ShardDelivered):
            if e.shard in self.outputs:
                return
            self.outputs[e.shard] = ShardOutput(
                e.job_id, e.shard, e.peer, e.attempt, _decode_result(e.result), e.energy_j, e.gpu_s
            )
        else:
            self.finished = True
            self.error = None if e.ok else (e.error or "failed")
        self._changed()

    def _changed(self) -> None:
        self._event.set()
        self._event = trio.Event()

    async def results(self) -> AsyncIterator[ShardOutput]:
        """Yield each shard's output once, in arrival order; raise on failure."""
        seen = 0
        order: list[int] = []
        while True:
            order.extend(s for s in self.outputs if s not in order)
            while seen < len(order):
                yield self.outputs[order[seen]]
                seen += 1
            if self.finished:
                self._raise()
                return
            await self._event.wait()

    async def wait(self, timeout: float = math.inf) -> list[ShardOutput]:
        """Wait for every shard; outputs sorted by shard index.

        Raises:
            JobTimeout: not finished within ``timeout`` seconds.
            JobFailed / JobCancelled: the job ended without all results.
        """
        with trio.move_on_after(timeout) as scope:
            while not self.finished:
                await self._event.wait()
        if scope.cancelled_caught:
            raise JobTimeout(f"job {self.job_id}: {self.done}/{self.shards} shards after {timeout}s")
        self._raise()
        return [self.outputs[i] for i in sorted(self.outputs)]

    def _raise(self) -> None:
        if self.error is None:
            return
        if self.error == "cancelled":
            raise JobCancelled(f"job {self.job_id} was cancelled")
        raise JobFailed(f"job {self.job_id}: {self.error}")

    async def cancel(self) -> None:
        self._client.agent.feed(CancelJob(self.job_id))


class Client:
    """A tenant connected to a swarm (create with ``open_client``)."""

    def __init__(self, core: ClientCore, agent: Agent) -> None:
        self.core = core
        self.agent = agent
        self.jobs: dict[str, JobHandle] = {}

    @property
    def tenant(self) -> str:
        return self.core.id

    def _on_effect(self, e: Effect) -> None:
        if isinstance(e, (ShardDelivered, JobFinished)):
            h = self.jobs.get(e.job_id)
            if h is not None:
                h.record(e)

    async def wait_for_peers(self, n: int = 1, timeout: float = 10.0) -> int:
        """Wait until the client's view holds ``n`` live peers."""
        with trio.move_on_after(timeout):
            while len(self.core.view.live(self.agent.now())) < n:
                await self.agent.wait_progress()
        have = len(self.core.view.live(self.agent.now()))
        if have < n:
            raise PeerUnreachable(f"only {have} of {n} peers known after {timeout}s")
        return have

    async def submit(self, req: JobRequest) -> JobHandle:
        effects = self.agent.feed(Submit(req))
        job_id = next(e.job_id for e in effects if isinstance(e, JobAccepted))
        handle = JobHandle(job_id, req.shards, self)
        self.jobs[job_id] = handle
        return handle

    async def run(self, req: JobRequest, timeout: float = math.inf) -> list[ShardOutput]:
        handle = await self.submit(req)
        return await handle.wait(timeout)


@asynccontextmanager
async def open_client(
    transport: Transport,
    identity: Identity,
    *,
    bootstrap: Sequence[str] = (),
    config: ClientConfig | None = None,
    clock: Any = None,
    seed: int | None = None,
) -> AsyncIterator[Client]:
    """Run a client over an open transport; ``bootstrap`` are peer ids."""
    cfg = config or ClientConfig()
    cfg = replace(cfg, bootstrap=tuple(bootstrap) or cfg.bootstrap)
    rng = random.Random(seed) if seed is not None else random.Random()
    core = ClientCore(identity, cfg, rng)
    client: Client
    agent = Agent(core, transport, clock=clock or WallClock(), on_effect=lambda e: client._on_effect(e))
    client = Client(core, agent)
    async with trio.open_nursery() as nursery:
        await nursery.start(agent.run)
        try:
            yield client
            await agent.drain(2.0)  # acknowledgements still on their way out
        finally:
            agent.stop()


@asynccontextmanager
async def open_swarm_client(
    bootstrap: Sequence[str],
    *,
    identity: Identity | None = None,
    listen: str = "/ip4/127.0.0.1/tcp/0",
    config: ClientConfig | None = None,
    min_peers: int = 1,
    connect_timeout: float = 10.0,
    transport_config: Any = None,
) -> AsyncIterator[Client]:
    """Connect to a real swarm over py-libp2p through bootstrap multiaddrs
    (``transport_config``: a ``Libp2pConfig``, default settings if None)."""
    from .net.libp2p import Libp2pConfig, open_libp2p_transport

    identity = identity or Identity.generate()
    tconfig = transport_config if transport_config is not None else Libp2pConfig()
    async with open_libp2p_transport(identity, listen, bootstrap=tuple(bootstrap), config=tconfig) as transport:
        ids: list[str] = []
        for addr in bootstrap:
            try:
                with trio.fail_after(connect_timeout):
                    ids.append(await transport.connect(addr))
            except Exception:  # one bad bootstrap address is not fatal
                continue
        if not ids:
            raise PeerUnreachable(f"no bootstrap peer reachable: {list(bootstrap)}")
        async with open_client(transport, identity, bootstrap=ids, config=config) as client:
            await client.wait_for_peers(min(min_peers, 1), timeout=connect_timeout)
            if min_peers > 1:
                await client.wait_for_peers(min_peers, timeout=connect_timeout)
            yield client


class BlockingClient:
    """A blocking facade over ``open_swarm_client`` (a trio loop in a thread)."""

    def __init__(self, bootstrap: Sequence[str], **kwargs: Any) -> None:
        self._bootstrap = list(bootstrap)
        self._kwargs = kwargs
        self._thread: threading.Thread | None = None
        self._token: Any = None
        self._client: Client | None = None
        self._ready: "queue.Queue[BaseException | None]" = queue.Queue()
        self._stop: trio.Event | None = None

    def __enter__(self) -> "BlockingClient":
        self._thread = threading.Thread(target=lambda: trio.run(self._main), daemon=True)
        self._thread.start()
        err = self._ready.get()
        if err is not None:
            raise err
        return self

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        try:
            async with open_swarm_client(self._bootstrap, **self._kwargs) as client:
                self._client = client
                self._ready.put(None)
                await self._stop.wait()
        except BaseException as exc:  # surfaced to the caller's thread
            if self._client is None:
                self._ready.put(exc)
            else:
                raise

    def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return trio.from_thread.run(fn, *args, trio_token=self._token)

    def run(self, req: JobRequest, timeout: float = math.inf) -> list[ShardOutput]:
        assert self._client is not None
        return self._run(self._client.run, req, timeout)

    def iter_results(self, req: JobRequest) -> Iterator[ShardOutput]:
        assert self._client is not None
        handle = self._run(self._client.submit, req)
        seen: set[int] = set()
        while True:
            # wait (in the trio thread) until the handle changes, then read it
            snap = self._run(_next_change, handle, seen)
            yield from snap
            if handle.finished:
                handle._raise()
                return

    def __exit__(self, *exc: Any) -> None:
        if self._stop is not None:
            trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        if self._thread is not None:
            self._thread.join(timeout=30)


async def _next_change(handle: JobHandle, seen: set[int]) -> list[ShardOutput]:
    while not handle.finished and all(s in seen for s in handle.outputs):
        await handle._event.wait()
    new = [handle.outputs[s] for s in sorted(handle.outputs) if s not in seen]
    seen.update(o.shard for o in new)
    return new
