"""A Ray-fronted peer next to a plain peer with the same number of slots.

    .venv/bin/python benchmarks/ray_peer.py [--slots 2] [--shards 30] [--size 64] [--iters 1] [--calls 20]

One run, two measurements, each for both engines:

* **through the swarm**: a swarm of the measured peer plus a companion that
  serves no tensor-map (so every shard goes to the measured peer; a lone
  peer's own state would age out of its view), and ``peer submit`` of one
  ``tensor-map`` job of ``--shards`` shards. ``shards/s`` is shards over the
  submit's wall time (interpreter start excluded: timed from the client's
  first line to its exit is not possible from outside, so the wall includes
  the client's start, equally for both engines). ``overhead/shard`` is
  ``slots * wall / shards - compute``, where ``compute`` is the mean time of
  one shard's ``task.run`` in this process (one torch thread): what a shard
  costs beyond its arithmetic, auction and leases included.
* **the engine alone**: ``--calls`` sequential ``run_shard`` calls on a
  ``RayRunner`` (this process as the Ray driver) and on the daemon's
  ``ExecutorRunner``; ``overhead/shard`` is the mean call time minus the
  shard's own compute time as the engine measured it (``run_s``).

The plain peer runs ``--slots`` shards side by side in its process; the Ray
cluster is one local node with ``--slots`` CPUs (``ray start --head``).
Numbers depend on the machine's load; they are for comparing the engines
in one run, not for absolute figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from fedswarm.testing.localswarm import LocalSwarm, PeerProcess  # noqa: E402
from fedswarm.runtime.ray_engine import LocalRayCluster  # noqa: E402

BASE = ROOT / "peers" / "cpu-laptop.toml"


def profile(work: Path, name: str, slots: int, tasks: list[str] | None = None) -> str:
    text = BASE.read_text().replace("slots = 1", f"slots = {slots}" + (f"\ntasks = {json.dumps(tasks)}" if tasks else ""))
    text = text.replace("count = 1", f"count = {slots}")
    p = work / f"{name}.toml"
    p.write_text(text)
    return str(p)


def submit(bootstrap: str, out: Path, a: argparse.Namespace) -> float:
    cmd = [sys.executable, "-m", "fedswarm.cli", "submit", "--bootstrap", bootstrap, "--kind", "tensor-map",
           "--shards", str(a.shards), "--size", str(a.size), "--iters", str(a.iters), "--seed", "3",
           "--out", str(out), "--min-peers", "2", "--timeout", "300", "--progress", "off", "--verify", "none"]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"submit failed: {p.stderr[-2000:]}")
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(r["shard"] for r in rows) == list(range(a.shards))
    return wall


def compute_time(a: argparse.Namespace) -> float:
    import torch

    from fedswarm.tasks.registry import get_task

    torch.set_num_threads(1)
    task = get_task("tensor-map")
    params = {"seed": 3, "size": a.size, "iters": a.iters}
    task.run(params, 0, device="cpu")  # warm-up
    ts = []
    for i in range(20):
        t0 = time.perf_counter()
        task.run(params, i, device="cpu")
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def through_swarm(a: argparse.Namespace, work: Path, cluster: LocalRayCluster) -> dict[str, float]:
    comp = profile(work, "companion", 1, ["llm-batch"])
    plain = profile(work, "plain", a.slots)
    out: dict[str, float] = {}
    with LocalSwarm(1, work / "companion", profile=comp) as swarm:
        for engine in ("local", "ray"):
            d = work / f"peer-{engine}"
            d.mkdir(exist_ok=True)
            cmd = [sys.executable, "-m", "fedswarm.cli", "start", "--profile", plain, "--data-dir", str(d),
                   "--metrics-port", "0", "--torch-threads", "1", "--grace", "2", "--bootstrap", swarm.bootstrap]
            if engine == "ray":
                cmd += ["--engine", "ray", "--ray-address", cluster.address]
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(d / "peer.log", "w"), text=True)
            peer = PeerProcess(proc, d)
            try:
                peer.wait_ready(120)
                deadline = time.monotonic() + 30
                while len(swarm.peers[0].status()["peers"]) < 2 and time.monotonic() < deadline:
                    time.sleep(0.1)
                # one warm-up job (Ray starts its worker processes; torch imports)
                submit(swarm.bootstrap, d / "warm.jsonl", argparse.Namespace(**{**vars(a), "shards": a.slots}))
                out[engine] = submit(swarm.bootstrap, d / "out.jsonl", a)
            finally:
                peer.terminate()
    return out


async def engine_alone(a: argparse.Namespace, cluster: LocalRayCluster, work: Path) -> dict[str, tuple[float, float]]:
    import msgpack

    from fedswarm.core.events import RunShard
    from fedswarm.core.identity import load_or_create_key
    from fedswarm.core.peer import PeerCore
    from fedswarm.daemon.runner import ExecutorRunner
    from fedswarm.profiles import load_profile
    from fedswarm.runtime.executor import ShardExecutor
    from fedswarm.runtime.ray_engine import RayRunner, connect_cluster

    prof = load_profile(profile(work, "alone", a.slots))
    params = msgpack.packb({"seed": 3, "size": a.size, "iters": a.iters})
    res: dict[str, tuple[float, float]] = {}
    ray_cluster = await connect_cluster(cluster.address, None)
    try:
        for engine in ("local", "ray"):
            core = PeerCore(load_or_create_key(work / f"{engine}.key"), prof.peer_config(), random.Random(1))
            runner = (RayRunner(ray_cluster, core) if engine == "ray"
                      else ExecutorRunner(ShardExecutor(slots=a.slots), core))
            calls, runs = [], []
            for i in range(a.calls + 2):
                eff = RunShard("t", "bench", i, 0, "tensor-map", params, 1.0, 1, 0, 1.0, 1.0)
                t0 = time.perf_counter()
                fin = await runner.run_shard(eff)
                dt = time.perf_counter() - t0
                assert fin.ok, fin.error
                if i >= 2:  # the first calls start workers / import torch
                    calls.append(dt)
                    runs.append(fin.run_s)
            res[engine] = (statistics.median(calls), statistics.median(c - r for c, r in zip(calls, runs)))
    finally:
        ray_cluster.shutdown()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slots", type=int, default=2, help="slots of both peers (Ray: CPUs of its one node)")
    ap.add_argument("--shards", type=int, default=30, help="shards of the job through the swarm")
    ap.add_argument("--size", type=int, default=64, help="tensor-map matrix size")
    ap.add_argument("--iters", type=int, default=1, help="tensor-map products per shard")
    ap.add_argument("--calls", type=int, default=20, help="sequential run_shard calls per engine")
    a = ap.parse_args()
    import trio

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    work = Path(tempfile.mkdtemp(prefix="ray-bench-"))
    compute = compute_time(a)
    with LocalRayCluster(work / "ray", head_cpus=a.slots) as cluster:
        walls = through_swarm(a, work, cluster)
        alone = trio.run(engine_alone, a, cluster, work)
    print(f"tensor-map size {a.size} iters {a.iters}: compute {compute * 1e3:.2f} ms/shard (1 thread); "
          f"{a.slots} slots each; job of {a.shards} shards through a 2-peer swarm")
    print(f"{'engine':<14}{'shards/s':>10}{'overhead/shard':>17}{'run_shard call':>17}{'engine overhead':>17}")
    for engine, label in (("local", "plain peer"), ("ray", "Ray-fronted")):
        wall = walls[engine]
        per = a.slots * wall / a.shards - compute
        call, over = alone[engine]
        print(f"{label:<14}{a.shards / wall:>10.2f}{per * 1e3:>14.1f} ms{call * 1e3:>14.1f} ms{over * 1e3:>14.1f} ms")


if __name__ == "__main__":
    main()
