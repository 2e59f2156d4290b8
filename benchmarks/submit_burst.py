#!/usr/bin/env python3
"""``peer submit`` of one job of many short shards on a small local swarm,
with result verification off (``--verify none``) and on (``auto``, the
default), side by side.

    .venv/bin/python benchmarks/submit_burst.py [--shards 600] [--peers 2] [--repeats 2] [--src DIR ...]

Each ``--src`` is a checkout's ``src`` directory (default: this one's). For
each, the script starts ``--peers`` real ``peer start`` processes on
127.0.0.1 with that code and runs ``peer submit --kind tensor-map`` against
them, the verification modes taking turns. It prints, per run: the seconds
to the first result line in ``--out`` and to the end, whether every shard
came back, and what the peers counted meanwhile: messages refused by their
rate limit (``rate-limited``) and those let past it as replies they had
asked for (``solicited_past_limit``). Times include the client's start-up
(imports, connecting), as a user sees them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fedswarm.testing.localswarm import LocalSwarm, repo_root


def _counters(sw: LocalSwarm) -> tuple[int, int]:
    refused = passed = 0
    for p in sw.peers:
        st = p.status()
        refused += int(st.get("rejected", {}).get("rate-limited", 0))
        passed += int(st.get("stats", {}).get("solicited_past_limit", 0))
    return refused, passed


def _submit(sw: LocalSwarm, env: dict[str, str], out: Path, shards: int, verify: str) -> dict[str, float | int | bool]:
    cmd = [sys.executable, "-m", "fedswarm.cli", "submit", "--kind", "tensor-map", "--shards", str(shards),
           "--seed", "1", "--size", "64", "--iters", "1", "--out", str(out), "--bootstrap", sw.bootstrap,
           "--min-peers", str(len(sw.peers)), "--verify", verify, "--progress", "off", "--quiet"]
    r0, p0 = _counters(sw)
    t0 = time.monotonic()
    first = None
    with subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) as proc:
        while proc.poll() is None:
            if first is None and out.exists() and out.stat().st_size > 0:
                first = time.monotonic() - t0
            time.sleep(0.02)  # polling a file for a measurement, not waiting for readiness
        err = proc.stderr.read() if proc.stderr else ""
    total = time.monotonic() - t0
    rows = len(out.read_text().splitlines()) if out.exists() else 0
    r1, p1 = _counters(sw)
    if proc.returncode != 0:
        print(f"submit failed ({proc.returncode}): {err[-500:]}", file=sys.stderr)
    return {"first_s": first if first is not None else total, "total_s": total, "ok": proc.returncode == 0 and rows == shards,
            "refused": r1 - r0, "passed": p1 - p0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=int, default=600)
    ap.add_argument("--peers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--src", action="append", default=[], help="a checkout's src directory (repeatable)")
    a = ap.parse_args()
    if a.shards < 1 or a.peers < 1 or a.repeats < 1:
        print("submit_burst: --shards, --peers and --repeats must be at least 1", file=sys.stderr)
        return 2
    srcs = [str(Path(s).resolve()) for s in a.src] or [str(repo_root() / "src")]
    for s in srcs:
        if not (Path(s) / "fedswarm" / "__init__.py").is_file():
            print(f"submit_burst: {s} holds no fedswarm package", file=sys.stderr)
            return 2
    print(f"peer submit --kind tensor-map --shards {a.shards} on {a.peers} local peers, {a.repeats} runs per mode")
    print(f"{'src':<34} {'verify':<6} {'first s':>8} {'total s':>8} {'all':>4} {'refused':>8} {'let past':>8}")
    summary: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="submit-burst-") as tmp:
        for k, src in enumerate(srcs):
            env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
            with LocalSwarm(a.peers, Path(tmp) / f"sw{k}", env=env) as sw:
                for rep in range(a.repeats):
                    for verify in ("none", "auto"):
                        r = _submit(sw, env, Path(tmp) / f"out{k}-{rep}-{verify}.jsonl", a.shards, verify)
                        summary.setdefault((src, verify), []).append(float(r["total_s"]))
                        print(f"{src[-34:]:<34} {verify:<6} {r['first_s']:8.2f} {r['total_s']:8.2f} "
                              f"{'yes' if r['ok'] else 'NO':>4} {r['refused']:8d} {r['passed']:8d}", flush=True)
    print()
    for src in srcs:
        none, auto = (statistics.median(summary[(src, v)]) for v in ("none", "auto"))
        print(f"{src[-34:]:<34} median total: none {none:.2f} s, auto {auto:.2f} s, auto/none {auto / none:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
