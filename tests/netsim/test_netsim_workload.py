import netsim_helpers  # noqa: F401  (must come first: fixes sys.path)
import random

import pytest

from netsim.workload import TraceError, generate, read_trace, write_trace

FULL = """job_id,tenant,arrival_s,shards,gpus_per_shard,duration_s,deadline_s,weight,kind
j1,alice,0,4,1,30,,1,bag
j2,bob,5.5,3,2,60,600,2.0,chain
"""
MIN = """tenant,job_id,arrival_s,shards,gpus_per_shard,duration_s
alice,a,10,2,1,5
alice,b,1,1,1,7.5
"""


def test_full_columns(tmp_path):
    f = tmp_path / "t.csv"
    f.write_text(FULL)
    j1, j2 = read_trace(f)
    assert (j1.job_id, j1.tenant, j1.shards, j1.gpus_per_shard, j1.duration_s, j1.deadline_s, j1.chain) == (
        "j1", "alice", 4, 1, 30.0, None, False)
    assert (j2.arrival_s, j2.deadline_s, j2.weight, j2.kind, j2.chain) == (5.5, 600.0, 2.0, "chain", True)


def test_required_only_sorted_by_arrival(tmp_path):
    f = tmp_path / "t.csv"
    f.write_text(MIN)
    jobs = read_trace(f)
    assert [j.job_id for j in jobs] == ["b", "a"]
    assert all(j.kind == "bag" and j.weight == 1.0 and j.deadline_s is None for j in jobs)


@pytest.mark.parametrize(
    "text, msg",
    [
        ("job_id,tenant,arrival_s,shards,duration_s\nj,a,0,1,1\n", "missing required column.*gpus_per_shard"),
        (MIN + "alice,c,3,two,1,5\n", r":4: column 'shards'.*not an integer"),
        (MIN + "alice,c,3,0,1,5\n", "must be > 0"),
        (MIN + "alice,a,3,1,1,5\n", "duplicate job_id"),
        (MIN + "alice,c,3,1,1\n", "expected 6 fields"),
        (FULL + "j3,a,0,1,1,5,,1,swarm\n", "kind"),
        (MIN.replace("duration_s", "duration_s,colour") .replace("5\n", "5,red\n").replace("7.5\n", "7.5,b\n"), "unknown column"),
        ("", "empty trace"),
    ],
)
def test_malformed(tmp_path, text, msg):
    f = tmp_path / "bad.csv"
    f.write_text(text)
    with pytest.raises(TraceError, match=msg):
        read_trace(f)


def test_generate_deterministic_and_roundtrip(tmp_path):
    tenants = [
        {"name": "a", "jobs": 20, "rate_per_h": 60, "shards": {"dist": "pareto", "xm": 2, "alpha": 1.5, "max": 50},
         "duration_s": {"dist": "lognormal", "median": 30, "sigma": 1}, "chain_fraction": 0.5, "chain_max_shards": 3,
         "deadline_factor": 3},
        {"name": "b", "jobs": 5, "rate_per_h": 10, "shards": 4, "duration_s": {"dist": "uniform", "lo": 1, "hi": 2}},
    ]
    a = generate(tenants, random.Random(7))
    assert a == generate(tenants, random.Random(7))
    assert a != generate(tenants, random.Random(8))
    assert len(a) == 25 and [j.arrival_s for j in a] == sorted(j.arrival_s for j in a)
    assert all(j.shards <= 3 for j in a if j.chain)
    f = tmp_path / "g.csv"
    write_trace(f, a)
    assert read_trace(f) == a
    with pytest.raises(TraceError, match="unknown key"):
        generate([{**tenants[1], "colour": 1}], random.Random(0))


GAVEL_CSV = """job_id,arrival_s,job_type,scale_factor,total_steps,duration_v100_s,duration_p100_s,duration_k80_s,thr_v100,thr_p100,thr_k80,priority_weight
0,0.000,ResNet-18 (batch size 64),8,100,1000.0,2000.0,4000.0,0.1,0.05,0.025,1.0
1,10.5,Transformer (batch size 16),1,100,300.0,400.0,900.0,1,1,1,2.0
"""


def test_gavel_csv_one_tenant_per_job_chains_of_rounds(tmp_path):
    from netsim.traces import convert_gavel, main

    src = tmp_path / "g.csv"
    src.write_text(GAVEL_CSV)
    jobs = convert_gavel(src)
    assert [(j.job_id, j.tenant, j.kind, j.shards, j.gpus_per_shard, j.weight) for j in jobs] == [
        ("gavel-0", "gavel-0", "chain", 3, 8, 1.0),  # 1000 s in rounds of <= 360 s
        ("gavel-1", "gavel-1", "bag", 1, 1, 2.0),
    ]
    assert jobs[0].duration_s == pytest.approx(1000 / 3, abs=1e-3)
    assert jobs[1].arrival_s == 10.5 and jobs[1].deadline_s is None
    assert [j.shards for j in convert_gavel(src, gpu="k80")] == [12, 3]  # k80 seconds as reference
    out = tmp_path / "out.csv"
    assert main(["gavel", "--in", str(src), "--out", str(out)]) == 0
    assert read_trace(out) == jobs


def test_gavel_trace_uses_throughputs_and_matches_its_csv(tmp_path):
    from netsim.traces import convert_gavel

    cols = ["Transformer (batch size 16)", "python3 train.py", "translation", "-step", "1", "720", "2", "1", "-1", "5.0"]
    (tmp_path / "t.trace").write_text("\t".join(cols) + "\n")
    thr = tmp_path / "thr.json"
    thr.write_text('{"v100": {"(\'Transformer (batch size 16)\', 2)": {"null": 1.0}}}')
    [j] = convert_gavel(tmp_path / "t.trace", throughputs=thr)
    assert (j.arrival_s, j.shards, j.gpus_per_shard, j.duration_s, j.kind) == (5.0, 2, 2, 360.0, "chain")
    (tmp_path / "bad.trace").write_text("a\tb\n")
    with pytest.raises(ValueError, match="10 tab-separated"):
        convert_gavel(tmp_path / "bad.trace", throughputs=thr)
