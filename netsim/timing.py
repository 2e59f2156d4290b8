"""Where a netsim run's time goes, by input: how long the cores take over
each kind of message they receive, their polls and their other inputs.

    sim = TimedSimulator(scenario, seed)
    sim.run()
    print(format_table(sim.timing, cpu_s))

``TimedSimulator`` runs exactly what ``Simulator`` runs (the same events,
the same results, byte for byte: tests/netsim/test_netsim_timing.py): it
only puts a stopwatch between the loop and each core. Each call of a core's
``handle`` or ``poll`` is timed with ``time.perf_counter`` and filed under
the input's kind (a message by the kind its envelope's header names,
``wire.peek_kind``, read outside the timed call) and whether a peer or a
client took it. What is left of the run's time is netsim's own work
(the event heap, the network model, effects, bookkeeping) and the
stopwatch's.

Used by ``benchmarks/netsim_scale.py --kinds``. Timings differ from run to
run; the counts do not.
"""

from __future__ import annotations

from dataclasses import dataclass
from time import perf_counter
from typing import Any

from fedswarm.core.events import MessageReceived
from fedswarm.core.wire import peek_kind

from .sim import NodeRec, Simulator


@dataclass(slots=True)
class Tally:
    calls: int = 0
    seconds: float = 0.0


class _Stopwatch:
    """Stands in for a core: times ``handle`` and ``poll``, hands everything
    else to the core itself."""

    __slots__ = ("core", "side", "table")

    def __init__(self, core: Any, side: str, table: dict[tuple[str, str], Tally]) -> None:
        object.__setattr__(self, "core", core)
        object.__setattr__(self, "side", side)
        object.__setattr__(self, "table", table)

    def handle(self, now: float, inp: Any) -> Any:
        t0 = perf_counter()
        out = self.core.handle(now, inp)
        dt = perf_counter() - t0
        if type(inp) is MessageReceived:
            kind = peek_kind(inp.data) or "(unreadable message)"
        else:
            kind = type(inp).__name__
        self._file(kind, dt)
        return out

    def poll(self, now: float) -> Any:
        t0 = perf_counter()
        out = self.core.poll(now)
        self._file("poll", perf_counter() - t0)
        return out

    def _file(self, kind: str, dt: float) -> None:
        key = (kind, self.side)
        t = self.table.get(key)
        if t is None:
            t = self.table[key] = Tally()
        t.calls += 1
        t.seconds += dt

    def __getattr__(self, name: str) -> Any:
        return getattr(self.core, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.core, name, value)


class TimedSimulator(Simulator):
    """A ``Simulator`` whose cores (joiners included) are timed by input kind:
    ``timing`` maps (kind, "peer" or "client") to calls and seconds."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.timing: dict[tuple[str, str], Tally] = {}
        super().__init__(*args, **kwargs)

    def _add_peer(self, *args: Any, **kwargs: Any) -> NodeRec:
        rec = super()._add_peer(*args, **kwargs)
        rec.core = _Stopwatch(rec.core, "peer", self.timing)
        return rec

    def _add_client(self, *args: Any, **kwargs: Any) -> NodeRec:
        rec = super()._add_client(*args, **kwargs)
        rec.core = _Stopwatch(rec.core, "client", self.timing)
        return rec


def format_table(timing: dict[tuple[str, str], Tally], run_s: float) -> str:
    """A Markdown table of ``timing``, the costliest first, with each row's
    share of ``run_s`` (the run's own time) and the rest of it as netsim's."""
    rows = sorted(timing.items(), key=lambda kv: -kv[1].seconds)
    cores = sum(t.seconds for t in timing.values())
    lines = ["| input | taken by | calls | seconds | share of the run | us per call |", "|---|---|---|---|---|---|"]
    for (kind, side), t in rows:
        lines.append(f"| {kind} | {side} | {t.calls:,} | {t.seconds:.2f} | {100 * t.seconds / run_s:.1f}% | "
                     f"{1e6 * t.seconds / t.calls:.1f} |")
    rest = run_s - cores
    lines.append(f"| (the cores, in all) | | {sum(t.calls for t in timing.values()):,} | {cores:.2f} | "
                 f"{100 * cores / run_s:.1f}% | |")
    lines.append(f"| (netsim's own work and the stopwatch) | | | {rest:.2f} | {100 * rest / run_s:.1f}% | |")
    return "\n".join(lines)
