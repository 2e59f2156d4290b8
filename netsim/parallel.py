"""Partitioned runs: one simulation split into parts that run side by side.

A scenario with a ``[parallel]`` table runs its swarm as parts: with
``regions = [[...], ...]`` one part per list of regions, holding every node
(peer or client) of those regions; with ``parts = K``, part 0 runs every
client and ``first_share`` of the peers, and the other peers go to parts
1..K-1 by a hash of their id. Each part is a ``Simulator`` over the nodes
it runs, with a stand-in (``NodeRec.remote``) for every other node.

The parts advance in windows of simulated time, a fraction of the
``lookahead``: the least possible delay of a message between two parts,
the smallest base latency of such a link (transfer time, jitter and
reordering only add to it), so 50 ms for parts by region (``inter_ms``'s
low end) and 5 ms for parts by hash (``intra_ms``'s). Windows are
``lookahead / (AHEAD + 1)`` long, so a message sent in a window arrives
after the next ``AHEAD`` windows end: a part may run those before it hears
what the others sent. After each window a part takes in the others'
reports (frames) of ``AHEAD`` windows before and sends its own:

* the messages it sent each other part, pushed into the receiver's queue
  in part order, each part's in the order it sent them;
* the changes to its nodes' liveness (started, crashed, left, leaving),
  which the receivers' stand-ins take (a part sees another's churn at most
  a lookahead late, as a real peer would see it some time late);
* its next event time, and when its clients' jobs were all done. From the
  same frames every part computes the same next window and stop time: a
  stretch in which no part has anything to do is skipped, and the run
  stops ``settle_s`` after the last part's jobs are done.

This is the conservative scheme of parallel discrete-event simulation (a
lookahead of one link's least latency), with the windows pipelined so
that a part's slow window is made up in its next ones instead of stalling
the others at once (``_Lane``). The result is a function of the scenario
and the seed alone, not of how the parts are spread over processes:
``workers = 1`` runs them in turn in one process, ``workers = K`` runs part
0 here and each other part in a forked process, and both write the same
bytes (tests/netsim/test_netsim_parallel.py). With ``parts = 1`` the run
is the unpartitioned ``Simulator``'s, byte for byte. With more parts it is
a different (equally deterministic) run of the same swarm: each part draws
message delays and joiners' bootstrap peers from its own RNG, and liveness
crosses parts late.

Processes exchange MessagePack frames through rings in shared memory
(``_Chan``), one per ordered pair of parts, and poll for each other's: a
run has an exchange per window, and on this VM a wake-up from a blocking
read costs about 0.3 ms.

Not partitioned (``PartitionError``): ``[[faults]]``, network partitions
and ``[llm]`` scenarios, whose injected windows and per-link faults are
read across nodes, and a ``settle_s`` shorter than the lookahead (the
parts learn of the stop that late); ``netsim compare`` and ``netsim faults``
run unpartitioned.
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
from collections import Counter, deque
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
#: how many windows a part may run ahead of what it has heard from the others (``_Lane``)
AHEAD = 3


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
    why, least = None, lookahead(scenario)
    if scenario.llm is not None:
        why = "an [llm] scenario"
    elif scenario.faults:
        why = "[[faults]] (their windows and links are read across nodes)"
    elif scenario.network.partitions:
        why = "network partitions"
    elif least <= 0:
        why = "links with no least latency (network intra_ms and inter_ms must start above 0)"
    elif scenario.settle_s < least:
        why = f"settle_s below the least latency between parts ({least * 1000:g} ms)"
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
        #: a window's length: the lookahead over AHEAD + 1 (a hair less, against
        #: float rounding), so nothing sent in window k arrives before window k + AHEAD + 1
        self.window = lookahead(scenario) / (AHEAD + 1) * (1.0 - 1e-9)
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
        # the run stops when every part's jobs are done (``_Lane``), not when this part's are
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
        # the end of window k + AHEAD: the receiver runs those windows before it hears of this one
        horizon = self.window_end + AHEAD * self.window
        for d in delays:
            t = self.now + d
            if t < horizon:
                raise AssertionError(f"a message arrives at {t}, before the window after this one ends ({horizon})")
            box.append((t, dst.id, src_id, data))

    def run_window(self, t_end: float) -> None:
        """Every event before ``t_end`` (or past the stop time)."""
        self.window_end = t_end
        self._loop(t_end)

    def next_time(self) -> float:
        return self.q.peek_time() if self.q else _INF

    def report_out(self) -> list[Any]:
        """What the other parts need after a window (a frame): [next event
        time, when its jobs were all done (None: not yet), events so far,
        liveness changes, messages per part, now, shards delivered, jobs
        finished, the earliest arrival of those messages]."""
        soonest = min((m[0] for box in self.outbox for m in box), default=_INF)
        out = [self.next_time(), self.done_at, self.events, self.changes, self.outbox, self.now,
               self.shards_delivered, self._finished, soonest]
        self.changes = []
        self.outbox = [[] for _ in range(self.parts)]
        return out

    def take_in(self, changes: list[Any], msgs: list[Any]) -> None:
        """Another part's liveness changes and messages to this one."""
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
    """Frames from one process to another through a ring of shared-memory
    slots.

    The writer copies a frame into the next free slot (in pieces, if it is
    larger than a slot), then bumps the count of pieces written; the reader
    polls that count, copies the piece out and bumps the count taken. A
    writer waits only when all slots are full, so a part can report a
    window and go on to the next before the other part has read the report;
    while it waits, it takes in what the others write to it (``pump``), so
    two parts whose rings to each other are both full cannot wait on each
    other.
    Pipes were far slower here: a ping-pong of 200 bytes between two
    polling processes took 343 us over pipes and 1.5 to 40 us through
    shared memory (``/tmp`` scripts, 2026-12-06), and a run has an exchange
    per window. The reader relies on x86-64's store order (the payload is
    visible before the count that follows it): on other machines
    ``Partitioned`` runs every part in one process."""

    _HDR = struct.Struct("<QQ")  # a slot's payload bytes, and whether more pieces of the frame follow
    _WRITTEN = 0  # pieces written, by the writer (the count is stored after the piece)
    _TAKEN = 64  # pieces taken, by the reader (a cache line of its own)
    _DATA = 128
    SLOTS = 8
    SPIN_S = 0.02  # poll this long, then poll every 0.2 ms

    def __init__(self, out: mmap.mmap | None, inp: mmap.mmap | None, alive: Callable[[], bool]) -> None:
        self.out, self.inp, self.alive = out, inp, alive
        size = len(out if out is not None else inp) - self._DATA  # type: ignore[arg-type]
        self.slot = size // self.SLOTS
        self.cap = self.slot - self._HDR.size
        self.sent = 0  # pieces of ours written
        self.taken = 0  # pieces of theirs taken
        self.wait_s = 0.0
        #: the frames taken in ahead of ``recv`` (by ``pump``), and the pieces of one not yet whole
        self.frames: deque[bytes] = deque()
        self._pieces: list[bytes] = []
        #: called while ``send`` waits for a free slot: ``pump`` of every channel into this process
        self.while_full: Callable[[], None] = lambda: None

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
        out, cap, slots = self.out, self.cap, self.SLOTS
        assert out is not None
        view = memoryview(data)
        while True:
            piece, view = view[:cap], view[cap:]
            n = self.sent

            def free() -> bool:
                if n - struct.unpack_from("<Q", out, self._TAKEN)[0] < slots:
                    return True
                self.while_full()
                return False
            self._wait(free)
            at = self._DATA + (n % slots) * self.slot
            self._HDR.pack_into(out, at, len(piece), 1 if len(view) else 0)
            at += self._HDR.size
            out[at:at + len(piece)] = piece
            self.sent = n + 1
            struct.pack_into("<Q", out, self._WRITTEN, n + 1)  # last: the reader takes the piece when it sees this
            if not len(view):
                return

    def _take_piece(self) -> bool:
        """Take the next piece if it is there; whether one was."""
        inp, hdr = self.inp, self._HDR
        assert inp is not None
        n = self.taken
        if struct.unpack_from("<Q", inp, self._WRITTEN)[0] <= n:
            return False
        at = self._DATA + (n % self.SLOTS) * self.slot
        size, more = hdr.unpack_from(inp, at)
        at += hdr.size
        self._pieces.append(inp[at:at + size])
        self.taken = n + 1
        struct.pack_into("<Q", inp, self._TAKEN, n + 1)
        if not more:
            self.frames.append(self._pieces[0] if len(self._pieces) == 1 else b"".join(self._pieces))
            self._pieces = []
        return True

    def pump(self) -> None:
        """Take in every piece written so far (whole frames wait for ``recv``)."""
        while self._take_piece():
            pass

    def recv(self) -> bytes:
        if not self.frames:
            self._wait(lambda: self._take_piece() and bool(self.frames))
        return self.frames.popleft()


_SLOT = 8 << 20  # bytes per direction and pair of parts


def _pump_while_full(outs: dict[int, _Chan], ins: dict[int, _Chan]) -> None:
    """A writer facing a full ring takes in what the others write to its process."""
    def pump() -> None:
        for ch in ins.values():
            ch.pump()
    for ch in outs.values():
        ch.while_full = pump


def _unpack(frame: bytes) -> Any:
    """A frame from another part (or a part's own pieces): lists, and maps
    with integer keys (shard indices)."""
    return msgpack.unpackb(frame, raw=False, use_list=True, strict_map_key=False)


def _running(pid: int) -> bool:
    try:
        return os.waitpid(pid, os.WNOHANG) == (0, 0)
    except ChildProcessError:
        return False


def _for(frame: list[Any], j: int) -> list[Any]:
    """``frame`` as part ``j`` takes it: only the messages to ``j``."""
    return [*frame[:4], frame[4][j], *frame[5:]]


class _Lane:
    """One part's side of the windows, in whichever process runs it.

    Window ``k`` is ``[s_k, s_k + W)`` with ``W`` the lookahead divided by
    ``AHEAD + 1``, so a message sent in window ``k`` arrives after window
    ``k + AHEAD`` ends. After window ``k`` the part takes in the other
    parts' reports (frames) of window ``k - AHEAD``, then sends its own of
    window ``k``: a part runs up to ``AHEAD`` windows ahead of what it has
    heard, and a slow window of one part is made up in the next ones
    instead of stalling the others at once. From the frames of window
    ``k - AHEAD`` (the same for every part) come

    * the stop time, once every part's jobs are done (``settle_s`` must be
      at least the lookahead, so no part has run past it by then);
    * the next window's start: ``s_{k+1} = max(s_k + W, G)``, where ``G``
      is the earliest event any part had left after window ``k - AHEAD``,
      counting the messages still in flight. If ``G`` is past window
      ``k``, the windows since were empty everywhere, and the idle stretch
      up to ``G`` is skipped.

    Each part computes both from the same frames, so every part runs the
    same windows and stops after the same one, whatever the processes."""

    def __init__(self, part: PartSim, sc: Scenario) -> None:
        self.part, self.sc = part, sc
        self.start = _INF  # the next window's start
        self.stop = sc.max_time_s
        self.own: deque[list[Any]] = deque()  # this part's frames not yet matched by the others' (oldest first)
        self.heard: list[list[Any]] = []  # every part's frames of window k - AHEAD, in part order
        self.flying: deque[float] = deque()  # the earliest arrival in each of the last AHEAD such sets of frames
        self.windows = 0

    def first(self) -> list[Any]:
        """The frame before any window."""
        f = self.part.report_out()
        self.own.append(f)
        return f

    def begin(self, others: dict[int, list[Any]]) -> bool:
        """Take in the other parts' first frames; whether there is a first window."""
        self.start = self._take(others)
        return self.going()

    def going(self) -> bool:
        return self.start < _INF and self.start <= self.stop

    def window(self) -> None:
        self.part.run_window(self.start + self.part.window)
        self.windows += 1

    def after(self, others: dict[int, list[Any]] | None) -> list[Any]:
        """After a window: take in the others' frames of ``AHEAD`` windows
        before (``None`` while there are none: the first ones were taken in
        before the first window), and give this window's frame."""
        soonest = self._take(others) if others is not None else -_INF
        f = self.part.report_out()
        self.own.append(f)
        self.start = max(self.start + self.part.window, soonest)
        return f

    def _take(self, others: dict[int, list[Any]]) -> float:
        """Take in one frame of every other part (and match this part's own
        of the same window); the earliest event any part then had left."""
        part, frames = self.part, []
        mine = self.own.popleft()
        for j in range(part.parts):
            if j == part.index:
                frames.append(mine)
                continue
            f = others[j]
            frames.append(f)
            part.take_in(f[3], f[4])
        self.heard = frames
        done = [f[1] for f in frames]
        if all(d is not None for d in done):
            self.stop = min(self.stop, max(done) + self.sc.settle_s)
        part.stop_at = min(part.stop_at, self.stop)
        # messages of the last AHEAD windows heard may not be in their receivers' queues yet
        self.flying.append(min(f[8] for f in frames))
        if len(self.flying) > AHEAD:
            self.flying.popleft()
        return min(min(f[0] for f in frames), min(self.flying))

    def end(self, last: list[list[Any]]) -> float:
        """The run's end time, from every part's last frame: where
        ``Simulator.run`` leaves ``now``."""
        end = max(f[5] for f in last)
        if self.stop < _INF:
            end = max(end, min(self.stop, self.sc.max_time_s))
        return end


def _drive(lanes: dict[int, _Lane], parts: int, send: Callable[[int, int, list[Any]], None],
           recv: Callable[[int, int], list[Any]], tick: Callable[[dict[int, list[Any]]], None] | None = None
           ) -> tuple[float, dict[int, list[Any]]]:
    """Run ``lanes`` (the parts in this process) window by window; the other
    parts' frames come from ``recv(j, i)`` (part ``j``'s next frame for
    ``i``) and ``send(i, j, frame)`` gives them theirs. ``tick(latest)``
    after each window, with the latest frame known from each part. Returns
    the end time and every part's last frame."""
    remote = [j for j in range(parts) if j not in lanes]
    if remote and len(lanes) > 1:
        raise AssertionError("a process with parts elsewhere runs one part")

    def others(i: int, frames: dict[int, list[Any]]) -> dict[int, list[Any]]:
        got = {j: _for(f, i) for j, f in frames.items() if j != i}
        for j in remote:
            got[j] = recv(j, i)
        return got

    def post(i: int, f: list[Any]) -> None:
        for j in remote:
            send(i, j, _for(f, j))

    frames = {i: ln.first() for i, ln in lanes.items()}
    for i in lanes:
        post(i, frames[i])
    going = {ln.begin(others(i, frames)) for i, ln in lanes.items()}
    if len(going) != 1:
        raise AssertionError("the parts disagree on the first window")
    if not going.pop():
        last = {j: f for ln in lanes.values() for j, f in enumerate(ln.heard)}
        return lanes[min(lanes)].end([last[j] for j in range(parts)]), last
    history: deque[dict[int, list[Any]]] = deque()  # this process's frames of the last windows, oldest first
    while True:
        for ln in lanes.values():
            ln.window()
        old = history.popleft() if len(history) == AHEAD else None
        frames = {}
        for i, ln in lanes.items():
            frames[i] = ln.after(None if old is None else others(i, old))
            post(i, frames[i])
        history.append(frames)
        if tick is not None:
            latest = {j: f for ln in lanes.values() for j, f in enumerate(ln.heard)}
            latest.update(frames)
            tick(latest)
        going = {ln.going() for ln in lanes.values()}
        if len(going) != 1:
            raise AssertionError("the parts disagree on the last window")
        if not going.pop():
            break
    # every part stopped after the same window; the others' frames of the last
    # windows are unread (a process with parts elsewhere runs only one lane)
    i0 = min(lanes)
    last: dict[int, list[Any]] = {}
    for old in history:
        last = others(i0, old)
    last.update(frames)
    return lanes[i0].end([last[j] for j in range(parts)]), last


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
        #: frames to and from each part run in another process
        self.outs: dict[int, _Chan] = {}
        self.ins: dict[int, _Chan] = {}
        self.pids: list[int] = []
        #: wall seconds each part's process waited for the others; none when the parts share a process
        self.waited_s: dict[int, float] = {}
        if self.workers > 1:
            # a ring per ordered pair of parts: each part hears from every other directly
            rings = {(i, j): mmap.mmap(-1, _SLOT) for i in range(self.parts) for j in range(self.parts) if i != j}
            for i in range(1, self.parts):
                self._fork(i, rings)
            alive = self._workers_alive
            for j in range(1, self.parts):
                self.outs[j] = _Chan(rings[0, j], None, alive)
                self.ins[j] = _Chan(None, rings[j, 0], alive)
            _pump_while_full(self.outs, self.ins)
        self.local: dict[int, PartSim] = {}
        try:
            for i in range(self.parts):
                if i not in self.ins:
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
        self.windows = 0  # windows run (each part runs the same ones)
        #: each part's share of the results (``PartSim.pieces``), unpacked
        self._pieces: dict[int, dict[str, Any]] = {}

    def _fork(self, index: int, rings: dict[tuple[int, int], mmap.mmap]) -> None:
        parent = os.getpid()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the part's process
            code = 1
            # Ctrl-C is netsim's to handle: it stops this process (``_stop_workers``)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            try:
                def alive() -> bool:
                    return os.getppid() == parent
                others = [j for j in range(self.parts) if j != index]
                outs = {j: _Chan(rings[index, j], None, alive) for j in others}
                ins = {j: _Chan(None, rings[j, index], alive) for j in others}
                _pump_while_full(outs, ins)
                _serve(self.sc, self.seed, self.plan, index, self.fast, outs, ins)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        self.pids.append(pid)

    def _workers_alive(self) -> bool:
        return all(_running(pid) for pid in self.pids)

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

    def _recv(self, j: int) -> Any:
        try:
            return _unpack(self.ins[j].recv())
        except EOFError:
            raise RuntimeError(f"netsim: part {j}'s process stopped (its error is above)") from None

    def _count(self, frames: dict[int, list[Any]]) -> None:
        self.events = sum(f[2] for f in frames.values())
        self.shards_delivered = sum(f[6] for f in frames.values())
        self.finished = sum(f[7] for f in frames.values())

    def _run(self, tick: Callable[["Partitioned"], None] | None, tick_s: float) -> None:
        lanes = {i: _Lane(p, self.sc) for i, p in self.local.items()}
        lane = lanes[0]
        last = time.perf_counter()

        def send(i: int, j: int, frame: list[Any]) -> None:
            self.outs[j].send(msgpack.packb(frame, use_bin_type=True))

        def recv(j: int, i: int) -> list[Any]:
            return self._recv(j)

        def on_window(frames: dict[int, list[Any]]) -> None:
            nonlocal last
            w = time.perf_counter()
            if w - last >= tick_s:
                last = w
                self._count(frames)
                self.stop_at = lane.stop
                self.now = min(lane.start, lane.stop)
                tick(self)  # type: ignore[misc]

        end, frames = _drive(lanes, self.parts, send, recv, on_window if tick is not None else None)
        self.windows = lane.windows
        self._count(frames)
        self.stop_at = lane.stop
        for i, p in self.local.items():
            p.now = end
            self._pieces[i] = _unpack(p.pieces(end))
        for j in self.ins:
            self._pieces[j] = self._recv(j)
            self.waited_s[j] = self._pieces[j]["waited_s"]
        self._stop_workers()
        self.end = self.now = end

    def _stop_workers(self, *, kill: bool = False) -> None:
        if self.ins:
            self.waited_s[0] = sum(ch.wait_s for ch in (*self.ins.values(), *self.outs.values()))
        self.ins, self.outs = {}, {}
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


def _serve(sc: Scenario, seed: int, plan: Plan, index: int, fast: bool,
           outs: dict[int, _Chan], ins: dict[int, _Chan]) -> None:
    """A part's process: its windows, then its share of the results to netsim's process."""
    part = PartSim(sc, seed, index=index, plan=plan, fast=fast)

    def send(i: int, j: int, frame: list[Any]) -> None:
        outs[j].send(msgpack.packb(frame, use_bin_type=True))

    def recv(j: int, i: int) -> list[Any]:
        return _unpack(ins[j].recv())

    with _young_gc():
        end, _ = _drive({index: _Lane(part, sc)}, part.parts, send, recv)
        part.now = end
        part.waited_s = sum(ch.wait_s for ch in (*ins.values(), *outs.values()))
        outs[0].send(part.pieces(end))
