"""Baseline schedulers on the same workload, swarm and churn as ``netsim run``.

Each baseline is a compact deterministic event loop (one heap of
``(time, seq, kind, a, b)``). It does **not** re-derive the scenario: it
builds a ``netsim.Simulator`` for the same scenario, seed and trace (without
running it) and reads from its event queue the peers and their start times,
the job submissions, crashes, graceful leaves and joins. The results come
from ``Simulator.results`` itself, called on this loop's state, so the
summary (rho, Jain, energy, utilisation, ...) is computed by the same code.

Policies (docs/evaluation.md):

* ``centralized``: one omniscient scheduler with a global queue and a global
  view. Whenever a slot frees or work arrives it gives the next ready shard
  of the job with the worst estimated finish-time fairness (Themis:
  ``(elapsed + unstarted work / fair share) / t_alone`` over the job's
  weight) to the fastest free peer that fits it. Messages per shard: submit,
  assign, completion (3).
* ``fifo``: each ready shard, in arrival order, goes to the peer with the
  least assigned work per slot (global load view); peers run their queue
  FIFO. Messages: submit, assign, completion (3).
* ``random``: each ready shard goes to a uniformly random capable peer; FIFO
  queues. Messages: 3 per shard.
* ``sparrow``: batch sampling with late binding: for m ready shards of a job
  the job's scheduler places reservations on 2m random capable peers; a
  peer whose queue reaches a reservation asks the scheduler for a task and
  gets one (launch) or a no-op. Messages: submit + 2 probes per shard + one
  request and one reply per reservation that reaches a queue head +
  completion.

Common rules, so the comparison is about placement only:

* the frequency level of a shard on a peer is ``core.energy.choose_level``
  with the peer's profile config (the same rule a fedswarm peer applies,
  deadline included; ``race_to_idle`` from the scenario's ``[peer]``);
* scheduling messages are delivered instantly and never lost (an optimistic
  bound for the baselines);
* a crashed peer's running and queued shards are re-queued when the
  scheduler notices, ``ClientConfig.lease_s`` after the crash (heartbeat
  timeout); a leaving peer hands back queued shards at once and running ones
  when ``churn.leave_grace_s`` ends.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from fedswarm.core.config import ClientConfig, PeerConfig
from fedswarm.core.energy import choose_level
from fedswarm.core.fairness import alone_time
from fedswarm.profiles import Profile

from . import sim as _sim
from .metrics import StepFn
from .scenario import Scenario
from .sim import JobRec, NodeRec, Simulator
from .workload import TraceJob

__all__ = ["BASELINES", "BaselineSim", "run_baseline"]

BASELINES = ("centralized", "fifo", "random", "sparrow")

ARRIVE, PSTART, CRASH, LEAVE, LEAVE_END, JOIN, FIN, DETECT = range(8)


class _Run(NamedTuple):  # what Simulator.results reads of a running shard (+ its end)
    gpus: int
    level: float
    end: float


@dataclass(eq=False)
class _Peer:
    rec: NodeRec
    cfg: PeerConfig
    speed: float
    slots: int
    free: int = 0
    queue: deque = field(default_factory=deque)  # ("task", job_id, shard) | ("resv", job_id)
    load: float = 0.0  # assigned, unfinished work (s on this peer x gpus) -- fifo's load view
    version: int = 0


@dataclass(eq=False)
class _Job:
    tj: TraceJob
    submit_t: float = 0.0
    ready: deque = field(default_factory=deque)  # shards ready to place (chain: at most one)
    next_chain: int = 0
    started: int = 0  # shards ever started (for the unstarted-work estimate)
    done: set = field(default_factory=set)
    resv: int = 0  # sparrow: outstanding reservations


class BaselineSim:
    """Run one baseline policy; ``results()`` has the same shape as ``netsim run``."""

    def __init__(self, scenario: Scenario, seed: int, policy: str, *, jobs: list[TraceJob] | None = None) -> None:
        if policy not in BASELINES:
            raise ValueError(f"unknown baseline {policy!r}; one of {BASELINES}")
        self.policy = policy
        self.sc = scenario
        self.seed = seed
        base = Simulator(scenario, seed, jobs=jobs)  # the same peers, churn draws and workload
        self.base = base  # never run; results() lends it this loop's state
        self.rng = random.Random(f"baseline/{policy}/{seed}")
        self.detect_s = ClientConfig(**scenario.client_overrides).lease_s
        self.q: list[tuple] = []
        self.seq = 0
        self.now = 0.0
        self.events = 0
        self.nodes: dict[str, NodeRec] = {}
        self.peers: dict[str, _Peer] = {}
        self.initial_peers = list(base.initial_peers)
        self.jobs: dict[str, JobRec] = {j.job_id: JobRec(j) for j in base.trace}
        self.st: dict[str, _Job] = {j.job_id: _Job(j) for j in base.trace}
        self.intervals: list[tuple[float, float, str, int]] = []
        self.wasted_gpu_s = 0.0
        self.capacity = StepFn(0.0, 0.0)
        self.active_tenants = StepFn(0.0, 0.0)
        self._tenant_open: Counter[str] = Counter()
        self._submitted = 0
        self.msgs = 0
        self.bytes = 0
        self.msg_kinds: Counter[str] = Counter()
        self.net_stats: Counter[str] = Counter()
        self.stop_at = scenario.max_time_s
        self.gen = 0
        self._joins = 0
        self._heaps: dict[int, list[tuple]] = {}
        self._free_ids: set[str] = set()  # peers with a free slot (centralized)
        self._open_jobs: set[str] = set()  # jobs with ready shards (centralized, fifo order)
        for t, _, kind, a, b, _c in sorted(base.q, key=lambda x: (x[0], x[1])):
            if kind == _sim.START and a.is_peer:
                self._add_peer(a)
                self._push(t, PSTART, a.id, None)
            elif kind == _sim.SUBMIT:
                self._push(t, ARRIVE, a.job_id, None)
            elif kind == _sim.CRASH:
                self._push(t, CRASH, a.id, None)
            elif kind == _sim.LEAVE:
                self._push(t, LEAVE, a.id, None)
            elif kind == _sim.JOIN:
                self._push(t, JOIN, a, b)

    # ------------------------------------------------------------------
    # plumbing

    def _push(self, t: float, kind: int, a: Any, b: Any) -> None:
        self.seq += 1
        heapq.heappush(self.q, (t, self.seq, kind, a, b))

    def _msg(self, kind: str, n: int = 1) -> None:
        self.msgs += n
        self.msg_kinds[kind] += n

    def _add_peer(self, rec: NodeRec) -> _Peer:
        """Track a peer record of the unrun Simulator (its core never runs:
        it only stands in, idle, for what ``Simulator.results`` reads)."""
        prof = rec.profile
        assert prof is not None
        cfg = prof.peer_config(**self.sc.peer_overrides)
        p = _Peer(rec, cfg, prof.speed(self.sc.task), prof.slots)
        self.nodes[rec.id] = rec
        self.peers[rec.id] = p
        return p

    def _bring_up(self, p: _Peer, t: float) -> None:
        """A peer starts (at setup or by joining): free, and work may go to it."""
        p.rec.alive = p.rec.started = True
        p.rec.start_t = t
        p.free = p.slots
        self._free_ids.add(p.rec.id)
        self._cap_update()
        self._load_changed(p)
        self._retry_open()

    def _join_peer(self, prof: Profile, region: str) -> _Peer:
        rec = self.base._new_peer(prof, region)
        rec.core = self.base._peer_core(rec, self.base.boot)
        return self._add_peer(rec)

    def _cap_update(self) -> None:
        self._usable_cache = None
        self._capable_cache = {}
        cap = 0.0
        for p in self.peers.values():
            if p.rec.alive and not p.rec.leaving:
                cap += p.slots * p.speed
        self.capacity.set(self.now, cap)

    _usable_cache: list[_Peer] | None = None
    _capable_cache: dict[int, list[_Peer]] = {}

    def _usable(self) -> list[_Peer]:
        if self._usable_cache is None:
            self._usable_cache = [self.peers[k] for k in sorted(self.peers)
                                  if self.peers[k].rec.alive and not self.peers[k].rec.leaving]
        return self._usable_cache

    def _load_changed(self, p: _Peer) -> None:
        """fifo: (re)file ``p`` in the lazy least-loaded heap of its slot size."""
        if self.policy != "fifo":
            return
        p.version += 1
        heapq.heappush(self._heaps.setdefault(p.slots, []), (p.load / p.slots, -p.speed, p.rec.id, p.version))

    def _least_loaded(self, g: int) -> _Peer | None:
        best: tuple | None = None
        for slots in sorted(self._heaps):
            if slots < g:
                continue
            h = self._heaps[slots]
            while h:
                top = h[0]
                p = self.peers[top[2]]
                if top[3] == p.version and p.rec.alive and not p.rec.leaving:
                    break
                heapq.heappop(h)
            if h and (best is None or h[0][:3] < best[:3]):
                best = h[0]
        return None if best is None else self.peers[best[2]]

    # ------------------------------------------------------------------
    # running shards

    def _level(self, p: _Peer, job: _Job, shard: int) -> tuple[float, float]:
        tj = job.tj
        work = tj.duration_s / max(p.speed, 1e-9)
        deadline = None if tj.deadline_s is None else job.submit_t + tj.deadline_s - self.now
        if deadline is not None and tj.chain:  # as PeerCore._on_cfb: this shard's share
            deadline /= max(tj.shards - shard, 1)
        c = choose_level(p.cfg.power, work, start_s=0.0, deadline_s=deadline, lam=0.0,
                         carbon_g_kwh=p.cfg.carbon_g_kwh, time_weight=tj.weight, race_to_idle=p.cfg.race_to_idle)
        return c.level, c.run_s

    def _start(self, p: _Peer, jid: str, shard: int) -> None:
        job = self.st[jid]
        g = max(job.tj.gpus_per_shard, 1)
        level, run_s = self._level(p, job, shard)
        p.free -= g
        if p.free <= 0:
            self._free_ids.discard(p.rec.id)
        self.gen += 1
        key = (jid, shard, self.gen)
        p.rec.running[key] = (self.gen, self.now, _Run(g, level, self.now + run_s))
        job.started += 1
        self._push(self.now + run_s, FIN, p.rec.id, key)

    def _account(self, p: _Peer, key: tuple, *, completed: bool) -> None:
        _, start, e = p.rec.running.pop(key)
        elapsed = max(self.now - start, 0.0)
        assert p.rec.profile is not None
        p.rec.busy_gpu_s += elapsed * e.gpus
        p.rec.busy_energy_j += p.rec.profile.power.power(e.level) * elapsed * e.gpus
        p.free += e.gpus
        if p.rec.alive:
            self._free_ids.add(p.rec.id)
        if completed:
            self.intervals.append((start, self.now, self.st[key[0]].tj.tenant, e.gpus))
            j = self.jobs[key[0]]
            j.gpu_s += elapsed * e.gpus
            en = p.rec.profile.power.power(e.level) * elapsed * e.gpus
            j.energy_j += en
            j.carbon_g += en / 3.6e6 * p.rec.profile.carbon_g_kwh
        else:
            self.wasted_gpu_s += elapsed * e.gpus

    def _finish(self, pid: str, key: tuple) -> None:
        p = self.peers[pid]
        if key not in p.rec.running or not p.rec.alive:
            return
        jid, shard, _ = key
        self._account(p, key, completed=True)
        p.load -= self.st[jid].tj.duration_s / p.speed * max(self.st[jid].tj.gpus_per_shard, 1)
        self._load_changed(p)
        self._msg("completion")
        job, rec = self.st[jid], self.jobs[jid]
        if shard not in job.done:
            job.done.add(shard)
            rec.delivered[shard] = 1
            if job.tj.chain and job.next_chain < job.tj.shards:
                job.ready.append(job.next_chain)
                job.next_chain += 1
                self._ready(job)
            if len(job.done) == job.tj.shards:
                rec.finish_t = self.now
                rec.ok = True
                self._tenant_open[job.tj.tenant] -= 1
                self.active_tenants.set(self.now, sum(1 for v in self._tenant_open.values() if v > 0))
                if all(j.finish_t is not None for j in self.jobs.values()) and self._submitted == len(self.jobs):
                    self.stop_at = min(self.stop_at, self.now + self.sc.settle_s)
        if p.rec.leaving and not p.rec.running:
            self._gone(p, "left")

    # ------------------------------------------------------------------
    # arrivals and placement

    def _arrive(self, jid: str) -> None:
        job, rec = self.st[jid], self.jobs[jid]
        job.submit_t = rec.submit_t = self.now
        rec.submitted = True
        self._submitted += 1
        self._tenant_open[job.tj.tenant] += 1
        self.active_tenants.set(self.now, sum(1 for v in self._tenant_open.values() if v > 0))
        self._msg("submit", job.tj.shards)
        if job.tj.chain:
            job.ready.append(0)
            job.next_chain = 1
        else:
            job.ready.extend(range(job.tj.shards))
        self._ready(job)

    def _ready(self, job: _Job) -> None:
        """New ready shards of ``job``: hand them to the policy."""
        if self.policy == "centralized":
            self._open_jobs.add(job.tj.job_id)
            return  # placed by _dispatch_central
        if self.policy == "sparrow":
            self._probe(job, len(job.ready))
            return
        while job.ready:
            shard = job.ready.popleft()
            p = self._place(job)
            if p is None:  # nothing can run it now: retry when the swarm changes
                job.ready.appendleft(shard)
                self._open_jobs.add(job.tj.job_id)
                return
            self._msg("assign")
            p.queue.append(("task", job.tj.job_id, shard))
            p.load += job.tj.duration_s / p.speed * max(job.tj.gpus_per_shard, 1)
            self._load_changed(p)
            self._drain(p)

    def _capable(self, job: _Job) -> list[_Peer]:
        g = max(job.tj.gpus_per_shard, 1)
        c = self._capable_cache.get(g)
        if c is None:
            c = self._capable_cache[g] = [p for p in self._usable() if p.slots >= g]
        return c

    def _place(self, job: _Job) -> _Peer | None:
        if self.policy == "fifo":
            return self._least_loaded(max(job.tj.gpus_per_shard, 1))
        cands = self._capable(job)
        if not cands:
            return None
        return cands[self.rng.randrange(len(cands))]

    def _probe(self, job: _Job, n: int) -> None:
        cands = self._capable(job)
        if not cands:
            self._open_jobs.add(job.tj.job_id)
            return
        k = 2 * n
        self._msg("probe", k)
        for _ in range(k):
            p = cands[self.rng.randrange(len(cands))]
            p.queue.append(("resv", job.tj.job_id))
            job.resv += 1
        for p in sorted({id(c): c for c in cands}.values(), key=lambda c: c.rec.id):
            if p.queue:
                self._drain(p)

    def _drain(self, p: _Peer) -> None:
        """Start queue heads while they fit (head-of-line blocking for gangs)."""
        while p.queue and p.rec.alive:
            item = p.queue[0]
            job = self.st[item[1]]
            g = max(job.tj.gpus_per_shard, 1)
            if g > p.free:
                return
            p.queue.popleft()
            if item[0] == "task":
                if item[2] not in job.done:
                    self._start(p, item[1], item[2])
                continue
            job.resv -= 1  # late binding: ask the job's scheduler for a task
            self._msg("late_bind_request")
            self._msg("late_bind_reply")
            if job.ready:
                self._start(p, item[1], job.ready.popleft())
            if job.ready and job.resv == 0:
                self._probe(job, len(job.ready))

    def _dispatch_central(self) -> None:
        if not self._open_jobs:
            return
        free = [p for p in (self.peers[i] for i in self._free_ids) if p.free > 0 and p.rec.alive and not p.rec.leaving]
        if not free:
            return
        free.sort(key=lambda p: (-p.speed, p.rec.id))
        cap = self.capacity.value
        nten = max(sum(1 for v in self._tenant_open.values() if v > 0), 1)
        share = max(cap / nten, 1e-9)

        def score(job: _Job) -> float:
            tj = job.tj
            t_alone = alone_time(tj.duration_s, tj.shards, tj.gpus_per_shard, tj.chain, cap, nten)
            unstarted = (tj.shards - job.started) * tj.duration_s * max(tj.gpus_per_shard, 1)
            return (self.now - job.submit_t + unstarted / share) / t_alone / tj.weight

        # omniscient: single-GPU shards may wait for a faster device that frees
        # up soon rather than start now on a much slower one. Release times of
        # busy single slots, per speed (consumed as shards are held for them).
        release: dict[float, list[float]] = {}
        if free and free[-1].speed < free[0].speed or len(free) < len(self._usable()):
            for q in self._usable():
                if q.free == 0 or q.speed > free[-1].speed:
                    h = release.setdefault(q.speed, [])
                    h.extend(r[2].end for r in q.rec.running.values())
            for h in release.values():
                heapq.heapify(h)

        def better_later(p: _Peer, w: float) -> bool:
            mine = self.now + w / p.speed
            for sp, h in release.items():
                if sp > p.speed and h and h[0] + w / sp < mine:
                    heapq.heappop(h)  # hold this shard for that slot
                    return True
            return False

        heap = [(-score(self.st[j]), self.st[j].submit_t, j) for j in sorted(self._open_jobs) if self.st[j].ready]
        heapq.heapify(heap)
        blocked = 0
        while heap and free:
            _, _, jid = heapq.heappop(heap)
            job = self.st[jid]
            g = max(job.tj.gpus_per_shard, 1)
            p = next((x for x in free if x.free >= g), None)
            if p is None:
                blocked += 1
                continue
            if g == 1 and release and better_later(p, job.tj.duration_s):
                continue  # this job waits (its remaining ready shards too, this pass)
            shard = job.ready.popleft()
            self._msg("assign")
            self._start(p, jid, shard)
            if p.free <= 0:
                free.remove(p)
            if job.ready:
                heapq.heappush(heap, (-score(job), job.submit_t, jid))
        self._open_jobs = {j for j in self._open_jobs if self.st[j].ready}

    def _retry_open(self) -> None:
        """The swarm changed: place shards that found no capable peer before."""
        if self.policy == "centralized" or not self._open_jobs:
            return
        jobs = sorted(self._open_jobs)
        self._open_jobs = set()
        for jid in jobs:
            job = self.st[jid]
            if job.ready:
                self._ready(job)

    # ------------------------------------------------------------------
    # churn

    def _requeue(self, items: list[tuple[str, int]]) -> None:
        touched: dict[str, _Job] = {}
        for jid, shard in sorted(items):
            job = self.st[jid]
            if shard in job.done or shard in job.ready:
                continue
            job.ready.append(shard)
            job.started -= 1
            touched[jid] = job
        for jid in sorted(touched):
            self._ready(touched[jid])

    def _evict(self, p: _Peer) -> list[tuple[str, int]]:
        items = []
        for key in sorted(p.rec.running):
            items.append((key[0], key[1]))
            self._account(p, key, completed=False)
        return items

    def _handed_back(self, p: _Peer) -> list[tuple[str, int]]:
        items = []
        for it in p.queue:
            if it[0] == "task":
                items.append((it[1], it[2]))
                self.st[it[1]].started += 1  # _requeue takes one off; queued ones never counted
            else:
                self.st[it[1]].resv -= 1
                items.append((it[1], -1))  # a lost reservation
        p.queue.clear()
        p.load = 0.0
        self._load_changed(p)
        return items

    def _lost(self, items: list[tuple[str, int]]) -> None:
        shards = [(j, s) for j, s in items if s >= 0]
        self._requeue(shards)
        if self.policy == "sparrow":  # re-probe jobs that lost their reservations
            for jid in sorted({j for j, s in items if s < 0}):
                job = self.st[jid]
                if job.ready and job.resv < len(job.ready):
                    self._probe(job, len(job.ready) - job.resv)

    def _gone(self, p: _Peer, fate: str) -> None:
        rec = p.rec
        rec.alive = False
        rec.end_t = self.now
        rec.fate = fate
        self._free_ids.discard(rec.id)
        self._cap_update()

    # ------------------------------------------------------------------
    # loop

    def run(self) -> None:
        q = self.q
        while q:
            t = q[0][0]
            if t > self.stop_at:
                break
            _, _, kind, a, b = heapq.heappop(q)
            self.now = t
            self.events += 1
            if kind == FIN:
                self._finish(a, b)
            elif kind == ARRIVE:
                self._arrive(a)
            elif kind == PSTART:
                self._bring_up(self.peers[a], t)
            elif kind == JOIN:
                self._bring_up(self._join_peer(a, b), t)
            elif kind == CRASH:
                p = self.peers[a]
                if p.rec.alive:
                    items = self._evict(p) + self._handed_back(p)
                    self._gone(p, "crashed")
                    self._push(t + self.detect_s, DETECT, items, None)
            elif kind == DETECT:
                self._lost(a)
            elif kind == LEAVE:
                p = self.peers[a]
                if p.rec.alive and not p.rec.leaving:
                    p.rec.leaving = True
                    self._cap_update()
                    self._lost(self._handed_back(p))
                    if not p.rec.running:
                        self._gone(p, "left")
                    else:
                        self._push(t + self.sc.churn.leave_grace_s, LEAVE_END, a, None)
            elif kind == LEAVE_END:
                p = self.peers[a]
                if p.rec.alive:
                    items = self._evict(p)
                    self._gone(p, "left")
                    self._lost(items)
            if self.policy == "centralized":
                self._dispatch_central()
            elif kind == FIN and self.peers[a].rec.alive:
                self._drain(self.peers[a])
        self.now = max(self.now, min(self.stop_at, self.sc.max_time_s)) if self.stop_at < math.inf else self.now

    def results(self) -> dict[str, Any]:
        # the same metrics code: the unrun Simulator gets this loop's state
        b = self.base
        for name in ("nodes", "jobs", "intervals", "wasted_gpu_s", "capacity", "active_tenants", "_submitted",
                     "msgs", "bytes", "msg_kinds", "net_stats", "events", "now", "initial_peers", "stop_at"):
            setattr(b, name, getattr(self, name))
        b._members = None
        res = b.results()
        res["policy"] = self.policy
        return res


def run_baseline(scenario: Scenario, seed: int, policy: str, jobs: list[TraceJob] | None = None) -> dict[str, Any]:
    b = BaselineSim(scenario, seed, policy, jobs=jobs)
    b.run()
    return b.results()
