"""The daemon's shard runner: clock levels and the energy charged for them."""

from __future__ import annotations

import random
import threading

import pytest
import trio

from fedswarm.core.config import PeerConfig
from fedswarm.core.energy import PowerModel
from fedswarm.core.events import RunShard, SetLevel
from fedswarm.core.peer import PeerCore
from fedswarm.daemon.runner import ExecutorRunner
from fedswarm.runtime.agent import wait_for
from fedswarm.runtime.executor import ShardExecutor
from fedswarm.tasks.registry import TaskEstimate, TaskRegistry
from helpers import ident

A100 = PowerModel(idle_w=60.0, max_w=400.0, alpha=2.5, levels=(0.6, 1.0))


class GateTask:
    """Runs until the test opens the gate."""

    name = "gate"

    def __init__(self) -> None:
        self.started = threading.Event()
        self.gate = threading.Event()

    def estimate(self, params: dict) -> TaskEstimate:
        return TaskEstimate(mem_bytes=1 << 10, ref_seconds=1.0)

    def run(self, params: dict, shard: int, *, device: str) -> dict:
        self.started.set()
        assert self.gate.wait(30)
        return {"shard": shard}


def test_energy_is_charged_per_level_for_the_time_spent_at_it() -> None:
    task = GateTask()
    reg = TaskRegistry(builtins=False, plugins=False)
    reg.register(task)
    ex = ShardExecutor(reg, device="cpu")
    assert ex.set_level(0.6) is False and ex.level == 1.0  # no NVML here: the level is modelled
    core = PeerCore(ident(1), PeerConfig(power=A100), random.Random(1))
    clock = [100.0]
    runner = ExecutorRunner(ex, core, clock=lambda: clock[0])
    got = []

    async def main() -> None:
        async def run() -> None:
            got.append(await runner.run_shard(RunShard("t", "j", 0, 0, "gate", b"\x80", 1.0, 1, 0, 0.6, 16.7)))

        async with trio.open_nursery() as n:
            n.start_soon(run)
            await wait_for(task.started.is_set, timeout=10)
            watts.append(core.now_w)  # what the peer gossips while the shard runs at 0.6
            clock[0] += 10.0  # 10 s at 0.6 ...
            runner.set_level(SetLevel("t", "j", 0, 0, 1.0, 12.0))
            watts.append(core.now_w)
            clock[0] += 5.0  # ... then 5 s at full clock
            task.gate.set()

    watts: list[float] = []
    trio.run(main)
    watts.append(core.now_w)  # idle again
    assert watts == pytest.approx([A100.power(0.6), A100.power(1.0), A100.idle_w])
    (fin,) = got
    assert fin.ok
    assert fin.energy_j == pytest.approx(A100.power(0.6) * 10.0 + A100.power(1.0) * 5.0)


def test_the_served_spans_level_and_the_shards_levels_take_the_highest() -> None:
    """A span served at 0.6 keeps the device at 0.6 while idle; a shard at
    full clock raises it for its run; when the shard ends the span's level
    holds again. Without a span, an idle device is at full clock as before."""
    task = GateTask()
    reg = TaskRegistry(builtins=False, plugins=False)
    reg.register(task)
    ex = ShardExecutor(reg, device="cpu")
    core = PeerCore(ident(2), PeerConfig(power=A100), random.Random(2))
    runner = ExecutorRunner(ex, core, clock=lambda: 0.0)
    assert runner.device_level == 1.0
    runner.set_span_level(0.6)
    seen = [runner.device_level]
    with pytest.raises(ValueError):
        runner.set_span_level(0.0)

    async def main() -> None:
        async def run() -> None:
            await runner.run_shard(RunShard("t", "j", 0, 0, "gate", b"\x80", 1.0, 1, 0, 1.0, 16.7))

        async with trio.open_nursery() as n:
            n.start_soon(run)
            await wait_for(task.started.is_set, timeout=10)
            seen.append(runner.device_level)
            runner.set_span_level(0.8)  # the span core moved while the shard runs
            seen.append(runner.device_level)
            task.gate.set()

    trio.run(main)
    seen.append(runner.device_level)
    assert seen == [0.6, 1.0, 1.0, 0.8]
