"""Workloads: a CSV trace reader and a multi-tenant Poisson generator.

Trace columns (header required, order free)::

    job_id, tenant, arrival_s, shards, gpus_per_shard, duration_s
    [, deadline_s, weight, kind, lam]

``duration_s`` is one shard's run time on ``gpus_per_shard`` reference
devices (-> ``JobRequest.work_s``/``gpus``); ``deadline_s`` is relative to
the arrival (empty: none); ``kind`` is ``bag`` (default) or ``chain``.
"""

from __future__ import annotations

import csv
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["TraceJob", "TraceError", "read_trace", "generate", "draw", "REQUIRED_COLUMNS", "OPTIONAL_COLUMNS"]

REQUIRED_COLUMNS = ("job_id", "tenant", "arrival_s", "shards", "gpus_per_shard", "duration_s")
OPTIONAL_COLUMNS = ("deadline_s", "weight", "kind", "lam")
KINDS = ("bag", "chain")


class TraceError(ValueError):
    """A malformed trace or workload spec; the message names file, line and column."""


@dataclass(frozen=True)
class TraceJob:
    job_id: str
    tenant: str
    arrival_s: float
    shards: int
    gpus_per_shard: int
    duration_s: float
    deadline_s: float | None = None
    weight: float = 1.0
    kind: str = "bag"
    lam: float = 0.0  # weight of joules against seconds in the award rule (JobRequest.lam)

    @property
    def chain(self) -> bool:
        return self.kind == "chain"


def _num(v: str, where: str, col: str, *, integer: bool = False, positive: bool = True) -> float:
    try:
        x = int(v) if integer else float(v)
    except ValueError:
        raise TraceError(f"{where}: column {col!r}: {v!r} is not {'an integer' if integer else 'a number'}") from None
    if isinstance(x, float) and not math.isfinite(x):
        raise TraceError(f"{where}: column {col!r}: {v!r} is not finite")
    if x < 0 or (positive and x == 0 and col != "arrival_s"):
        raise TraceError(f"{where}: column {col!r}: {v!r} must be {'> 0' if positive else '>= 0'}")
    return x


def read_trace(path: str | Path) -> list[TraceJob]:
    """Parse a CSV trace; raises ``TraceError`` with file:line on bad input."""
    p = Path(path)
    try:
        f = p.open(newline="")
    except OSError as exc:
        raise TraceError(f"{p}: cannot open trace: {exc.strerror}") from None
    with f:
        rows = list(csv.reader(f))
    rows = [r for r in rows if r and not (len(r) == 1 and not r[0].strip()) and not r[0].lstrip().startswith("#")]
    if not rows:
        raise TraceError(f"{p}: empty trace (a header row is required)")
    header = [h.strip() for h in rows[0]]
    missing = [c for c in REQUIRED_COLUMNS if c not in header]
    if missing:
        raise TraceError(f"{p}: line 1: missing required column(s) {missing}; header is {header}")
    unknown = [c for c in header if c not in REQUIRED_COLUMNS + OPTIONAL_COLUMNS]
    if unknown:
        raise TraceError(f"{p}: line 1: unknown column(s) {unknown}")
    if len(set(header)) != len(header):
        raise TraceError(f"{p}: line 1: duplicate column names in {header}")
    jobs: list[TraceJob] = []
    seen: set[str] = set()
    for lineno, row in enumerate(rows[1:], start=2):
        where = f"{p}:{lineno}"
        if len(row) != len(header):
            raise TraceError(f"{where}: expected {len(header)} fields, got {len(row)}")
        rec = {h: v.strip() for h, v in zip(header, row)}
        jid = rec["job_id"]
        if not jid:
            raise TraceError(f"{where}: column 'job_id' is empty")
        if jid in seen:
            raise TraceError(f"{where}: duplicate job_id {jid!r}")
        seen.add(jid)
        if not rec["tenant"]:
            raise TraceError(f"{where}: column 'tenant' is empty")
        deadline = rec.get("deadline_s", "")
        kind = rec.get("kind", "") or "bag"
        if kind not in KINDS:
            raise TraceError(f"{where}: column 'kind': {kind!r} is not one of {list(KINDS)}")
        jobs.append(
            TraceJob(
                job_id=jid,
                tenant=rec["tenant"],
                arrival_s=_num(rec["arrival_s"], where, "arrival_s", positive=False),
                shards=int(_num(rec["shards"], where, "shards", integer=True)),
                gpus_per_shard=int(_num(rec["gpus_per_shard"], where, "gpus_per_shard", integer=True)),
                duration_s=_num(rec["duration_s"], where, "duration_s"),
                deadline_s=_num(deadline, where, "deadline_s") if deadline else None,
                weight=_num(rec.get("weight", "") or "1", where, "weight"),
                lam=_num(rec.get("lam", "") or "0", where, "lam", positive=False),
                kind=kind,
            )
        )
    jobs.sort(key=lambda j: (j.arrival_s, j.job_id))
    return jobs


# -- distributions -----------------------------------------------------------

_DIST_KEYS = {
    "const": {"value"},
    "uniform": {"lo", "hi"},
    "lognormal": {"median", "sigma", "min", "max"},
    "pareto": {"xm", "alpha", "max"},
    "choice": {"values", "weights"},
}


def check_dist(spec: Any, where: str) -> None:
    if isinstance(spec, (int, float)) and not isinstance(spec, bool):
        return
    if not isinstance(spec, dict) or "dist" not in spec:
        raise TraceError(f"{where}: a distribution is a number or a table with 'dist' in {sorted(_DIST_KEYS)}")
    kind = spec["dist"]
    if kind not in _DIST_KEYS:
        raise TraceError(f"{where}: unknown dist {kind!r}; one of {sorted(_DIST_KEYS)}")
    unknown = sorted(set(spec) - _DIST_KEYS[kind] - {"dist"})
    if unknown:
        raise TraceError(f"{where}: unknown key(s) {unknown} for dist {kind!r}")


def draw(spec: Any, rng: random.Random) -> float:
    """One sample of a distribution spec (a number, or a table with ``dist``)."""
    if isinstance(spec, (int, float)):
        return float(spec)
    kind = spec["dist"]
    if kind == "const":
        return float(spec["value"])
    if kind == "uniform":
        return rng.uniform(spec["lo"], spec["hi"])
    if kind == "lognormal":
        x = rng.lognormvariate(math.log(spec["median"]), spec.get("sigma", 1.0))
        return min(max(x, spec.get("min", 0.0)), spec.get("max", math.inf))
    if kind == "pareto":
        x = spec["xm"] * rng.paretovariate(spec["alpha"])
        return min(x, spec.get("max", math.inf))
    if kind == "choice":
        vals = spec["values"]
        return float(rng.choices(vals, weights=spec.get("weights"))[0])
    raise TraceError(f"unknown dist {kind!r}")


_TENANT_KEYS = {
    "name", "jobs", "rate_per_h", "start_s", "shards", "duration_s", "gpus", "chain_fraction",
    "deadline_factor", "weight", "chain_max_shards",
}


def generate(tenants: list[dict[str, Any]], rng: random.Random) -> list[TraceJob]:
    """Poisson arrivals per tenant with heavy-tailed shard counts and durations.

    Each tenant table: ``name``, ``jobs`` (count), ``rate_per_h`` (Poisson
    rate), ``start_s`` (first possible arrival), ``shards`` and
    ``duration_s`` (distribution specs), ``gpus`` (spec, default 1),
    ``chain_fraction`` (probability a job is a chain), ``deadline_factor``
    (deadline = factor * duration, times shards for chains; 0 = none),
    ``chain_max_shards`` (cap on a chain's length), ``weight``.
    """
    out: list[TraceJob] = []
    for ti, t in enumerate(tenants):
        where = f"workload.tenants[{ti}]"
        if not isinstance(t, dict):
            raise TraceError(f"{where}: must be a table")
        unknown = sorted(set(t) - _TENANT_KEYS)
        if unknown:
            raise TraceError(f"{where}: unknown key(s) {unknown}; allowed {sorted(_TENANT_KEYS)}")
        for req in ("name", "jobs", "rate_per_h", "shards", "duration_s"):
            if req not in t:
                raise TraceError(f"{where}: missing {req!r}")
        for k in ("shards", "duration_s", "gpus"):
            if k in t:
                check_dist(t[k], f"{where}.{k}")
        name = str(t["name"])
        trng = random.Random(rng.getrandbits(64))
        now = float(t.get("start_s", 0.0))
        rate = float(t["rate_per_h"]) / 3600.0
        if rate <= 0:
            raise TraceError(f"{where}: rate_per_h must be > 0")
        for i in range(int(t["jobs"])):
            now += trng.expovariate(rate)
            shards = max(1, int(round(draw(t["shards"], trng))))
            dur = max(draw(t["duration_s"], trng), 1e-3)
            gpus = max(1, int(round(draw(t.get("gpus", 1), trng))))
            chain = trng.random() < float(t.get("chain_fraction", 0.0))
            if chain and "chain_max_shards" in t:
                shards = min(shards, max(int(t["chain_max_shards"]), 1))
            df = float(t.get("deadline_factor", 0.0))
            deadline = df * dur * (shards if chain else 1) if df > 0 else None
            out.append(
                TraceJob(
                    job_id=f"{name}-{i:04d}",
                    tenant=name,
                    arrival_s=round(now, 6),
                    shards=shards,
                    gpus_per_shard=gpus,
                    duration_s=round(dur, 6),
                    deadline_s=None if deadline is None else round(deadline, 6),
                    weight=float(t.get("weight", 1.0)),
                    kind="chain" if chain else "bag",
                )
            )
    out.sort(key=lambda j: (j.arrival_s, j.job_id))
    return out


def write_trace(path: str | Path, jobs: list[TraceJob]) -> None:
    with Path(path).open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(REQUIRED_COLUMNS + OPTIONAL_COLUMNS)
        for j in jobs:
            w.writerow([j.job_id, j.tenant, j.arrival_s, j.shards, j.gpus_per_shard, j.duration_s,
                        "" if j.deadline_s is None else j.deadline_s, j.weight, j.kind, j.lam])
