"""Partitioned runs: one simulation split into parts that run side by side.

A scenario with a ``[parallel]`` table runs its swarm as parts: with
``regions = [[...], ...]`` one part per list of regions, holding every node
(peer or client) of those regions; with ``parts = K``, part 0 runs every
client and ``first_share`` of the peers, and the other peers go to parts
1..K-1 by a hash of their id. Each part is a ``Simulator`` over the nodes
it runs, with a stand-in (``NodeRec.remote``) for every other node.

The parts advance in windows of simulated time as long as the least
possible delay of a message between two parts, ``lookahead``: the smallest
base latency of such a link (transfer time, jitter and reordering only add
to it), so 50 ms for parts by region (``inter_ms``'s low end) and 5 ms for
parts by hash (``intra_ms``'s). A message sent
inside a window ``[ws, ws + L)`` therefore arrives at ``ws + L`` or later,
so no part can receive, within a window, anything another part sends in the
same window: each part runs its window alone, and between windows the
parts exchange

* the messages they sent each other, pushed into the receivers' queues in
  part order, each part's in the order it sent them;
* the changes to their nodes' liveness (started, crashed, left, leaving),
  which the receivers' stand-ins take (a part sees another's churn at most
  one window late, as a real peer would);
* their next event times, and when their clients' jobs were all done: the
  next window starts at the earliest next event of any part, so idle
  stretches cost nothing, and the run stops ``settle_s`` after the last
  part's jobs are done.

This is the conservative, synchronous-window scheme of parallel
discrete-event simulation (a lookahead of one link's least latency). The
result is a function of the scenario and the seed alone, not of how the
parts are spread over processes: ``workers = 1`` runs them in turn in one
process, ``workers = K`` runs part 0 here and each other part in a forked
process, and both write the same bytes (tests/netsim/test_netsim_parallel.py).
With ``parts = 1`` the run is the unpartitioned ``Simulator``'s, byte for
byte. With more parts it is a different (equally deterministic) run of the
same swarm: each part draws message delays and joiners' bootstrap peers
from its own RNG, and liveness crosses parts a window late.

Processes exchange MessagePack frames through shared memory (``_Chan``)
and poll for each other's: a run has an exchange per window, and on this
VM a wake-up from a blocking read costs about 0.3 ms.

Not partitioned (``PartitionError``): ``[[faults]]``, network partitions
and ``[llm]`` scenarios, whose injected windows and per-link faults are
read across nodes; ``netsim compare`` and ``netsim faults`` run unpartitioned.
"""

from __future__ import annotations

import hashlib
import math
import mmap
import os
import platform
import random
import signal
import struct
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgpack

from .plan import Plan, make_plan
from .report import JobRec, NodeRun, RunRecord, report
from .scenario import Scenario, ScenarioError
from .sim import JOIN, MSG, SUBMIT, NodeRec, Simulator, _young_gc
from .stats import StepFn
from .workload import TraceJob

__all__ = ["PartitionError", "PartSim", "Partitioned", "lookahead", "owner", "check_partitionable"]

_INF = math.inf


class PartitionError(ScenarioError):
    """A scenario that a partitioned run does not take."""


def lookahead(scenario: Scenario) -> float:
    """The least delay of any message between two parts, in seconds: no
    link's base latency is below its range's low end, and everything else
    only adds to it. Parts by region exchange only messages between regions."""
    net = scenario.network
    if scenario.part_regions:
        return net.inter_ms[0] / 1000.0
    return min(net.intra_ms[0], net.inter_ms[0]) / 1000.0


def check_partitionable(scenario: Scenario) -> None:
    """Raise ``PartitionError`` for a scenario with ``parts > 1`` that a
    partitioned run cannot take."""
    if scenario.parts <= 1:
        return
    why = None
    if scenario.llm is not None:
        why = "an [llm] scenario"
    elif scenario.faults:
        why = "[[faults]] (their windows and links are read across nodes)"
    elif scenario.network.partitions:
        why = "network partitions"
    elif lookahead(scenario) <= 0:
        why = "links with no least latency (network intra_ms and inter_ms must start above 0)"
    if why is not None:
        raise PartitionError(f"{scenario.name}: parallel.parts = {scenario.parts} does not take {why}; "
                             "set parts = 1")


def owner(pid: str, is_peer: bool, region: str, scenario: Scenario) -> int:
    """The part that runs node ``pid``: by its region (``[parallel] regions``),
    or else clients in part 0 and a peer by a hash of its id (``first_share``
    of them in part 0, the rest spread evenly)."""
    parts, first_share = scenario.parts, scenario.first_share
    if scenario.part_regions:
        for i, group in enumerate(scenario.part_regions):
            if region in group:
                return i
        raise PartitionError(f"{scenario.name}: node {pid[:12]} is in region {region!r}, "
                             f"which no part of parallel.regions names")
    if parts <= 1 or not is_peer:
        return 0
    u = int.from_bytes(hashlib.blake2b(pid.encode(), digest_size=8).digest(), "big") / 2.0**64
    if u < first_share:
        return 0
    return 1 + min(int((u - first_share) / (1.0 - first_share) * (parts - 1)), parts - 2)


def _derived(state: Any, index: int) -> random.Random:
    """Part ``index``'s RNG: part 0 draws from the plan's own (so one part is
    the unpartitioned run), the others from seeds drawn from it."""
    base = random.Random()
    base.setstate(state)
    if index == 0:
        return base
    seeds = [base.getrandbits(64) for _ in range(index)]
    return random.Random(seeds[-1])


class PartSim(Simulator):
    """One part of a partitioned run: the loop of ``Simulator`` over the nodes
    this part runs, and stand-ins for the rest."""

    def __init__(self, scenario: Scenario, seed: int, *, index: int, plan: Plan, fast: bool = True) -> None:
        check_partitionable(scenario)
        self.index = index
        self.parts = scenario.parts
        self.lookahead = lookahead(scenario)
        #: messages to the other parts, per part: (arrival, to, from, bytes)
        self.outbox: list[list[tuple[float, str, str, bytes]]] = [[] for _ in range(self.parts)]
        #: liveness changes of this part's nodes since the last exchange: (id, alive, leaving)
        self.changes: list[tuple[str, bool, bool]] = []
        self.window_end = 0.0
        self.waited_s = 0.0  # wall seconds this part's process waited for the others (not in the results)
        super().__init__(scenario, seed, fast=fast, plan=plan)
        self.net_rng = _derived(plan.net_rng_state, index)
        self.churn_rng = _derived(plan.churn_rng_state, index)
        for _, kind, subject, _ in plan.actions:  # peers that will join in another part
            if kind == "join" and self._part_of(subject.id, True, subject.region) != index:
                self._stand_in(subject.id, True, subject.region, subject.profile, subject.profile.name)
        #: this part's clients' jobs; when all have finished (-inf: it has none)
        self._jobs_here = sum(1 for j in self.trace if not self.clients[j.tenant].remote)
        self.done_at: float | None = None if self._jobs_here else -_INF

    def _all_done(self) -> None:
        # the run stops when every part's jobs are done (``_route``), not when this part's are
        self.all_done_t = self.done_at = self.now

    # -- who runs what --------------------------------------------------

    def _part_of(self, pid: str, is_peer: bool, region: str) -> int:
        return owner(pid, is_peer, region, self.sc)

    def _stand_in(self, pid: str, is_peer: bool, region: str, profile: Any, name: str) -> NodeRec:
        rec = NodeRec(pid, None, is_peer, region, profile, name, remote=True,
                      part=self._part_of(pid, is_peer, region))
        self.nodes[pid] = rec
        return rec

    def _add_peer(self, p: Any, boot: tuple[str, ...]) -> NodeRec:
        if self._part_of(p.id, True, p.region) != self.index:
            return self._stand_in(p.id, True, p.region, p.profile, p.profile.name)
        return super()._add_peer(p, boot)

    def _add_client(self, c: Any) -> NodeRec:
        if self._part_of(c.id, False, c.region) == self.index:
            return super()._add_client(c)
        rec = self._stand_in(c.id, False, c.region, None, c.tenant)
        self.clients[c.tenant] = rec
        self.tenant_of[rec.id] = c.tenant  # a peer's finished run names its tenant's client
        return rec

    def _runs_action(self, kind: int, subject: Any) -> bool:
        if kind == SUBMIT:
            return not self.clients[subject.tenant].remote
        if kind == JOIN:
            return self._part_of(subject.id, True, subject.region) == self.index
        return not self.nodes[subject].remote

    # -- liveness, told to the other parts -------------------------------

    def _changed(self, rec: NodeRec) -> None:
        if self.parts > 1:
            self.changes.append((rec.id, rec.alive, rec.leaving))

    def _start(self, rec: NodeRec) -> None:
        super()._start(rec)
        self._changed(rec)

    def _remove(self, rec: NodeRec, fate: str) -> None:
        super()._remove(rec, fate)
        self._changed(rec)

    def leave(self, rec: NodeRec) -> None:
        super().leave(rec)
        self._changed(rec)

    # -- windows and exchanges -----------------------------------------

    def _post(self, dst: NodeRec, src_id: str, data: bytes, delays: list[float]) -> None:
        box = self.outbox[dst.part]
        for d in delays:
            t = self.now + d
            if t < self.window_end:
                raise AssertionError(f"a message arrives at {t} inside the window ending {self.window_end}")
            box.append((t, dst.id, src_id, data))

    def run_window(self, t_end: float) -> None:
        """Every event before ``t_end`` (or past the stop time)."""
        self.window_end = t_end
        self._loop(t_end)

    def next_time(self) -> float:
        return self.q.peek_time() if self.q else _INF

    def report_out(self) -> list[Any]:
        """What the other parts need after a window: [next event time, when
        its jobs were all done (None: not yet), events so far, liveness
        changes, messages per part, now, shards delivered, jobs finished]."""
        out = [self.next_time(), self.done_at, self.events, self.changes, self.outbox, self.now,
               self.shards_delivered, self._finished]
        self.changes = []
        self.outbox = [[] for _ in range(self.parts)]
        return out

    def take_in(self, stop_at: float, changes: list[Any], msgs: list[Any]) -> None:
        """The other parts' liveness changes and messages to this one, in part order."""
        self.stop_at = min(self.stop_at, stop_at)
        nodes = self.nodes
        for pid, alive, leaving in changes:
            rec = nodes[pid]
            rec.alive, rec.leaving = alive, leaving
        if changes:
            self._members = None
        push = self._push
        for t, dst, src, data in msgs:
            push(t, MSG, nodes[dst], src, data)

    # -- the part's share of the results ---------------------------------

    def pieces(self, end: float) -> bytes:
        """This part's counters, finished runs and nodes at the run's ``end``,
        packed: the same bytes whether they cross a pipe or not."""
        jobs = []
        for jid, j in self.jobs.items():
            if j.submitted:
                jobs.append([jid, j.submit_t, j.finish_t, j.ok, list(j.delivered.items()), j.energy_j, j.carbon_g,
                             j.gpu_s, [[k, v[0], v[1]] for k, v in j.delivered_by.items()]])
        holders = [[jid, [[sh, list(h.items())] for sh, h in by.items()]] for jid, by in self._holders().items()]
        nodes = []
        for r in self.nodes.values():
            if r.remote:
                continue
            n = self._node_run(r, end)
            nodes.append([n.id, n.is_peer, n.name, n.started, n.start_t, n.end_t, n.fate, n.hung, n.busy_gpu_s,
                          n.busy_energy_j, n.msgs, n.bytes, n.open_runs, dict(n.stats), dict(n.rejected),
                          n.stale_leases, n.fault_ids])
        return msgpack.packb({
            "nodes": nodes, "events": self.events, "msgs": self.msgs, "bytes": self.bytes, "spins": self.spins,
            "wasted_gpu_s": self.wasted_gpu_s, "intervals": self.intervals, "msg_kinds": dict(self.msg_kinds),
            "bytes_kinds": dict(self.bytes_kinds), "net_stats": dict(self.net_stats),
            "fault_stats": dict(self.fault_stats), "lapsed_at": dict(self.lapsed_at),
            "gc_tenant": {k: dict(v) for k, v in self.gc_tenant.items()},
            "capacity": [self.capacity.ts, self.capacity.vs],
            "active_tenants": [self.active_tenants.ts, self.active_tenants.vs],
            "submitted": self._submitted, "jobs": jobs, "holders": holders,
            "waited_s": self.waited_s,
        }, use_bin_type=True)


def _sum_steps(fns: list[StepFn]) -> StepFn:
    """The sum of step functions, added in part order at every change."""
    if len(fns) == 1:
        return fns[0]
    cur = [f.vs[0] for f in fns]
    out = StepFn(0.0, sum(cur))
    for t, i, v in sorted((t, i, v) for i, f in enumerate(fns) for t, v in zip(f.ts[1:], f.vs[1:])):
        cur[i] = v
        out.set(t, sum(cur))
    return out


class _Chan:
    """Frames to and from another process through two shared-memory slots,
    one per direction.

    The exchanges strictly alternate (a part reports, then hears back), so
    one slot per direction suffices: the writer waits until the reader has
    taken the previous frame, copies the frame in (in pieces, if it is
    larger than the slot), then bumps the slot's sequence number; the reader
    polls that number. Pipes were far slower here: a ping-pong of 200 bytes
    between two polling processes took 343 us over pipes and 1.5 to 40 us
    through shared memory (``/tmp`` scripts, 2026-12-06), and a run has an
    exchange per window. The reader relies on x86-64's store order (the
    payload is visible before the sequence number that follows it): on
    other machines ``Partitioned`` runs every part in one process."""

    _HDR = struct.Struct("<QQQ")  # sequence number, payload bytes, more pieces follow (the sequence number written last)
    _ACK = 24  # the reader's last taken sequence number
    _DATA = 64
    SPIN_S = 0.02  # poll this long, then poll every 0.2 ms

    def __init__(self, out: mmap.mmap, inp: mmap.mmap, alive: Callable[[], bool]) -> None:
        self.out, self.inp, self.alive = out, inp, alive
        self.cap = len(out) - self._DATA
        self.sent = 0  # sequence numbers of our frames (pieces)
        self.taken = 0  # of theirs
        self.wait_s = 0.0

    def _wait(self, ready: Callable[[], bool]) -> None:
        if ready():
            return
        t0 = time.perf_counter()
        spin_until = t0 + self.SPIN_S
        check = t0 + 0.1
        while not ready():
            now = time.perf_counter()
            if now > spin_until:
                time.sleep(0.0002)
            if now > check:
                check = now + 0.1
                if not self.alive():
                    raise EOFError("the other part's process stopped")
        self.wait_s += time.perf_counter() - t0

    def send(self, data: bytes) -> None:
        out, cap = self.out, self.cap
        view = memoryview(data)
        while True:
            piece, view = view[:cap], view[cap:]
            sent = self.sent
            self._wait(lambda: struct.unpack_from("<Q", out, self._ACK)[0] == sent)
            out[self._DATA:self._DATA + len(piece)] = piece
            self.sent = sent + 1
            struct.pack_into("<QQ", out, 8, len(piece), 1 if len(view) else 0)
            struct.pack_into("<Q", out, 0, sent + 1)  # last: the reader takes the frame when it sees this
            if not len(view):
                return

    def recv(self) -> bytes:
        inp, hdr = self.inp, self._HDR
        parts = []
        while True:
            want = self.taken + 1
            self._wait(lambda: struct.unpack_from("<Q", inp, 0)[0] == want)
            _, n, more = hdr.unpack_from(inp, 0)
            parts.append(inp[self._DATA:self._DATA + n])
            self.taken = want
            struct.pack_into("<Q", inp, self._ACK, want)
            if not more:
                return parts[0] if len(parts) == 1 else b"".join(parts)


_SLOT = 8 << 20  # bytes per direction and worker


def _unpack(frame: bytes) -> Any:
    """A frame from another part (or a part's own pieces): lists, and maps
    with integer keys (shard indices)."""
    return msgpack.unpackb(frame, raw=False, use_list=True, strict_map_key=False)


def _running(pid: int) -> bool:
    try:
        return os.waitpid(pid, os.WNOHANG) == (0, 0)
    except ChildProcessError:
        return False


def _route(states: dict[int, list[Any]], parts: int, sc: Scenario
           ) -> tuple[float, float, list[list[Any]], list[list[Any]]]:
    """From every part's report: the next window's start, the stop time (the
    settling time after the last part's jobs are all done), and per part the
    others' liveness changes and the messages to it, in part order."""
    nxt = min(s[0] for s in states.values())
    done = [s[1] for s in states.values()]
    stop = sc.max_time_s
    if all(d is not None for d in done):
        stop = min(stop, max(done) + sc.settle_s)
    changes: list[list[Any]] = [[] for _ in range(parts)]
    msgs: list[list[Any]] = [[] for _ in range(parts)]
    for i in range(parts):
        s = states[i]
        for j in range(parts):
            if j != i:
                changes[j].extend(s[3])
                box = s[4][j]
                if box:
                    msgs[j].extend(box)
                    nxt = min(nxt, min(m[0] for m in box))
    return nxt, stop, changes, msgs


class Partitioned:
    """A partitioned run of ``scenario`` (its ``[parallel]`` table) over
    ``workers`` processes (1: every part here, in turn; else one per part).

    ``run(progress)`` runs it; ``results()`` gives the results JSON's dict.
    Construct it before starting any thread: it forks its workers."""

    def __init__(self, scenario: Scenario, seed: int = 0, *, jobs: list[TraceJob] | None = None,
                 fast: bool = True, workers: int = 1) -> None:
        check_partitionable(scenario)
        self.sc = scenario
        self.seed = seed
        self.parts = scenario.parts
        # processes share frames by x86-64's store order (``_Chan``)
        x86 = platform.machine().lower() in ("x86_64", "amd64")
        self.workers = self.parts if workers > 1 and self.parts > 1 and x86 else 1
        self.plan = make_plan(scenario, seed, jobs=jobs)
        # every node has a part (a region no part names is refused here, before any fork)
        for p in self.plan.peers:
            owner(p.id, True, p.region, scenario)
        for c in self.plan.clients:
            owner(c.id, False, c.region, scenario)
        for _, kind, subject, _ in self.plan.actions:
            if kind == "join":
                owner(subject.id, True, subject.region, scenario)
        self.fast = fast
        self.chans: dict[int, _Chan] = {}
        self.pids: list[int] = []
        #: wall seconds each part's process waited for the others (the
        #: first waits for all of theirs in turn); none when the parts share a process
        self.waited_s: dict[int, float] = {}
        if self.workers > 1:
            for i in range(1, self.parts):
                self._fork(i)
        self.local: dict[int, PartSim] = {}
        try:
            for i in range(self.parts):
                if i not in self.chans:
                    self.local[i] = PartSim(scenario, seed, index=i, plan=self.plan, fast=fast)
        except BaseException:
            self._stop_workers(kill=True)
            raise
        self.trace = self.plan.trace
        self.events = 0
        self.shards_delivered = 0
        self.finished = 0
        self.stop_at = scenario.max_time_s
        self.now = 0.0
        self.end: float | None = None
        #: each part's share of the results (``PartSim.pieces``), unpacked
        self._pieces: dict[int, dict[str, Any]] = {}

    def _fork(self, index: int) -> None:
        down = mmap.mmap(-1, _SLOT)  # here -> part
        up = mmap.mmap(-1, _SLOT)  # part -> here
        parent = os.getpid()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the part's process
            code = 1
            # Ctrl-C is netsim's to handle: it stops this process (``_stop_workers``)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            try:
                _serve(self.sc, self.seed, self.plan, index, self.fast,
                       _Chan(up, down, lambda: os.getppid() == parent))
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        self.chans[index] = _Chan(down, up, lambda: _running(pid))
        self.pids.append(pid)

    # -- the run -----------------------------------------------------------

    def done_permille(self) -> float:
        """Per mille of the run done, as ``netsim.progress`` counts it."""
        jobs = self.finished / max(len(self.trace), 1)
        shards = self.shards_delivered / max(sum(j.shards for j in self.trace), 1)
        t = self.now / self.stop_at if 0 < self.stop_at < _INF else 0.0
        return 1000.0 * min(max(jobs, shards, t), 1.0)

    def run(self, tick: Callable[["Partitioned"], None] | None = None, *, tick_s: float = 0.25) -> None:
        """Run to the end; ``tick(self)`` about every ``tick_s`` of wall time.
        A part's failure (or Ctrl-C) stops the other parts' processes too."""
        try:
            with _young_gc():
                self._run(tick, tick_s)
        except BaseException:
            self._stop_workers(kill=True)
            raise

    def _recv(self, i: int) -> list[Any]:
        try:
            return _unpack(self.chans[i].recv())
        except EOFError:
            raise RuntimeError(f"netsim: part {i}'s process stopped (its error is above)") from None

    def _run(self, tick: Callable[["Partitioned"], None] | None, tick_s: float) -> None:
        parts = self.parts
        states: dict[int, list[Any]] = {i: p.report_out() for i, p in self.local.items()}
        for i in self.chans:
            states[i] = self._recv(i)
        last = time.perf_counter()
        while True:
            nxt, stop, changes, msgs = _route(states, parts, self.sc)
            self.stop_at = stop
            self.events = sum(s[2] for s in states.values())
            self.shards_delivered = sum(s[6] for s in states.values())
            self.finished = sum(s[7] for s in states.values())
            if tick is not None:
                w = time.perf_counter()
                if w - last >= tick_s:
                    last = w
                    self.now = min(nxt, stop)
                    tick(self)
            if not (nxt < _INF and nxt <= stop):
                break
            for i, ch in self.chans.items():
                ch.send(msgpack.packb([nxt, stop, changes[i], msgs[i]], use_bin_type=True))
            for i, p in self.local.items():
                p.take_in(stop, changes[i], msgs[i])
                p.run_window(nxt + p.lookahead)
                states[i] = p.report_out()
            for i in self.chans:
                states[i] = self._recv(i)
        # where Simulator.run leaves ``now``: the stop time, or the last event
        end = max(s[5] for s in states.values())
        if stop < _INF:
            end = max(end, min(stop, self.sc.max_time_s))
        for i, ch in self.chans.items():
            ch.send(msgpack.packb([None, end, [], []], use_bin_type=True))
        for i, p in self.local.items():
            p.stop_at = min(p.stop_at, stop)
            p.now = end
            self._pieces[i] = _unpack(p.pieces(end))
        for i, ch in self.chans.items():
            try:
                self._pieces[i] = _unpack(ch.recv())
            except EOFError:
                raise RuntimeError(f"netsim: part {i}'s process stopped (its error is above)") from None
            self.waited_s[i] = self._pieces[i]["waited_s"]
        self._stop_workers()
        self.end = self.now = end

    def _stop_workers(self, *, kill: bool = False) -> None:
        self.waited_s[0] = sum(ch.wait_s for ch in self.chans.values())
        self.chans = {}
        for pid in self.pids:
            try:
                if kill:
                    os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ChildProcessError, ProcessLookupError):
                pass
        self.pids = []

    # -- results ---------------------------------------------------------

    def record(self) -> RunRecord:
        """The parts' shares merged into one ``RunRecord``, as ``Simulator.record`` gives it."""
        if self.end is None:
            raise RuntimeError("Partitioned.record before run")
        end, plan = self.end, self.plan
        pieces = [self._pieces[i] for i in range(self.parts)]
        joins = [(t, k, a) for k, (t, kind, a, _) in enumerate(plan.actions) if kind == "join"]
        profiles = {p.id: p.profile for p in plan.peers} | {a.id: a.profile for _, _, a in joins}
        joiners = sorted((t, k, a.id) for t, k, a in joins)
        runs: dict[str, NodeRun] = {}
        for pc in pieces:
            for (pid, is_peer, name, started, start_t, end_t, fate, hung, busy_s, busy_j, msgs, nbytes, open_r,
                 stats, rejected, stale, fault_ids) in pc["nodes"]:
                runs[pid] = NodeRun(
                    id=pid, is_peer=is_peer, name=name, profile=profiles.get(pid) if is_peer else None,
                    started=started, start_t=start_t, end_t=end_t, fate=fate, hung=hung, busy_gpu_s=busy_s,
                    busy_energy_j=busy_j, msgs=msgs, bytes=nbytes, open_runs=[tuple(x) for x in open_r],
                    stats=Counter(stats), rejected=Counter(rejected), stale_leases=stale, fault_ids=fault_ids)
        order = [p.id for p in plan.peers] + [c.id for c in plan.clients] + [pid for _, _, pid in joiners]
        nodes = {pid: runs[pid] for pid in order if pid in runs}

        def total(key: str) -> Counter:
            out: Counter = Counter()
            for pc in pieces:
                out.update(pc[key])
            return out

        gc_tenant: dict[str, Counter] = {}
        for pc in pieces:
            for k, v in pc["gc_tenant"].items():
                gc_tenant.setdefault(k, Counter()).update(v)
        wasted = 0.0
        for pc in pieces:
            wasted += pc["wasted_gpu_s"]
        jobs = {j.job_id: JobRec(j) for j in plan.trace}
        holders: dict[str, dict[int, dict[int, str]]] = {}
        for pc in pieces:
            for jid, submit_t, finish_t, ok, delivered, energy, carbon, gpu_s, by in pc["jobs"]:
                j = jobs[jid]
                j.submitted, j.submit_t, j.finish_t, j.ok = True, submit_t, finish_t, ok
                j.delivered = {k: v for k, v in delivered}
                j.energy_j, j.carbon_g, j.gpu_s = energy, carbon, gpu_s
                j.delivered_by = {k: (peer, attempt) for k, peer, attempt in by}
            for jid, by in pc["holders"]:
                holders[jid] = {sh: {a: peer for a, peer in h} for sh, h in by}
        holders = {jid: holders[jid] for jid in sorted(holders)}
        clients = {c.tenant: nodes[c.id] for c in plan.clients}
        return RunRecord(
            scenario=self.sc, seed=self.seed, end=end, events=sum(pc["events"] for pc in pieces), jobs=jobs,
            submitted=sum(pc["submitted"] for pc in pieces), nodes=nodes, clients=clients,
            initial_peers=len(plan.initial_peers),
            intervals=[tuple(x) for pc in pieces for x in pc["intervals"]], wasted_gpu_s=wasted,
            capacity=_sum_steps([StepFn.from_points(*pc["capacity"]) for pc in pieces]),
            active_tenants=_sum_steps([StepFn.from_points(*pc["active_tenants"]) for pc in pieces]),
            msgs=sum(pc["msgs"] for pc in pieces), bytes=sum(pc["bytes"] for pc in pieces),
            msg_kinds=total("msg_kinds"), bytes_kinds=total("bytes_kinds"), net_stats=total("net_stats"),
            holders=holders, fault_targets=plan.fault_targets, fault_stats=total("fault_stats"),
            gc_tenant=gc_tenant, lapsed_at=total("lapsed_at"),
        )

    def results(self) -> dict[str, Any]:
        with _young_gc():
            return report(self.record())


def _serve(sc: Scenario, seed: int, plan: Plan, index: int, fast: bool, ch: _Chan) -> None:
    """A part's process: report, take the exchange, run the window, until told the end."""
    part = PartSim(sc, seed, index=index, plan=plan, fast=fast)
    with _young_gc():
        ch.send(msgpack.packb(part.report_out(), use_bin_type=True))
        while True:
            nxt, stop, changes, msgs = _unpack(ch.recv())
            if nxt is None:  # the end: ``stop`` is the run's end time
                part.stop_at = min(part.stop_at, stop)
                part.now = stop
                part.waited_s = ch.wait_s
                ch.send(part.pieces(stop))
                return
            part.take_in(stop, changes, msgs)
            part.run_window(nxt + part.lookahead)
            ch.send(msgpack.packb(part.report_out(), use_bin_type=True))
