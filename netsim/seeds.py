"""``netsim compare --seeds``: the same comparison over several seeds.

One seed's max rho is set by one job, and which job depends on where a
crash lands and on the placement before it (docs/evaluation.md), so a ratio
from one seed can sit far from the ratio of the next. ``--seeds 1-6`` (or ``--seeds 1 2 3``) runs
``netsim compare`` once per seed and prints, per seed and policy, the
figures the evaluation's goals are judged by, the job that sets each max
rho, and each policy's ratios against one reference policy (``--against``,
default ``centralized``) with their median and range over the seeds.

Each seed runs as its own ``python -m netsim compare --seed S`` process,
``--workers`` of them at a time (default: one per CPU, at most one per
seed), and writes what that command writes with ``--no-plot``: with
``--out OUT``, ``OUT``'s stem plus ``.seed{S}.json`` next to it, byte for
byte the file ``netsim compare --seed S --out ... --no-plot`` writes; and
``OUT`` itself, the summary (per seed and policy, then the ratios). The
processes exchange nothing but those JSON files.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from . import dumps_results

__all__ = ["parse_seeds", "summarize", "print_seeds", "seeds_main"]

#: a single --seeds spec may name at most this many seeds
MAX_SEEDS = 1000


def parse_seeds(spec: str) -> list[int]:
    """``"1-6"``, ``"1 3 5"``, ``"1,3,5"`` or ``"1-3 7"``: the seeds, in the
    order given, each once. Raises ValueError naming what is wrong."""
    seeds: list[int] = []
    for part in spec.replace(",", " ").split():
        lo, sep, hi = part.partition("-")
        try:
            a = int(lo)
            b = int(hi) if sep else a
        except ValueError:
            raise ValueError(f"--seeds {spec!r}: {part!r} is not a seed or a range like 1-6") from None
        if a < 0 or b < 0:
            raise ValueError(f"--seeds {spec!r}: seeds are >= 0")
        if b < a:
            raise ValueError(f"--seeds {spec!r}: the range {part!r} runs backwards")
        if len(seeds) + b - a + 1 > MAX_SEEDS:
            raise ValueError(f"--seeds {spec!r}: more than {MAX_SEEDS} seeds")
        seeds.extend(s for s in range(a, b + 1) if s not in seeds)
    return seeds


def _worst(pol: dict[str, Any]) -> str | None:
    """The job that sets the policy's max rho (the first of equals)."""
    worst = max((j for j in pol["jobs"] if j.get("rho") is not None), key=lambda j: j["rho"], default=None)
    return None if worst is None else worst["job_id"]


def _row(pol: dict[str, Any]) -> dict[str, Any]:
    s = pol["summary"]
    return {
        "mean_jct_s": s["mean_jct_s"],
        "p99_jct_s": pol["p99_jct_s"],
        "max_rho": s["max_rho"],
        "max_rho_job": _worst(pol),
        "deadline_misses": pol["deadline_misses"],
        "jobs_with_deadline": pol["jobs_with_deadline"],
        "shards_lost": s["shards_lost"],
        "shards_duplicated": s["shards_duplicated"],
    }


RATIOS = ("mean_jct_s", "p99_jct_s", "max_rho")


def summarize(per_seed: dict[int, dict[str, Any]], policies: list[str], against: str) -> dict[str, Any]:
    """The summary of per-seed ``compare`` results (seed -> its JSON) of
    ``policies``: per seed and policy the judged figures, and per policy
    other than ``against`` its ratios to it, per seed, with median, min and
    max. Rows keep the order of ``policies``."""
    seeds = list(per_seed)
    first = per_seed[seeds[0]]
    rows = {s: {p: _row(per_seed[s]["policies"][p]) for p in policies} for s in seeds}
    ratios: dict[str, Any] = {}
    for pol in policies:
        if pol == against:
            continue
        ratios[pol] = {}
        for key in RATIOS:
            vals = {}
            for s in seeds:
                ref, got = rows[s][against][key], rows[s][pol][key]
                vals[s] = None if not ref or got is None else got / ref
            known = [v for v in vals.values() if v is not None]
            ratios[pol][key] = {
                "per_seed": {str(s): v for s, v in vals.items()},
                "median": statistics.median(known) if known else None,
                "min": min(known, default=None),
                "max": max(known, default=None),
            }
    return {
        "scenario": first["scenario"],
        "peers": first["peers"],
        "seeds": seeds,
        "against": against,
        "per_seed": {str(s): rows[s] for s in seeds},
        "ratios": ratios,
    }


def _g(v: float | None) -> str:
    return "-" if v is None else f"{v:.4g}"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}x"


def print_seeds(summ: dict[str, Any], spec: str, out: Any = None) -> None:
    out = out if out is not None else sys.stdout
    against = summ["against"]
    pols = list(summ["per_seed"][str(summ["seeds"][0])])
    w = max(12, *(len(p) + 1 for p in pols))
    print(f"# {summ['scenario']} seeds={spec} peers={summ['peers']}; ratios against {against}", file=out)
    print(f"{'seed':<6}{'policy':<{w}}{'mean_jct_s':>11}{'max_rho':>9}  {'max_rho job':<16}{'dl_miss':>9}"
          f"{'jct ratio':>11}{'rho ratio':>11}", file=out)
    for s in summ["seeds"]:
        for p in pols:
            r = summ["per_seed"][str(s)][p]
            rat = summ["ratios"].get(p)
            jr = _x(rat["mean_jct_s"]["per_seed"][str(s)]) if rat else ""
            rr = _x(rat["max_rho"]["per_seed"][str(s)]) if rat else ""
            print(f"{s:<6}{p:<{w}}{_g(r['mean_jct_s']):>11}{_g(r['max_rho']):>9}  {r['max_rho_job'] or '-':<16}"
                  f"{str(r['deadline_misses']) + '/' + str(r['jobs_with_deadline']):>9}{jr:>11}{rr:>11}", file=out)
    n = len(summ["seeds"])
    for p, rat in summ["ratios"].items():
        parts = []
        for key in ("mean_jct_s", "max_rho"):
            q = rat[key]
            parts.append(f"{key} median {_x(q['median'])} [{_x(q['min'])}, {_x(q['max'])}]")
        print(f"{p} against {against} over {n} seeds: " + "; ".join(parts), file=out)


def _child_argv(args: Any, seed: int, out: Path) -> list[str]:
    argv = [sys.executable, "-m", "netsim", "compare", str(args.scenario), "--seed", str(seed),
            "--out", str(out), "--no-plot", "-q", "--policies", args.policies]
    for flag, val in (("--trace", args.trace), ("--peers", args.peers), ("--profiles", args.profiles),
                      ("--max-time", args.max_time), ("--checkpoint-s", getattr(args, "checkpoint_s", None))):
        if val is not None:
            argv += [flag, str(val)]
    return argv


def seeds_main(args: Any, policies: list[str]) -> int:
    """``netsim compare ... --seeds SPEC``: see the module's docstring."""
    try:
        spec = " ".join(args.seeds)
        seeds = parse_seeds(spec)
    except ValueError as exc:
        print(f"netsim: error: {exc}", file=sys.stderr)
        return 2
    against = args.against or "centralized"
    if against not in policies:
        print(f"netsim: error: --against {against}: not among --policies {','.join(policies)}", file=sys.stderr)
        return 2
    workers = min(args.workers or os.cpu_count() or 1, len(seeds))
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="netsim-seeds-") as tmp:
        if args.out:
            stem = Path(args.out).with_suffix("")
            files = {s: stem.with_name(f"{stem.name}.seed{s}.json") for s in seeds}
        else:
            files = {s: Path(tmp) / f"seed{s}.json" for s in seeds}
        pending = list(seeds)
        running: dict[int, tuple[subprocess.Popen[str], Any]] = {}
        done = 0
        try:
            while pending or running:
                while pending and len(running) < workers:
                    s = pending.pop(0)
                    err = tempfile.TemporaryFile("w+", dir=tmp)
                    running[s] = (subprocess.Popen(_child_argv(args, s, files[s]), stdout=subprocess.DEVNULL,
                                                   stderr=err, text=True), err)
                s, (proc, err) = _wait_any(running)
                del running[s]
                if proc.returncode not in (0, 1):  # 1: lost or duplicated shards, reported below
                    err.seek(0)
                    tail = err.read().strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
                    print(f"netsim: error: seed {s}: {tail[0]}", file=sys.stderr)
                    return proc.returncode if proc.returncode > 0 else 1
                err.close()
                done += 1
                if not args.quiet:
                    print(f"netsim: seed {s} done ({done} of {len(seeds)}, {time.perf_counter() - t0:.1f}s)",
                          file=sys.stderr)
        finally:
            for proc, _ in running.values():  # Ctrl-C or a failed seed: the others stop too
                proc.kill()
                proc.wait()
        per_seed = {s: json.loads(files[s].read_text()) for s in seeds}
    summ = summarize(per_seed, policies, against)
    if args.out:
        Path(args.out).write_text(dumps_results(summ))
        if not args.quiet:
            print(f"netsim: per-seed results: {', '.join(str(files[s]) for s in seeds)}", file=sys.stderr)
    print_seeds(summ, spec)
    lost = any(r["shards_lost"] or r["shards_duplicated"] for rows in summ["per_seed"].values() for r in rows.values())
    return 1 if lost else 0


def _wait_any(running: dict[int, tuple[subprocess.Popen[str], Any]]) -> tuple[int, tuple[subprocess.Popen[str], Any]]:
    """The first of the running seeds' processes to end (reaped)."""
    while True:
        pid, status = os.wait()
        for s, (proc, err) in running.items():
            if proc.pid == pid:
                proc.returncode = os.waitstatus_to_exitcode(status)
                return s, (proc, err)
