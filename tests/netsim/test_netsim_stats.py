import netsim_helpers  # noqa: F401  (must come first: fixes sys.path)
import math

import pytest

from fedswarm.core.fairness import alone_time
from netsim.stats import StepFn, jain, rho, round_floats


def test_jain_hand_made():
    assert jain([1, 1, 1, 1]) == pytest.approx(1.0)
    assert jain([1, 0, 0, 0]) == pytest.approx(0.25)  # 1/n: one gets everything
    assert jain([1, 2]) == pytest.approx(9 / 10)  # (3)^2 / (2 * 5)
    assert jain([]) == 1.0
    assert jain([0, 0]) == 1.0


def test_rho_bag_and_chain():
    # 10 shards x 60 s on 1 GPU, capacity 20 slots, 2 tenants -> share 10 slots
    r, t_alone = rho(120.0, 60.0, 10, 1, False, 20.0, 2.0)
    assert t_alone == pytest.approx(60.0)  # max(one shard, 600 / 10)
    assert r == pytest.approx(2.0)
    # fluid bound dominates with a small share: 600 gpu-s / 4 slots
    r, t_alone = rho(300.0, 60.0, 10, 1, False, 8.0, 2.0)
    assert t_alone == pytest.approx(150.0)
    assert r == pytest.approx(2.0)
    # chain: all shards back to back
    r, t_alone = rho(1200.0, 60.0, 10, 1, True, 100.0, 1.0)
    assert t_alone == pytest.approx(600.0) and r == pytest.approx(2.0)
    # agrees with the core's alone_time for integer tenant counts
    assert rho(1.0, 30.0, 7, 2, False, 12.0, 3.0)[1] == pytest.approx(alone_time(30.0, 7, 2, False, 12.0, 3))
    # fewer than one tenant is clamped to one
    assert rho(10.0, 10.0, 1, 1, False, 1.0, 0.2)[1] == pytest.approx(10.0)


def test_stepfn_time_average():
    f = StepFn(0.0, 1.0)
    f.set(10.0, 3.0)
    f.set(20.0, 0.0)
    assert f.mean(0, 10) == pytest.approx(1.0)
    assert f.mean(0, 20) == pytest.approx(2.0)
    assert f.mean(5, 15) == pytest.approx(2.0)
    assert f.mean(15, 30) == pytest.approx(1.0)
    assert f.mean(12, 12) == 3.0
    with pytest.raises(ValueError):
        f.set(5.0, 1.0)
    # rebuilt from its points (a split run's part hands them over): the same
    # function, integrals to the bit
    g = StepFn.from_points(f.ts, f.vs)
    assert (g.ts, g.vs, g.cum) == (f.ts, f.vs, f.cum) and g.ts is not f.ts
    f.set(25.0, 7.25)
    f.set(25.0, 0.0)  # overwritten in place: two equal values in a row
    f.set(31.0, 0.1)
    assert f.vs[-3:] == [0.0, 0.0, 0.1]
    g = StepFn.from_points(f.ts, f.vs)
    assert g.cum == f.cum and g.mean(3.3, 40.7) == f.mean(3.3, 40.7)


def test_round_floats():
    assert round_floats({"a": 1.23456789, "b": [math.inf, 2.0000001, 0.0], "c": 3}) == {
        "a": 1.23457, "b": [None, 2.0, 0.0], "c": 3}
