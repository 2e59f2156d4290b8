import netsim_helpers  # noqa: F401  (must come first: fixes sys.path)
import json
import os
import subprocess
import sys

from netsim import dumps_results, load_scenario, run_scenario
from netsim.cli import main
from netsim_helpers import SCENARIOS

TRACE = """job_id,tenant,arrival_s,shards,gpus_per_shard,duration_s,deadline_s,weight,kind
job-a,alice,0,3,1,10,,1,bag
job-b,bob,2,2,1,8,100,1,chain
job-c,alice,4,4,2,5,,2,bag
"""


def test_cli_trace_peers_plot(tmp_path, capsys):
    trace = tmp_path / "t.csv"
    trace.write_text(TRACE)
    out = tmp_path / "r.json"
    rc = main(["run", str(SCENARIOS / "smoke-20.toml"), "--seed", "2", "--out", str(out), "--trace", str(trace),
               "--peers", "12", "--plot", str(tmp_path / "p.png")])
    cap = capsys.readouterr()
    assert rc == 0
    assert "shards_lost" in cap.out and "jain_index" in cap.out
    assert "wall=" in cap.err
    res = json.loads(out.read_text())
    assert sorted(j["job_id"] for j in res["jobs"]) == ["job-a", "job-b", "job-c"]
    assert res["peers"]["initial"] == 12
    assert res["summary"]["shards_completed"] == 9 and res["summary"]["shards_lost"] == 0
    assert "wall" not in out.read_text()
    # matplotlib is a default dependency: the figures are always written
    for name in ("p.png", "p.cdf.png", "p.energy.png", "p.shares.png", "p.messages.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert "netsim: figures:" in cap.err


def test_cli_errors(tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_text("job_id,tenant\nx,y\n")
    assert main(["run", str(SCENARIOS / "smoke-20.toml"), "--trace", str(bad)]) == 2
    assert "missing required column" in capsys.readouterr().err
    sc = tmp_path / "s.toml"
    sc.write_text('name = "x"\ncolour = 1\n[[swarm]]\nprofile = "cpu-laptop"\ncount = 1\n')
    assert main(["run", str(sc), "--profiles", str(SCENARIOS.parents[1] / "peers")]) == 2
    assert "unknown key" in capsys.readouterr().err
    # a [client] or [peer] value of the wrong kind is named in one line
    for table, line, msg in (("client", 'rank_per_probe = "16"', "client.rank_per_probe: must be an integer, got '16'"),
                             ("client", "rank_max = 25.6", "client.rank_max: must be an integer, got 25.6"),
                             ("peer", "renew_batch = 1", "peer.renew_batch: must be true or false, got 1"),
                             ("peer", 'gossip_interval_s = "10"', "peer.gossip_interval_s: must be a number")):
        sc.write_text(f'name = "x"\n[{table}]\n{line}\n[[swarm]]\nprofile = "cpu-laptop"\ncount = 1\n')
        assert main(["run", str(sc), "--profiles", str(SCENARIOS.parents[1] / "peers")]) == 2
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    # an integer is a number: a float field takes it
    sc.write_text('name = "x"\nmax_time_s = 5\n[peer]\ngossip_interval_s = 10\n[[swarm]]\nprofile = "cpu-laptop"\ncount = 1\n')
    assert main(["run", str(sc), "-q", "--profiles", str(SCENARIOS.parents[1] / "peers")]) == 0
    capsys.readouterr()
    # --workers on a scenario that is not split: it runs here, and says so
    assert main(["run", str(sc), "-q", "--workers", "2", "--profiles", str(SCENARIOS.parents[1] / "peers")]) == 0
    err = capsys.readouterr().err
    assert "netsim: note: --workers 2 has no effect: x is not split into parts" in err
    assert "workers=" not in err.splitlines()[-1]


def test_the_command_exits_without_teardown_and_loses_no_output(tmp_path):
    """``python -m netsim`` leaves through ``os._exit`` (no heap teardown
    after a large run): what it printed into a pipe is flushed first, the
    exit code is main's, and the JSON is complete."""
    out = tmp_path / "r.json"
    smoke = SCENARIOS / "smoke-20.toml"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout into a pipe is buffered
    done = subprocess.run([sys.executable, "-m", "netsim", "run", str(smoke), "--seed", "3", "-q", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0].split() == ["metric", "value"] and "bytes_per_peer_s" in done.stdout
    assert "huge_pages=" in done.stderr.splitlines()[-1]
    assert out.read_text() == dumps_results(run_scenario(load_scenario(smoke), 3))
    bad = subprocess.run([sys.executable, "-m", "netsim", "run", str(tmp_path / "nosuch.toml")],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "no such scenario file" in bad.stderr
