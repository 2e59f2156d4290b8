"""Convert public GPU-cluster traces to the netsim trace CSV.

    python -m netsim.traces philly --in /work/shared/traces/philly_real/pollux_philly_82k_jobs.csv \\
        --out eval.csv --start "2017-10-09 00:00:00" --window-h 6 --tenants-from cluster --tenants 4

Philly (``timestamp, duration, num_gpus, gpu_time, cluster``), per job in the
window ``[start, start + window)``:

* ``tenant``: the virtual cluster (``--tenants-from cluster``); the
  ``--tenants`` busiest clusters of the window keep their id, the rest are
  pooled as ``other`` (so demand stays as skewed as in the trace);
* ``arrival_s``: seconds since ``start``, divided by ``--time-scale``;
* run time: ``duration / --time-scale / --speedup`` reference-device (A100)
  seconds (``--speedup``: how much faster an A100 is than the trace's GPUs;
  default 1, i.e. trace seconds are taken as A100 seconds);
* a job longer than ``--round-s`` becomes a ``chain`` of rounds of about
  ``--round-s`` (at most ``--max-rounds``; the published schedulers lease
  GPUs in rounds of a few minutes);
* a job wider than ``--max-gpus`` (8, the largest profile) is split into a
  ``bag`` of ``ceil(gpus / 8)`` gang shards of 8 GPUs per round (so a wide
  and long job is a bag of ``rounds * ceil(gpus / 8)`` shards: its GPU-seconds
  are kept, the order of its rounds is not);
* a deterministic ``--deadline-frac`` of the jobs (by a hash of the job id)
  get ``deadline_s = --deadline-factor x`` their run time alone (chains: all
  rounds back to back); Philly records no deadlines.

Gavel (``python -m netsim.traces gavel --in T.csv|T.trace --out x.csv``):
Gavel's own job lists, either the ``.csv`` written beside a generated trace
(``job_id, arrival_s, job_type, scale_factor, total_steps, duration_{v100,p100,k80}_s, ...``)
or a ``.trace`` file (tab-separated, 10 columns) with Gavel's measured
throughputs (``--throughputs``; a job's run time on ``scale_factor`` GPUs of
type ``w`` is ``total_steps / thr[w][(job_type, scale_factor)]``). Per job:

* one tenant per job (``tenant = job_id``), as Gavel's per-job fairness;
* ``--gpu`` (default ``v100``) names the trace's reference device: its run
  times are taken as reference seconds (a scenario then gives its peers
  throughput 1.0 to run at the trace's speed);
* a job is a ``chain`` of rounds of about ``--round-s`` (360 s: Gavel leases
  GPUs in 6-minute rounds), no cap on their number; ``gpus_per_shard`` is
  its ``scale_factor`` (a gang); no deadlines (``SLO`` -1) unless given.

``--copies K`` (weak scaling) overlays K copies of the window, each with its
own tenants (``T~i``) and job ids (``J~i``), copy i shifted by ``i *
--copy-offset`` seconds: K times the load for a swarm K times as large, with
the same mix of jobs.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import math
import sys
from collections import Counter
from datetime import datetime
from pathlib import Path

from dataclasses import replace

from .workload import TraceJob, write_trace

__all__ = ["convert_philly", "convert_gavel", "replicate", "main"]


def _frac(key: str) -> float:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64


def convert_philly(
    path: str | Path,
    *,
    start: str | None = None,
    window_h: float = 6.0,
    tenants: int = 4,
    tenants_from: str = "cluster",
    time_scale: float = 1.0,
    speedup: float = 1.0,
    round_s: float = 300.0,
    max_rounds: int = 12,
    max_gpus: int = 8,
    min_duration_s: float = 1.0,
    deadline_frac: float = 0.3,
    deadline_factor: float = 3.0,
    max_jobs: int = 0,
    lam: float = 0.0,
) -> list[TraceJob]:
    if tenants_from != "cluster":
        raise ValueError("--tenants-from: only 'cluster' is supported for Philly")
    rows = []
    with Path(path).open(newline="") as f:
        for i, r in enumerate(csv.DictReader(f)):
            try:
                ts = datetime.strptime(r["timestamp"].strip(), "%Y-%m-%d %H:%M:%S")
                dur = float(r["duration"])
                g = int(float(r["num_gpus"]))
            except (KeyError, ValueError) as exc:
                raise ValueError(f"{path}:{i + 2}: bad Philly row: {exc}") from None
            if dur < min_duration_s or g < 1:
                continue
            rows.append((ts, i, dur, g, r["cluster"].strip()))
    if not rows:
        return []
    rows.sort()
    t0 = datetime.strptime(start, "%Y-%m-%d %H:%M:%S") if start else rows[0][0]
    t1 = t0.timestamp() + window_h * 3600
    sel = [r for r in rows if t0.timestamp() <= r[0].timestamp() < t1]
    if max_jobs:
        sel = sel[:max_jobs]
    busiest = [c for c, _ in sorted(Counter(r[4] for r in sel).items(), key=lambda x: (-x[1], x[0]))[:tenants]]
    out: list[TraceJob] = []
    for ts, i, dur, g, cluster in sel:
        tenant = cluster if cluster in busiest else "other"
        jid = f"philly-{i}"
        run = dur / time_scale / speedup
        rounds = min(max(int(math.ceil(run / round_s)), 1), max_rounds)
        per = run / rounds
        width = int(math.ceil(g / max_gpus))
        gps = min(g, max_gpus)
        if width > 1:
            kind, shards = "bag", rounds * width
        else:
            kind, shards = ("chain" if rounds > 1 else "bag"), rounds
        alone = per * rounds  # chain: rounds back to back; a wide bag: its width side by side, rounds long
        deadline = round(deadline_factor * alone, 3) if _frac(jid) < deadline_frac else None
        out.append(TraceJob(jid, tenant, round((ts.timestamp() - t0.timestamp()) / time_scale, 3), shards, gps,
                            round(per, 3), deadline, 1.0, kind, lam))
    out.sort(key=lambda j: (j.arrival_s, j.job_id))
    return out


GAVEL_GPUS = ("v100", "p100", "k80")


def _gavel_rows(path: Path, gpu: str, throughputs: str | Path | None) -> list[tuple[str, float, int, float, float]]:
    """(job id, arrival s, scale factor, run s on ``gpu``, priority weight) per job."""
    out = []
    if path.suffix == ".csv":
        with path.open(newline="") as f:
            for i, r in enumerate(csv.DictReader(f)):
                try:
                    out.append((r["job_id"].strip(), float(r["arrival_s"]), int(r["scale_factor"]),
                                float(r[f"duration_{gpu}_s"]), float(r.get("priority_weight") or 1.0)))
                except (KeyError, ValueError) as exc:
                    raise ValueError(f"{path}:{i + 2}: bad Gavel row: {exc!r}") from None
        return out
    if throughputs is None:
        tp = path.parent.parent / "throughputs" / "physical_cluster_throughputs.json"
    else:
        tp = Path(throughputs)
    try:
        thr = json.loads(tp.read_text())[gpu]
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"{tp}: no {gpu} throughputs ({exc!r}); pass --throughputs") from None
    with path.open() as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            cols = line.rstrip("\n").split("\t")
            if len(cols) != 10:
                raise ValueError(f"{path}:{i + 1}: a Gavel .trace line has 10 tab-separated columns, not {len(cols)}")
            try:
                job_type, steps, scale = cols[0], int(cols[5]), int(cols[6])
                weight, arrival = float(cols[7]), float(cols[9])
                rate = float(thr[str((job_type, scale))]["null"])
            except (KeyError, ValueError) as exc:
                raise ValueError(f"{path}:{i + 1}: bad Gavel line: {exc!r}") from None
            out.append((str(len(out)), arrival, scale, steps / rate, weight))
    return out


def convert_gavel(
    path: str | Path,
    *,
    gpu: str = "v100",
    round_s: float = 360.0,
    throughputs: str | Path | None = None,
    time_scale: float = 1.0,
    max_jobs: int = 0,
) -> list[TraceJob]:
    """Gavel's trace as netsim jobs: one tenant per job, chains of ``round_s`` rounds."""
    if gpu not in GAVEL_GPUS:
        raise ValueError(f"--gpu: one of {', '.join(GAVEL_GPUS)}")
    if round_s <= 0 or time_scale <= 0:
        raise ValueError("--round-s and --time-scale must be > 0")
    rows = _gavel_rows(Path(path), gpu, throughputs)
    if max_jobs:
        rows = rows[:max_jobs]
    out: list[TraceJob] = []
    for jid, arrival, scale, run, weight in rows:
        if scale < 1 or not run > 0:
            raise ValueError(f"{path}: job {jid}: scale factor {scale}, run time {run}")
        run /= time_scale
        rounds = max(int(math.ceil(run / round_s - 1e-9)), 1)
        job = f"gavel-{jid}"
        out.append(TraceJob(job, job, round(arrival / time_scale, 3), rounds, scale, round(run / rounds, 3),
                            None, weight, "chain" if rounds > 1 else "bag"))
    out.sort(key=lambda j: (j.arrival_s, j.job_id))
    return out


def replicate(jobs: list[TraceJob], copies: int, offset_s: float = 7.0) -> list[TraceJob]:
    """``copies`` overlaid copies of a workload with distinct tenants and ids."""
    if copies < 1:
        raise ValueError("copies must be >= 1")
    if copies == 1:
        return list(jobs)
    out = [
        replace(j, job_id=f"{j.job_id}~{i}", tenant=f"{j.tenant}~{i}", arrival_s=round(j.arrival_s + i * offset_s, 3))
        for i in range(copies)
        for j in jobs
    ]
    out.sort(key=lambda j: (j.arrival_s, j.job_id))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m netsim.traces", description="Convert public traces to netsim CSV.")
    sub = ap.add_subparsers(dest="fmt", required=True)
    p = sub.add_parser("philly", help="Philly job list (timestamp, duration, num_gpus, gpu_time, cluster)")
    p.add_argument("--in", dest="src", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--start", help='window start "YYYY-MM-DD HH:MM:SS" (default: first job)')
    p.add_argument("--window-h", type=float, default=6.0)
    p.add_argument("--tenants-from", default="cluster", choices=["cluster"])
    p.add_argument("--tenants", type=int, default=4, help="busiest clusters kept as tenants; the rest pooled as 'other'")
    p.add_argument("--time-scale", type=float, default=1.0, help="divide arrivals and durations by this")
    p.add_argument("--speedup", type=float, default=1.0, help="A100 speed relative to the trace's GPUs")
    p.add_argument("--round-s", type=float, default=300.0)
    p.add_argument("--max-rounds", type=int, default=12)
    p.add_argument("--max-gpus", type=int, default=8)
    p.add_argument("--min-duration", type=float, default=1.0)
    p.add_argument("--deadline-frac", type=float, default=0.3)
    p.add_argument("--deadline-factor", type=float, default=3.0)
    p.add_argument("--max-jobs", type=int, default=0)
    p.add_argument("--lam", type=float, default=0.0, help="every job's weight of joules against seconds")
    p.add_argument("--copies", type=int, default=1, help="overlay this many copies with their own tenants (weak scaling)")
    p.add_argument("--copy-offset", type=float, default=7.0, help="seconds between the copies' arrivals")
    g = sub.add_parser("gavel", help="Gavel trace (.csv beside a generated trace, or .trace + throughputs)")
    g.add_argument("--in", dest="src", required=True)
    g.add_argument("--out", required=True)
    g.add_argument("--gpu", default="v100", choices=GAVEL_GPUS, help="the trace's device taken as reference speed")
    g.add_argument("--round-s", type=float, default=360.0, help="round (lease) length; longer jobs become chains")
    g.add_argument("--throughputs", help="Gavel's throughputs JSON (for a .trace)")
    g.add_argument("--time-scale", type=float, default=1.0, help="divide arrivals and durations by this")
    g.add_argument("--max-jobs", type=int, default=0)
    g.add_argument("--copies", type=int, default=1, help="overlay this many copies with their own tenants")
    g.add_argument("--copy-offset", type=float, default=7.0, help="seconds between the copies' arrivals")
    a = ap.parse_args(argv)
    try:
        if a.fmt == "gavel":
            jobs = convert_gavel(a.src, gpu=a.gpu, round_s=a.round_s, throughputs=a.throughputs,
                                 time_scale=a.time_scale, max_jobs=a.max_jobs)
        else:
            jobs = convert_philly(a.src, start=a.start, window_h=a.window_h, tenants=a.tenants,
                                  tenants_from=a.tenants_from, time_scale=a.time_scale, speedup=a.speedup,
                                  round_s=a.round_s, max_rounds=a.max_rounds, max_gpus=a.max_gpus,
                                  min_duration_s=a.min_duration, deadline_frac=a.deadline_frac,
                                  deadline_factor=a.deadline_factor, max_jobs=a.max_jobs, lam=a.lam)
        jobs = replicate(jobs, a.copies, a.copy_offset)
    except (OSError, ValueError) as exc:
        print(f"netsim.traces: error: {exc}", file=sys.stderr)
        return 2
    write_trace(a.out, jobs)
    tally = Counter(j.tenant for j in jobs)
    tenants = f"{len(tally)} tenants" if len(tally) > 12 else f"tenants {dict(sorted(tally.items()))}"
    print(f"{len(jobs)} jobs, {sum(j.shards for j in jobs)} shards, "
          f"{sum(j.shards * j.gpus_per_shard * j.duration_s for j in jobs) / 3600:.1f} reference GPU-hours; "
          f"{tenants}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
