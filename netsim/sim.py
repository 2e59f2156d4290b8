"""The loop: a deterministic discrete-event loop that drives the sans-IO cores.

A run is three parts. ``netsim.plan`` draws the swarm, its workload, churn
and faults as data; this module's ``Simulator`` builds the cores from that
plan and runs them; ``netsim.report`` turns the ``RunRecord`` the run
leaves (``Simulator.record()``) into the results JSON. The baseline
schedulers (``netsim.baselines``) build from the same plan and hand the
same ``report`` their own record.

One heap of ``(time, seq, kind, a, b, c)`` actions; ``seq`` is a global
counter, so ties break in insertion order and a seed replays a run exactly.
Every core's next deadline lives in the heap as a ``POLL`` action; a popped
poll whose deadline is no longer the node's scheduled one is stale and
skipped, so a step costs O(log events), not O(nodes). Nothing iterates a
set or reads the wall clock.
"""

from __future__ import annotations

import gc
import math
import random
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from fedswarm.core.client_core import ClientCore, JobRequest
from fedswarm.core.config import ClientConfig
from fedswarm.core.identity import Identity
from fedswarm.core.events import (
    CancelShard,
    HandBackRunning,
    JobFinished,
    Leave,
    MessageReceived,
    Publish,
    RunShard,
    Send,
    SetLevel,
    ShardDelivered,
    ShardFinished,
    ShardProgress,
    Submit,
)
from fedswarm.core.peer import PeerCore
from fedswarm.core.runs import Ended, Runs, run_key
from fedswarm.core.wire import VerifyCache
from fedswarm.profiles import Profile

from . import hugepages
from .eventq import event_queue
from .stats import StepFn
from .plan import ClientPlan, PeerPlan, Plan, make_plan
from .report import JobRec, NodeRun, RunRecord, open_runs, report
from .scenario import Scenario
from .workload import TraceJob

__all__ = ["Simulator", "NodeRec", "JobRec"]

MSG, POLL, FIN, SUBMIT, START, CRASH, LEAVE, LEAVE_END, JOIN, FORGET, RESCHED, HANG, RESUME, CKPT = range(14)
#: the plan's action kinds as the loop's
_ACTION = {"start": START, "submit": SUBMIT, "crash": CRASH, "leave": LEAVE, "join": JOIN, "hang": HANG,
           "resume": RESUME}
CLIENT_RESCHED_S = 0.01  # a client's deadline is re-read at most this late after a message
_FREEZE_EVERY = (1 << 20) - 1  # events between collections (mask)

_NO_SIGNATURE = bytes(64)


@dataclass(frozen=True, eq=False)
class PlaceholderSigner(Identity):
    """An honest in-process core's identity in fast mode: the same key and
    peer id, but ``sign`` gives 64 zero bytes, an Ed25519 signature's size.

    In fast mode no receiver checks a signature (the shared cache is
    ``trusted``), so the real ones were computed only to be ignored: runs
    without them take 0.83x to 0.87x the CPU (docs/benchmarks.md, "no
    signatures in fast mode"). The messages keep their sizes and everything
    else in their bytes, and ``fast=False`` signs and verifies for real
    with the same results (tests/netsim/test_netsim_sim.py)."""

    def sign(self, data: bytes) -> bytes:
        return _NO_SIGNATURE


def _collect_and_freeze() -> None:
    """The loop's garbage collection, every 2^20 events: collect what was
    made since the last call (the young generations), then freeze what
    survived out of every later collection."""
    gc.collect(1)
    gc.freeze()


@contextmanager
def _young_gc() -> Iterator[None]:
    """No automatic garbage collection while the loop runs.

    A large swarm holds millions of long-lived objects (views, ledgers,
    queued messages). CPython's full collections walk all of them, and took
    a third of a 5,000-peer run's time. Its young collections cost too:
    with the earlier thresholds (100,000, 50, 100), every 50th walked the
    millions of objects made since the last freeze, and each checks every
    object it walks against its referents, scattered over gigabytes. In a
    10,000-peer run that was 7 to 10% of the CPU, and 12% with the data it
    evicted from the caches (against a run with no collection at all; up
    to 6% per 20 simulated seconds remained with only the youngest
    generation collected). The
    simulation makes little cyclic garbage: that run's peak RSS was the
    same with no collection at all. So automatic collection is off, and
    the loop collects the young generations itself every 2^20 events, then
    freezes what survived (``gc.freeze``: no later collection walks it; it
    is still freed by reference counting): garbage cycles live at most
    that long. Results do not depend on it: nothing in the simulation reads
    object identity or finalisers.
    Re-entrant: only the outermost one turns collection off and back on
    and unfreezes. ``netsim run`` runs the loop in slices of ~0.25 s for
    its progress line; restoring CPython's settings after each slice made
    the next allocations collect every unfrozen object of a 10,000-peer
    swarm, 18% of such a run's time (py-spy), so ``run_sim`` holds one
    around the slices.
    """
    global _gc_depth
    _gc_depth += 1
    if _gc_depth > 1:
        try:
            yield
        finally:
            _gc_depth -= 1
        return
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        _gc_depth -= 1
        if was:
            gc.enable()
        gc.unfreeze()


_gc_depth = 0


@dataclass(eq=False)
class NodeRec:
    id: str
    core: Any
    is_peer: bool
    region: str
    profile: Profile | None = None
    name: str = ""  # tenant name for clients, profile name for peers
    alive: bool = False  # started and not crashed/left
    started: bool = False
    leaving: bool = False
    sched: float | None = None  # the deadline of the valid POLL in the heap
    resched_pending: bool = False
    start_t: float = 0.0
    end_t: float | None = None
    fate: str = "live"  # live | crashed | left
    #: the shards running here, their levels' segments and the busy GPU-seconds
    #: and joules of the closed ones (fedswarm.core.runs, as every driver keeps them)
    runs: Runs = field(default_factory=Runs)
    msgs: int = 0
    bytes: int = 0
    # -- injected faults ([[faults]]) --
    hung: bool = False  # connected but silent: inputs dropped, no polls
    windows: tuple[tuple[float, float, float], ...] = ()  # (start, end, speed): slow (1/factor), hang (0)
    offline: tuple[tuple[float, float], ...] = ()  # client-disconnect windows
    fault_ids: list[int] = field(default_factory=list)  # indices into scenario.faults
    deferred: list[tuple] = field(default_factory=list)  # FIN actions that fell in a hang (schedule() hangs)
    #: a partitioned run's stand-in for a node another part runs (netsim.parallel):
    #: no core; its liveness as that part last reported it
    remote: bool = False
    part: int = 0  # the part that runs it (partitioned runs)


class Simulator:
    def __init__(
        self, scenario: Scenario, seed: int = 0, *, jobs: list[TraceJob] | None = None, fast: bool = True,
        plan: Plan | None = None,
    ) -> None:
        """``plan``: one made by ``netsim.plan.make_plan(scenario, seed, jobs=jobs)`` (made here if None)."""
        hugepages.enable()  # the swarm's objects on huge pages, where built (netsim.hugepages)
        if plan is None:
            plan = make_plan(scenario, seed, jobs=jobs)
        self.plan = plan
        self.sc = scenario
        self.seed = seed
        self.net_rng = random.Random()
        self.net_rng.setstate(plan.net_rng_state)
        self.churn_rng = random.Random()
        self.churn_rng.setstate(plan.churn_rng_state)
        self.net = plan.net
        # fast: every envelope is an honest core's, signed with a placeholder
        self.cache = VerifyCache(capacity=1 << 18, trusted=fast)
        self.fast = fast
        self.now = 0.0
        #: the events, by (time, seq): netsim.eventq (compiled when built)
        self.q = event_queue()
        self.seq = 0
        self.nodes: dict[str, NodeRec] = {}
        self._members: list[str] | None = None  # sorted alive node ids (pubsub targets)
        self.client_cfg = ClientConfig(**scenario.client_overrides)
        self.events = 0
        self.msgs = 0
        self.bytes = 0
        self.msg_kinds: Counter[str] = Counter()
        self.bytes_kinds: Counter[str] = Counter()
        self.net_stats: Counter[str] = Counter()
        self.spins = 0
        self.intervals: list[tuple[float, float, str, int]] = []  # start, end, tenant, gpus (completed runs)
        self.wasted_gpu_s = 0.0
        self.capacity = StepFn(0.0, 0.0)
        #: (profile name, its slots x throughput) -> live, non-leaving peers of it
        self._cap_n: dict[tuple[str, float], int] = {}
        self.active_tenants = StepFn(0.0, 0.0)
        self._tenant_open: Counter[str] = Counter()
        self.stop_at = scenario.max_time_s
        self.all_done_t: float | None = None

        # -- the plan's swarm, tenants, workload, faults -------------------
        self.boot = plan.boot
        for p in plan.peers:
            self._add_peer(p, self.boot)
        self.initial_peers = plan.initial_peers
        self.part_b: list[frozenset[str] | None] = list(plan.part_b)
        self.trace = plan.trace
        self.jobs: dict[str, JobRec] = {j.job_id: JobRec(j) for j in self.trace}
        self._jobs_here = len(self.jobs)  # the jobs this loop's clients submit (netsim.parallel: a part's)
        self.clients: dict[str, NodeRec] = {}  # tenant name -> rec
        self.tenant_of: dict[str, str] = {}  # client peer id -> tenant name
        for c in plan.clients:
            self._add_client(c)
        self.fault_targets: list[tuple[str, ...]] = plan.fault_targets
        self.delay_faults: list[tuple[float, float, float, float, str]] = plan.delay_faults
        self.fault_stats: Counter[str] = Counter()
        self.gc_tenant: dict[str, Counter[str]] = {}  # client id -> counters of GC at the peers
        self.lapsed_at: Counter[str] = Counter()  # peer id -> client polls that found its leases lapsed
        for t, kind, subject, arg in plan.actions:
            k = _ACTION[kind]
            if not self._runs_action(k, subject):
                continue
            if k in (SUBMIT, JOIN):
                self._push(t, k, subject, None, None)
            else:
                self._push(t, k, self.nodes[subject], arg, None)

    # ------------------------------------------------------------------
    # construction

    def _runs_action(self, kind: int, subject: Any) -> bool:
        """Whether this loop performs a planned action (a partitioned run's
        part performs only those of the nodes it runs: netsim.parallel)."""
        return True

    def _node(self, rec: NodeRec) -> NodeRec:
        """File ``rec`` with the plan's faults for it."""
        plan = self.plan
        rec.windows = plan.windows.get(rec.id, ())
        rec.offline = plan.offline.get(rec.id, ())
        rec.fault_ids = list(plan.fault_ids.get(rec.id, ()))
        self.nodes[rec.id] = rec
        return rec

    def _signer(self, identity: Identity) -> Identity:
        """The identity a core signs with: the plan's, or in fast mode the
        same key with a placeholder signature (``PlaceholderSigner``)."""
        return PlaceholderSigner(identity.private_key) if self.fast else identity

    def _add_peer(self, p: PeerPlan, boot: tuple[str, ...]) -> NodeRec:
        rec = self._node(NodeRec(p.id, None, True, p.region, p.profile, p.profile.name,
                                 runs=Runs(p.profile.power.power)))
        cfg = p.profile.peer_config(**{**self.sc.peer_overrides, "region": p.region, "bootstrap": boot})
        # fast: what a core signs goes into the shared (trusted) cache as it
        # signs it (Node._encode), so no receiver decodes it
        rec.core = PeerCore(self._signer(p.identity), cfg, random.Random(p.core_seed), verify_cache=self.cache)
        return rec

    def _add_client(self, c: ClientPlan) -> NodeRec:
        cfg = replace(self.client_cfg, bootstrap=self.boot)
        core = ClientCore(self._signer(c.identity), cfg, random.Random(c.core_seed), verify_cache=self.cache)
        rec = self._node(NodeRec(c.id, core, False, c.region, None, c.tenant))
        self.clients[c.tenant] = rec
        self.tenant_of[rec.id] = c.tenant
        return rec

    def _finish_at(self, rec: NodeRec, start: float, work: float) -> float:
        """When a run of ``work`` seconds started at ``start`` ends, given the
        peer's speed windows (slow: 1/factor, hung: 0, overlaps multiply)."""
        if not rec.windows:
            return start + work
        pts = sorted({x for a, b, _ in rec.windows for x in (a, b) if start < x < math.inf})
        t, left = start, work
        for nxt in pts + [math.inf]:
            speed = 1.0
            for a, b, v in rec.windows:
                if a <= t < b:
                    speed *= v
            if speed > 0:
                if nxt == math.inf or left <= (nxt - t) * speed:
                    return t + left / speed
                left -= (nxt - t) * speed
            t = nxt
        return math.inf

    def _offline(self, rec: NodeRec) -> bool:
        now = self.now
        return any(a <= now < b for a, b in rec.offline)

    def _extra_delay(self, a: str, b: str) -> float:
        extra = 0.0
        now = self.now
        for start, end, frac, delay, tag in self.delay_faults:
            if start <= now < end and (frac >= 1.0 or self.net.link_unit(tag, a, b) < frac):
                extra += delay
        return extra

    def hang(self, rec: NodeRec) -> None:
        if rec.alive and not rec.hung:
            rec.hung = True
            self.fault_stats["peers_hung"] += 1

    def resume(self, rec: NodeRec) -> None:
        """A hung peer wakes up: it polls at once (abandoning leases whose
        client it has not heard from for lease_grace_s) and runs on."""
        if not rec.alive or not rec.hung:
            return
        rec.hung = False
        rec.sched = None
        self.fault_stats["peers_resumed"] += 1
        for key, gen in rec.deferred:
            self._push(self.now, FIN, rec, key, gen)
        rec.deferred.clear()
        self._poll(rec)

    # ------------------------------------------------------------------
    # queue plumbing

    def _push(self, t: float, kind: int, a: Any, b: Any, c: Any) -> None:
        self.seq += 1
        self.q.push(t, self.seq, kind, a, b, c)

    def _resched(self, rec: NodeRec, after_poll: bool = False) -> None:
        if not rec.alive:
            return
        d = rec.core.next_deadline()
        if d <= self.now:
            if after_poll:  # a poll left something due at once: don't spin in place
                self.spins += 1
                d = self.now + 1e-3
            else:
                d = self.now
        if d != rec.sched:
            rec.sched = d
            if d < math.inf:
                self._push(d, POLL, rec, d, None)

    def _after(self, rec: NodeRec, after_poll: bool = False) -> None:
        """Bookkeeping after a node handled an input."""
        if rec.leaving and rec.alive and rec.core.idle:
            self._remove(rec, "left")
            return
        if rec.is_peer or after_poll:
            self._resched(rec, after_poll)
        elif not rec.resched_pending:
            rec.resched_pending = True
            self._push(self.now + CLIENT_RESCHED_S, RESCHED, rec, None, None)

    def members(self) -> list[str]:
        if self._members is None:
            self._members = sorted(pid for pid, r in self.nodes.items() if r.alive)
        return self._members

    def _cap_update(self, rec: NodeRec, delta: int) -> None:
        """``rec`` (a peer) starts (+1) or stops (-1) counting in the swarm's
        capacity, sum(slots x throughput) over live, non-leaving peers: kept
        as a count per profile, so a change costs O(profiles), not O(peers)
        (at 10,000 peers the rescan cost 10^8 steps over a run's starts)."""
        if rec.profile is None:
            return
        key = (rec.profile.name, rec.profile.slots * rec.profile.speed(self.sc.task))
        self._cap_n[key] = self._cap_n.get(key, 0) + delta
        self.capacity.set(self.now, sum(n * w for (_, w), n in sorted(self._cap_n.items())))

    # ------------------------------------------------------------------
    # network

    def _blocked(self, a: NodeRec, b: NodeRec) -> bool:
        now = self.now
        for p, side_b in zip(self.net.partitions, self.part_b):
            if p.start_s <= now < p.end_s:
                if side_b is None:
                    if (a.region in p.regions) != (b.region in p.regions):
                        return True
                elif (a.id in side_b) != (b.id in side_b):
                    return True
        return False

    def _send(self, src: NodeRec, dst_id: str, data: bytes, kind: str) -> None:
        n = len(data)
        self.msgs += 1
        self.bytes += n
        src.msgs += 1
        src.bytes += n
        self.msg_kinds[kind] += 1
        self.bytes_kinds[kind] += n
        dst = self.nodes.get(dst_id)
        if dst is None or not dst.alive:
            self.net_stats["to_dead"] += 1
            return
        if (src.offline and self._offline(src)) or (dst.offline and self._offline(dst)):
            self.net_stats["client_offline"] += 1
            return
        if self.net.partitions and self._blocked(src, dst):
            self.net_stats["partitioned"] += 1
            return
        delays = self.net.delays(self.net_rng, self.net.latency(src.id, dst_id, src.region, dst.region), n)
        if not delays:
            self.net_stats["lost"] += 1
        elif len(delays) > 1:
            self.net_stats["duplicated"] += 1
        if self.delay_faults and delays:
            extra = self._extra_delay(src.id, dst_id)
            if extra > 0:
                self.net_stats["delayed"] += 1
                delays = [d + extra for d in delays]
        if dst.remote:  # another part runs it (netsim.parallel)
            self._post(dst, src.id, data, delays)
            return
        for d in delays:
            self._push(self.now + d, MSG, dst, src.id, data)

    def _post(self, dst: NodeRec, src_id: str, data: bytes, delays: list[float]) -> None:
        raise AssertionError("a remote node in an unpartitioned run")

    # ------------------------------------------------------------------
    # effects

    def _perform(self, rec: NodeRec, effects: list[Any]) -> None:
        for e in effects:
            t = type(e)
            if t is Send:
                self._send(rec, e.to, e.data, e.kind)
            elif t is Publish:
                targets = [m for m in self.members() if m != rec.id]
                k = self.sc.pubsub_fanout
                if k and len(targets) > k:
                    targets = self.net_rng.sample(targets, k)
                for m in targets:
                    self._send(rec, m, e.data, e.kind)
            elif t is RunShard:
                old = rec.runs.start(self.now, e)  # a run under the same key ends, unfinished
                if old is not None:
                    self._ended(old, completed=False)
                key = run_key(e)
                run = rec.runs.get(key)
                assert run is not None
                fin_t = self._finish_at(rec, self.now, e.run_s)
                if fin_t < math.inf:  # a peer hung for good never finishes it
                    self._push(fin_t, FIN, rec, key, run.gen)
                ck = self.sc.checkpoint_s
                # (a peer slowed by a fault window saves none: its progress
                # is not what the core's clock says)
                if ck > 0 and e.run_s > ck and not rec.windows:
                    self._push(self.now + ck, CKPT, rec, key, (self.now, e.run_s * e.level))
            elif t is SetLevel:
                run = rec.runs.set_level(self.now, e)
                if run is None:
                    continue
                # the core's new run time counts from the run's start
                fin_t = self._finish_at(rec, self.now, run.left(self.now))
                if fin_t < math.inf:
                    self._push(fin_t, FIN, rec, run_key(e), run.gen)
            elif t is CancelShard:
                ended = rec.runs.end(self.now, run_key(e))
                if ended is not None:
                    self._ended(ended, completed=False)
            elif t is ShardDelivered:
                job = self.jobs.get(e.job_id)
                if job is not None:
                    n = job.delivered.get(e.shard, 0)
                    if not n:
                        self.shards_delivered += 1
                    job.delivered[e.shard] = n + 1
                    job.delivered_by.setdefault(e.shard, (e.peer, e.attempt))
                    job.energy_j += e.energy_j
                    job.carbon_g += e.carbon_g
                    job.gpu_s += e.gpu_s
            elif t is JobFinished:
                self._job_finished(rec, e)

    def _ended(self, ended: Ended, *, completed: bool) -> None:
        """A run ended (its joules are charged to the peer by ``Runs``): a
        completed run counts in its tenant's share, any other is waste."""
        e = ended.effect
        if completed:
            self.intervals.append((ended.began, ended.ended, self.tenant_of.get(e.tenant, e.tenant), ended.gpus))
        else:
            self.wasted_gpu_s += ended.seconds * ended.gpus

    def _job_finished(self, rec: NodeRec, e: JobFinished) -> None:
        job = self.jobs.get(e.job_id)
        if job is None or job.finish_t is not None:
            return
        job.finish_t = self.now
        job.ok = e.ok
        self._finished += 1
        tname = job.tj.tenant
        self._tenant_open[tname] -= 1
        self.active_tenants.set(self.now, sum(1 for v in self._tenant_open.values() if v > 0))
        self._push(self.now + self.sc.forget_after_s, FORGET, rec, e.job_id, None)
        if self._finished == self._jobs_here and self._submitted == self._jobs_here:
            self._all_done()

    def _all_done(self) -> None:
        """Every job of the trace (that this loop submits) has finished."""
        self.all_done_t = self.now
        self.stop_at = min(self.stop_at, self.now + self.sc.settle_s)

    _submitted = 0
    _finished = 0
    #: shards of the trace delivered at least once (progress: ``netsim.progress``)
    shards_delivered = 0

    # ------------------------------------------------------------------
    # churn

    def _start(self, rec: NodeRec) -> None:
        rec.alive = rec.started = True
        rec.start_t = self.now
        self._members = None
        if rec.is_peer:
            self._cap_update(rec, +1)
        self._perform(rec, rec.core.start(self.now))
        self._after(rec)

    def _remove(self, rec: NodeRec, fate: str) -> None:
        for ended in rec.runs.end_all(self.now):
            self._ended(ended, completed=False)
        counted = rec.alive and not rec.leaving
        rec.alive = False
        rec.end_t = self.now
        rec.fate = fate
        rec.sched = None
        self._members = None
        if rec.is_peer and counted:
            self._cap_update(rec, -1)

    def crash(self, rec: NodeRec) -> None:
        if rec.alive:
            self._remove(rec, "crashed")

    def leave(self, rec: NodeRec) -> None:
        if not rec.alive or rec.leaving:
            return
        rec.leaving = True
        if rec.is_peer:
            self._cap_update(rec, -1)
        self._perform(rec, rec.core.handle(self.now, Leave()))
        self._push(self.now + self.sc.churn.leave_grace_s, LEAVE_END, rec, None, None)
        self._after(rec)

    def _leave_end(self, rec: NodeRec) -> None:
        if not rec.alive:
            return
        self._perform(rec, rec.core.handle(self.now, HandBackRunning()))
        self._remove(rec, "left")

    def _join(self, p: PeerPlan) -> None:
        live = [m for m in self.members() if self.nodes[m].is_peer and not self.nodes[m].leaving]
        boot = tuple(self.churn_rng.sample(live, min(len(live), max(self.sc.bootstrap_peers, 1))))
        self._start(self._add_peer(p, boot))

    def _submit(self, tj: TraceJob) -> None:
        rec = self.clients[tj.tenant]
        job = self.jobs[tj.job_id]
        job.submit_t = self.now
        job.submitted = True
        self._submitted += 1
        self._tenant_open[tj.tenant] += 1
        self.active_tenants.set(self.now, sum(1 for v in self._tenant_open.values() if v > 0))
        req = JobRequest(
            task=self.sc.task_of(tj.tenant),
            shards=tj.shards,
            work_s=tj.duration_s,
            gpus=tj.gpus_per_shard,
            chain=tj.chain,
            deadline_s=tj.deadline_s,
            weight=tj.weight,
            lam=tj.lam,
            job_id=tj.job_id,
        )
        self._perform(rec, rec.core.handle(self.now, Submit(req)))  # JobAccepted first: nothing to do
        self._after(rec)

    # ------------------------------------------------------------------
    # the loop

    def run_until(self, t_end: float) -> None:
        """Process every action due before ``t_end`` (or the run's stop time)."""
        with _young_gc():
            self._loop(t_end)

    def young_gc(self) -> Any:
        """The loop's garbage-collection settings (``_young_gc``) for a
        caller that calls ``run_until`` many times: hold it around them."""
        return _young_gc()

    def _loop(self, t_end: float) -> None:
        q = self.q
        pop, peek = q.pop, q.peek_time
        freeze = _collect_and_freeze
        while q:
            t = peek()
            if t >= t_end or t > self.stop_at:
                break
            _, kind, a, b, c = pop()
            self.now = t
            self.events += 1
            if not self.events & _FREEZE_EVERY:
                freeze()  # collect the young, then freeze the survivors
            if kind == MSG:
                if not a.alive:
                    continue
                if a.hung:  # accepted by the connection, never handled
                    self.net_stats["to_hung"] += 1
                    continue
                if a.offline and self._offline(a):  # in flight when the client lost its network
                    self.net_stats["client_offline"] += 1
                    continue
                self._perform(a, a.core.handle(t, MessageReceived(b, c)))
                self._after(a)
            elif kind == POLL:
                if not a.alive or a.sched != b or a.hung:
                    continue
                a.sched = None
                self._poll(a)
            elif kind == FIN:
                if not a.runs.is_current(b, c) or not a.alive:
                    continue
                if a.hung:  # only for hangs without a speed window (schedule()): noticed on resume
                    a.deferred.append((b, c))
                    continue
                ended = a.runs.end(t, b)
                assert ended is not None
                self._ended(ended, completed=True)
                e: RunShard = ended.effect
                began, energy = ended.began, ended.energy_j
                # deterministic result bytes per (job, shard): replicas agree
                res = f"{e.job_id}/{e.shard}".encode()
                # the executor reports what it measured: longer than expected on a slowed/hung peer
                run_s = e.run_s if not a.windows else t - began
                fin = ShardFinished(e.tenant, e.job_id, e.shard, e.attempt, True, res, run_s=run_s, energy_j=energy)
                self._perform(a, a.core.handle(t, fin))
                self._after(a)
            elif kind == CKPT:
                self._checkpoint(a, b, c)
            elif kind == RESCHED:
                a.resched_pending = False
                self._resched(a)
            elif kind == SUBMIT:
                self._submit(a)
            elif kind == START:
                self._start(a)
            elif kind == CRASH:
                self.crash(a)
            elif kind == LEAVE:
                self.leave(a)
            elif kind == LEAVE_END:
                self._leave_end(a)
            elif kind == JOIN:
                self._join(a)
            elif kind == FORGET:
                self._harvest_holders(a, b)
                a.core.forget(b)
            elif kind == HANG:
                self.hang(a)
            elif kind == RESUME:
                self.resume(a)
        self.now = max(self.now, min(t_end, self.stop_at)) if t_end < math.inf else self.now

    def _checkpoint(self, rec: NodeRec, key: Any, began_work: tuple[float, float]) -> None:
        """A running shard's task saves its progress (every
        ``workload.checkpoint_s`` of its run): the share of the shard's work
        behind it, counting what the run it resumed from had done. The
        state stands for the task's: a few bytes naming the point."""
        began, work = began_work
        run = rec.runs.get(key)
        if run is None or run.began != began or not rec.alive or rec.hung:
            return
        now = self.now
        e = run.effect
        # the core's clock: what is left of the run, at its level, in full-clock seconds
        left_w = run.left(now) * e.level
        done = (1.0 - e.left) + e.left * (1.0 - left_w / work)
        if 1.0 - e.left < done < 1.0:
            state = f"{e.job_id}/{e.shard}@{done:.6f}".encode()
            self._perform(rec, rec.core.handle(now, ShardProgress(e.tenant, e.job_id, e.shard, e.attempt, done,
                                                                  state)))
            self._after(rec)
        if run.left(now) > self.sc.checkpoint_s:
            self._push(now + self.sc.checkpoint_s, CKPT, rec, key, began_work)

    def _poll(self, rec: NodeRec) -> None:
        core = rec.core
        if rec.is_peer and (core.leases or core.outbox):
            # attribute the peer's garbage collection (abandoned leases,
            # undeliverable results) to the tenants whose work it was
            leases, outbox = tuple(core.leases), tuple(core.outbox)
            ab0, un0 = core.stats["leases_abandoned"], core.stats["results_undelivered"]
            effects = core.poll(self.now)
            if core.stats["leases_abandoned"] != ab0:
                for k in leases:
                    if k not in core.leases:
                        self.gc_tenant.setdefault(k[0], Counter())["leases_abandoned"] += 1
            if core.stats["results_undelivered"] != un0:
                for k in outbox:
                    if k not in core.outbox:
                        self.gc_tenant.setdefault(k[0], Counter())["results_undelivered"] += 1
        elif not rec.is_peer and self.sc.faults:
            # which peers' leases lapsed at this client (it marks them suspect)
            n0 = core.stats["leases_lapsed"]
            effects = core.poll(self.now)
            if core.stats["leases_lapsed"] != n0:
                until = self.now + core.config.suspect_s
                suspects = core.suspects
                for pid in sorted(suspects):
                    if suspects[pid] == until:
                        self.lapsed_at[pid] += 1
        else:
            effects = core.poll(self.now)
        self._perform(rec, effects)
        self._after(rec, after_poll=True)

    def _harvest_holders(self, client: NodeRec, job_id: str) -> None:
        """Keep which peer held which attempt of each shard before the client forgets the job."""
        job = self.jobs.get(job_id)
        cj = getattr(client.core, "jobs", {}).get(job_id)
        if job is not None and cj is not None and job.holders is None:
            job.holders = {sh.index: dict(sh.holders) for sh in cj.shards}

    def run(self) -> None:
        self.run_until(math.inf)
        if self.stop_at < math.inf:
            self.now = max(self.now, min(self.stop_at, self.sc.max_time_s))

    # ------------------------------------------------------------------
    # inspection (tests)

    def schedule(self, t: float, what: str, pid: str) -> None:
        """Schedule a ``crash``, graceful ``leave``, ``hang`` or ``resume`` of peer ``pid`` at ``t``.

        (A ``hang`` scheduled here stops message handling and polls; a shard
        that finishes meanwhile is noticed on ``resume``. ``[[faults]]`` hangs
        also pause the running shards.)"""
        kinds = {"crash": CRASH, "leave": LEAVE, "hang": HANG, "resume": RESUME}
        self._push(t, kinds[what], self.nodes[pid], None, None)

    def live_peers(self) -> list[NodeRec]:
        return [self.nodes[m] for m in self.members() if self.nodes[m].is_peer]

    def peer(self, pid: str) -> PeerCore:
        return self.nodes[pid].core

    # ------------------------------------------------------------------
    # results

    def record(self) -> RunRecord:
        """What the run left, as ``netsim.report`` reads it."""
        end = self.now
        nodes = {pid: self._node_run(r, end) for pid, r in self.nodes.items()}
        holders = self._holders()
        return RunRecord(
            scenario=self.sc, seed=self.seed, end=end, events=self.events, jobs=self.jobs,
            submitted=self._submitted, nodes=nodes, clients={t: nodes[c.id] for t, c in self.clients.items()},
            initial_peers=len(self.initial_peers), intervals=self.intervals, wasted_gpu_s=self.wasted_gpu_s,
            capacity=self.capacity, active_tenants=self.active_tenants, msgs=self.msgs, bytes=self.bytes,
            msg_kinds=self.msg_kinds, bytes_kinds=self.bytes_kinds, net_stats=self.net_stats, holders=holders,
            fault_targets=self.fault_targets, fault_stats=self.fault_stats, gc_tenant=self.gc_tenant,
            lapsed_at=self.lapsed_at,
        )

    def _holders(self) -> dict[str, dict[int, dict[int, str]]]:
        """Which peer held which attempt of each job's shards (job id -> shard -> attempt -> peer)."""
        holders: dict[str, dict[int, dict[int, str]]] = {}
        for jid in sorted(self.jobs):
            j = self.jobs[jid]
            if j.holders is not None:
                holders[jid] = j.holders
            else:
                cj = getattr(self.clients[j.tj.tenant].core, "jobs", {}).get(jid)
                if cj is not None:
                    holders[jid] = {sh.index: dict(sh.holders) for sh in cj.shards}
        return holders

    @staticmethod
    def _node_run(r: NodeRec, end: float) -> NodeRun:
        stale = 0
        if r.is_peer and r.alive and not r.hung:
            grace = r.core.config.lease_grace_s
            stale = sum(1 for lease in r.core.leases.values() if end - lease.last_ack_at > grace + 1.0)
        return NodeRun(
            id=r.id, is_peer=r.is_peer, name=r.name, profile=r.profile, started=r.started, start_t=r.start_t,
            end_t=r.end_t, fate=r.fate, hung=r.hung, busy_gpu_s=r.runs.busy_s, busy_energy_j=r.runs.busy_j,
            msgs=r.msgs, bytes=r.bytes, open_runs=open_runs(r.runs),
            stats=r.core.stats, rejected=r.core.rejected, stale_leases=stale, fault_ids=r.fault_ids,
        )

    def results(self) -> dict[str, Any]:
        # the report is built under the loop's collection settings too: with
        # CPython's own, its allocations set off full collections of the
        # whole swarm (0.73 against 0.21 CPU s at 3,000 peers)
        with _young_gc():
            return report(self.record())
