#!/usr/bin/env python3
"""netsim with long queues: one job of many short shards on 2 peers, so each
peer holds thousands of queued leases, timed for one or more checkouts side
by side.

    .venv/bin/python benchmarks/netsim_queue.py [--shards 4000] [--verify none] [--src DIR ...]

Each ``--src`` is a checkout's ``src`` directory (default: this one's); the
scenario and the netsim package come from the checkout above it. Per
checkout: the CPU seconds of ``netsim run`` (a child process, so imports
count too), its events, the job's completion time in simulated seconds and
the start of the results JSON's SHA-256 (equal digests: byte-identical).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCENARIO = """\
name = "queue-2"
max_time_s = 3600
warmup_s = 5
settle_s = 5

[network]
regions = {{ us = 1.0 }}
intra_ms = [1, 2]
inter_ms = [1, 2]
jitter_ms = 0
bandwidth_mbps = 1000
loss = 0.0

[client]
verify = "{verify}"

[[swarm]]
profile = "workstation-rtx4090"
count = 2

[workload]
task = "sim"
"""

TRACE = "job_id,tenant,arrival_s,shards,gpus_per_shard,duration_s,deadline_s,weight,kind,lam\nbig,t0,10,{shards},1,0.01,,1.0,bag,0.0\n"


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=int, default=4000)
    ap.add_argument("--verify", choices=["none", "auto", "always"], default="none")
    ap.add_argument("--src", action="append", default=[], help="a checkout's src directory (repeatable)")
    a = ap.parse_args()
    if a.shards < 1:
        print("netsim_queue: --shards must be at least 1", file=sys.stderr)
        return 2
    here = Path(__file__).resolve().parents[1]
    srcs = [Path(s).resolve() for s in a.src] or [here / "src"]
    for s in srcs:
        if not (s / "fedswarm" / "__init__.py").is_file() or not (s.parent / "netsim" / "sim.py").is_file():
            print(f"netsim_queue: {s} is not a checkout's src directory", file=sys.stderr)
            return 2
    print(f"netsim: one job of {a.shards} shards of 10 ms on 2 peers (workstation-rtx4090, 2 slots each), verify {a.verify}")
    print(f"{'src':<34} {'CPU s':>7} {'wall s':>7} {'events':>8} {'JCT sim s':>10} {'delivered':>9}  JSON sha256")
    with tempfile.TemporaryDirectory(prefix="netsim-queue-") as tmp:
        sc, tr = Path(tmp) / "queue-2.toml", Path(tmp) / "big.csv"
        sc.write_text(SCENARIO.format(verify=a.verify))
        tr.write_text(TRACE.format(shards=a.shards))
        for k, src in enumerate(srcs):
            out = Path(tmp) / f"r{k}.json"
            env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{src.parent}"}
            cmd = [sys.executable, "-m", "netsim", "run", str(sc), "--seed", "1", "--trace", str(tr), "-q",
                   "--out", str(out), "--profiles", str(src.parent / "peers")]
            c0, t0 = _children_cpu(), time.perf_counter()
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=src.parent)
            wall, cpu = time.perf_counter() - t0, _children_cpu() - c0
            if proc.returncode != 0:
                print(f"netsim_queue: {src}: netsim failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
                return 1
            raw = out.read_bytes()
            res = json.loads(raw)
            job = res["jobs"][0]
            digest = hashlib.sha256(raw).hexdigest()[:12]
            events = next((ln.split("events=")[1].split()[0] for ln in proc.stderr.splitlines() if "events=" in ln), "?")
            print(f"{str(src)[-34:]:<34} {cpu:7.1f} {wall:7.1f} {events:>8} {job['jct_s']:10.2f} "
                  f"{job['shards_delivered']:>9}  {digest}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
