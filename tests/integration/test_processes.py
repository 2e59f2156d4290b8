"""Real daemons on 127.0.0.1: separate processes, py-libp2p, torch.

Every wait is on an observable condition (a printed line, a status page, a
process exit), bounded by a timeout; nothing sleeps a fixed time to guess
readiness.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedswarm.testing.localswarm import LocalSwarm

pytestmark = pytest.mark.slow

# ~0.5-1 s per shard on one CPU thread: long enough to kill a peer mid-job
LONG = ["--size", "1024", "--iters", "25"]


def submit(bootstrap: str, out: Path, shards: int, extra: list[str], *, min_peers: int = 1) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "fedswarm.cli", "submit", "--bootstrap", bootstrap, "--kind", "tensor-map",
           "--shards", str(shards), "--seed", "7", "--out", str(out), "--min-peers", str(min_peers),
           "--timeout", "240", "--progress", "off", *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def local(out: Path, shards: int, extra: list[str]) -> list[dict]:
    subprocess.run([sys.executable, "-m", "fedswarm.cli", "submit", "--local", "--kind", "tensor-map", "--shards",
                    str(shards), "--seed", "7", "--out", str(out), "--progress", "off", *extra], check=True,
                   capture_output=True)
    return read(out)


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def wait_until(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def check_results(rows: list[dict], expected: list[dict]) -> None:
    assert [r["shard"] for r in rows] == list(range(len(expected))), "each shard exactly once"
    for r, e in zip(rows, expected):
        assert r["result"] == e["result"], f"shard {r['shard']} differs from the local run"


def test_three_peers_compute_what_a_local_run_computes(tmp_path: Path) -> None:
    expected = local(tmp_path / "local.jsonl", 9, ["--size", "96"])
    with LocalSwarm(3, tmp_path / "swarm") as swarm:
        p = submit(swarm.bootstrap, tmp_path / "out.jsonl", 9, ["--size", "96"], min_peers=3)
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        rows = read(tmp_path / "out.jsonl")
        check_results(rows, expected)
        ids = {peer.peer_id for peer in swarm.peers}
        assert {r["peer"] for r in rows} <= ids
        assert len({r["peer"] for r in rows}) >= 2
        st = swarm.peers[0].status()
        assert len(st["peers"]) == 3
        assert sum(peer.status()["stats"].get("shards_run", 0) for peer in swarm.peers) >= 9


def test_kill_9_of_a_peer_holding_shards_loses_nothing(tmp_path: Path) -> None:
    shards = 10
    expected = local(tmp_path / "local.jsonl", shards, LONG)
    with LocalSwarm(4, tmp_path / "swarm") as swarm:
        p = submit(swarm.bootstrap, tmp_path / "out.jsonl", shards, LONG, min_peers=4)
        victims = swarm.peers[1:]

        def running_holder():
            for peer in victims:
                if any(lease["state"] == "running" for lease in peer.status()["leases"]):
                    return peer
            return None

        wait_until(lambda: running_holder() is not None, 60, "a peer running a shard")
        victim = running_holder()
        victim.kill()  # SIGKILL: no goodbye, no hand-back
        _, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
        rows = read(tmp_path / "out.jsonl")
        check_results(rows, expected)
        assert len(rows) == shards
        # the shards it held were re-run elsewhere under a later attempt
        assert any(r["attempt"] > 0 for r in rows)


def test_sigterm_drains_gracefully(tmp_path: Path) -> None:
    shards = 8
    expected = local(tmp_path / "local.jsonl", shards, LONG)
    with LocalSwarm(3, tmp_path / "swarm") as swarm:
        p = submit(swarm.bootstrap, tmp_path / "out.jsonl", shards, LONG, min_peers=3)
        leaver = swarm.peers[2]
        wait_until(lambda: len(leaver.status()["leases"]) >= 1, 60, "the leaver to hold a lease")
        rc = leaver.terminate(timeout=30)
        assert rc == 0
        log = (leaver.data_dir / "peer.log").read_text().splitlines()
        events = [json.loads(line) for line in log if line.startswith("{")]
        assert any(e["msg"] == "leaving" and e.get("signal") == "SIGTERM" for e in events)
        assert any(e["msg"] == "left" for e in events)
        _, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
        check_results(read(tmp_path / "out.jsonl"), expected)


def test_restart_with_the_same_key_keeps_the_peer_id(tmp_path: Path) -> None:
    swarm = LocalSwarm(1, tmp_path)
    first = swarm.start_peer(0)
    pid = first.peer_id
    assert first.terminate() == 0
    key = tmp_path / "peer0" / "peer.key"
    assert key.stat().st_mode & 0o777 == 0o600
    again = swarm.start_peer(0)
    try:
        assert again.peer_id == pid
    finally:
        again.terminate()


def test_a_hung_peer_loses_nothing(tmp_path: Path) -> None:
    """SIGSTOP: connected but silent. Its leases lapse and are re-auctioned."""
    import signal as _signal

    shards = 8
    expected = local(tmp_path / "local.jsonl", shards, LONG)
    with LocalSwarm(3, tmp_path / "swarm") as swarm:
        p = submit(swarm.bootstrap, tmp_path / "out.jsonl", shards, LONG, min_peers=3)
        hung = swarm.peers[2]
        wait_until(lambda: len(hung.status()["leases"]) >= 1, 60, "the peer to hold a lease")
        hung.proc.send_signal(_signal.SIGSTOP)
        try:
            _, err = p.communicate(timeout=180)
        finally:
            hung.proc.send_signal(_signal.SIGCONT)
        assert p.returncode == 0, err
        rows = read(tmp_path / "out.jsonl")
        check_results(rows, expected)
        assert all(r["peer"] != hung.peer_id for r in rows if r["attempt"] == 0) or any(r["attempt"] > 0 for r in rows)


def test_flooded_daemon_keeps_serving_a_real_job(tmp_path: Path) -> None:
    shards = 8
    expected = local(tmp_path / "local.jsonl", shards, ["--size", "512", "--iters", "10"])
    with LocalSwarm(2, tmp_path / "swarm") as swarm:
        target = swarm.peers[0]
        flood = subprocess.Popen([sys.executable, str(Path(__file__).with_name("flooder.py")), target.addr, "20"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_until(lambda: sum(target.status()["rejected"].values()) > 100, 60, "the flood to arrive")
        p = submit(swarm.bootstrap, tmp_path / "out.jsonl", shards, ["--size", "512", "--iters", "10"], min_peers=2)
        _, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
        check_results(read(tmp_path / "out.jsonl"), expected)
        out, ferr = flood.communicate(timeout=60)
        assert flood.returncode == 0, ferr
        sent = json.loads(out.strip().splitlines()[-1])
        assert sum(sent.values()) > 200
        st = target.status()
        rejected = st["rejected"]
        # every kind of garbage was refused with a typed reason and counted
        assert rejected.get("malformed", 0) > 0
        assert rejected.get("bad-signature", 0) > 0
        assert rejected.get("replayed", 0) + rejected.get("stale", 0) + rejected.get("rate-limited", 0) > 0
        assert target.proc.poll() is None  # still alive
