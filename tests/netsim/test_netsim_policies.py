"""Policy units: the energy level rule, fedswarm-race, trace conversion."""

from __future__ import annotations

import netsim_helpers  # noqa: F401  (must come first: fixes sys.path)

from hypothesis import given, settings
from hypothesis import strategies as st

from fedswarm.core.energy import DEADLINE_MARGIN, PowerModel, choose_level, leaves_rerun_room
from netsim.baselines import BaselineSim
from netsim.compare import run_policy
from netsim.traces import convert_philly, replicate
from netsim.workload import TraceJob, read_trace, write_trace

from netsim_helpers import make_scenario

A100 = PowerModel(idle_w=60.0, max_w=400.0, alpha=2.5, levels=(0.6, 0.8, 1.0))


def test_deadline_with_slack_slows_down_to_least_energy():
    c = choose_level(A100, 100.0, start_s=0.0, deadline_s=1000.0)
    assert c.level == 0.6 and c.energy_j < A100.energy(100.0, 1.0)


def test_tight_deadline_races():
    c = choose_level(A100, 100.0, start_s=10.0, deadline_s=100.0)
    assert c.level == 1.0
    mid = choose_level(A100, 100.0, start_s=0.0, deadline_s=100.0 / 0.8 / DEADLINE_MARGIN + 1)
    assert mid.level == 0.8


def test_no_deadline_no_lambda_is_fastest_and_race_flag_wins():
    assert choose_level(A100, 50.0).level == 1.0
    assert choose_level(A100, 50.0, deadline_s=1e6, race_to_idle=True).level == 1.0


def test_idle_heavy_model_prefers_race_even_with_slack():
    flat = PowerModel(idle_w=300.0, max_w=400.0, alpha=3.0, levels=(0.5, 1.0))
    assert choose_level(flat, 100.0, deadline_s=1e4).level == 1.0


def test_power_cap_holds():
    capped = PowerModel(idle_w=60.0, max_w=400.0, alpha=2.5, cap_w=250.0, levels=(0.6, 0.8, 1.0))
    assert choose_level(capped, 10.0, deadline_s=11.0).level <= 0.8


def test_a_slowed_level_leaves_room_for_one_rerun_at_full_clock():
    # the traced crash victims of window a/40: 69 s alone, a 207 s deadline,
    # a 30 s lease. 0.6 (115 s) fits 0.8 x 207 s, but a crash at its end
    # leaves 115 + 30 + 69 = 214 s > 207 s; 0.8 (86 s) leaves room (185 s)
    assert choose_level(A100, 69.0, deadline_s=207.0).level == 0.6
    assert choose_level(A100, 69.0, deadline_s=207.0, rerun_reserve_s=30.0).level == 0.8
    # the reserve counts: with no time to notice the crash 0.6 has room
    assert choose_level(A100, 69.0, deadline_s=207.0, rerun_reserve_s=0.0).level == 0.6
    # the queue wait counts too; no slowed level has room: the fastest
    assert choose_level(A100, 69.0, start_s=25.0, deadline_s=207.0, rerun_reserve_s=30.0).level == 1.0
    # the fastest level keeps the old rule: chosen even without room
    assert choose_level(A100, 100.0, deadline_s=150.0, rerun_reserve_s=30.0).level == 1.0
    assert leaves_rerun_room(69.0, 86.25, 1.0, start_s=0.0, deadline_s=207.0, reserve_s=30.0)
    assert not leaves_rerun_room(69.0, 115.0, 1.0, start_s=0.0, deadline_s=207.0, reserve_s=30.0)


_LEVELS = st.lists(st.sampled_from([0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 1.0]), min_size=1, max_size=5, unique=True)


@settings(max_examples=300, deadline=None)
@given(
    levels=_LEVELS,
    alpha=st.floats(1.0, 3.5),
    idle=st.floats(0.0, 300.0),
    work=st.floats(0.1, 5000.0),
    start=st.floats(0.0, 2000.0),
    deadline=st.floats(0.1, 20000.0),
    reserve=st.floats(0.0, 120.0),
)
def test_a_chosen_slowed_level_always_leaves_room_for_a_full_clock_rerun(
    levels: list[float], alpha: float, idle: float, work: float, start: float, deadline: float, reserve: float
) -> None:
    model = PowerModel(idle_w=idle, max_w=400.0, alpha=alpha, levels=tuple(levels))
    fastest = model.allowed_levels()[-1]
    c = choose_level(model, work, start_s=start, deadline_s=deadline, rerun_reserve_s=reserve)
    if c.level < fastest:
        assert start + work / c.level + reserve + work / fastest <= deadline
        assert start + work / c.level <= DEADLINE_MARGIN * deadline
    # the room only takes slow levels away: never slower than without it
    assert c.level >= choose_level(model, work, start_s=start, deadline_s=deadline).level


def test_fedswarm_race_uses_more_busy_energy_with_deadlines():
    sc = make_scenario(
        swarm=[{"profile": "datacenter-a100", "count": 2}, {"profile": "workstation-rtx4090", "count": 2}],
        client={"verify": "none"}, max_time_s=3000,
    )
    jobs = [TraceJob(f"j{i}", "ab"[i % 2], 5.0 * i, 4, 1, 30.0, deadline_s=600.0) for i in range(6)]
    fs = run_policy(sc, 1, "fedswarm", jobs)["summary"]
    race = run_policy(sc, 1, "fedswarm-race", jobs)["summary"]
    assert fs["shards_completed"] == race["shards_completed"] == 24
    assert fs["energy_busy_j"] < race["energy_busy_j"]


def test_fedswarm_rerun_turns_the_rerun_room_on():
    # 30 s shards with a 75 s deadline: the 0.6 clock (50 s) fits 0.8 x 75 s,
    # but a re-run after a crash at its end (30 s more, after the lease) does
    # not: fedswarm-rerun runs them faster than fedswarm, slower than the race
    swarm = [{"profile": "datacenter-a100", "count": 2}, {"profile": "workstation-rtx4090", "count": 2}]
    sc = make_scenario(swarm=swarm, client={"verify": "none"}, max_time_s=3000)
    jobs = [TraceJob(f"j{i}", "ab"[i % 2], 5.0 * i, 4, 1, 30.0, deadline_s=75.0) for i in range(6)]
    pols = ("fedswarm", "fedswarm-rerun", "fedswarm-race", "centralized")
    runs = {p: run_policy(sc, 1, p, jobs)["summary"] for p in pols}
    assert all(r["shards_completed"] == 24 for r in runs.values())
    assert runs["fedswarm"]["energy_busy_j"] < runs["fedswarm-rerun"]["energy_busy_j"] <= runs["fedswarm-race"][
        "energy_busy_j"]
    # the baselines apply the scenario's level rule: [peer] rerun_room = true
    # gives them the room too (fedswarm-rerun does not: it is fedswarm's alone)
    room = make_scenario(swarm=swarm, client={"verify": "none"}, peer={"rerun_room": True}, max_time_s=3000)
    both = {p: run_policy(room, 1, p, jobs)["summary"] for p in ("fedswarm", "centralized")}
    assert both["fedswarm"] == runs["fedswarm-rerun"]
    assert both["centralized"]["shards_completed"] == 24
    assert runs["centralized"]["energy_busy_j"] < both["centralized"]["energy_busy_j"]


def test_the_centralized_scheduler_raises_slowed_shards_while_work_waits():
    # one A100 peer (8 slots): j0's 8 shards of 30 s with a 75 s deadline
    # start at the 0.6 clock (50 s); alone they keep it. With 8 more shards
    # arriving 5 s later and no slot free, the scheduler raises the running
    # ones to full clock, as a fedswarm peer does when work queues behind them
    sc = make_scenario(swarm=[{"profile": "datacenter-a100", "count": 1}], client={"verify": "none"},
                       churn={"crash_fraction": 0.0}, max_time_s=3000)
    first = TraceJob("j0", "a", 0.0, 8, 1, 30.0, deadline_s=75.0)

    def run(jobs: list[TraceJob]) -> tuple[BaselineSim, dict[str, float]]:
        b = BaselineSim(sc, 1, "centralized", jobs=jobs)
        b.run()
        return b, {j["job_id"]: j["jct_s"] for j in b.results()["jobs"]}

    alone, jct = run([first])
    assert alone.levels_raised == 0 and 50.0 < jct["j0"] < 51.0
    busy, jct2 = run([first, TraceJob("j1", "b", 5.0, 8, 1, 30.0)])
    assert busy.levels_raised == 8
    # 5 s at 0.6 (3 s of work), the other 27 s at full clock: 32 s
    assert 32.0 < jct2["j0"] < 33.0 and jct2["j1"] < jct["j0"] + 30.0


def test_philly_conversion(tmp_path):
    src = tmp_path / "p.csv"
    src.write_text(
        "timestamp,duration,num_gpus,gpu_time,cluster\n"
        "2017-10-09 00:00:00,100,1,100,aa\n"
        "2017-10-09 00:01:00,3000,2,6000,aa\n"
        "2017-10-09 00:02:00,900,16,14400,bb\n"
        "2017-10-09 00:03:00,50,1,50,cc\n"
        "2017-10-10 00:00:00,50,1,50,aa\n"
    )
    jobs = convert_philly(src, start="2017-10-09 00:00:00", window_h=1, tenants=1, round_s=300, deadline_frac=0)
    by = {j.job_id: j for j in jobs}
    assert len(jobs) == 4 and {j.tenant for j in jobs} == {"aa", "other"}
    assert by["philly-0"].kind == "bag" and by["philly-0"].shards == 1
    long = by["philly-1"]
    assert long.kind == "chain" and long.shards == 10 and long.gpus_per_shard == 2 and long.duration_s == 300
    wide = by["philly-2"]
    assert wide.kind == "bag" and wide.gpus_per_shard == 8 and wide.shards == 3 * 2
    assert abs(wide.shards * wide.gpus_per_shard * wide.duration_s - 900 * 16) < 1e-6
    out = tmp_path / "t.csv"
    write_trace(out, jobs)
    assert read_trace(out) == sorted(jobs, key=lambda j: (j.arrival_s, j.job_id))


def test_replicated_trace_keeps_the_mix_with_its_own_tenants(tmp_path):
    base = [TraceJob("a", "t1", 0.0, 2, 1, 10.0), TraceJob("b", "t2", 5.0, 1, 8, 3.0, deadline_s=9.0, kind="chain")]
    jobs = replicate(base, 3, offset_s=1.0)
    assert len(jobs) == 6 and len({j.job_id for j in jobs}) == 6
    assert {j.tenant for j in jobs} == {f"{t}~{i}" for t in ("t1", "t2") for i in range(3)}
    assert sorted(j.arrival_s for j in jobs if j.tenant.startswith("t2")) == [5.0, 6.0, 7.0]
    assert sum(j.shards * j.gpus_per_shard * j.duration_s for j in jobs) == 3 * (20.0 + 24.0)
    out = tmp_path / "x.csv"
    write_trace(out, jobs)
    assert read_trace(out) == jobs


def test_a_slowed_shard_is_sped_up_when_a_queue_forms_and_charged_per_segment():
    sc = make_scenario(swarm=[{"profile": "datacenter-a100", "count": 1}], client={"verify": "none"}, max_time_s=600)
    slow = TraceJob("slow", "a", 0.0, 1, 1, 30.0, lam=0.05)  # idle swarm: worth running at 0.6
    burst = TraceJob("burst", "a", 10.0, 9, 1, 30.0)  # 9 more shards for 7 free slots: a queue
    res = run_policy(sc, 1, "fedswarm", [slow, burst])
    job = {j["job_id"]: j for j in res["jobs"]}["slow"]
    pm = A100
    assert job["finished"]
    # faster than 30 s / 0.6 = 50 s, slower than 30 s at full clock
    assert 30.0 < job["jct_s"] < 50.0
    # charged at 0.6 up to the speed-up, at 1.0 after it: between the two pure runs
    assert pm.power(0.6) * 50.0 < job["energy_j"] < pm.power(1.0) * 30.0
