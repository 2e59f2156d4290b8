"""Progress of long netsim commands (``run``, ``compare``, ``faults``).

On a terminal: a rich progress bar per run (simulated time, events per
second, estimate of the time left). Off a terminal (CI logs, pipes): one
plain line every ``interval_s`` seconds and one when a run ends. ``quiet``
silences both. Everything goes to stderr, so stdout stays the table or JSON.

``run_sim(sim, reporter)`` drives a ``Simulator`` in slices of simulated
time with the same result as ``sim.run()`` (the event loop just pauses
between slices) and reports after each.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from typing import Any, TextIO

__all__ = ["Progress", "run_sim"]


class _Task:
    def __init__(self, owner: "Progress", label: str, total: float | None) -> None:
        self.owner = owner
        self.label = label
        self.total = total
        self.done = 0.0
        self.t0 = time.perf_counter()
        self.last_line = self.t0
        self.sim_t = 0.0
        self.events = 0
        self.rich_id: Any = None

    def update(self, *, done: float | None = None, sim_t: float | None = None, events: int | None = None) -> None:
        if done is not None:
            self.done = done
        if sim_t is not None:
            self.sim_t = sim_t
        if events is not None:
            self.events = events
        self.owner._update(self)

    def finish(self) -> None:
        if self.total is not None:
            self.done = self.total
        self.owner._finish(self)

    # -- text ---------------------------------------------------------------
    def rate(self) -> float:
        return self.events / max(time.perf_counter() - self.t0, 1e-9)

    def eta_s(self) -> float | None:
        if not self.total or self.done <= 0:
            return None
        el = time.perf_counter() - self.t0
        return el * (self.total - self.done) / self.done

    def line(self, final: bool = False) -> str:
        parts = [f"netsim: {self.label}"]
        if self.total:
            parts.append(f"{int(100.0 * min(self.done / self.total, 1.0)):3d}%")  # floor: 100% only when done
        parts.append(f"sim={self.sim_t:.1f}s events={self.events} ({self.rate():.0f}/s)")
        el = time.perf_counter() - self.t0
        if final:
            parts.append(f"done in {el:.1f}s")
        else:
            eta = self.eta_s()
            parts.append(f"elapsed {el:.0f}s" + (f" eta {eta:.0f}s" if eta is not None else ""))
        return " ".join(parts)


class Progress:
    """``with Progress(quiet=args.quiet) as p: t = p.task("fedswarm", total=jobs)``."""

    def __init__(self, *, quiet: bool = False, stream: TextIO | None = None, interval_s: float = 5.0,
                 force_terminal: bool | None = None) -> None:
        self.quiet = quiet
        self.stream = stream if stream is not None else sys.stderr
        self.interval_s = interval_s
        tty = force_terminal if force_terminal is not None else bool(getattr(self.stream, "isatty", lambda: False)())
        self.rich = None
        if tty and not quiet:
            from rich.console import Console
            from rich.progress import (BarColumn, Progress as RichProgress, TaskProgressColumn, TextColumn,
                                       TimeElapsedColumn, TimeRemainingColumn)

            self.rich = RichProgress(
                TextColumn("[bold]{task.description}"), BarColumn(), TaskProgressColumn(),
                TextColumn("sim {task.fields[sim]}"), TextColumn("{task.fields[rate]}"),
                TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                console=Console(file=self.stream, force_terminal=True), transient=False,
            )

    def __enter__(self) -> "Progress":
        if self.rich is not None:
            self.rich.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.rich is not None:
            self.rich.stop()

    def task(self, label: str, total: float | None = None) -> _Task:
        t = _Task(self, label, total)
        if self.rich is not None:
            t.rich_id = self.rich.add_task(label, total=total, sim="0.0 s", rate="")
        return t

    def _update(self, t: _Task) -> None:
        if self.quiet:
            return
        if self.rich is not None:
            self.rich.update(t.rich_id, total=t.total, completed=t.done, sim=f"{t.sim_t:,.1f} s", rate=f"{t.rate():,.0f} ev/s")
            return
        now = time.perf_counter()
        if now - t.last_line >= self.interval_s:
            t.last_line = now
            print(t.line(), file=self.stream, flush=True)

    def _finish(self, t: _Task) -> None:
        if self.quiet:
            return
        if self.rich is not None:
            self.rich.update(t.rich_id, total=t.total or 1, completed=t.total or 1,
                             sim=f"{t.sim_t:,.1f} s", rate=f"{t.rate():,.0f} ev/s")
            return
        print(t.line(final=True), file=self.stream, flush=True)


def _done(sim: Any) -> float:
    """Per mille of the run done: shards delivered of the trace's, jobs
    finished of its jobs, or simulated time of the stop time, whichever is
    furthest. (Shards move first: at 10,000 peers a job takes minutes of
    simulated time, and by jobs alone scale-10k's bar stayed at 0 to 2%
    for the first five minutes of a 32-minute run, its time left put at
    over three hours.)"""
    jobs = sum(1 for j in sim.jobs.values() if j.finish_t is not None) / max(len(sim.trace), 1)
    shards = getattr(sim, "shards_delivered", 0) / max(sum(j.shards for j in sim.trace), 1)
    t = sim.now / sim.stop_at if 0 < sim.stop_at < math.inf else 0.0
    return 1000.0 * min(max(jobs, shards, t), 1.0)


def run_sim(sim: Any, task: _Task | None, *, slice_wall_s: float = 0.25) -> None:
    """``sim.run()`` in slices of simulated time, reporting progress (jobs
    finished out of the trace's) after each slice. Same results: the event
    loop only stops between events."""
    if task is None or not sim.stop_at < math.inf:
        # without a finite stop time the slices would leave ``now`` past the
        # last event, which ``run()`` does not: run in one go
        sim.run()
        if task is not None:
            task.update(done=_done(sim), sim_t=sim.now, events=sim.events)
            task.finish()
        return
    task.total = 1000.0
    step = 1.0  # simulated seconds per slice, adapted to ~slice_wall_s of wall time
    t = sim.now
    # one setting of the loop's gc thresholds for all the slices (see netsim.sim._young_gc)
    with sim.young_gc() if hasattr(sim, "young_gc") else contextlib.nullcontext():
        while sim.q and sim.q.peek_time() <= sim.stop_at:
            t = max(t, sim.q.peek_time()) + step
            w0 = time.perf_counter()
            sim.run_until(t)
            took = time.perf_counter() - w0
            step = min(max(step * (2.0 if took < slice_wall_s / 2 else 0.5 if took > 2 * slice_wall_s else 1.0), 1e-3),
                       1e6)
            task.update(done=_done(sim), sim_t=sim.now, events=sim.events)
    # what Simulator.run does after its loop (a slice's end never passes
    # stop_at <= max_time_s, so ``now`` ends where ``run()`` leaves it)
    if sim.stop_at < math.inf:
        sim.now = max(sim.now, min(sim.stop_at, sim.sc.max_time_s))
    task.update(done=_done(sim), sim_t=sim.now, events=sim.events)
    task.finish()


def run_parts(run: Any, task: _Task | None, *, tick_s: float = 0.25) -> None:
    """A partitioned run (``netsim.parallel.Partitioned``) to its end,
    reporting progress about every ``tick_s`` of wall time."""
    if task is None:
        run.run()
        return
    task.total = 1000.0

    def tick(r: Any) -> None:
        task.update(done=r.done_permille(), sim_t=r.now, events=r.events)

    run.run(tick, tick_s=tick_s)
    tick(run)
    task.finish()
