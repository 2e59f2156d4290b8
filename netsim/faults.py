"""The fault matrix: each fault scenario (``netsim/scenarios/fault-*.toml``)
against batch and LLM jobs, with the exactly-once and garbage-collection
counts. ``netsim faults`` prints it; tests/netsim/test_netsim_faults.py
asserts it. See docs/netsim.md ("Faults").
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["FAULT_SCENARIOS", "SCENARIO_DIR", "job_kind", "matrix_rows", "run_matrix", "format_matrix", "faults_main"]

SCENARIO_DIR = Path(__file__).resolve().parent / "scenarios"
FAULT_SCENARIOS = ("fault-crash", "fault-hang", "fault-slow", "fault-partition", "fault-messages", "fault-client")
KINDS = ("batch", "llm")
COLUMNS = ("jobs", "done", "shards", "delivered", "lost", "dup", "abandoned", "undelivered", "lapsed", "rerun")


def job_kind(task: str) -> str:
    """``llm`` for the llm-batch task, ``batch`` for the rest (sim, tensor-map)."""
    return "llm" if task == "llm-batch" else "batch"


def matrix_rows(res: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Per job kind: jobs submitted/completed, shards submitted/delivered/lost/
    duplicated, and the fault bookkeeping of those kinds' tenants (peers'
    abandoned leases and undeliverable results, clients' lapsed leases)."""
    out = {k: dict.fromkeys(COLUMNS, 0) for k in KINDS}
    for j in res["jobs"]:
        if j["arrival_s"] is None:
            continue
        r = out[job_kind(j["task"])]
        r["jobs"] += 1
        r["done"] += int(bool(j["finished"]))
        r["shards"] += j["shards"]
        r["delivered"] += j["shards_delivered"]
        r["lost"] += j["shards_lost"]
        r["dup"] += j["shards_duplicated"]
    for t in res["faults"]["tenants"].values():
        r = out[job_kind(t["task"])]
        r["abandoned"] += t["leases_abandoned"]
        r["undelivered"] += t["results_undelivered"]
        r["lapsed"] += t["leases_lapsed"]
    # shards a crashed/hung/slow peer held that were delivered from another attempt
    for d in res["faults"]["injected"]:
        for task, n in d.get("shards_rerun_by_task", {}).items():
            out[job_kind(task)]["rerun"] += n
    return out


def run_matrix(names: tuple[str, ...] = FAULT_SCENARIOS, seeds: tuple[int, ...] = (1, 2), *,
               scenario_dir: Path = SCENARIO_DIR, profiles_dir: str | None = None,
               progress: Any = None) -> dict[str, Any]:
    from .progress import run_sim
    from .scenario import load_scenario
    from .sim import Simulator

    runs = []
    for name in names:
        sc = load_scenario(scenario_dir / f"{name}.toml", profiles_dir=profiles_dir)
        for seed in seeds:
            t0 = time.perf_counter()
            sim = Simulator(sc, seed)
            # ``progress``: a netsim.progress.Progress (a bar or periodic
            # lines per run) or a text stream (one line per run)
            run_sim(sim, progress.task(f"faults {name} seed={seed}") if hasattr(progress, "task") else None)
            res = sim.results()
            if progress is not None and not hasattr(progress, "task"):
                print(f"netsim faults: {name} seed={seed} wall={time.perf_counter() - t0:.2f}s", file=progress)
            s = res["summary"]
            runs.append({
                "scenario": name,
                "seed": seed,
                "rows": matrix_rows(res),
                "summary": {k: s[k] for k in ("jobs_submitted", "jobs_completed", "shards_submitted", "shards_completed",
                                              "shards_lost", "shards_duplicated", "makespan_s", "mean_jct_s")},
                "faults": {k: res["faults"][k] for k in ("injected", "counts", "gc")},
            })
    return {"seeds": list(seeds), "runs": runs}


def aggregate(matrix: dict[str, Any]) -> list[tuple[str, str, dict[str, int]]]:
    """Sum each (fault, kind) row over the seeds."""
    acc: dict[tuple[str, str], dict[str, int]] = {}
    order: list[tuple[str, str]] = []
    for run in matrix["runs"]:
        for kind in KINDS:
            key = (run["scenario"], kind)
            if key not in acc:
                acc[key] = dict.fromkeys(COLUMNS, 0)
                order.append(key)
            for c in COLUMNS:
                acc[key][c] += run["rows"][kind][c]
    return [(f, k, acc[(f, k)]) for f, k in order]


def format_matrix(matrix: dict[str, Any]) -> str:
    head = ("fault", "jobs", "kind", "jobs done", "shards delivered", "lost", "dup", "abandoned", "undelivered",
            "lapsed", "re-run")
    rows = []
    for fault, kind, r in aggregate(matrix):
        rows.append((
            fault.removeprefix("fault-"), "", kind, f"{r['done']}/{r['jobs']}", f"{r['delivered']}/{r['shards']}",
            str(r["lost"]), str(r["dup"]), str(r["abandoned"]), str(r["undelivered"]), str(r["lapsed"]),
            str(r["rerun"]),
        ))
    head = head[:1] + head[2:]
    rows = [r[:1] + r[2:] for r in rows]
    w = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    line = lambda cells: "| " + " | ".join(c.ljust(w[i]) for i, c in enumerate(cells)) + " |"  # noqa: E731
    out = [line(head), "|" + "|".join("-" * (x + 2) for x in w) + "|"]
    out += [line(r) for r in rows]
    return "\n".join(out)


def ok(matrix: dict[str, Any]) -> bool:
    return all(
        r["lost"] == 0 and r["dup"] == 0 and r["done"] == r["jobs"]
        for run in matrix["runs"] for r in run["rows"].values()
    )


def faults_main(args: Any) -> int:
    """``netsim faults``: run the fault matrix, print it, write JSON."""
    import json

    from .stats import round_floats
    from .scenario import ScenarioError

    from .progress import Progress

    names = tuple(args.only) if args.only else FAULT_SCENARIOS
    t0 = time.perf_counter()
    try:
        with Progress(quiet=getattr(args, "quiet", False)) as prog:
            m = run_matrix(names, tuple(args.seeds), scenario_dir=Path(args.dir) if args.dir else SCENARIO_DIR,
                           profiles_dir=args.profiles, progress=prog)
    except (ScenarioError, ValueError) as exc:
        print(f"netsim: error: {exc}", file=sys.stderr)
        return 2
    print(format_matrix(m))
    print(f"netsim faults: {len(m['runs'])} runs, seeds {list(args.seeds)}, wall={time.perf_counter() - t0:.1f}s",
          file=sys.stderr)
    if args.out:
        Path(args.out).write_text(json.dumps(round_floats(m), sort_keys=True, indent=1, allow_nan=False) + "\n")
    return 0 if ok(m) else 1
