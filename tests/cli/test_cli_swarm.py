"""Mistakes and interruptions against a real 2-peer swarm (separate ``peer
start`` processes on 127.0.0.1): a second daemon on a used data dir or port,
a /metrics URL given to ``peer status``, a bootstrap peer that is not up yet,
and ``peer submit`` stopped by Ctrl-C or its timeout without losing the
shards already received.

Every wait is on an observable condition (a printed line, a file's lines, a
status page), bounded; nothing sleeps to guess.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from cli_helpers import PEER, REPO, error_line, free_port, run
from fedswarm.testing.localswarm import LocalSwarm, PeerProcess

pytestmark = pytest.mark.slow

# ~0.15 s per shard on one core: 40 shards keep two peers busy for seconds
JOB = ["--kind", "tensor-map", "--seed", "7", "--size", "512", "--iters", "10"]
N_LONG = 150  # shards: a job the timeout test stops (SIGSTOP) before it can finish
N_INT = 600  # shards: a job that is still running when the interrupt test's Ctrl-C arrives
PARAMS = {"seed": 7, "size": 512, "iters": 10}
CPU = str(REPO / "peers" / "cpu-laptop.toml")


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory):
    with LocalSwarm(2, tmp_path_factory.mktemp("swarm")) as s:
        yield s


def wait_until(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def check_against_local(got: list[dict]) -> None:
    from fedswarm.client import _jsonable
    from fedswarm.tasks.registry import default_registry

    task = default_registry().get("tensor-map")
    assert len({r["shard"] for r in got}) == len(got), "a shard twice"
    for r in got:
        assert r["result"] == _jsonable(task.run(PARAMS, r["shard"], device="cpu")), f"shard {r['shard']} differs"


def submit(swarm: LocalSwarm, out: Path, shards: int, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(PEER + ["submit", "--bootstrap", swarm.bootstrap, *JOB, "--shards", str(shards),
                                    "--out", str(out), "--min-peers", "2", "--progress", "off", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_second_daemon_on_the_same_data_dir_is_refused(swarm: LocalSwarm) -> None:
    first = swarm.peers[0]
    p = run(PEER + ["start", "--profile", CPU, "--data-dir", str(first.data_dir)])
    error_line(p, 2, rf"data dir \S+ is in use by another daemon \(pid {first.proc.pid}\)")


def test_ports_in_use_are_refused(swarm: LocalSwarm, tmp_path: Path) -> None:
    first = swarm.peers[0]
    port = first.addr.split("/tcp/")[1].split("/")[0]
    p = run(PEER + ["start", "--profile", CPU, "--data-dir", str(tmp_path / "a"), "--listen", f"/ip4/127.0.0.1/tcp/{port}"])
    error_line(p, 2, rf"listen port {port} on 127.0.0.1 is already in use")
    mport = first.metrics_url.rsplit(":", 1)[1]
    p = run(PEER + ["start", "--profile", CPU, "--data-dir", str(tmp_path / "b"), "--metrics-port", mport])
    error_line(p, 2, rf"--metrics-port {mport} on 127.0.0.1 is already in use")
    lport = first.status()["transport"]["lane_port"]
    p = run(PEER + ["start", "--profile", CPU, "--data-dir", str(tmp_path / "c"), "--lane-port", str(lport)])
    error_line(p, 2, rf"--lane-port {lport} on 127.0.0.1 is already in use")
    assert first.status()["peer"] == first.peer_id  # the first one is untouched


def test_status_of_a_metrics_url_is_one_line(swarm: LocalSwarm) -> None:
    url = swarm.peers[0].metrics_url
    p = run(PEER + ["status", "--url", f"{url}/metrics"])
    error_line(p, 2, r"did not answer JSON .*give the daemon's /status URL")
    p = run(PEER + ["status", "--url", f"{url}/status"])
    assert p.returncode == 0 and "2 live peers" in p.stdout, p.stdout + p.stderr
    lport = swarm.peers[0].status()["transport"]["lane_port"]
    assert f"direct lanes on port {lport}: " in p.stdout, p.stdout


def test_submit_writes_sorted_results_and_a_json_summary(swarm: LocalSwarm, tmp_path: Path) -> None:
    out = tmp_path / "ok.jsonl"
    p = submit(swarm, out, 4, "--json")
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == 0, stderr
    got = rows(out)
    assert [r["shard"] for r in got] == [0, 1, 2, 3]
    check_against_local(got)
    summary = json.loads(stdout)
    assert summary["done"] == 4 and summary["out"] == str(out)


def test_ctrl_c_keeps_the_shards_received(swarm: LocalSwarm, tmp_path: Path) -> None:
    """Ctrl-C right after a first result of a 600-shard job (about 35 s here;
    jobs of 40 and 150 quick shards once finished before the SIGINT took):
    exit 130 at once, the shards received kept."""
    out = tmp_path / "int.jsonl"
    p = submit(swarm, out, N_INT)
    wait_until(lambda: len(rows(out)) >= 1 or p.poll() is not None, 120, "the first result in the file")
    p.send_signal(signal.SIGINT)
    stdout, stderr = p.communicate(timeout=60)
    got = rows(out)
    line = error_line(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr), 130,
                      rf"interrupted: (\d+) of {N_INT} shards received, (\d+) missing", only_line=False)
    n = int(re.search(rf"(\d+) of {N_INT} shards received", line).group(1))
    assert n == len(got) >= 1 and n < N_INT
    assert f"{N_INT - n} missing" in line
    check_against_local(got)


def test_bootstrap_not_up_yet_is_retried_and_shown_until_it_connects(tmp_path: Path) -> None:
    from fedswarm.core.identity import load_or_create_key
    from fedswarm.profiles import load_profile

    later_key = tmp_path / "later" / "peer.key"
    later_id = load_or_create_key(later_key).peer_id
    later_port, port = free_port(), free_port()
    boot = f"/ip4/127.0.0.1/tcp/{later_port}/p2p/{later_id}"
    d = tmp_path / "early"
    d.mkdir()
    # no --profile: the machine is read and written to DATA_DIR/profile.toml
    cmd = PEER + ["start", "--data-dir", str(d), "--listen", f"/ip4/127.0.0.1/tcp/{port}",
                  "--announce", f"/dns4/localhost/tcp/{port}", "--bootstrap", boot, "--bootstrap-retry-max", "2", "--metrics-port", "0",
                  "--torch-threads", "1", "--grace", "1"]
    log = open(d / "peer.log", "w")
    early = PeerProcess(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True), d)
    later = None
    try:
        early.wait_ready()
        assert early.addr.startswith(f"/dns4/localhost/tcp/{port}/p2p/"), early.addr
        assert load_profile(d / "profile.toml").devices
        assert "wrote" in (d / "peer.log").read_text() and "profile.toml" in (d / "peer.log").read_text()
        st = early.status()
        assert st["addrs"] == [early.addr]
        b = st["bootstrap"][0]
        assert b["addr"] == boot and b["state"] in ("retrying", "connecting") and b["attempts"] >= 1, b
        assert b["last_error"]
        p = run(PEER + ["status", "--url", early.metrics_url + "/status"])
        assert p.returncode == 0 and "bootstrap" in p.stdout and boot in p.stdout, p.stdout
        # the bootstrap peer comes up: the early one connects and joins through it
        later = PeerProcess(subprocess.Popen(
            PEER + ["start", "--profile", CPU, "--data-dir", str(later_key.parent), "--listen",
                    f"/ip4/127.0.0.1/tcp/{later_port}", "--metrics-port", "0", "--torch-threads", "1", "--grace", "1",
                    "--no-lane"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True), later_key.parent)
        later.wait_ready()
        wait_until(lambda: early.status()["bootstrap"][0]["state"] == "connected", 60, "the bootstrap to connect")
        wait_until(lambda: len(early.status()["peers"]) == 2, 30, "the early peer to join")
        # --no-lane: no lane listener, and peer status says so
        assert later.status()["transport"]["lane_port"] == 0 and early.status()["transport"]["lane_port"] > 0
        p = run(PEER + ["status", "--url", later.metrics_url + "/status"])
        assert "direct lanes off (--no-lane)" in p.stdout, p.stdout
        events = [json.loads(x) for x in (d / "peer.log").read_text().splitlines() if x.startswith("{")]
        assert any(e["level"] == "warning" and e["msg"].startswith("bootstrap unreachable") for e in events)
    finally:
        rcs = [early.terminate()] + ([later.terminate()] if later else [])
        log.close()
    assert rcs == [0] * len(rcs)


def test_a_lone_peer_answers_verify_auto_with_a_note_and_verify_always_with_an_error(tmp_path: Path) -> None:
    """One peer cannot check its own results: ``--verify auto`` (the default)
    delivers them and says they are unverified, ``--verify always`` fails at
    once with the reason; neither waits for its timeout (120 s)."""
    with LocalSwarm(1, tmp_path / "one") as one:
        base = PEER + ["submit", "--bootstrap", one.bootstrap, *JOB, "--shards", "3", "--min-peers", "1",
                       "--progress", "off", "--timeout", "120"]
        out = tmp_path / "auto.jsonl"
        p = run(base + ["--out", str(out)], timeout=100)
        assert p.returncode == 0, p.stderr
        assert "note: 3 of 3 shards accepted unverified" in p.stderr
        check_against_local(rows(out))
        p = run(base + ["--out", str(tmp_path / "always.jsonl"), "--verify", "always"], timeout=100)
        error_line(p, 1, r"no other peer can verify its result", only_line=False)


def test_timeout_keeps_the_shards_received(swarm: LocalSwarm, tmp_path: Path) -> None:
    """Last in the module: it stops the swarm's peers (SIGSTOP) so the
    job cannot finish, then lets them go on."""
    out = tmp_path / "slow.jsonl"
    p = submit(swarm, out, N_LONG, "--timeout", "20")
    stopped = []
    try:
        wait_until(lambda: len(rows(out)) >= 1 or p.poll() is not None, 20, "the first result in the file")
        for peer in swarm.peers:
            peer.proc.send_signal(signal.SIGSTOP)
            stopped.append(peer)
        stdout, stderr = p.communicate(timeout=60)
    finally:
        for peer in stopped:
            peer.proc.send_signal(signal.SIGCONT)
    got = rows(out)
    line = error_line(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr), 1,
                      rf"timed out after 20s: (\d+) of {N_LONG} shards received, (\d+) missing", only_line=False)
    n = int(re.search(rf"(\d+) of {N_LONG} shards received", line).group(1))
    assert n == len(got) >= 1 and n < N_LONG
    check_against_local(got)
