"""``netsim run SCENARIO.toml --seed S --out results.json [--trace F.csv] [--peers N] [--plot [STEM.png]] [-q]``

``netsim compare`` and ``netsim faults`` share ``-q``. Progress goes to
stderr (a rich bar on a terminal, a line every few seconds elsewhere);
figures (``netsim.plots``) go next to the JSON.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, NoReturn
from pathlib import Path

from . import dumps_results, hugepages
from .scenario import ScenarioError, checkpoint_interval, load_scenario
from .sim import Simulator
from .workload import TraceError, read_trace

SUMMARY_ROWS = (
    "jobs_submitted", "jobs_completed", "shards_completed", "shards_lost", "shards_duplicated", "jain_index",
    "max_rho", "mean_rho", "mean_jct_s", "makespan_s", "utilization", "energy_j", "carbon_g",
    "msgs_per_peer_s", "bytes_per_peer_s",
)


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    return "-" if v is None else str(v)


def print_summary(summary: dict, out=None) -> None:
    out = out if out is not None else sys.stdout
    w = max(len(k) for k in SUMMARY_ROWS)
    print(f"{'metric':<{w}}  value", file=out)
    print(f"{'-' * w}  {'-' * 12}", file=out)
    for k in SUMMARY_ROWS:
        print(f"{k:<{w}}  {_fmt(summary.get(k))}", file=out)


def _add_faults_parser(sub) -> None:
    """``netsim faults [--seeds 1 2] [--out F.json]``: the fault matrix (each fault x batch / LLM jobs)."""
    f = sub.add_parser("faults", help="run the fault scenarios and print the fault matrix",
                       description="Run the fault-*.toml scenarios and print the fault matrix. "
                                   "Example: netsim faults --seeds 1 2 --out faults.json")
    f.add_argument("--seeds", type=int, nargs="+", default=[1, 2], help="seeds to run each scenario with (default: 1 2)")
    f.add_argument("--out", help="write the matrix and per-run fault counts as JSON")
    f.add_argument("--only", nargs="+", metavar="NAME", help="run only these scenarios (e.g. fault-hang)")
    f.add_argument("--dir", help="directory of the fault-*.toml scenarios (default: netsim/scenarios)")
    f.add_argument("--profiles", help="directory of peer profiles (default: nearest peers/ above the scenarios)")
    f.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr (default: progress)")


def _add_scenario_args(p: argparse.ArgumentParser, *, out: str, profiles: str, policies: str | None = None) -> None:
    """The arguments ``run`` and ``compare`` share (``--policies`` for compare)."""
    p.add_argument("scenario", help="scenario TOML file")
    if policies is not None:
        p.add_argument("--policies", default="fedswarm,centralized,fifo,random,sparrow", help=policies)
    p.add_argument("--seed", type=int, help="seed of the run: the same seed gives the same JSON (default: 0)")
    p.add_argument("--out", help=out)
    p.add_argument("--trace", help="CSV trace replacing the scenario's workload")
    p.add_argument("--peers", type=int, help="scale the swarm to N initial peers, keeping the profile mix")
    p.add_argument("--profiles", help=profiles)
    p.add_argument("--max-time", type=float, help="override the scenario's max_time_s")
    p.add_argument("--checkpoint-s", type=float, metavar="SECONDS",
                   help="override the scenario's workload.checkpoint_s: tasks save progress this often (0: never)")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="no progress on stderr (default: a bar on a terminal, a line every 5 s elsewhere)")
    if policies is None:
        p.add_argument("--workers", type=int, metavar="N",
                       help="processes for a scenario split into parts ([parallel]): 1 runs the parts in turn here, "
                            "more runs one process per part; the results are the same (default: one per part, "
                            "up to the CPUs)")


#: where ``run`` leaves its simulator and results when the command will
#: leave by ``os._exit`` (``script``); None when ``main`` is called in-process
_HOLD: list[object] | None = None


def script() -> NoReturn:
    """The ``netsim`` command and ``python -m netsim``: ``main``, then out
    without tearing the heap down. After a large run there is nothing left
    to do but free it object by object, which took 6.1 s after scale-10k
    (3.8 GB), so ``run`` leaves its simulator in ``_HOLD`` rather than
    letting it go when it returns; the results are written and closed by
    then."""
    global _HOLD
    _HOLD = []
    rc = main()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said
            pass
    os._exit(rc)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="netsim", description="Simulate a fedswarm swarm in virtual time.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a scenario",
                       description="Run one scenario in virtual time; the summary goes to stdout, progress to stderr. "
                                   "Example: netsim run netsim/scenarios/smoke-20.toml --seed 1 --out r.json --plot")
    _add_scenario_args(r, out="results JSON path (default: print nothing but the summary)",
                       profiles="directory of peer profiles (default: nearest peers/ above the scenario)")
    r.add_argument("--plot", nargs="?", const="", metavar="STEM.png",
                   help="write PNG figures (JCT/rho CDFs, energy, shares, messages) as STEM.png and STEM.*.png; "
                        "without a value, next to --out (default: no figures)")
    c = sub.add_parser("compare", help="run fedswarm and baseline schedulers on the same workload and swarm",
                       description="Run fedswarm and baseline schedulers on the same workload and swarm; print a table, "
                                   "write the JSON and PNG figures next to it. Example: netsim compare "
                                   "netsim/scenarios/smoke-20.toml --seed 1 --out cmp.json")
    _add_scenario_args(c, out="results JSON path; PNG figures go next to it (STEM.png, STEM.cdf.png, ...)",
                       profiles="directory of peer profiles",
                       policies="comma-separated: fedswarm, fedswarm-race, fedswarm-rerun, centralized, fifo, random, sparrow "
                                "(networked), or centralized-instant, ... (their messages instant)")
    c.add_argument("--no-plot", action="store_true", help="write the JSON only, no PNG figures")
    c.add_argument("--seeds", metavar="SEEDS", nargs="+",
                   help="run every seed given (1 2 3, 1-6 or 1-3 7), one process per seed, and print each seed's "
                        "mean JCT, max rho (and the job that sets it) and deadline misses, with each policy's ratios "
                        "against --against and their median and range; with --out, OUT is that summary and each "
                        "seed's results go next to it as STEM.seedS.json (docs/netsim.md, \"Several seeds\")")
    c.add_argument("--against", metavar="POLICY",
                   help="with --seeds: the policy the ratios are taken against (default: centralized)")
    c.add_argument("--workers", type=int, metavar="N",
                   help="with --seeds: seeds run side by side (default: one per CPU)")
    _add_faults_parser(sub)
    ap.add_argument("--debug", action="store_true", help="show the traceback of an error")
    args = ap.parse_args(argv)
    from fedswarm.cli import check_writable, report_failure

    if args.cmd == "compare" and args.seeds is not None and args.seed is not None:
        print("netsim: error: --seed and --seeds: give one of them", file=sys.stderr)
        return 2
    if getattr(args, "seed", 0) is None:
        args.seed = 0
    if getattr(args, "workers", None) is not None and args.workers < 1:  # run and compare --seeds
        print("netsim: error: --workers must be >= 1", file=sys.stderr)
        return 2

    try:
        if args.out:  # checked before minutes of simulation, not after
            check_writable(args.out)
        return _dispatch(args)
    except BaseException as exc:  # one line and an exit code (2 input, 1 failure, 130 Ctrl-C)
        if isinstance(exc, SystemExit):
            raise
        return report_failure(f"netsim {args.cmd}", exc, debug=args.debug)


def _dispatch(args: argparse.Namespace) -> int:
    if args.cmd == "compare":
        return compare_main(args)
    if args.cmd == "faults":
        from .faults import faults_main

        return faults_main(args)

    t0 = time.perf_counter()
    loaded = _load(args)
    if loaded is None:
        return 2
    sc, jobs = loaded
    if sc.llm is not None:  # LLM serving sessions: netsim.llm
        from .llm import llm_run_main

        return llm_run_main(args, sc, t0)
    if args.plot == "" and not args.out:
        print("netsim: error: --plot without a value needs --out (the figures go next to it)", file=sys.stderr)
        return 2
    if args.workers is not None and args.workers > 1 and sc.parts == 1:
        print(f"netsim: note: --workers {args.workers} has no effect: {sc.name} is not split into parts "
              "(a [parallel] table; docs/netsim.md, \"Two cores\"), so it runs in this process", file=sys.stderr)
    try:
        if sc.parts > 1:  # before the progress bar's thread: this forks the parts' processes
            from .parallel import Partitioned

            workers = args.workers if args.workers is not None else min(sc.parts, os.cpu_count() or 1)
            sim: Any = Partitioned(sc, args.seed, jobs=jobs, workers=workers)
        else:
            sim = Simulator(sc, args.seed, jobs=jobs)
    except (ScenarioError, ValueError) as exc:  # e.g. a fault names a tenant the trace lacks
        print(f"netsim: error: {exc}", file=sys.stderr)
        return 2
    from .progress import Progress, run_parts, run_sim

    with Progress(quiet=args.quiet) as prog:
        task = prog.task(f"{sc.name} seed={args.seed}")
        if sc.parts > 1:
            run_parts(sim, task)
        else:
            run_sim(sim, task)
    res = sim.results()
    if _HOLD is not None:
        _HOLD.append((sim, res))  # freed by the process's exit, not object by object
    text = dumps_results(res)
    if args.out:
        Path(args.out).write_text(text)
    print_summary(res["summary"])
    wall = time.perf_counter() - t0
    print(
        f"netsim: {sc.name} seed={args.seed} peers={sc.n_peers} sim={sim.now:.1f}s events={sim.events} "
        f"wall={wall:.2f}s ({sim.events / max(wall, 1e-9):.0f} events/s) core={_core_kind()} "
        f"huge_pages={hugepages.status()}"
        + (f" parts={sc.parts} workers={sim.workers}" if sc.parts > 1 else "")
        + (" waited=" + ",".join(f"{sim.waited_s[i]:.1f}" for i in sorted(sim.waited_s)) + "s"
           if sc.parts > 1 and sim.waited_s else ""),
        file=sys.stderr,
    )
    if args.plot is not None:
        from .plots import plot_run

        written = plot_run(res, args.plot or args.out)
        print(f"netsim: figures: {', '.join(written)}", file=sys.stderr)
    s = res["summary"]
    if s["shards_lost"] or s["shards_duplicated"]:
        return 1
    return 0


def _core_kind() -> str:
    """``compiled`` when fedswarm's core runs as its mypyc build, else
    ``python`` and how to compile it (about 0.7x the time at scale)."""
    import fedswarm.core

    return "compiled" if fedswarm.core.NATIVE else "python (scripts/build_native.py compiles it)"


def _load(args: argparse.Namespace) -> "tuple[Any, Any] | None":
    """The scenario (scaled, time-capped) and trace named on the command
    line; None after printing the error for a bad input."""
    try:
        sc = load_scenario(args.scenario, profiles_dir=args.profiles)
        jobs = read_trace(args.trace) if args.trace else None
        if args.peers is not None:
            sc = sc.scaled(args.peers)
        if args.max_time is not None:
            sc.max_time_s = args.max_time
        if getattr(args, "checkpoint_s", None) is not None:
            sc.checkpoint_s = checkpoint_interval(args.checkpoint_s, "--checkpoint-s")
    except (ScenarioError, TraceError, ValueError) as exc:
        print(f"netsim: error: {exc}", file=sys.stderr)
        return None
    return sc, jobs


def compare_main(args: argparse.Namespace) -> int:
    from .compare import POLICIES, compare, print_table
    from .progress import Progress

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    bad = [p for p in policies if p not in POLICIES]
    if bad or not policies:
        print(f"netsim: error: unknown policy {bad}; choose from {list(POLICIES)}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    loaded = _load(args)
    if loaded is None:
        return 2
    sc, jobs = loaded
    if args.seeds is None:
        for flag, val in (("--against", args.against), ("--workers", args.workers)):
            if val is not None:
                print(f"netsim: error: {flag} goes with --seeds", file=sys.stderr)
                return 2
    elif sc.llm is not None:
        print("netsim: error: --seeds compares batch scenarios; run an [llm] scenario one --seed at a time",
              file=sys.stderr)
        return 2
    else:
        from .seeds import seeds_main

        return seeds_main(args, policies)
    if sc.llm is not None:  # LLM serving: fedswarm against static spans (netsim.llm)
        from .llm import llm_compare_main

        return llm_compare_main(args, sc, t0)

    with Progress(quiet=args.quiet) as prog:
        cmp = compare(sc, args.seed, policies, jobs, progress=prog)
    if args.out:
        from .plots import plot_compare

        Path(args.out).write_text(dumps_results(cmp))
        written = [] if args.no_plot else plot_compare(cmp, args.out)
        if written and not args.quiet:
            print(f"netsim: figures: {', '.join(written)} ({time.perf_counter() - t0:.1f}s)", file=sys.stderr)
    print(f"# {sc.name} seed={args.seed} peers={sc.n_peers}")
    print_table(cmp)
    lost = sum(p["summary"]["shards_lost"] + p["summary"]["shards_duplicated"] for p in cmp["policies"].values())
    return 1 if lost else 0


if __name__ == "__main__":
    script()
