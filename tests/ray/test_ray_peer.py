"""A peer in front of a real Ray cluster (``peer start --engine ray``).

One Ray cluster for the module, on 127.0.0.1: a head and a second node, one
CPU each (``ray start --block`` processes, see
``fedswarm.runtime.ray_engine.LocalRayCluster``), dashboard on for Ray's
state API. Every wait is on a printed line, a status page or Ray's own
answers, bounded; nothing sleeps to guess readiness.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="the [ray] extra is not installed: pip install 'fedswarm[ray]'")

from fedswarm.localswarm import LocalSwarm, PeerProcess, repo_root  # noqa: E402
from fedswarm.runtime.ray_engine import LocalRayCluster  # noqa: E402

pytestmark = pytest.mark.slow

PROFILE = str(repo_root() / "peers" / "cpu-laptop.toml")
ERROR_LINE = "peer start: error: "
# ~1-2 s per shard on one Ray worker CPU: long enough to kill a node mid-shard
LONG = ["--size", "768", "--iters", "40"]


def submit(bootstrap: str, out: Path, shards: int, extra: list[str], *, min_peers: int = 1) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "fedswarm.cli", "submit", "--bootstrap", bootstrap, "--kind", "tensor-map",
           "--shards", str(shards), "--seed", "11", "--out", str(out), "--min-peers", str(min_peers),
           "--timeout", "150", "--progress", "off", "--verify", "none", *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def local(out: Path, shards: int, extra: list[str]) -> list[dict]:
    subprocess.run([sys.executable, "-m", "fedswarm.cli", "submit", "--local", "--kind", "tensor-map", "--shards",
                    str(shards), "--seed", "11", "--out", str(out), "--progress", "off", *extra], check=True,
                   capture_output=True)
    return read(out)


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def wait_until(pred, timeout: float, what: str, poll: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(poll)


def check_results(rows: list[dict], expected: list[dict]) -> None:
    assert sorted(r["shard"] for r in rows) == list(range(len(expected))), "each shard exactly once"
    by = {r["shard"]: r for r in rows}
    for e in expected:
        assert by[e["shard"]]["result"] == e["result"], f"shard {e['shard']} differs from the local run"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with LocalRayCluster(tmp_path_factory.mktemp("ray"), head_cpus=1) as c:
        c.add_node(cpus=1)
        yield c


def start_ray_peer(workdir: Path, address: str, bootstrap: list[str], *extra: str) -> PeerProcess:
    d = workdir / "raypeer"
    d.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "fedswarm.cli", "start", "--engine", "ray", "--ray-address", address,
           "--profile", PROFILE, "--data-dir", str(d), "--metrics-port", "0", "--grace", "5", *extra]
    for b in bootstrap:
        cmd += ["--bootstrap", b]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(d / "peer.log", "a"), text=True)
    p = PeerProcess(proc, d)
    try:
        p.wait_ready(90)
    except BaseException:
        p.terminate()
        raise
    return p


def own_slots(peer: PeerProcess) -> int:
    st = peer.status()
    return next(e["slots"] for e in st["peers"] if e["self"])


def ray_tasks(cluster: LocalRayCluster, *, detail: bool = False) -> list:
    from ray.util.state import list_tasks

    return list_tasks(address=cluster.dashboard, limit=10000, raise_on_missing_output=False, detail=detail)


@pytest.fixture(scope="module")
def swarm(cluster, tmp_path_factory):
    """Two plain peers and one Ray-fronted peer (``--ray-address auto``: the
    local cluster), shared by the module's job tests."""
    work = tmp_path_factory.mktemp("swarm")
    with LocalSwarm(2, work, profile=PROFILE) as plain:
        ray_peer = start_ray_peer(work, "auto", [plain.bootstrap])
        try:
            yield plain, ray_peer
        finally:
            assert ray_peer.terminate() == 0


def test_plain_and_ray_peers_compute_what_a_local_run_computes(cluster, swarm, tmp_path: Path) -> None:
    plain, ray_peer = swarm
    shards = 8
    args = ["--size", "128", "--iters", "3"]
    expected = local(tmp_path / "local.jsonl", shards, args)
    # the cluster's two CPUs are what it offers
    wait_until(lambda: own_slots(ray_peer) == 2, 30, "the Ray peer to advertise 2 slots")
    wait_until(lambda: len(plain.peers[0].status()["peers"]) == 3, 30, "3 peers in the view")
    p = submit(plain.bootstrap, tmp_path / "out.jsonl", shards, args, min_peers=3)
    _, err = p.communicate(timeout=150)
    assert p.returncode == 0, err
    rows = read(tmp_path / "out.jsonl")
    check_results(rows, expected)
    mine = sorted(r["shard"] for r in rows if r["peer"] == ray_peer.peer_id)
    assert mine, "the Ray-fronted peer ran none of the shards"
    assert {r["peer"] for r in rows} <= {ray_peer.peer_id, *(q.peer_id for q in plain.peers)}
    assert ray_peer.status()["stats"].get("ray_tasks_run", 0) >= len(mine)
    # Ray's state API lists each shard this peer ran as one of its tasks
    want = {f"fedswarm tensor-map#{s}" for s in mine}

    def listed():
        done = {t.name for t in ray_tasks(cluster) if t.state == "FINISHED"}
        return want <= done

    wait_until(listed, 30, "Ray's state API to list the shards' tasks", poll=0.5)


def test_a_killed_ray_node_loses_nothing_and_slots_follow_the_nodes(cluster, tmp_path: Path) -> None:
    """The Ray peer's companion serves no tensor-map (its profile lists other
    kinds): every shard runs on Ray, two at a time, so one runs on the node
    that is killed."""
    shards = 6
    expected = local(tmp_path / "local.jsonl", shards, LONG)
    other = tmp_path / "no-tensor-map.toml"
    other.write_text(Path(PROFILE).read_text().replace('slots = 1', 'slots = 1\ntasks = ["llm-batch"]'))
    with LocalSwarm(1, tmp_path / "companion", profile=str(other)) as companion:
        ray_peer = start_ray_peer(tmp_path, cluster.address, [companion.bootstrap])
        try:
            wait_until(lambda: own_slots(ray_peer) == 2, 30, "2 slots (head + node)")
            victim = cluster.nodes[1]
            p = submit(companion.bootstrap, tmp_path / "out.jsonl", shards, LONG, min_peers=2)

            from ray.util.state import list_nodes

            head_ids = {n.node_id for n in list_nodes(address=cluster.dashboard) if n.is_head_node}

            def running_off_head():
                return [t for t in ray_tasks(cluster) if t.state == "RUNNING"
                        and t.name.startswith("fedswarm tensor-map#") and t.node_id not in head_ids]

            wait_until(running_off_head, 90, "a shard running on the second node", poll=0.2)
            cluster.kill_node(victim)  # SIGKILL the node's raylet and workers: a machine gone
            # the node's slot leaves the peer's advertised capacity
            wait_until(lambda: own_slots(ray_peer) == 1, 60, "the advertised slots to drop to 1")
            _, err = p.communicate(timeout=150)
            assert p.returncode == 0, err
            rows = read(tmp_path / "out.jsonl")
            check_results(rows, expected)
            assert len(rows) == shards
            assert {r["peer"] for r in rows} == {ray_peer.peer_id}
            st = ray_peer.status()
            # the shard lost with the node ran again on the cluster, within its lease
            assert st["stats"].get("ray_retries", 0) >= 1
            # a node joins: its slot is offered to the swarm
            cluster.add_node(cpus=1)
            wait_until(lambda: own_slots(ray_peer) == 2, 60, "the advertised slots to rise back to 2")
        finally:
            assert ray_peer.terminate() == 0


def run_start(args: list[str], tmp: Path, *, pre: str = "") -> subprocess.CompletedProcess[str]:
    code = f"import sys; {pre}from fedswarm.cli import main; sys.exit(main())"
    cmd = [sys.executable, "-c", code, "start", "--profile", PROFILE, "--data-dir", str(tmp), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "RAY_ADDRESS": ""})


def one_error_line(p: subprocess.CompletedProcess[str], pattern: str) -> str:
    import re

    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr, p.stderr
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith(ERROR_LINE), lines[0]
    assert re.search(pattern, lines[0]), lines[0]
    assert p.stdout == "", "a daemon that failed its checks must print no readiness line"
    return lines[0]


def test_bad_ray_input_is_one_line_and_no_daemon(cluster, tmp_path: Path) -> None:
    from fedswarm.runtime.ray_engine import _free_port

    # Ray not installed (the import fails): the extra to install
    p = run_start(["--engine", "ray"], tmp_path / "a", pre="sys.modules['ray'] = None; ")
    one_error_line(p, r"needs Ray, which is not installed \(pip install 'fedswarm\[ray\]'\)")
    # nobody listens at the address: a bounded connect
    t0 = time.monotonic()
    p = run_start(["--engine", "ray", "--ray-address", f"127.0.0.1:{_free_port()}"], tmp_path / "b")
    one_error_line(p, r"no Ray cluster listens at 127\.0\.0\.1:\d+")
    assert time.monotonic() - t0 < 60
    # a reserve larger than the cluster (2 CPUs)
    p = run_start(["--engine", "ray", "--ray-address", cluster.address, "--ray-reserve", "3"], tmp_path / "c")
    one_error_line(p, r"--ray-reserve 3 is larger than the cluster: it has \d+ CPU")
    p = run_start(["--engine", "ray", "--ray-reserve", "lots"], tmp_path / "e")
    one_error_line(p, r"--ray-reserve 'lots' is not a reserve")
    # a cluster with no resources: a head with no CPUs and no GPUs
    with LocalRayCluster(tmp_path / "empty", head_cpus=0) as empty:
        p = run_start(["--engine", "ray", "--ray-address", empty.address], tmp_path / "f")
        one_error_line(p, r"has no CPUs and no GPUs")



def test_reserve_syntax() -> None:
    from fedswarm.errors import InputError
    from fedswarm.runtime.ray_engine import parse_reserve

    assert parse_reserve(None) == {}
    assert parse_reserve("2") == {"slots": 2.0}
    assert parse_reserve("CPU=4, GPU=1,memory=16G") == {"CPU": 4.0, "GPU": 1.0, "memory": 16.0 * (1 << 30)}
    for bad in ("lots", "-1", "CPU=", "=2", "CPU=1,CPU=2", "nan", "memory=1X"):
        with pytest.raises(InputError):
            parse_reserve(bad)


# -- the runner on its own (this process as the Ray driver) ------------------------------------

def _run_runner_case(cluster: LocalRayCluster, case) -> None:
    import random

    import trio

    from fedswarm.core.identity import load_or_create_key
    from fedswarm.core.peer import PeerCore
    from fedswarm.profiles import load_profile
    from fedswarm.runtime.ray_engine import RayRunner, connect_cluster

    async def main() -> None:
        ray_cluster = await connect_cluster(cluster.address, None)
        try:
            import tempfile

            key = Path(tempfile.mkdtemp()) / "k"
            core = PeerCore(load_or_create_key(key), load_profile(PROFILE).peer_config(), random.Random(0))
            runner = RayRunner(ray_cluster, core)
            await case(runner, core)
        finally:
            ray_cluster.shutdown()

    trio.run(main)


def _shard(i: int, params: dict, *, job: str, gpus: int = 1):
    import msgpack

    from fedswarm.core.events import RunShard

    return RunShard("tenant", job, i, 0, "tensor-map", msgpack.packb(params), 1.0, gpus, 0, 1.0, 1.0)


def _expected(params: dict, shard: int) -> dict:
    from fedswarm.tasks.registry import get_task

    return get_task("tensor-map").run(params, shard, device="cpu")


def test_runner_cancel_gang_and_chain_on_the_cluster(cluster) -> None:
    """A cancelled shard's Ray task is cancelled; a gang shard runs in one
    placement group that is gone afterwards; chain shards run in order."""
    import types

    import msgpack
    import trio
    from ray.util.state import list_placement_groups

    small = {"seed": 5, "size": 64, "iters": 2}
    big = {"seed": 5, "size": 2048, "iters": 1000}  # ~17 TFLOP: hours on one CPU unless cancelled

    def task_named(name: str):
        rows = [t for t in ray_tasks(cluster) if t.name == name]
        return rows[-1] if rows else None

    async def case(runner, core) -> None:
        # cancel: the shard's Ray task stops, the runner returns at once
        with trio.move_on_after(120) as scope:
            async with trio.open_nursery() as n:
                n.start_soon(runner.run_shard, _shard(0, big, job="cancel-me"))
                while not ((t := await trio.to_thread.run_sync(task_named, "fedswarm tensor-map#0"))
                           and t.state == "RUNNING"):
                    await trio.sleep(0.2)
                n.cancel_scope.cancel()
        assert not scope.cancelled_caught, "the shard never ran"
        assert runner.stats["ray_cancelled"] == 1
        with trio.fail_after(60):
            while (t := await trio.to_thread.run_sync(task_named, "fedswarm tensor-map#0")).state == "RUNNING":
                await trio.sleep(0.2)
        # it stopped long before its work was done (Ray's state API may label a task
        # interrupted by ray.cancel FINISHED: ray-project/ray#32826)
        assert t.state in ("FAILED", "FINISHED"), t.state

        # gang: two slots, one placement group, removed afterwards
        fin = await runner.run_shard(_shard(7, small, job="gang", gpus=2))
        assert fin.ok, fin.error
        assert msgpack.unpackb(fin.result) == _expected(small, 7)
        pgs = list_placement_groups(address=cluster.dashboard, raise_on_missing_output=False)
        assert pgs and all(p.state == "REMOVED" for p in pgs), [(p.placement_group_id, p.state) for p in pgs]

        # chain: shard 11 arrives first, yet waits for shard 10 (two CPUs are free)
        for s in (10, 11):  # (names apart from the shards above: Ray names a task by kind and shard)
            core.leases[("tenant", "chain", s, 0)] = types.SimpleNamespace(job=types.SimpleNamespace(chain=True))
        mid = {"seed": 5, "size": 256, "iters": 20}
        done: list[int] = []

        async def one(s: int) -> None:
            fin = await runner.run_shard(_shard(s, mid, job="chain"))
            assert fin.ok, fin.error
            done.append(s)

        async with trio.open_nursery() as n:
            n.start_soon(one, 11)
            await trio.sleep(0)  # shard 11 arrives first and waits for shard 10
            n.start_soon(one, 10)
        assert done == [10, 11]
        core.leases.clear()
        def times():
            rows = {t.name: t for t in ray_tasks(cluster, detail=True)}
            a, b = rows.get("fedswarm tensor-map#10"), rows.get("fedswarm tensor-map#11")
            return (a, b) if a and b and a.end_time_ms and b.start_time_ms else None

        with trio.fail_after(30):  # the state API learns task events a moment late
            while not (both := await trio.to_thread.run_sync(times)):
                await trio.sleep(0.3)
        first, second = both
        assert second.start_time_ms >= first.end_time_ms, "chain shard 11 started before shard 10 ended"

    _run_runner_case(cluster, case)
