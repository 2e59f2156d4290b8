import pytest
import torch

from fedswarm.tasks import get_task
from fedswarm.tasks.tensor_map import results_agree, round_sig


@pytest.fixture
def task():
    return get_task("tensor-map")


def test_deterministic_per_seed_and_shard(task):
    p = {"seed": 7, "size": 48, "iters": 3}
    a = task.run(p, 2, device="cpu")
    assert a == task.run(dict(p), 2, device="cpu")
    assert set(a) == {"checksum", "size", "iters", "digest"}
    assert a["size"] == 48 and a["iters"] == 3 and len(a["digest"]) == 64
    assert task.run(p, 3, device="cpu")["digest"] != a["digest"]
    assert task.run({**p, "seed": 8}, 2, device="cpu")["digest"] != a["digest"]
    assert task.run({**p, "size": 40}, 2, device="cpu")["digest"] != a["digest"]


def test_thread_count_does_not_change_result(task):
    p = {"seed": 1, "size": 200, "iters": 2}
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        a = task.run(p, 0, device="cpu")
        torch.set_num_threads(2)
        b = task.run(p, 0, device="cpu")
    finally:
        torch.set_num_threads(old)
    assert results_agree(a, b)
    assert a["checksum"] == b["checksum"]


def test_defaults_and_rounding(task):
    r = task.run({}, 0, device="cpu")
    assert r["size"] == 64 and r["iters"] == 1
    assert round_sig(r["checksum"]) == r["checksum"]
    assert round_sig(123456789.0) == 123457000.0


@pytest.mark.parametrize(
    "params",
    [
        {"size": 4},
        {"size": 5000},
        {"size": 64.0},
        {"size": True},
        {"size": "64"},
        {"iters": 0},
        {"iters": 10**6},
        {"seed": -1},
        {"seed": 2**63},
        {"code": "import os"},
        [],
        None,
    ],
)
def test_bad_params(task, params):
    with pytest.raises(ValueError):
        task.estimate(params)
    with pytest.raises(ValueError):
        task.run(params, 0, device="cpu")


@pytest.mark.parametrize("shard", [-1, 2**32, 1.0, True, "0"])
def test_bad_shard(task, shard):
    with pytest.raises(ValueError):
        task.run({}, shard, device="cpu")


def test_estimate_scales_with_size(task):
    small = task.estimate({"size": 64})
    big = task.estimate({"size": 1024, "iters": 10})
    assert big.ref_seconds > 10 * small.ref_seconds
    assert big.mem_bytes > small.mem_bytes >= 64 * 64 * 4
