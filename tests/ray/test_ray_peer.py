"""A peer in front of a real Ray cluster (``peer start --engine ray``).

One Ray cluster for the module, on 127.0.0.1: a head and a second node, one
CPU each (``ray start --block`` processes, see
``fedswarm.runtime.ray_engine.LocalRayCluster``), dashboard on for Ray's
state API. Every test gets it back whole (the head and one more live node):
a test that killed a node and failed before re-adding it must not leave the
next one a cluster too small for its work.

One swarm for the module's job tests: a companion peer that serves no
tensor-map (its profile lists other kinds) and one Ray-fronted peer
(``--ray-address auto``, the local cluster through ``$RAY_ADDRESS``). The
first job test adds two plain tensor-map peers to it (with the Ray peer
fresh, its speed still the profile's like theirs) and ends them; the
node-kill test then runs on it as it was, so every shard goes to Ray.

Every wait is on a printed line, a status page, a process title or Ray's own
answers, bounded; nothing sleeps to guess readiness.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="the [ray] extra is not installed: pip install 'fedswarm[ray]'")

from fedswarm.testing.localswarm import LocalSwarm, PeerProcess, repo_root  # noqa: E402
from fedswarm.runtime.ray_engine import LocalRayCluster, task_name  # noqa: E402

pytestmark = pytest.mark.slow

PROFILE = str(repo_root() / "peers" / "cpu-laptop.toml")
ERROR_LINE = "peer start: error: "
# ~0.9 s per shard on one idle Ray worker CPU (more under load; a fresh worker
# imports torch first): a shard whose worker's title says it runs on a node
# still runs when that node is killed a few ms later
LONG = {"size": 768, "iters": 30}


# -- helpers ---------------------------------------------------------------------------------

def submit(bootstrap: str, out: Path, shards: int, extra: list[str], *, min_peers: int) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "fedswarm.cli", "submit", "--bootstrap", bootstrap, "--kind", "tensor-map",
           "--shards", str(shards), "--seed", "11", "--out", str(out), "--min-peers", str(min_peers),
           "--timeout", "150", "--progress", "off", "--verify", "none", "--json", *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish_submit(p: subprocess.Popen[str]) -> str:
    """Wait for a ``submit --json``; its job id."""
    out, err = p.communicate(timeout=180)
    assert p.returncode == 0, err
    return str(json.loads(out)["job_id"])


def start_local(out: Path, shards: int, extra: list[str]) -> subprocess.Popen[str]:
    """``peer submit --local`` of the same job, started now, read with :func:`finish_local`."""
    return subprocess.Popen([sys.executable, "-m", "fedswarm.cli", "submit", "--local", "--kind", "tensor-map",
                             "--shards", str(shards), "--seed", "11", "--out", str(out), "--progress", "off", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish_local(p: subprocess.Popen[str], out: Path) -> list[dict]:
    _, err = p.communicate(timeout=180)
    assert p.returncode == 0, err
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


def own_slots(peer: PeerProcess) -> int:
    st = peer.status()
    return next(e["slots"] for e in st["peers"] if e["self"])


def ray_tasks(cluster: LocalRayCluster, *, detail: bool = False) -> list:
    from ray.util.state import list_tasks

    return list_tasks(address=cluster.dashboard, limit=10000, raise_on_missing_output=False, detail=detail)


def start_ray_peer(workdir: Path, cluster: LocalRayCluster, bootstrap: list[str], *extra: str) -> PeerProcess:
    """``peer start --engine ray --ray-address auto``: the local cluster, which
    ``$RAY_ADDRESS`` names (so no other Ray cluster on this machine is taken)."""
    d = workdir / "raypeer"
    d.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "fedswarm.cli", "start", "--engine", "ray", "--ray-address", "auto",
           "--profile", PROFILE, "--data-dir", str(d), "--metrics-port", "0", "--grace", "5", *extra]
    for b in bootstrap:
        cmd += ["--bootstrap", b]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(d / "peer.log", "a"), text=True,
                            env={**os.environ, "RAY_ADDRESS": cluster.address})
    p = PeerProcess(proc, d)
    try:
        p.wait_ready(90)
    except BaseException:
        p.terminate()
        raise
    return p


# -- fixtures --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    with LocalRayCluster(tmp_path_factory.mktemp("ray"), head_cpus=1) as c:
        c.add_node(cpus=1)
        yield c


@pytest.fixture
def cluster(ray_cluster: LocalRayCluster) -> LocalRayCluster:
    """The module's cluster, whole: the head and one more live node."""
    for proc in [p for p in ray_cluster.nodes[1:] if p.poll() is not None]:
        ray_cluster.kill_node(proc)  # a node that died on its own: its leftovers
    while len(ray_cluster.nodes) < 2:
        ray_cluster.add_node(cpus=1)
    return ray_cluster


@pytest.fixture(scope="module")
def swarm(ray_cluster, tmp_path_factory):
    """A companion peer that serves no tensor-map, and the Ray-fronted peer."""
    work = tmp_path_factory.mktemp("swarm")
    other = work / "no-tensor-map.toml"
    other.write_text(Path(PROFILE).read_text().replace('slots = 1', 'slots = 1\ntasks = ["llm-batch"]'))
    with LocalSwarm(1, work / "companion", profile=str(other)) as companion:
        ray_peer = start_ray_peer(work, ray_cluster, [companion.bootstrap])
        try:
            yield companion.peers[0], ray_peer, work
        finally:
            assert ray_peer.terminate() == 0


# -- bad input -------------------------------------------------------------------------------

def test_reserve_syntax() -> None:
    from fedswarm.errors import InputError
    from fedswarm.runtime.ray_engine import parse_reserve

    assert parse_reserve(None) == {}
    assert parse_reserve("2") == {"slots": 2.0}
    assert parse_reserve("CPU=4, GPU=1,memory=16G") == {"CPU": 4.0, "GPU": 1.0, "memory": 16.0 * (1 << 30)}
    for bad in ("lots", "-1", "CPU=", "=2", "CPU=1,CPU=2", "nan", "memory=1X"):
        with pytest.raises(InputError):
            parse_reserve(bad)


def start_cli(args: list[str], tmp: Path, *, pre: str = "") -> subprocess.Popen[str]:
    code = f"import sys; {pre}from fedswarm.cli import main; sys.exit(main())"
    cmd = [sys.executable, "-c", code, "start", "--profile", PROFILE, "--data-dir", str(tmp), *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "RAY_ADDRESS": ""})


def one_error_line(p: subprocess.Popen[str], pattern: str) -> str:
    """The daemon exits 2 with one ``peer start: error:`` line matching
    ``pattern``, no traceback and no readiness line (nothing half-started)."""
    out, err = p.communicate(timeout=120)
    lines = [x for x in err.splitlines() if x.strip()]
    assert p.returncode == 2, err
    assert "Traceback" not in err, err
    assert len(lines) == 1, err
    assert lines[0].startswith(ERROR_LINE), lines[0]
    assert re.search(pattern, lines[0]), lines[0]
    assert out == "", "a daemon that failed its checks must print no readiness line"
    return lines[0]


def test_bad_ray_input_is_one_line_and_no_daemon(cluster, tmp_path: Path) -> None:
    """Side by side: Ray missing, nobody at the address, a reserve too large,
    a malformed reserve, and (once its head is up) a cluster with no CPUs
    and no GPUs."""
    from fedswarm.runtime.ray_engine import _free_port

    empty = LocalRayCluster(tmp_path / "empty", head_cpus=0, dashboard=False)
    try:
        # the empty head starts first, alone: started beside the four CLI
        # processes below (each importing Ray) on 2 cores, its raylet once
        # missed Ray's own 30 s wait for it to register (CI, 2026-12-06)
        empty.start()
        t0 = time.monotonic()
        cases = [
            # Ray not installed (the import fails): the extra to install
            (start_cli(["--engine", "ray"], tmp_path / "a", pre="sys.modules['ray'] = None; "),
             r"needs Ray, which is not installed \(pip install 'fedswarm\[ray\]'\)"),
            # nobody listens at the address: a bounded connect
            (start_cli(["--engine", "ray", "--ray-address", f"127.0.0.1:{_free_port()}"], tmp_path / "b"),
             r"no Ray cluster listens at 127\.0\.0\.1:\d+"),
            # a reserve larger than the cluster (2 CPUs)
            (start_cli(["--engine", "ray", "--ray-address", cluster.address, "--ray-reserve", "3"],
                       tmp_path / "c"),
             r"--ray-reserve 3 is larger than the cluster: it has 2 CPU"),
            (start_cli(["--engine", "ray", "--ray-reserve", "lots"], tmp_path / "d"),
             r"--ray-reserve 'lots' is not a reserve"),
        ]
        for p, pattern in cases:
            one_error_line(p, pattern)
        assert time.monotonic() - t0 < 60, "the checks are bounded"
        # a cluster with no resources: a head with no CPUs and no GPUs
        p = start_cli(["--engine", "ray", "--ray-address", empty.address], tmp_path / "e")
        one_error_line(p, r"has no CPUs and no GPUs")
    finally:
        empty.close()


# -- the runner on its own (this process as the Ray driver) ----------------------------------

def _run_runner_case(cluster: LocalRayCluster, key: Path, case) -> None:
    import random

    import trio

    from fedswarm.core.identity import load_or_create_key
    from fedswarm.core.peer import PeerCore
    from fedswarm.profiles import load_profile
    from fedswarm.runtime.ray_engine import RayRunner, connect_cluster

    async def main() -> None:
        ray_cluster = await connect_cluster(cluster.address, None)
        try:
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


def test_runner_cancel_gang_and_chain_on_the_cluster(cluster, tmp_path: Path) -> None:
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
        victim = task_name("tensor-map", 0, "cancel-me")
        with trio.move_on_after(120) as scope:
            async with trio.open_nursery() as n:
                n.start_soon(runner.run_shard, _shard(0, big, job="cancel-me"))
                while not ((t := await trio.to_thread.run_sync(task_named, victim)) and t.state == "RUNNING"):
                    await trio.sleep(0.1)
                n.cancel_scope.cancel()
        assert not scope.cancelled_caught, "the shard never ran"
        assert runner.stats["ray_cancelled"] == 1
        with trio.fail_after(60):
            while (t := await trio.to_thread.run_sync(task_named, victim)).state == "RUNNING":
                await trio.sleep(0.1)
        # it stopped long before its work was done (Ray's state API may label a task
        # interrupted by ray.cancel FINISHED: ray-project/ray#32826)
        assert t.state in ("FAILED", "FINISHED"), t.state

        # gang: two slots, one placement group, removed afterwards
        with trio.fail_after(90):  # the cluster's two CPUs, once the cancelled worker has gone
            fin = await runner.run_shard(_shard(7, small, job="gang", gpus=2))
        assert fin.ok, fin.error
        assert msgpack.unpackb(fin.result) == _expected(small, 7)
        pgs = list_placement_groups(address=cluster.dashboard, raise_on_missing_output=False)
        assert pgs and all(p.state == "REMOVED" for p in pgs), [(p.placement_group_id, p.state) for p in pgs]

        # chain: shard 11 arrives first, yet waits for shard 10 (two CPUs are free)
        for s in (10, 11):
            core.leases[("tenant", "chain", s, 0)] = types.SimpleNamespace(job=types.SimpleNamespace(chain=True))
        mid = {"seed": 5, "size": 256, "iters": 20}
        done: list[int] = []

        async def one(s: int) -> None:
            fin = await runner.run_shard(_shard(s, mid, job="chain"))
            assert fin.ok, fin.error
            done.append(s)

        with trio.fail_after(90):
            async with trio.open_nursery() as n:
                n.start_soon(one, 11)
                await trio.sleep(0)  # shard 11 arrives first and waits for shard 10
                n.start_soon(one, 10)
        assert done == [10, 11]
        core.leases.clear()

        def times():
            rows = {t.name: t for t in ray_tasks(cluster, detail=True)}
            a, b = rows.get(task_name("tensor-map", 10, "chain")), rows.get(task_name("tensor-map", 11, "chain"))
            return (a, b) if a and b and a.end_time_ms and b.start_time_ms else None

        with trio.fail_after(30):  # the state API learns task events a moment late
            while not (both := await trio.to_thread.run_sync(times)):
                await trio.sleep(0.2)
        first, second = both
        assert second.start_time_ms >= first.end_time_ms, "chain shard 11 started before shard 10 ended"

    _run_runner_case(cluster, tmp_path / "key", case)


# -- jobs through the swarm ------------------------------------------------------------------

def test_plain_and_ray_peers_compute_what_a_local_run_computes(cluster, swarm, tmp_path: Path) -> None:
    """Two plain peers join the swarm; a job through the three tensor-map
    peers gives what ``--local`` gives, and Ray's state API lists each shard
    the Ray peer ran as one of its tasks. The plain peers leave at the end."""
    companion, ray_peer, work = swarm
    shards = 12
    args = ["--size", "128", "--iters", "3"]
    local = start_local(tmp_path / "local.jsonl", shards, args)
    plain = LocalSwarm(2, work / "plain", profile=PROFILE)
    try:
        plain.peers = [plain.spawn_peer(i, bootstrap=[companion.addr]) for i in range(2)]
        for q in plain.peers:
            q.wait_ready()
        wait_until(lambda: own_slots(ray_peer) == 2, 30, "the Ray peer to advertise 2 slots")
        wait_until(lambda: len(plain.peers[0].status()["peers"]) == 4, 30, "4 peers in the view")
        p = submit(plain.peers[0].addr, tmp_path / "out.jsonl", shards, args, min_peers=4)
        job = finish_submit(p)
        rows = read(tmp_path / "out.jsonl")
        check_results(rows, finish_local(local, tmp_path / "local.jsonl"))
        mine = sorted(r["shard"] for r in rows if r["peer"] == ray_peer.peer_id)
        assert mine, "the Ray-fronted peer ran none of the shards"
        assert {r["peer"] for r in rows} <= {ray_peer.peer_id, *(q.peer_id for q in plain.peers)}
        # Ray's state API lists each shard this peer ran as one of its tasks
        want = {task_name("tensor-map", s, job) for s in mine}

        def listed():
            return want <= {t.name for t in ray_tasks(cluster) if t.state == "FINISHED"}

        wait_until(listed, 30, "Ray's state API to list the shards' tasks", poll=0.3)
    finally:
        plain.close()


def test_a_killed_ray_node_loses_nothing_and_slots_follow_the_nodes(cluster, swarm, tmp_path: Path) -> None:
    """Only the Ray peer serves tensor-map here (the plain peers have left),
    so every shard runs on Ray,
    two at a time, one of them on the second node, which is killed mid-shard;
    its slot leaves the peer's offer, and a node that joins adds one."""
    companion, ray_peer, _ = swarm
    shards = 4
    wait_until(lambda: own_slots(ray_peer) == 2, 30, "2 slots (head + node)")
    # the plain peers of the test before have left (their leave is gossiped at once)
    wait_until(lambda: len(companion.status()["peers"]) == len(ray_peer.status()["peers"]) == 2, 30,
               "the companion and the Ray peer to see each other and nobody else")
    victim = cluster.nodes[1]
    p = submit(companion.addr, tmp_path / "out.jsonl", shards, [f"--{k}={v}" for k, v in LONG.items()], min_peers=2)
    # a shard running on the second node: its worker's process title, at once
    running = wait_until(lambda: [t for t in cluster.busy_workers(victim) if t.startswith("fedswarm tensor-map#")],
                         90, "a shard running on the second node", poll=0.02)
    cluster.kill_node(victim)  # SIGKILL the node's raylet and workers: a machine gone
    # the node's slot leaves the peer's advertised capacity
    wait_until(lambda: own_slots(ray_peer) == 1, 60, "the advertised slots to drop to 1")
    with ThreadPoolExecutor(1) as pool:
        # a node joins (while the job goes on): its slot is offered to the swarm
        joined = pool.submit(cluster.add_node, cpus=1)
        job = finish_submit(p)
        assert running[0].endswith(" " + job), running
        rows = read(tmp_path / "out.jsonl")
        # what --local computes: the registry's task, in this process (as JSON)
        check_results(rows, [{"shard": i, "result": json.loads(json.dumps(_expected({"seed": 11, **LONG}, i)))}
                             for i in range(shards)])
        assert {r["peer"] for r in rows} == {ray_peer.peer_id}
        # the shard lost with the node ran again on the cluster, within its lease
        st = ray_peer.status()["stats"]
        assert st.get("ray_retries", 0) >= 1, st
        assert st.get("ray_handed_back", 0) == 0, st
        joined.result(timeout=120)
    wait_until(lambda: own_slots(ray_peer) == 2, 60, "the advertised slots to rise back to 2")


# -- an LLM span on a Ray actor --------------------------------------------------------------

def test_a_span_on_a_ray_actor_serves_what_the_local_span_serves(cluster, tiny_dir, tmp_path: Path) -> None:
    """A ``BlockServer`` whose span is a ``RaySpan`` (weights and KV caches in
    a Ray actor) answers forwards and a batched step, and a retried step,
    as the same server on the span loaded here does; the actor is a live
    Ray actor on the cluster, and its caches go when the sessions go."""
    import torch
    import trio
    from ray.util.state import list_actors

    from fedswarm.llm_protocol import decode, encode, pack_tensor, unpack_tensor
    from fedswarm.llm_serving import BlockServer, ServerLimits, measure_throughput
    from fedswarm.tasks.checkpoint import load_block_span, model_hash
    from fedswarm.runtime.ray_engine import connect_cluster, span_loader

    sids = [bytes([65 + i]) * 16 for i in range(3)]
    mhash = model_hash(tiny_dir)

    def call(srv, msg):
        return decode(trio.run(srv.handle, "client-a", encode(msg)))

    def fwd(sid, pos, x):
        return {"v": 1, "op": "forward", "model": mhash, "span": [0, 2], "session": sid, "pos": pos,
                "max_length": 32, "hidden": pack_tensor(x)}

    def step(pos, x):
        return {"v": 1, "op": "step", "model": mhash, "span": [0, 2], "sessions": sids, "pos": pos,
                "max_length": [32] * len(sids), "hidden": pack_tensor(x)}

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randn(n, 64, generator=g) for n in (3, 5, 2)]
    nxt = torch.randn(3, 64, generator=g)

    def session(srv) -> list:
        outs = [unpack_tensor(call(srv, fwd(sid, 0, p))["hidden"]) for sid, p in zip(sids, prompts)]
        r = call(srv, step([len(p) for p in prompts], nxt))
        assert r["ok"] is True and r["length"] == [len(p) + 1 for p in prompts], r
        # a retried step (the same positions again): each cache is cut back first
        again = call(srv, step([len(p) for p in prompts], nxt))
        return outs + [unpack_tensor(r["hidden"]), unpack_tensor(again["hidden"])]

    want = session(BlockServer(load_block_span(tiny_dir, 0, 2), mhash, limits=ServerLimits(max_batch=8)))

    async def connect():
        return await connect_cluster(cluster.address, None)

    rc = trio.run(connect)
    try:
        span = span_loader(rc)(tiny_dir, 0, 2)
        try:
            assert measure_throughput(span) > 0
            srv = BlockServer(span, mhash, limits=ServerLimits(max_batch=8))
            got = session(srv)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
            alive = [a for a in list_actors(address=cluster.dashboard, raise_on_missing_output=False)
                     if a.state == "ALIVE" and a.class_name == "SpanWorker"]
            assert len(alive) == 1 and alive[0].node_id in {n["NodeID"] for n in rc.ray.nodes() if n["Alive"]}
            assert rc.ray.get(span.actor.cached.remote()) == 3
            for sid in sids:
                assert call(srv, {"v": 1, "op": "close", "model": mhash, "session": sid})["ok"]
            import gc

            gc.collect()
            call(srv, fwd(b"Z" * 16, 0, prompts[0]))  # frees travel with the next forward
            assert rc.ray.get(span.actor.cached.remote()) == 1
        finally:
            span.close()
    finally:
        rc.shutdown()


def test_peer_start_engine_ray_serves_its_span_from_a_ray_actor(cluster, tiny_dir, tmp_path: Path) -> None:
    """``peer start --engine ray --serve-model``: the span lives in a Ray actor
    on the cluster; a generation through it and a plain peer's span gives
    the tokens of one local process."""
    from ray.util.state import list_actors

    from fedswarm.tasks.checkpoint import load_block_span, load_client_head
    from fedswarm.tasks.llama import generate_greedy
    from fedswarm.tasks.tokenizer import ByteTokenizer

    prompt = "Ray holds my blocks"
    ref = generate_greedy(load_client_head(tiny_dir), [load_block_span(tiny_dir, 0, 4)],
                          ByteTokenizer().encode(prompt), 12)
    with LocalSwarm(1, tmp_path / "plain", extra_args=["--serve-model", str(tiny_dir), "--blocks", "2:4"]) as plain:
        ray_peer = start_ray_peer(tmp_path, cluster, [plain.peers[0].addr],
                                  "--serve-model", str(tiny_dir), "--blocks", "0:2")
        try:
            actors = [a for a in list_actors(address=cluster.dashboard, limit=1000, raise_on_missing_output=False)
                      if a.state == "ALIVE" and "span 0:2" in (a.name or "")]
            assert len(actors) == 1, actors
            out = tmp_path / "gen.json"
            r = subprocess.run(
                [sys.executable, "-m", "fedswarm.cli", "generate", "--bootstrap", plain.peers[0].addr, "--model",
                 str(tiny_dir), "--prompt", prompt, "--max-new-tokens", "12", "--greedy", "--out", str(out)],
                capture_output=True, text=True, timeout=120)
            assert r.returncode == 0, r.stderr[-3000:]
            got = json.loads(out.read_text())
            assert got["token_ids"] == ref
            assert [h["blocks"] for h in got["route"]] == [[0, 2], [2, 4]]
            assert got["route"][0]["peer"] == ray_peer.peer_id
            spans = ray_peer.status()["spans"]
            # where the actor computes (a CPU-only cluster: --serve-device auto is its CPU), in the checkpoint's dtype
            assert [(s["start"], s["end"], s["device"], s["dtype"]) for s in spans] == [(0, 2, "cpu", "float32")]
        finally:
            assert ray_peer.terminate() == 0
