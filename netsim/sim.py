"""The deterministic discrete-event loop that drives the sans-IO cores.

One heap of ``(time, seq, kind, a, b, c)`` actions; ``seq`` is a global
counter, so ties break in insertion order and a seed replays a run exactly.
Every core's next deadline lives in the heap as a ``POLL`` action; a popped
poll whose deadline is no longer the node's scheduled one is stale and
skipped, so a step costs O(log events), not O(nodes).

Randomness: one master ``random.Random(seed)``; every component (identities,
each core, network, churn, workload) gets its own RNG seeded from it, in a
fixed order. Nothing iterates a set or reads the wall clock.
"""

from __future__ import annotations

import gc
import heapq
import math
import random
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from fedswarm.core.client import ClientCore, JobRequest
from fedswarm.core.config import ClientConfig
from fedswarm.core.events import (
    CancelShard,
    JobFinished,
    Leave,
    MessageReceived,
    Publish,
    RunShard,
    Send,
    SetLevel,
    ShardDelivered,
    ShardFinished,
)
from fedswarm.core.identity import Identity
from fedswarm.core.peer import PeerCore
from fedswarm.errors import RemoteProtocolError
from fedswarm.core.wire import VerifyCache, decode_unverified
from fedswarm.profiles import Profile

from .metrics import StepFn, jain, rho
from .network import Partition
from .scenario import Scenario
from .workload import TraceJob

__all__ = ["Simulator", "NodeRec", "JobRec"]

MSG, POLL, FIN, SUBMIT, START, CRASH, LEAVE, LEAVE_END, JOIN, FORGET, RESCHED, HANG, RESUME = range(13)
CLIENT_RESCHED_S = 0.01  # a client's deadline is re-read at most this late after a message
_FREEZE_EVERY = (1 << 20) - 1  # events between gc.freeze() calls (mask)


#: which cost a message kind counts under in the results' message split
MSG_CLASS = {
    "Gossip": "gossip", "PeerState": "gossip",
    "LeaseRenew": "leases", "LeaseAck": "leases", "LeaseRenewBatch": "leases", "LeaseAckBatch": "leases",
}  # everything else (calls for bids, bids, awards, declines, cancels, results and their acks): scheduling


def _split(kinds: Counter[str], peer_s: float) -> dict[str, float]:
    """Messages (or bytes) per peer per second, by cost class."""
    out = {"gossip": 0.0, "leases": 0.0, "scheduling": 0.0}
    if peer_s > 0:
        for kind, n in sorted(kinds.items()):
            out[MSG_CLASS.get(kind, "scheduling")] += n / peer_s
    return out


@contextmanager
def _young_gc() -> Iterator[None]:
    """Collect only young objects while the loop runs.

    A large swarm holds millions of long-lived objects (views, ledgers,
    queued messages). CPython's full collections walk all of them, and took
    a third of a 5,000-peer run's time. The loop freezes what has survived
    every 2^20 events (``gc.freeze``: later collections skip it; it is
    still freed by reference counting) and collects less often. Results do
    not depend on it: nothing in the simulation reads object identity or
    finalisers.
    """
    old = gc.get_threshold()
    gc.set_threshold(100_000, 50, 100)
    try:
        yield
    finally:
        gc.set_threshold(*old)
        gc.unfreeze()


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
    running: dict[tuple, tuple] = field(default_factory=dict)  # key -> (gen, segment start, RunShard)
    # key -> (start of the run, joules of its earlier segments): a run whose
    # level changed (SetLevel) is accounted segment by segment
    segs: dict[tuple, tuple[float, float]] = field(default_factory=dict)
    busy_gpu_s: float = 0.0
    busy_energy_j: float = 0.0
    msgs: int = 0
    bytes: int = 0
    # -- injected faults ([[faults]]) --
    hung: bool = False  # connected but silent: inputs dropped, no polls
    windows: tuple[tuple[float, float, float], ...] = ()  # (start, end, speed): slow (1/factor), hang (0)
    offline: tuple[tuple[float, float], ...] = ()  # client-disconnect windows
    fault_ids: list[int] = field(default_factory=list)  # indices into scenario.faults
    deferred: list[tuple] = field(default_factory=list)  # FIN actions that fell in a hang (schedule() hangs)


@dataclass(eq=False)
class JobRec:
    tj: TraceJob
    submit_t: float = 0.0
    submitted: bool = False
    finish_t: float | None = None
    ok: bool | None = None
    delivered: dict[int, int] = field(default_factory=dict)  # shard -> deliveries
    energy_j: float = 0.0
    carbon_g: float = 0.0
    gpu_s: float = 0.0
    delivered_by: dict[int, tuple[str, int]] = field(default_factory=dict)  # shard -> (peer, attempt), first
    holders: dict[int, dict[int, str]] | None = None  # shard -> attempt -> peer (taken before forget)


class Simulator:
    def __init__(
        self, scenario: Scenario, seed: int = 0, *, jobs: list[TraceJob] | None = None, fast: bool = True
    ) -> None:
        self.sc = scenario
        self.seed = seed
        master = random.Random(seed)
        self.id_rng = random.Random(master.getrandbits(64))
        self.core_rng = random.Random(master.getrandbits(64))
        self.net_rng = random.Random(master.getrandbits(64))
        self.churn_rng = random.Random(master.getrandbits(64))
        self.place_rng = random.Random(master.getrandbits(64))
        work_rng = random.Random(master.getrandbits(64))
        self.net = replace(scenario.network, seed=master.getrandbits(64))
        self.fault_rng = random.Random(master.getrandbits(64))
        self.cache = VerifyCache(capacity=1 << 18)
        self.fast = fast
        self.now = 0.0
        self.q: list[tuple] = []
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
        self.gen = 0
        self.intervals: list[tuple[float, float, str, int]] = []  # start, end, tenant, gpus (completed runs)
        self.wasted_gpu_s = 0.0
        self.capacity = StepFn(0.0, 0.0)
        #: (profile name, its slots x throughput) -> live, non-leaving peers of it
        self._cap_n: dict[tuple[str, float], int] = {}
        self.active_tenants = StepFn(0.0, 0.0)
        self._tenant_open: Counter[str] = Counter()
        self.stop_at = scenario.max_time_s
        self.all_done_t: float | None = None

        # -- peers ------------------------------------------------------
        self._region_names = sorted(scenario.regions)
        self._region_w = [scenario.regions[r] for r in self._region_names]
        order: list[NodeRec] = []
        for g in scenario.swarm:
            prof = scenario.profiles[g.profile]
            for _ in range(g.count):
                order.append(self._new_peer(prof, g.region))
        self.boot = tuple(r.id for r in order[: max(scenario.bootstrap_peers, 1)])
        for rec in order:
            rec.core = self._peer_core(rec, self.boot)
            self._push(self.place_rng.uniform(0, scenario.warmup_s / 2), START, rec, None, None)
        self.initial_peers = sorted(r.id for r in order)

        # -- partitions: side B per partition ------------------------------
        self.part_b: list[frozenset[str] | None] = []
        for p in self.net.partitions:
            if p.regions:
                self.part_b.append(None)
            else:
                ids = list(self.initial_peers)
                random.Random(self.churn_rng.getrandbits(64)).shuffle(ids)
                self.part_b.append(frozenset(ids[: int(round(p.fraction * len(ids)))]))

        # -- workload and tenants ----------------------------------------
        self.trace = list(jobs) if jobs is not None else scenario.jobs(work_rng)
        self.jobs: dict[str, JobRec] = {}
        self.clients: dict[str, NodeRec] = {}  # tenant name -> rec
        self.tenant_of: dict[str, str] = {}  # client peer id -> tenant name
        for tname in sorted({j.tenant for j in self.trace}):
            self._add_client(tname)
        for j in self.trace:
            if j.job_id in self.jobs:
                raise ValueError(f"duplicate job_id {j.job_id!r}")
            self.jobs[j.job_id] = JobRec(j)
            self._push(scenario.warmup_s + j.arrival_s, SUBMIT, j, None, None)

        # -- churn ----------------------------------------------------------
        ch = scenario.churn
        n0 = len(self.initial_peers)
        n_crash = int(round(ch.crash_fraction * n0))
        n_leave = int(round(ch.leave_fraction * n0))
        victims = self.churn_rng.sample(self.initial_peers, n_crash + n_leave)
        for pid in victims[:n_crash]:
            self._push(self.churn_rng.uniform(*ch.crash_window_s), CRASH, self.nodes[pid], None, None)
        for pid in victims[n_crash:]:
            self._push(self.churn_rng.uniform(*ch.leave_window_s), LEAVE, self.nodes[pid], None, None)
        profs = [scenario.profiles[g.profile] for g in scenario.swarm]
        weights = [g.count for g in scenario.swarm]
        for _ in range(ch.join_count):
            k = self.churn_rng.choices(range(len(profs)), weights=weights)[0]
            self._push(self.churn_rng.uniform(*ch.join_window_s), JOIN, profs[k], scenario.swarm[k].region, None)

        # -- injected faults ------------------------------------------------
        self.fault_targets: list[tuple[str, ...]] = []
        self.delay_faults: list[tuple[float, float, float, float, str]] = []
        self.fault_stats: Counter[str] = Counter()
        self.gc_tenant: dict[str, Counter[str]] = {}  # client id -> counters of GC at the peers
        self.lapsed_at: Counter[str] = Counter()  # peer id -> client polls that found its leases lapsed
        if scenario.faults:
            self._setup_faults()

    # ------------------------------------------------------------------
    # construction

    def _identity(self) -> Identity:
        return Identity.from_seed(self.id_rng.randbytes(32))

    def _draw_region(self) -> str:
        return self.place_rng.choices(self._region_names, weights=self._region_w)[0]

    def _new_peer(self, prof: Profile, region: str) -> NodeRec:
        idn = self._identity()
        region = region or prof.region or self._draw_region()
        rec = NodeRec(idn.peer_id, idn, True, region, prof, prof.name)
        self.nodes[rec.id] = rec
        return rec

    def _peer_core(self, rec: NodeRec, boot: tuple[str, ...]) -> PeerCore:
        idn: Identity = rec.core
        assert rec.profile is not None
        cfg = rec.profile.peer_config(**{**self.sc.peer_overrides, "region": rec.region, "bootstrap": boot})
        return PeerCore(idn, cfg, random.Random(self.core_rng.getrandbits(64)), verify_cache=self.cache)

    def _add_client(self, tname: str) -> NodeRec:
        idn = self._identity()
        cfg = replace(self.client_cfg, bootstrap=self.boot)
        core = ClientCore(idn, cfg, random.Random(self.core_rng.getrandbits(64)), verify_cache=self.cache)
        rec = NodeRec(idn.peer_id, core, False, self._draw_region(), None, tname)
        self.nodes[rec.id] = rec
        self.clients[tname] = rec
        self.tenant_of[rec.id] = tname
        self._push(self.sc.warmup_s / 2, START, rec, None, None)
        return rec

    def _setup_faults(self) -> None:
        """Turn ``scenario.faults`` into targets, windows and scheduled actions.

        Draws only from ``fault_rng`` (created after every older RNG), so a
        scenario without faults replays exactly as before.
        """
        rng = self.fault_rng
        n0 = len(self.initial_peers)
        pool = list(self.initial_peers)
        rng.shuffle(pool)  # peer faults take disjoint victims from this order
        for i, f in enumerate(self.sc.faults):
            targets: list[str] = []
            if f.kind in ("crash", "hang", "slow"):
                n = f.count if f.count is not None else int(round((f.fraction or 0.0) * n0))
                n = min(n, len(pool))
                targets, pool = sorted(pool[:n]), pool[n:]
                for pid in targets:
                    rec = self.nodes[pid]
                    rec.fault_ids.append(i)
                    if f.kind == "crash":
                        self._push(rng.uniform(f.start_s, f.end_s), CRASH, rec, None, None)
                    elif f.kind == "hang":
                        rec.windows += ((f.start_s, f.end_s, 0.0),)
                        self._push(f.start_s, HANG, rec, i, None)
                        if f.end_s < math.inf:
                            self._push(f.end_s, RESUME, rec, i, None)
                    else:
                        rec.windows += ((f.start_s, f.end_s, 1.0 / f.factor),)
            elif f.kind == "partition":
                self.net.partitions = self.net.partitions + (Partition(f.start_s, f.end_s, f.fraction or 0.0, f.regions),)
                if f.regions:
                    self.part_b.append(None)
                    targets = [p for p in self.initial_peers if self.nodes[p].region in f.regions]
                else:
                    ids = list(self.initial_peers)
                    random.Random(rng.getrandbits(64)).shuffle(ids)
                    side = frozenset(ids[: int(round((f.fraction or 0.0) * n0))])
                    self.part_b.append(side)
                    targets = sorted(side)
            elif f.kind == "delay":
                self.delay_faults.append((f.start_s, f.end_s, f.fraction if f.fraction is not None else 1.0,
                                          f.delay_s, f"delay{i}"))
            elif f.kind == "client-disconnect":
                names = sorted(self.clients)
                if f.tenant:
                    if f.tenant not in self.clients:
                        raise ValueError(f"faults[{i}]: no tenant {f.tenant!r} in the workload (have {names})")
                    chosen = [f.tenant]
                else:
                    n = f.count if f.count is not None else int(round((f.fraction or 0.0) * len(names)))
                    chosen = sorted(rng.sample(names, min(n, len(names))))
                for tname in chosen:
                    rec = self.clients[tname]
                    rec.offline += ((f.start_s, f.end_s),)
                    rec.fault_ids.append(i)
                    targets.append(rec.id)
            self.fault_targets.append(tuple(targets))

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
        heapq.heappush(self.q, (t, self.seq, kind, a, b, c))

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
        if self.fast:
            # produced by an honest in-process core, so its signature is valid
            # by construction: seed the shared cache (keyed by the exact bytes)
            # and skip the receivers' Ed25519 verify, the costliest step
            mb = dst.core.max_message_bytes
            if self.cache.get(data, mb) is None:
                try:
                    self.cache.add(data, mb, decode_unverified(data, max_bytes=mb))
                except RemoteProtocolError:
                    pass  # let the receiver reject (and count) it

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
        for d in delays:
            self._push(self.now + d, MSG, dst, src.id, data)

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
                self.gen += 1
                key = (e.tenant, e.job_id, e.shard, e.attempt)
                old = rec.running.pop(key, None)
                if old is not None:
                    self._account(rec, old, completed=False)
                rec.running[key] = (self.gen, self.now, e)
                fin_t = self._finish_at(rec, self.now, e.run_s)
                if fin_t < math.inf:  # a peer hung for good never finishes it
                    self._push(fin_t, FIN, rec, key, self.gen)
            elif t is SetLevel:
                key = (e.tenant, e.job_id, e.shard, e.attempt)
                run = rec.running.get(key)
                if run is None:
                    continue
                _, seg_start, old_e = run
                first, acc = rec.segs.get(key, (seg_start, 0.0))
                rec.segs[key] = (first, acc + self._segment(rec, seg_start, old_e))
                # the core's new run time counts from the run's start
                left = max(e.run_s - (self.now - first), 0.0)
                self.gen += 1
                rec.running[key] = (self.gen, self.now, replace(old_e, level=e.level, run_s=e.run_s))
                fin_t = self._finish_at(rec, self.now, left)
                if fin_t < math.inf:
                    self._push(fin_t, FIN, rec, key, self.gen)
            elif t is CancelShard:
                r = rec.running.pop((e.tenant, e.job_id, e.shard, e.attempt), None)
                if r is not None:
                    self._account(rec, r, completed=False)
            elif t is ShardDelivered:
                job = self.jobs.get(e.job_id)
                if job is not None:
                    job.delivered[e.shard] = job.delivered.get(e.shard, 0) + 1
                    job.delivered_by.setdefault(e.shard, (e.peer, e.attempt))
                    job.energy_j += e.energy_j
                    job.carbon_g += e.carbon_g
                    job.gpu_s += e.gpu_s
            elif t is JobFinished:
                self._job_finished(rec, e)

    def _segment(self, rec: NodeRec, seg_start: float, e: RunShard) -> float:
        """Charge the run's time since ``seg_start`` at its level; its joules."""
        gpus = max(e.gpus, 1)
        elapsed = max(self.now - seg_start, 0.0)
        assert rec.profile is not None
        energy = rec.profile.power.power(e.level) * elapsed * gpus
        rec.busy_gpu_s += elapsed * gpus
        rec.busy_energy_j += energy
        return energy

    def _account(self, rec: NodeRec, run: tuple, *, completed: bool) -> float:
        """The run ends: charge its last segment; its total joules."""
        _, seg_start, e = run
        start, earlier = rec.segs.pop((e.tenant, e.job_id, e.shard, e.attempt), (seg_start, 0.0))
        energy = earlier + self._segment(rec, seg_start, e)
        gpus = max(e.gpus, 1)
        if completed:
            self.intervals.append((start, self.now, self.tenant_of.get(e.tenant, e.tenant), gpus))
        else:
            self.wasted_gpu_s += max(self.now - start, 0.0) * gpus
        return energy

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
        if self._finished == len(self.jobs) and self._submitted == len(self.jobs):
            self.all_done_t = self.now
            self.stop_at = min(self.stop_at, self.now + self.sc.settle_s)

    _submitted = 0
    _finished = 0

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
        for key in sorted(rec.running):
            self._account(rec, rec.running[key], completed=False)
        rec.running.clear()
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
        self._perform(rec, rec.core.hand_back_running(self.now))
        self._remove(rec, "left")

    def _join(self, prof: Profile, region: str) -> None:
        rec = self._new_peer(prof, region)
        live = [m for m in self.members() if self.nodes[m].is_peer and not self.nodes[m].leaving]
        boot = tuple(self.churn_rng.sample(live, min(len(live), max(self.sc.bootstrap_peers, 1))))
        rec.core = self._peer_core(rec, boot)
        self._start(rec)

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
        _, effects = rec.core.submit(self.now, req)
        self._perform(rec, effects)
        self._after(rec)

    # ------------------------------------------------------------------
    # the loop

    def run_until(self, t_end: float) -> None:
        """Process every action due before ``t_end`` (or the run's stop time)."""
        with _young_gc():
            self._loop(t_end)

    def _loop(self, t_end: float) -> None:
        q = self.q
        pop = heapq.heappop
        freeze = gc.freeze
        while q:
            t = q[0][0]
            if t >= t_end or t > self.stop_at:
                break
            _, _, kind, a, b, c = pop(q)
            self.now = t
            self.events += 1
            if not self.events & _FREEZE_EVERY:
                freeze()  # survivors so far: out of every later collection
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
                run = a.running.get(b)
                if run is None or run[0] != c or not a.alive:
                    continue
                if a.hung:  # only for hangs without a speed window (schedule()): noticed on resume
                    a.deferred.append((b, c))
                    continue
                del a.running[b]
                e: RunShard = run[2]
                began = a.segs.get(b, (run[1], 0.0))[0]
                energy = self._account(a, run, completed=True)
                # deterministic result bytes per (job, shard): replicas agree
                res = f"{e.job_id}/{e.shard}".encode()
                # the executor reports what it measured: longer than expected on a slowed/hung peer
                run_s = e.run_s if not a.windows else t - began
                fin = ShardFinished(e.tenant, e.job_id, e.shard, e.attempt, True, res, run_s=run_s, energy_j=energy)
                self._perform(a, a.core.handle(t, fin))
                self._after(a)
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
                self._join(a, b)
            elif kind == FORGET:
                self._harvest_holders(a, b)
                a.core.forget(b)
            elif kind == HANG:
                self.hang(a)
            elif kind == RESUME:
                self.resume(a)
        self.now = max(self.now, min(t_end, self.stop_at)) if t_end < math.inf else self.now

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
                for pid in sorted(core._suspect):
                    if core._suspect[pid] == until:
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

    def results(self) -> dict[str, Any]:
        end = self.now
        sc = self.sc
        jobs_out = []
        lost = dup = completed_shards = 0
        per_tenant_rho: dict[str, list[float]] = {}
        per_tenant_jct: dict[str, list[float]] = {}
        for jid in sorted(self.jobs):
            j = self.jobs[jid]
            tj = j.tj
            j_lost = j_dup = j_done = 0
            for s in range(tj.shards):
                n = j.delivered.get(s, 0)
                if n == 0:
                    j_lost += 1 if j.submitted else 0
                else:
                    j_done += 1
                    j_dup += n - 1
            lost += j_lost
            dup += j_dup
            completed_shards += j_done
            rec: dict[str, Any] = {
                "job_id": jid,
                "tenant": tj.tenant,
                "kind": tj.kind,
                "task": sc.task_of(tj.tenant),
                "shards": tj.shards,
                "gpus_per_shard": tj.gpus_per_shard,
                "work_s": tj.duration_s,
                "arrival_s": j.submit_t - sc.warmup_s if j.submitted else None,
                "finished": j.finish_t is not None and bool(j.ok),
                "shards_delivered": j_done,
                "shards_lost": j_lost,
                "shards_duplicated": j_dup,
                "jct_s": None,
                "rho": None,
                "t_alone_s": None,
                "tenants_avg": None,
                "energy_j": j.energy_j,
                "carbon_g": j.carbon_g,
                "gpu_s": j.gpu_s,
            }
            if j.finish_t is not None and j.ok:
                jct = j.finish_t - j.submit_t
                cap = self.capacity.mean(j.submit_t, j.finish_t)
                nten = max(self.active_tenants.mean(j.submit_t, j.finish_t), 1.0)
                r, t_alone = rho(jct, tj.duration_s, tj.shards, tj.gpus_per_shard, tj.chain, cap, nten)
                rec.update(jct_s=jct, rho=r, t_alone_s=t_alone, tenants_avg=nten)
                per_tenant_rho.setdefault(tj.tenant, []).append(r)
                per_tenant_jct.setdefault(tj.tenant, []).append(jct)
            jobs_out.append(rec)

        tenants = sorted(self.clients)
        # GPU-seconds per tenant per bucket (completed runs only)
        first = min((self.jobs[j].submit_t for j in self.jobs if self.jobs[j].submitted), default=0.0)
        last = max((j.finish_t for j in self.jobs.values() if j.finish_t is not None), default=end)
        makespan = max(last - first, 0.0) if self.jobs else 0.0
        bucket = sc.sample_s if sc.sample_s > 0 else max(makespan / 50.0, 1.0)
        nb = max(int(math.ceil(makespan / bucket)), 1) if makespan > 0 else 0
        grid = {t: [0.0] * nb for t in tenants}
        gpu_s_t = dict.fromkeys(tenants, 0.0)
        for s0, s1, tname, g in self.intervals:
            if tname in gpu_s_t:
                gpu_s_t[tname] += (s1 - s0) * g
            a, b = s0 - first, s1 - first
            i = max(int(a // bucket), 0)
            while i < nb and i * bucket < b:
                lo, hi = max(a, i * bucket), min(b, (i + 1) * bucket)
                if hi > lo and tname in grid:
                    grid[tname][i] += (hi - lo) * g
                i += 1
        shares_t: dict[str, list[float]] = {t: [] for t in tenants}
        window_jain = []
        for i in range(nb):
            tot = sum(grid[t][i] for t in tenants)
            active = [t for t in tenants if grid[t][i] > 0]
            for t in tenants:
                shares_t[t].append(grid[t][i] / tot if tot > 0 else 0.0)
            if len(active) >= 2:
                window_jain.append(jain([grid[t][i] for t in active]))

        mean_rho = {t: sum(v) / len(v) for t, v in per_tenant_rho.items()}
        all_rho = [r for v in per_tenant_rho.values() for r in v]
        all_jct = [x for v in per_tenant_jct.values() for x in v]

        # energy: busy (power(level) * run time * gpus, incl. cancelled runs) + idle GPUs at idle_w
        busy_e = idle_e = carbon = 0.0
        slot_s = busy_s = peer_s = 0.0
        floor_w = 0.0  # idle draw of the peers still up at the end
        fates: Counter[str] = Counter()
        msgs_peers = bytes_peers = 0
        for pid in sorted(self.nodes):
            r = self.nodes[pid]
            if not r.is_peer or not r.started:
                continue
            assert r.profile is not None
            t1 = r.end_t if r.end_t is not None else end
            life = max(t1 - r.start_t, 0.0)
            # runs still going at the end count up to `end`
            for key in sorted(r.running):
                _, st, e = r.running[key]
                g = max(e.gpus, 1)
                r_e = r.profile.power.power(e.level) * (end - st) * g
                busy_e += r_e
                carbon += r_e / 3.6e6 * r.profile.carbon_g_kwh
                busy_s += (end - st) * g
            idle = max(r.profile.slots * life - r.busy_gpu_s, 0.0) * r.profile.power.idle_w
            if r.end_t is None:
                floor_w += r.profile.slots * r.profile.power.idle_w
            busy_e += r.busy_energy_j
            idle_e += idle
            carbon += (r.busy_energy_j + idle) / 3.6e6 * r.profile.carbon_g_kwh
            slot_s += r.profile.slots * life
            busy_s += r.busy_gpu_s
            peer_s += life
            fates[r.fate] += 1
            msgs_peers += r.msgs
            bytes_peers += r.bytes

        core_stats: Counter[str] = Counter()
        rejected: Counter[str] = Counter()
        for pid in sorted(self.nodes):
            r = self.nodes[pid]
            core_stats.update(r.core.stats)
            rejected.update(r.core.rejected)

        summary = {
            "jobs_submitted": self._submitted,
            "jobs_completed": sum(1 for j in self.jobs.values() if j.finish_t is not None and j.ok),
            "jobs_failed": sum(1 for j in self.jobs.values() if j.finish_t is not None and not j.ok),
            "shards_submitted": sum(j.tj.shards for j in self.jobs.values() if j.submitted),
            "shards_completed": completed_shards,
            "shards_lost": lost,
            "shards_duplicated": dup,
            "jain_index": jain(list(mean_rho.values())),
            "jain_share_index": (sum(window_jain) / len(window_jain)) if window_jain else 1.0,
            "max_rho": max(all_rho) if all_rho else None,
            "mean_rho": (sum(all_rho) / len(all_rho)) if all_rho else None,
            "mean_jct_s": (sum(all_jct) / len(all_jct)) if all_jct else None,
            "makespan_s": makespan,
            "sim_time_s": end,
            "utilization": busy_s / slot_s if slot_s > 0 else 0.0,
            "energy_j": busy_e + idle_e,
            "energy_busy_j": busy_e,
            "energy_idle_j": idle_e,
            "idle_floor_w": floor_w,
            "carbon_g": carbon,
            "wasted_gpu_s": self.wasted_gpu_s,
            "msgs_per_peer_s": self.msgs / peer_s if peer_s > 0 else 0.0,
            "bytes_per_peer_s": self.bytes / peer_s if peer_s > 0 else 0.0,
            "msgs_per_peer_s_split": _split(self.msg_kinds, peer_s),
            "bytes_per_peer_s_split": _split(self.bytes_kinds, peer_s),
            "events": self.events,
        }
        return {
            "scenario": sc.name,
            "seed": self.seed,
            "summary": summary,
            "jobs": jobs_out,
            "tenants": {
                t: {
                    "jobs": sum(1 for j in self.jobs.values() if j.tj.tenant == t),
                    "mean_rho": mean_rho.get(t),
                    "max_rho": max(per_tenant_rho[t]) if t in per_tenant_rho else None,
                    "mean_jct_s": (sum(per_tenant_jct[t]) / len(per_tenant_jct[t])) if t in per_tenant_jct else None,
                    "gpu_s": gpu_s_t[t],
                }
                for t in tenants
            },
            "shares_over_time": {"bucket_s": bucket, "t_s": [i * bucket for i in range(nb)], "tenants": shares_t},
            "peers": {
                "initial": len(self.initial_peers),
                "joined": sum(1 for r in self.nodes.values() if r.is_peer) - len(self.initial_peers),
                "crashed": fates["crashed"],
                "left": fates["left"],
                "live_at_end": fates["live"],
                "profiles": dict(sorted(Counter(r.name for r in self.nodes.values() if r.is_peer).items())),
            },
            "network": {
                "msgs": self.msgs,
                "bytes": self.bytes,
                "msgs_by_peers": msgs_peers,
                "bytes_by_peers": bytes_peers,
                "by_kind": dict(sorted(self.msg_kinds.items())),
                **{k: v for k, v in sorted(self.net_stats.items())},
            },
            "core_stats": dict(sorted(core_stats.items())),
            "core_rejected": dict(sorted(rejected.items())),
            "faults": self._faults_results(end),
        }

    def _faults_results(self, end: float) -> dict[str, Any]:
        """What was injected and what it did: shards the targets held and
        that were re-run elsewhere, messages eaten, and the garbage
        collection on both sides (peers: abandoned leases and undeliverable
        results, per node and per tenant; clients: lapsed leases and
        deduplicated results)."""
        holders: dict[str, dict[int, dict[int, str]]] = {}
        for jid in sorted(self.jobs):
            j = self.jobs[jid]
            if j.holders is not None:
                holders[jid] = j.holders
            else:
                cj = getattr(self.clients[j.tj.tenant].core, "jobs", {}).get(jid)
                if cj is not None:
                    holders[jid] = {sh.index: dict(sh.holders) for sh in cj.shards}
        injected = []
        for i, f in enumerate(self.sc.faults):
            tg = set(self.fault_targets[i]) if i < len(self.fault_targets) else set()
            d = f.describe()
            d["targets"] = len(tg)
            if f.kind in ("crash", "hang", "slow"):
                held = rerun = by_targets = reawarded = 0
                rerun_by: dict[str, int] = {}
                for jid, hs in holders.items():
                    for shard, att in hs.items():
                        mine = {(p, a) for a, p in att.items() if p in tg}
                        if not mine:
                            continue
                        held += 1
                        if any(p not in tg and a > min(x[1] for x in mine) for a, p in att.items()):
                            reawarded += 1  # a later attempt went to a peer outside the fault
                        got = self.jobs[jid].delivered_by.get(shard)
                        if got is not None and got not in mine:
                            rerun += 1
                            task = self.sc.task_of(self.jobs[jid].tj.tenant)
                            rerun_by[task] = rerun_by.get(task, 0) + 1
                        elif got is not None:
                            by_targets += 1
                d.update(shards_held=held, shards_reawarded=reawarded, shards_rerun=rerun,
                         lapses=sum(self.lapsed_at[p] for p in tg),
                         shards_rerun_by_task=dict(sorted(rerun_by.items())), shards_delivered_by_targets=by_targets)
            if f.kind == "client-disconnect":
                d["tenants"] = sorted(self.tenant_of[c] for c in tg)
            injected.append(d)
        nodes: dict[str, Any] = {}
        gc: Counter[str] = Counter()
        stale = 0
        for pid in sorted(self.nodes):
            r = self.nodes[pid]
            st = r.core.stats
            if r.is_peer:
                row = {k: st[k] for k in ("leases_abandoned", "results_undelivered", "leases_revoked") if st[k]}
                if self.lapsed_at[pid]:
                    row["lapses"] = self.lapsed_at[pid]
                if r.alive and not r.hung:
                    grace = r.core.config.lease_grace_s
                    n = sum(1 for lease in r.core.leases.values() if end - lease.last_ack_at > grace + 1.0)
                    stale += n
                    if n:
                        row["stale_leases"] = n
            else:
                row = {k: st[k] for k in ("leases_lapsed", "results_duplicate", "renewals_unknown") if st[k]}
            for k, v in row.items():
                gc[k] += v
            if row or r.fault_ids:
                row["faults"] = [self.sc.faults[i].kind for i in r.fault_ids]
                row["role"] = f"client:{r.name}" if not r.is_peer else f"peer:{r.name}"
                row["fate"] = r.fate if r.fate != "live" else ("hung" if r.hung else "live")
                nodes[pid] = row
        tenants = {}
        for tname in sorted(self.clients):
            c = self.clients[tname]
            g = self.gc_tenant.get(c.id, Counter())
            tenants[tname] = {
                "task": self.sc.task_of(tname),
                "leases_abandoned": g["leases_abandoned"],
                "results_undelivered": g["results_undelivered"],
                "leases_lapsed": c.core.stats["leases_lapsed"],
                "results_duplicate": c.core.stats["results_duplicate"],
            }
        counts = {k: v for k, v in sorted(self.fault_stats.items())}
        for k in ("to_hung", "client_offline", "delayed", "partitioned", "lost", "duplicated"):
            counts[f"msgs_{k}"] = self.net_stats[k]
        return {
            "injected": injected,
            "counts": counts,
            "gc": {k: gc[k] for k in ("leases_abandoned", "results_undelivered", "leases_revoked", "leases_lapsed",
                                      "results_duplicate", "renewals_unknown")} | {"stale_leases_at_end": stale},
            "tenants": tenants,
            "nodes": nodes,
        }
