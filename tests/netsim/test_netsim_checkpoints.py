"""netsim with ``workload.checkpoint_s``: running shards save progress, and a
crash victim goes on from its last checkpoint, under fedswarm and the
baselines alike."""

from __future__ import annotations

import netsim_helpers  # noqa: F401  (must come first: fixes sys.path)

import json

import pytest

from netsim import dumps_results
from netsim.baselines import BASELINES, BaselineSim
from netsim.cli import main
from netsim.scenario import ScenarioError
from netsim.sim import Simulator
from netsim.workload import TraceJob

from netsim_helpers import make_scenario

# long shards on few peers, a third of which crash while they run
JOBS = [
    TraceJob("a0", "a", 0.0, 6, 1, 120.0),
    TraceJob("b0", "b", 3.0, 4, 1, 90.0, deadline_s=900.0),
    TraceJob("c0", "c", 6.0, 2, 1, 150.0, kind="chain"),
]


def scenario(checkpoint_s: float):
    return make_scenario(
        swarm=[{"profile": "datacenter-a100", "count": 3}, {"profile": "workstation-rtx4090", "count": 9}],
        client={"verify": "none"},
        churn={"crash_fraction": 0.34, "crash_window_s": [40, 120]},
        network={"loss": 0.01},
        workload={"checkpoint_s": checkpoint_s},
        max_time_s=20000,
    )


def run(checkpoint_s: float, seed: int = 2, fast: bool = True) -> Simulator:
    sim = Simulator(scenario(checkpoint_s), seed, jobs=JOBS, fast=fast)
    sim.run()
    return sim


def exactly_once(res: dict) -> None:
    s = res["summary"]
    assert s["jobs_completed"] == s["jobs_submitted"] == len(JOBS)
    assert s["shards_completed"] == s["shards_submitted"]
    assert s["shards_lost"] == 0 and s["shards_duplicated"] == 0


def stat(sim: Simulator, name: str, peers: bool) -> int:
    return sum(r.core.stats[name] for r in sim.nodes.values() if r.is_peer == peers)


def test_crash_victims_go_on_from_their_checkpoints_and_replay_exactly():
    a, b, plain = run(10.0), run(10.0), run(10.0, fast=False)
    ra = dumps_results(a.results())
    assert ra == dumps_results(b.results()) == dumps_results(plain.results())
    res = json.loads(ra)
    exactly_once(res)
    assert res["peers"]["crashed"] >= 3
    assert res["network"]["by_kind"]["ShardCheckpoint"] == stat(a, "checkpoints_sent", True) > 0
    resumed = stat(a, "awards_resumed", False)
    assert resumed > 0 and stat(a, "shards_resumed", True) == resumed
    # without checkpoints the same crashes make every victim start over
    off = run(0.0)
    exactly_once(off.results())
    assert stat(off, "awards_resumed", False) == 0 and stat(off, "checkpoints_sent", True) == 0
    assert "ShardCheckpoint" not in off.results()["network"]["by_kind"]
    assert a.results()["summary"]["makespan_s"] < off.results()["summary"]["makespan_s"]


@pytest.mark.parametrize("policy", BASELINES)
def test_baselines_go_on_from_checkpoints_too(policy):
    on = BaselineSim(scenario(10.0), 2, policy, jobs=JOBS)
    on.run()
    off = BaselineSim(scenario(0.0), 2, policy, jobs=JOBS)
    off.run()
    for sim in (on, off):
        exactly_once(sim.results())
    assert on.msg_kinds["checkpoint"] > 0 and off.msg_kinds["checkpoint"] == 0
    saved = [d for job in on.st.values() for d in job.progress.values()]
    assert saved and all(0 < d < 1 for d in saved)
    assert not any(job.progress for job in off.st.values())


@pytest.mark.parametrize("bad", [-1, "10", 1e6])
def test_a_bad_checkpoint_interval_is_refused(bad):
    with pytest.raises(ScenarioError, match="checkpoint_s"):
        scenario(bad)


def test_the_cli_overrides_the_interval(tmp_path, capsys):
    path = tmp_path / "sc.toml"
    path.write_text('name = "ck"\nmax_time_s = 2000\n[[swarm]]\nprofile = "workstation-rtx4090"\ncount = 4\n'
                    '[workload]\ntask = "sim"\n[[workload.tenants]]\nname = "t"\njobs = 2\nrate_per_h = 600\nshards = 2\n'
                    'duration_s = 40\n')
    out = tmp_path / "r.json"
    assert main(["run", str(path), "--seed", "1", "--checkpoint-s", "10", "--profiles",
                 str(netsim_helpers.PEERS), "--out", str(out), "-q"]) == 0
    assert json.loads(out.read_text())["network"]["by_kind"].get("ShardCheckpoint", 0) > 0
    assert main(["run", str(path), "--checkpoint-s", "-5", "--profiles", str(netsim_helpers.PEERS), "-q"]) != 0
    assert "--checkpoint-s" in capsys.readouterr().err


def test_seeds_run_side_by_side_keep_the_interval(tmp_path):
    # `compare --seeds 1-2 --workers 2` runs each seed as a child process
    # with the parent's options: the interval goes along
    import argparse

    from netsim.seeds import _child_argv

    args = argparse.Namespace(scenario="sc.toml", trace=None, peers=None, profiles=None, max_time=None,
                              checkpoint_s=30.0, policies="fedswarm", quiet=True, no_plot=True)
    argv = _child_argv(args, 2, tmp_path / "s2.json")
    assert argv[argv.index("--checkpoint-s") + 1] == "30.0"
    args.checkpoint_s = None
    assert "--checkpoint-s" not in _child_argv(args, 2, tmp_path / "s2.json")
