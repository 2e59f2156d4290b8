"""The run-time bookkeeping that every driver shares (core.runs)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from fedswarm.core.events import CancelShard, RunShard, SetLevel
from fedswarm.core.runs import Runs, run_key


def _run(shard: int = 0, *, gpus: int = 1, level: float = 1.0, run_s: float = 10.0) -> RunShard:
    return RunShard("t", "j", shard, 0, "sim", b"", run_s, gpus, 0, level, run_s)


def _watts(level: float) -> float:
    return 100.0 * level


def test_a_run_charges_each_segment_at_its_level_on_each_device() -> None:
    runs = Runs(_watts)
    e = _run(gpus=2, level=0.5, run_s=20.0)
    assert runs.start(0.0, e) is None
    run = runs.set_level(4.0, SetLevel("t", "j", 0, 0, 1.0, 14.0))
    assert run is not None and run.effect.level == 1.0 and run.effect.run_s == 14.0
    assert run.left(4.0) == 10.0  # the new run time counts from the run's start
    ended = runs.end(14.0, run_key(e))
    assert ended is not None
    # 4 s at 50 W + 10 s at 100 W, on 2 devices
    assert ended.energy_j == 2 * (4 * 50.0 + 10 * 100.0)
    assert (ended.began, ended.ended, ended.seconds, ended.gpus) == (0.0, 14.0, 14.0, 2)
    assert runs.busy_s == 28.0 and runs.busy_j == ended.energy_j
    assert len(runs) == 0 and runs.end(15.0, run_key(e)) is None


def test_per_gpu_false_counts_a_run_once_and_max_level_follows_the_runs() -> None:
    runs = Runs(_watts, per_gpu=False)
    assert runs.max_level() == 1.0 and runs.max_level(default=0.3) == 0.3
    runs.start(0.0, _run(0, gpus=4, level=0.6))
    runs.start(0.0, _run(1, level=0.8))
    assert runs.max_level() == 0.8 and list(runs) == [("t", "j", 0, 0), ("t", "j", 1, 0)]
    ended = runs.end(2.0, ("t", "j", 0, 0))
    assert ended is not None and ended.energy_j == 2 * 60.0 and ended.gpus == 1


def test_set_level_and_cancel_of_an_unknown_run_are_ignored_and_gens_go_stale() -> None:
    runs = Runs()
    assert runs.set_level(1.0, SetLevel("t", "j", 0, 0, 1.0, 5.0)) is None
    assert runs.end(1.0, run_key(CancelShard("t", "j", 0, 0))) is None
    runs.start(0.0, _run())
    run = runs.get(("t", "j", 0, 0))
    assert run is not None
    gen = run.gen
    assert runs.is_current(run.key, gen)
    runs.set_level(1.0, SetLevel("t", "j", 0, 0, 1.0, 5.0))
    assert not runs.is_current(run.key, gen) and runs.is_current(run.key, run.gen)
    # a second RunShard under the same key ends the first, unfinished
    old = runs.start(2.0, _run(run_s=3.0))
    assert old is not None and old.began == 0.0 and old.effect.run_s == 5.0
    assert [e.effect.run_s for e in runs.end_all(4.0)] == [3.0]
    assert len(runs) == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 50.0), st.sampled_from([0.5, 0.75, 1.0])), max_size=6),
       st.integers(1, 4))
def test_the_joules_of_a_run_are_the_sum_of_its_segments(changes: list[tuple[float, float]], gpus: int) -> None:
    runs = Runs(_watts)
    runs.start(0.0, _run(gpus=gpus, level=1.0, run_s=100.0))
    t, level, expect = 0.0, 1.0, 0.0
    for dt, new in changes:
        expect += _watts(level) * dt * gpus
        t += dt
        runs.set_level(t, SetLevel("t", "j", 0, 0, new, 100.0))
        level = new
    expect += _watts(level) * 1.0 * gpus
    ended = runs.end(t + 1.0, ("t", "j", 0, 0))
    assert ended is not None
    assert abs(ended.energy_j - expect) <= 1e-9 * max(expect, 1.0)
    assert abs(runs.busy_s - (t + 1.0) * gpus) <= 1e-9 * max(t, 1.0)
    assert abs(runs.busy_j - ended.energy_j) <= 1e-9 * max(expect, 1.0)
