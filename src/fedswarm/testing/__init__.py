"""Testing helpers: a small deterministic swarm of cores (like trio.testing).

``MiniSwarm`` connects ``PeerCore``s and ``ClientCore``s with a fixed-latency,
optionally lossy/duplicating network and "runs" shards for their ``run_s``
in virtual time, with optional lying peers. It is the quick way to test a
policy or a protocol property in a few lines; netsim does the same at scale
with a network model, churn and workloads::

    s = MiniSwarm(8, seed=1)
    c = s.add_client()
    s.step_until(s.now + 10)                     # the view converges
    jid = s.submit(c, JobRequest("sim", shards=4, work_s=2.0))
    s.step_until(s.now + 600, stop=lambda: jid in s.finished)
    assert s.finished[jid].ok
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from fedswarm.core.client_core import ClientCore, JobRequest
from fedswarm.core.config import ClientConfig, PeerConfig
from fedswarm.core.contract import Core
from fedswarm.core.events import (
    CancelJob,
    CancelShard,
    JobAccepted,
    JobFinished,
    MessageReceived,
    Publish,
    RunShard,
    Send,
    SetLevel,
    ShardDelivered,
    ShardFinished,
    Submit,
)
from fedswarm.core.identity import Identity
from fedswarm.core.membership import issue_membership
from fedswarm.core.peer import PeerCore
from fedswarm.core.runs import Ended, Runs, run_key
from fedswarm.core.wire import VerifyCache


def ident(i: int, salt: int = 0) -> Identity:
    return Identity.from_seed(random.Random(i * 7919 + salt).randbytes(32))


@dataclass
class MiniSwarm:
    n: int
    seed: int = 0
    latency: float = 0.01
    loss: float = 0.0
    dup: float = 0.0
    peer_config: Callable[[int], PeerConfig] | None = None
    client_config: ClientConfig = field(default_factory=ClientConfig)
    now: float = 1000.0
    #: peer index -> probability that it returns a wrong result
    liars: dict[int, float] = field(default_factory=dict)
    #: peer indices admitted by the test federation (trusted)
    trusted: tuple[int, ...] = ()
    #: peer index -> factor by which its shards run slower than it bids
    slow: dict[int, float] = field(default_factory=dict)
    #: (sender, Send) -> True to drop that message (targeted loss)
    drop: Callable[[str, Send], bool] | None = None
    #: (sender, Send) -> extra seconds that message takes (targeted delay)
    delay: Callable[[str, Send], float] | None = None

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.q: list[tuple[float, int, Any]] = []
        self.seq = 0
        self.cache = VerifyCache()
        ids = [ident(i, self.seed) for i in range(self.n)]
        boot = (ids[0].peer_id,)
        self.federation = ident(424242)
        feds = frozenset({self.federation.peer_id})
        self.liar_ids = {ids[i].peer_id: p for i, p in self.liars.items()}
        self.slow_ids = {ids[i].peer_id: f for i, f in self.slow.items()}
        self.peers: dict[str, PeerCore] = {}
        for i, idn in enumerate(ids):
            cfg = self.peer_config(i) if self.peer_config else PeerConfig()
            member = issue_membership(self.federation, idn.peer_id, 1e12) if i in self.trusted else b""
            cfg = replace(cfg, bootstrap=boot, federations=feds, membership=member)
            self.peers[idn.peer_id] = PeerCore(idn, cfg, random.Random(self.seed * 1000 + i), verify_cache=self.cache)
        self.clients: dict[str, ClientCore] = {}
        self.dead: set[str] = set()
        self.delivered: list[ShardDelivered] = []
        self.finished: dict[str, JobFinished] = {}
        #: peer id -> the shards running there (``core.runs``)
        self.runs: dict[str, Runs] = {pid: Runs() for pid in self.peers}
        #: every run that ended (finished, cancelled, replaced), by peer, in order
        self.ended: list[tuple[str, Ended]] = []
        self.bytes_sent = 0
        self.msgs_sent = 0
        self.executions = 0  # shard runs that finished
        self.lies = 0  # of which returned a wrong result
        for pid, p in sorted(self.peers.items()):
            self._perform(pid, p.start(self.now))

    def add_client(self, i: int = 0, **kw: Any) -> ClientCore:
        idn = ident(10_000 + i, self.seed)
        cfg = replace(self.client_config, bootstrap=(next(iter(sorted(self.peers))),),
                      federations=frozenset({self.federation.peer_id}), **kw)
        c = ClientCore(idn, cfg, random.Random(self.seed + 77 + i), verify_cache=self.cache)
        self.clients[idn.peer_id] = c
        self._perform(idn.peer_id, c.start(self.now))
        return c

    def node(self, pid: str) -> Core | None:
        return self.peers.get(pid) or self.clients.get(pid)

    def submit(self, client: ClientCore, req: JobRequest) -> str:
        """Submit a job from one of this swarm's clients now; its messages go
        out through the swarm. Returns the job id (a key of ``finished`` once
        the job ends)."""
        effects = client.handle(self.now, Submit(req))
        accepted = effects[0]
        assert isinstance(accepted, JobAccepted)
        self.perform(client.id, effects[1:])
        return accepted.job_id

    def cancel(self, client: ClientCore, job_id: str) -> None:
        """Cancel a client's job now (its holders are told to stop)."""
        self.perform(client.id, client.handle(self.now, CancelJob(job_id)))

    def perform(self, src: str, effects: list[Any]) -> None:
        """Carry out effects that node ``src`` returned from a call the swarm
        did not make itself: messages are sent (through loss, duplication and
        latency), shard runs scheduled, deliveries and finished jobs recorded.
        ``step_until`` does this for everything the cores return to it."""
        self._perform(src, effects)

    def _push(self, t: float, action: Any) -> None:
        self.seq += 1
        heapq.heappush(self.q, (t, self.seq, action))

    def _perform(self, src: str, effects: list[Any]) -> None:
        for e in effects:
            if isinstance(e, Send):
                self.msgs_sent += 1
                self.bytes_sent += len(e.data)
                lost = self.rng.random() < self.loss
                if lost or (self.drop is not None and self.drop(src, e)):
                    continue
                copies = 2 if self.rng.random() < self.dup else 1
                extra = self.delay(src, e) if self.delay is not None else 0.0
                for c in range(copies):
                    self._push(self.now + extra + self.latency * (1 + c + self.rng.random()), ("msg", src, e.to, e.data))
            elif isinstance(e, Publish):
                for pid in sorted(self.peers):
                    if pid != src:
                        self._push(self.now + self.latency, ("msg", src, pid, e.data))
            elif isinstance(e, RunShard):
                runs = self.runs[src]
                old = runs.start(self.now, e)
                if old is not None:
                    self.ended.append((src, old))
                run = runs.get(run_key(e))
                assert run is not None
                self._push(self.now + e.run_s * self.slow_ids.get(src, 1.0), ("fin", src, run.key, run.gen))
            elif isinstance(e, SetLevel):
                run = self.runs[src].set_level(self.now, e)
                if run is not None:  # the new run time counts from the run's start
                    self._push(self.now + run.left(self.now) * self.slow_ids.get(src, 1.0), ("fin", src, run.key, run.gen))
            elif isinstance(e, CancelShard):
                ended = self.runs[src].end(self.now, run_key(e))  # its pending finish is void
                if ended is not None:
                    self.ended.append((src, ended))
            elif isinstance(e, ShardDelivered):
                self.delivered.append(e)
            elif isinstance(e, JobFinished):
                self.finished[e.job_id] = e

    def crash(self, pid: str) -> None:
        self.dead.add(pid)

    def step_until(self, t_end: float, stop: Callable[[], bool] | None = None) -> None:
        while True:
            everyone: list[tuple[str, Core]] = [*self.peers.items(), *self.clients.items()]
            nodes = sorted(((pid, n) for pid, n in everyone if pid not in self.dead), key=lambda kv: kv[0])
            t_next = min([n.next_deadline() for _, n in nodes] + [self.q[0][0] if self.q else float("inf"), t_end])
            self.now = max(self.now, t_next)
            if self.now >= t_end or (stop is not None and stop()):
                return
            while self.q and self.q[0][0] <= self.now:
                _, _, act = heapq.heappop(self.q)
                if act[0] == "msg":
                    _, src, dst, data = act
                    node = self.node(dst)
                    if node is None or dst in self.dead:
                        continue
                    self._perform(dst, node.handle(self.now, MessageReceived(src, data)))
                else:
                    _, pid, key, gen = act
                    if pid in self.dead or not self.runs[pid].is_current(key, gen):
                        continue
                    done = self.runs[pid].end(self.now, key)
                    assert done is not None
                    self.ended.append((pid, done))
                    e = done.effect
                    result = b"r%d" % e.shard
                    self.executions += 1
                    if self.rng.random() < self.liar_ids.get(pid, 0.0):
                        result = b"wrong-%d" % self.rng.randrange(10**6)
                        self.lies += 1
                    fin = ShardFinished(e.tenant, e.job_id, e.shard, e.attempt, True, result, run_s=e.run_s)
                    self._perform(pid, self.peers[pid].handle(self.now, fin))
            for pid, n in nodes:
                if pid not in self.dead and n.next_deadline() <= self.now:
                    self._perform(pid, n.poll(self.now))
