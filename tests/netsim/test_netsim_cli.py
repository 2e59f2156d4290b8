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


def test_compare_over_seeds_writes_each_seed_as_one_seed_would(tmp_path, capsys):
    """``compare --seeds``: each seed's file is byte for byte what ``compare
    --seed S --no-plot`` writes, and the summary's ratios and worst jobs are
    those files' figures."""
    smoke = str(SCENARIOS / "smoke-20.toml")
    pols = ["--policies", "fedswarm,centralized,fifo"]
    assert main(["compare", smoke, *pols, "--seeds", "2-3", "1", "--workers", "2", "-q",
                 "--out", str(tmp_path / "s.json")]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0] == "# smoke-20 seeds=2-3 1 peers=20; ratios against centralized"
    # rows per seed, in the order given, policies in --policies order
    assert [(r.split()[0], r.split()[1]) for r in table[2:11]] == [
        (s, p) for s in ("2", "3", "1") for p in ("fedswarm", "centralized", "fifo")]
    assert main(["compare", smoke, *pols, "--seed", "3", "--no-plot", "-q", "--out", str(tmp_path / "one.json")]) == 0
    capsys.readouterr()
    assert (tmp_path / "one.json").read_bytes() == (tmp_path / "s.seed3.json").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.json", "s.json", "s.seed1.json", "s.seed2.json",
                                                         "s.seed3.json"]  # --no-plot: no figures
    summ = json.loads((tmp_path / "s.json").read_text())
    assert summ["seeds"] == [2, 3, 1] and summ["against"] == "centralized"
    for s in (1, 2, 3):
        res = json.loads((tmp_path / f"s.seed{s}.json").read_text())["policies"]
        for pol in ("fedswarm", "fifo"):
            want = res[pol]["summary"]["max_rho"] / res["centralized"]["summary"]["max_rho"]
            assert abs(summ["ratios"][pol]["max_rho"]["per_seed"][str(s)] - want) < 1e-5 * want
            worst = max(res[pol]["jobs"], key=lambda j: j["rho"])
            assert summ["per_seed"][str(s)][pol]["max_rho_job"] == worst["job_id"]
            assert summ["per_seed"][str(s)][pol]["max_rho"] == worst["rho"]
    ratios = sorted(summ["ratios"]["fedswarm"]["mean_jct_s"]["per_seed"].values())
    assert summ["ratios"]["fedswarm"]["mean_jct_s"]["median"] == ratios[1]
    assert summ["ratios"]["fedswarm"]["mean_jct_s"]["min"] == ratios[0]
    assert "fedswarm against centralized over 3 seeds: mean_jct_s median" in table[-2]


def test_compare_over_seeds_refuses_bad_input_in_one_line(tmp_path, capsys):
    from netsim.seeds import parse_seeds

    assert parse_seeds("1-3 7,2") == [1, 2, 3, 7]
    smoke = str(SCENARIOS / "smoke-20.toml")
    for argv, msg in (
        (["--seeds", "3-1"], "the range '3-1' runs backwards"),
        (["--seeds", "one"], "'one' is not a seed or a range like 1-6"),
        (["--seeds", "1-2", "--seed", "1"], "--seed and --seeds: give one of them"),
        (["--seeds", "1-2", "--against", "random"], "--against random: not among --policies fedswarm,centralized"),
        (["--seeds", "1-2", "--workers", "0"], "--workers must be >= 1"),
        (["--workers", "2"], "--workers goes with --seeds"),
    ):
        assert main(["compare", smoke, "--policies", "fedswarm,centralized", "-q", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not list(tmp_path.iterdir())


def test_a_scenario_extends_another_file_in_its_directory(tmp_path, capsys):
    """``extends``: the named file's tables, with this file's keys on top
    (tables merge key by key; arrays and values are replaced); the shipped
    variants of eval-philly are such files; a bad or cyclic ``extends`` is
    one line and exit code 2."""
    base = load_scenario(SCENARIOS / "eval-philly.toml")
    resc = load_scenario(SCENARIOS / "eval-philly-rescue.toml")
    assert resc.name == "eval-philly-rescue"
    assert resc.peer_overrides == {**base.peer_overrides, "queue_etas": True}
    assert resc.client_overrides == {**base.client_overrides, "rescue_gain": 0.5}
    assert (resc.swarm, resc.churn, resc.network, resc.trace) == (base.swarm, base.churn, base.network, base.trace)
    rerun = load_scenario(SCENARIOS / "eval-philly-rerun.toml")
    assert rerun.peer_overrides == {**base.peer_overrides, "rerun_room": True}
    (tmp_path / "a.toml").write_text((SCENARIOS / "smoke-20.toml").read_text())
    (tmp_path / "b.toml").write_text('extends = "a.toml"\nname = "b"\n[[swarm]]\nprofile = "datacenter-a100"\ncount = 3\n'
                                     '[network]\nloss = 0.1\n')
    a, b = load_scenario(tmp_path / "a.toml"), load_scenario(tmp_path / "b.toml")
    assert [(g.profile, g.count) for g in b.swarm] == [("datacenter-a100", 3)]
    assert b.network.loss == 0.1 and b.network.intra_ms == a.network.intra_ms
    (tmp_path / "c.toml").write_text('extends = "d.toml"\n')
    (tmp_path / "d.toml").write_text('extends = "c.toml"\n')
    (tmp_path / "e.toml").write_text('extends = "../smoke-20.toml"\n')
    for name, says in (("c.toml", "a cycle"), ("e.toml", "in the same directory")):
        assert main(["run", str(tmp_path / name)]) == 2
        assert says in capsys.readouterr().err
