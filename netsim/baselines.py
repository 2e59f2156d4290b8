"""Baseline schedulers on the same workload, swarm and churn as ``netsim run``.

Each baseline is a compact deterministic event loop (one heap of
``(time, seq, kind, a, b)``). It builds from the same plan as fedswarm's
simulator (``netsim.plan.make_plan`` for the scenario, seed and trace): the
peers and their start times, the job submissions, crashes, graceful leaves
and joins. Its ``record()`` is a ``netsim.report.RunRecord`` and its results
are ``netsim.report.report`` of it, so the summary (rho, Jain, energy,
utilisation, ...) is computed by the same code.

Policies (docs/evaluation.md):

* ``centralized``: one omniscient scheduler with a global queue and a global
  view. Whenever a slot frees or work arrives it gives the next ready shard
  of the job with the worst estimated finish-time fairness (Themis:
  ``(elapsed + unstarted work / fair share) / t_alone`` over the job's
  weight) to the fastest free peer that fits it. While shards wait for a
  slot it runs every slowed shard at its peer's top clock (below).
  Messages per shard: submit, assign, completion (3), plus one per slowed
  run it raises.
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
  with the peer's profile config (the rule a fedswarm peer applies,
  deadline included; ``race_to_idle`` and ``rerun_room`` from the
  scenario's ``[peer]``). With ``rerun_room`` (off by default) a shard
  with a deadline runs below the top clock only if a crash at the end of
  its run, noticed ``lease_s`` later (the heartbeat timeout below), leaves
  time to run it again at the top clock, as on a fedswarm peer. (``netsim
  compare --policies fedswarm-rerun`` turns it on for fedswarm's peers
  alone; ``[peer] rerun_room = true`` turns it on for every policy). A
  fedswarm peer raises its slowed shards to the top clock when work queues
  behind them (``SetLevel``); the centralized scheduler, whose queue is
  global, does the same for every slowed run in the swarm whenever a shard
  is left waiting for a slot (``_raise_slowed``; since 2026-12-07: before,
  its deadline shards kept their low clock on a loaded swarm, and its mean
  JCT on twice the load, seed 1, was 495.0 s against 416.7 s now). fifo,
  random and sparrow do not raise levels;
* scheduling messages cross the scenario's network: each one takes the
  one-way latency of its link (the same per-link draw as fedswarm's
  messages, plus exponential jitter), and none is lost. ``centralized``,
  ``fifo`` and ``random`` have one scheduler, placed in the scenario's
  largest region; ``sparrow``'s job schedulers sit at the tenants' clients.
  A shard's path is submit (client to scheduler), assign (scheduler to
  peer), completion (peer to scheduler) and result (peer to client); a job
  finishes when the client has every result. The centralized scheduler
  sees a slot free only when the completion reaches it, and holds the slot
  from the moment it assigns it. Sparrow's peer holds the slot while it
  asks for a task (late binding);
* the ``-instant`` variant of each (``centralized-instant``, ...) delivers
  every scheduling message at once: an optimistic bound no swarm reaches;
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
from typing import Any

from fedswarm.core.config import ClientConfig, PeerConfig
from fedswarm.core.energy import choose_level
from fedswarm.core.events import RunShard, SetLevel
from fedswarm.core.runs import RunKey, Runs, run_key
from fedswarm.core.fairness import alone_time

from .stats import StepFn
from .plan import PeerPlan, make_plan
from .report import JobRec, NodeRun, RunRecord, open_runs, report
from .scenario import Scenario
from .sim import NodeRec
from .workload import TraceJob

__all__ = ["BASELINES", "BaselineSim", "run_baseline"]

_KINDS = ("centralized", "fifo", "random", "sparrow")
BASELINES = _KINDS + tuple(f"{k}-instant" for k in _KINDS)

ARRIVE, PSTART, CRASH, LEAVE, LEAVE_END, JOIN, FIN, DETECT = range(8)
# networked baselines: a message reaches its destination
SCHED_ARRIVE, ASSIGN_AT, DONE_AT, RESULT_AT, RESV_AT, LB_REQ, LB_REPLY = range(8, 15)


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
    got: set = field(default_factory=set)  # shards whose result reached the client
    #: shard -> the share of its work behind its last checkpoint
    #: (``workload.checkpoint_s``): a re-run goes on from there
    progress: dict = field(default_factory=dict)


class BaselineSim:
    """Run one baseline policy; ``results()`` has the same shape as ``netsim run``."""

    def __init__(self, scenario: Scenario, seed: int, policy: str, *, jobs: list[TraceJob] | None = None) -> None:
        if policy not in BASELINES:
            raise ValueError(f"unknown baseline {policy!r}; one of {BASELINES}")
        self.name = policy
        self.netted = not policy.endswith("-instant")
        self.policy = policy.removesuffix("-instant")
        self.sc = scenario
        self.seed = seed
        plan = make_plan(scenario, seed, jobs=jobs)  # the same peers, churn draws and workload
        self.plan = plan
        self.rng = random.Random(f"baseline/{self.policy}/{seed}")
        self.net = plan.net
        self.net_rng = random.Random(f"baseline-net/{self.policy}/{seed}")
        # the one scheduler (centralized, fifo, random): in the largest region
        regions = scenario.regions or {"us": 1.0}
        self.sched_at = ("scheduler", max(regions, key=lambda r: regions[r]))
        self.client_at = {c.tenant: (c.id, c.region) for c in plan.clients}
        self.detect_s = ClientConfig(**scenario.client_overrides).lease_s
        #: centralized: runs going on below their peer's top clock, which a
        #: shard left waiting for a slot raises (``_raise_slowed``); a run
        #: leaves it when it ends (``_account``), so it holds running ones only
        self._slowed: dict[tuple[str, RunKey], None] = {}
        self.levels_raised = 0
        self.q: list[tuple] = []
        self.seq = 0
        self.now = 0.0
        self.events = 0
        self.nodes: dict[str, NodeRec] = {}
        self.peers: dict[str, _Peer] = {}
        self.initial_peers = plan.initial_peers
        self.jobs: dict[str, JobRec] = {j.job_id: JobRec(j) for j in plan.trace}
        self.st: dict[str, _Job] = {j.job_id: _Job(j) for j in plan.trace}
        self.intervals: list[tuple[float, float, str, int]] = []
        self.wasted_gpu_s = 0.0
        self.capacity = StepFn(0.0, 0.0)
        self.active_tenants = StepFn(0.0, 0.0)
        self._tenant_open: Counter[str] = Counter()
        self._submitted = 0
        self._finished = 0
        self.msgs = 0
        self.bytes = 0
        self.msg_kinds: Counter[str] = Counter()
        self.net_stats: Counter[str] = Counter()
        self.stop_at = scenario.max_time_s
        self.gen = 0
        self._heaps: dict[int, list[tuple]] = {}
        self._free_ids: set[str] = set()  # peers with a free slot (centralized)
        self._open_jobs: set[str] = set()  # jobs with ready shards (centralized, fifo order)
        initial = {p.id: p for p in plan.peers}
        # the plan's actions in the order fedswarm's loop meets them (time, then draw order)
        for _, (t, kind, a, _arg) in sorted(enumerate(plan.actions), key=lambda x: (x[1][0], x[0])):
            if kind == "start" and a in initial:
                self._add_peer(initial[a])
                self._push(t, PSTART, a, None)
            elif kind == "submit":
                self._push(t, ARRIVE, a.job_id, None)
            elif kind == "crash":
                self._push(t, CRASH, a, None)
            elif kind == "leave":
                self._push(t, LEAVE, a, None)
            elif kind == "join":
                self._push(t, JOIN, a, None)

    # ------------------------------------------------------------------
    # plumbing

    def _push(self, t: float, kind: int, a: Any, b: Any) -> None:
        self.seq += 1
        heapq.heappush(self.q, (t, self.seq, kind, a, b))

    def _msg(self, kind: str, n: int = 1) -> None:
        self.msgs += n
        self.msg_kinds[kind] += n

    def _lat(self, a: tuple[str, str], b: tuple[str, str]) -> float:
        """One-way delay of a scheduling message from ``a`` to ``b`` ((id,
        region) each): the link's latency, as fedswarm's messages get it,
        plus exponential jitter. Never lost."""
        d = self.net.latency(a[0], b[0], a[1], b[1])
        if self.net.jitter_ms > 0:
            d += self.net_rng.expovariate(1000.0 / self.net.jitter_ms)
        return d

    def _send(self, src: tuple[str, str], dst: tuple[str, str], kind: int, a: Any, b: Any) -> None:
        """A scheduling message from ``src`` to ``dst``: event ``kind`` fires
        when it arrives."""
        self._push(self.now + self._lat(src, dst), kind, a, b)

    @staticmethod
    def _at(p: _Peer) -> tuple[str, str]:
        return (p.rec.id, p.rec.region)

    def _sched_of(self, job: _Job) -> tuple[str, str]:
        """Where ``job``'s scheduler sits: sparrow's at the tenant's client."""
        return self.client_at[job.tj.tenant] if self.policy == "sparrow" else self.sched_at

    def _bounce(self, p: _Peer, items: list[tuple[str, int]], to: tuple[str, str]) -> None:
        """Work sent to a peer that crashed, left or is leaving comes back to
        its scheduler: a crash is noticed ``lease_s`` after it happened, a
        leaving peer says so."""
        if p.rec.fate == "crashed":
            self._push(max(self.now, (p.rec.end_t or self.now) + self.detect_s), DETECT, items, None)
        else:
            self._send(self._at(p), to, DETECT, items, None)

    def _add_peer(self, pp: PeerPlan) -> _Peer:
        """Track a peer of the plan (no core: the policy is this loop)."""
        prof = pp.profile
        rec = NodeRec(pp.id, None, True, pp.region, prof, prof.name, runs=Runs(prof.power.power))
        rec.fault_ids = list(self.plan.fault_ids.get(pp.id, ()))
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
        work = tj.duration_s * (1.0 - job.progress.get(shard, 0.0)) / max(p.speed, 1e-9)
        deadline = None if tj.deadline_s is None else job.submit_t + tj.deadline_s - self.now
        if deadline is not None and tj.chain:  # as PeerCore._on_cfb: this shard's share
            deadline /= max(tj.shards - shard, 1)
        c = choose_level(p.cfg.power, work, start_s=0.0, deadline_s=deadline, lam=0.0,
                         carbon_g_kwh=p.cfg.carbon_g_kwh, time_weight=tj.weight, race_to_idle=p.cfg.race_to_idle,
                         rerun_reserve_s=self.detect_s if p.cfg.rerun_room else None)
        return c.level, c.run_s

    def _start(self, p: _Peer, jid: str, shard: int, *, held: bool = False) -> None:
        """Run a shard on ``p`` now; ``held``: its slot was taken (and the
        shard counted as started) when it was assigned."""
        job = self.st[jid]
        g = max(job.tj.gpus_per_shard, 1)
        level, run_s = self._level(p, job, shard)
        if not held:
            self._take(p, g)
            job.started += 1
        self.gen += 1
        # keyed ("", job, shard, run counter): the runs of a peer sort by job and shard
        e = RunShard("", jid, shard, self.gen, self.sc.task_of(job.tj.tenant), b"", job.tj.duration_s, g, 0,
                     level, run_s, 1.0 - job.progress.get(shard, 0.0))
        p.rec.runs.start(self.now, e)
        self._push(self.now + run_s, FIN, p.rec.id, (e.tenant, jid, shard, self.gen))
        if self.policy == "centralized" and level < p.cfg.power.allowed_levels()[-1]:
            self._slowed[(p.rec.id, run_key(e))] = None

    def _take(self, p: _Peer, g: int) -> None:
        p.free -= g
        if p.free <= 0:
            self._free_ids.discard(p.rec.id)

    def _release(self, p: _Peer, g: int) -> None:
        p.free += g
        if p.rec.alive:
            self._free_ids.add(p.rec.id)

    def _account(self, p: _Peer, key: RunKey, *, completed: bool, release: bool = True) -> int:
        """The run ends (``Runs`` charges the peer): free its slot unless the
        scheduler is to hear of it first (``release=False``). Returns its GPUs."""
        ended = p.rec.runs.end(self.now, key)
        assert ended is not None and p.rec.profile is not None
        self._slowed.pop((p.rec.id, key), None)
        g = ended.gpus
        ck = self.sc.checkpoint_s
        if ck > 0 and ended.effect.run_s > ck:
            # its task saved progress every ck seconds of the run, each time
            # a message to the scheduler (as fedswarm's peers tell the client)
            e = ended.effect
            saved = min(int(ended.seconds // ck), int(math.ceil(e.run_s / ck)) - 1)
            if saved > 0:
                self._msg("checkpoint", saved)
                if not completed:
                    done = (1.0 - e.left) + e.left * min(saved * ck / e.run_s, 1.0)
                    if done < 1.0:
                        job = self.st[e.job_id]
                        job.progress[e.shard] = max(job.progress.get(e.shard, 0.0), done)
        if release:
            self._release(p, g)
        if completed:
            jid = ended.effect.job_id
            self.intervals.append((ended.began, self.now, self.st[jid].tj.tenant, g))
            j = self.jobs[jid]
            j.gpu_s += ended.seconds * g
            j.energy_j += ended.energy_j
            j.carbon_g += ended.energy_j / 3.6e6 * p.rec.profile.carbon_g_kwh
        else:
            self.wasted_gpu_s += ended.seconds * g
        return g

    def _finish(self, pid: str, key: RunKey) -> None:
        """A shard's run ends on its peer."""
        p = self.peers[pid]
        if key not in p.rec.runs or not p.rec.alive:
            return
        _, jid, shard, _ = key
        job = self.st[jid]
        # the centralized scheduler hands the slot out again once it hears
        late = self.netted and self.policy == "centralized"
        g = self._account(p, key, completed=True, release=not late)
        self._msg("completion")
        if not self.netted:
            self._done(p, jid, shard, 0)
            self._result(jid, shard)
        else:
            sched = self._sched_of(job)
            self._send(self._at(p), sched, DONE_AT, pid, (jid, shard, g if late else 0))
            if self.policy != "sparrow":  # the result goes to the client too
                self._msg("result")
                self._send(self._at(p), self.client_at[job.tj.tenant], RESULT_AT, jid, shard)
        if p.rec.leaving and not p.rec.runs:
            self._gone(p, "left")

    def _done(self, p: _Peer, jid: str, shard: int, g: int) -> None:
        """The scheduler hears a shard completed (and frees ``g`` slots of ``p``)."""
        if g:
            self._release(p, g)
        p.load -= self.st[jid].tj.duration_s / p.speed * max(self.st[jid].tj.gpus_per_shard, 1)
        self._load_changed(p)
        job = self.st[jid]
        if shard not in job.done:
            job.done.add(shard)
            if job.tj.chain and job.next_chain < job.tj.shards:
                job.ready.append(job.next_chain)
                job.next_chain += 1
                self._ready(job)

    def _result(self, jid: str, shard: int) -> None:
        """A shard's result reaches the job's client: the job ends with its last."""
        job, rec = self.st[jid], self.jobs[jid]
        if shard in job.got:
            return
        job.got.add(shard)
        rec.delivered[shard] = 1
        if len(job.got) == job.tj.shards:
            rec.finish_t = self.now
            rec.ok = True
            self._finished += 1
            self._tenant_open[job.tj.tenant] -= 1
            self.active_tenants.set(self.now, sum(1 for v in self._tenant_open.values() if v > 0))
            if self._finished == len(self.jobs) and self._submitted == len(self.jobs):
                self.stop_at = min(self.stop_at, self.now + self.sc.settle_s)

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
        if self.netted and self.policy != "sparrow":
            self._send(self.client_at[job.tj.tenant], self.sched_at, SCHED_ARRIVE, jid, None)
            return
        self._accept(job)

    def _accept(self, job: _Job) -> None:
        """The job reaches its scheduler: its first shards are ready."""
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
            p.load += job.tj.duration_s / p.speed * max(job.tj.gpus_per_shard, 1)
            self._load_changed(p)
            if self.netted:
                self._send(self.sched_at, self._at(p), ASSIGN_AT, p.rec.id, (job.tj.job_id, shard))
                continue
            p.queue.append(("task", job.tj.job_id, shard))
            self._drain(p)

    def _assign_at(self, p: _Peer, jid: str, shard: int) -> None:
        """An assignment reaches its peer (networked)."""
        if not p.rec.alive or p.rec.leaving:
            if self.policy != "centralized":
                self.st[jid].started += 1  # _requeue takes one off; a queued one never counted
            self._bounce(p, [(jid, shard)], self.sched_at)
            return
        if self.policy == "centralized":
            self._start(p, jid, shard, held=True)
        else:
            p.queue.append(("task", jid, shard))
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
        if self.netted:  # reservations travel from the job's scheduler (its client)
            src = self._sched_of(job)
            for _ in range(k):
                p = cands[self.rng.randrange(len(cands))]
                job.resv += 1
                self._send(src, self._at(p), RESV_AT, p.rec.id, job.tj.job_id)
            return
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
            if self.netted:  # hold the slot while asking the job's scheduler
                self._take(p, g)
                self._send(self._at(p), self._sched_of(job), LB_REQ, p.rec.id, (item[1], g))
                continue
            job.resv -= 1  # late binding: ask the job's scheduler for a task
            self._msg("late_bind_request")
            self._msg("late_bind_reply")
            if job.ready:
                self._start(p, item[1], job.ready.popleft())
            if job.ready and job.resv == 0:
                self._probe(job, len(job.ready))

    def _resv_at(self, p: _Peer, jid: str) -> None:
        """A sparrow reservation reaches its peer (networked)."""
        if not p.rec.alive or p.rec.leaving:
            self.st[jid].resv -= 1
            self._bounce(p, [(jid, -1)], self._sched_of(self.st[jid]))
            return
        p.queue.append(("resv", jid))
        self._drain(p)

    def _lb_request(self, p: _Peer, jid: str, g: int) -> None:
        """A peer's late-binding request reaches the job's scheduler: it
        replies with a ready shard or a no-op."""
        job = self.st[jid]
        job.resv -= 1
        self._msg("late_bind_request")
        self._msg("late_bind_reply")
        shard = job.ready.popleft() if job.ready else None
        if shard is not None:
            job.started += 1
        self._send(self._sched_of(job), self._at(p), LB_REPLY, p.rec.id, (jid, shard, g))
        if job.ready and job.resv == 0:
            self._probe(job, len(job.ready))

    def _lb_reply(self, p: _Peer, jid: str, shard: int | None, g: int) -> None:
        """The reply reaches the peer holding a slot for it."""
        if shard is not None and p.rec.alive and not p.rec.leaving:
            self._start(p, jid, shard, held=True)
            return
        self._release(p, g)
        if shard is not None:
            self._bounce(p, [(jid, shard)], self._sched_of(self.st[jid]))
        self._drain(p)

    def _dispatch_central(self) -> None:
        if not self._open_jobs:
            return
        free = [p for p in (self.peers[i] for i in self._free_ids) if p.free > 0 and p.rec.alive and not p.rec.leaving]
        if not free:
            self._raise_slowed()
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
                    h.extend(r.began + r.effect.run_s for r in map(q.rec.runs.get, q.rec.runs) if r is not None)
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
            if self.netted:  # the slot is this shard's from now; it starts when the assignment arrives
                self._take(p, g)
                job.started += 1
                self._send(self.sched_at, self._at(p), ASSIGN_AT, p.rec.id, (jid, shard))
            else:
                self._start(p, jid, shard)
            if p.free <= 0:
                free.remove(p)
            if job.ready:
                heapq.heappush(heap, (-score(job), job.submit_t, jid))
        self._open_jobs = {j for j in self._open_jobs if self.st[j].ready}
        self._raise_slowed()

    def _raise_slowed(self) -> None:
        """If a ready shard waits for a slot after a dispatch: every run below
        its peer's top clock goes to the top clock for the rest of its run,
        as a fedswarm peer raises its slowed shards when work queues behind
        them (``SetLevel``). The scheduler tells each peer (one message per
        run raised; applied at once). A raised run's earlier end is a new
        ``FIN``; the old one finds the run gone."""
        if not self._slowed or not any(self.st[j].ready for j in self._open_jobs):
            return
        slowed, self._slowed = self._slowed, {}
        for pid, key in slowed:
            p = self.peers[pid]
            r = p.rec.runs.get(key)
            assert r is not None  # it would have left _slowed when it ended
            top = p.cfg.power.allowed_levels()[-1]
            e = r.effect
            left = r.left(self.now) * e.level / top
            run_s = self.now - r.began + left  # from the run's start, as SetLevel counts it
            p.rec.runs.set_level(self.now, SetLevel(e.tenant, e.job_id, e.shard, e.attempt, top, run_s))
            self.levels_raised += 1
            self._msg("raise")
            self._push(self.now + left, FIN, pid, key)

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
        for key in list(p.rec.runs):
            items.append((key[1], key[2]))
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
            elif kind == SCHED_ARRIVE:
                self._accept(self.st[a])
            elif kind == ASSIGN_AT:
                self._assign_at(self.peers[a], *b)
            elif kind == DONE_AT:
                self._done(self.peers[a], *b)
                if self.policy == "sparrow":  # its scheduler is the client
                    self._result(b[0], b[1])
            elif kind == RESULT_AT:
                self._result(a, b)
            elif kind == RESV_AT:
                self._resv_at(self.peers[a], b)
            elif kind == LB_REQ:
                self._lb_request(self.peers[a], *b)
            elif kind == LB_REPLY:
                self._lb_reply(self.peers[a], *b)
            elif kind == PSTART:
                self._bring_up(self.peers[a], t)
            elif kind == JOIN:
                self._bring_up(self._add_peer(a), t)
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
                    if not p.rec.runs:
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

    def record(self) -> RunRecord:
        """What the run left, for ``netsim.report`` (the same record fedswarm's
        simulator hands it). Peers have no core: no core counters, no leases.
        The clients only submit and collect: they are not among ``nodes``."""
        nodes = {}
        for pid, r in self.nodes.items():
            nodes[pid] = NodeRun(
                id=r.id, is_peer=True, name=r.name, profile=r.profile, started=r.started, start_t=r.start_t,
                end_t=r.end_t, fate=r.fate, hung=False, busy_gpu_s=r.runs.busy_s, busy_energy_j=r.runs.busy_j,
                msgs=r.msgs, bytes=r.bytes, fault_ids=r.fault_ids, open_runs=open_runs(r.runs),
            )
        clients = {}
        for c in self.plan.clients:
            clients[c.tenant] = NodeRun(
                id=c.id, is_peer=False, name=c.tenant, profile=None, started=False, start_t=0.0, end_t=None,
                fate="live", hung=False, busy_gpu_s=0.0, busy_energy_j=0.0, msgs=0, bytes=0,
                fault_ids=list(self.plan.fault_ids.get(c.id, ())),
            )
        return RunRecord(
            scenario=self.sc, seed=self.seed, end=self.now, events=self.events, jobs=self.jobs,
            submitted=self._submitted, nodes=nodes, clients=clients, initial_peers=len(self.initial_peers),
            intervals=self.intervals, wasted_gpu_s=self.wasted_gpu_s, capacity=self.capacity,
            active_tenants=self.active_tenants, msgs=self.msgs, bytes=self.bytes, msg_kinds=self.msg_kinds,
            bytes_kinds=Counter(), net_stats=self.net_stats, fault_targets=self.plan.fault_targets,
        )

    def results(self) -> dict[str, Any]:
        res = report(self.record())
        res["policy"] = self.name
        return res


def run_baseline(scenario: Scenario, seed: int, policy: str, jobs: list[TraceJob] | None = None) -> dict[str, Any]:
    b = BaselineSim(scenario, seed, policy, jobs=jobs)
    b.run()
    return b.results()
