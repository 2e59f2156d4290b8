"""ShardExecutor and resumable tasks: ``resume`` and ``on_checkpoint`` reach
resumable tasks only, checkpoints are checked and dropped once a run is
abandoned, and a resumed run's throughput counts only the work it did."""

from __future__ import annotations

import threading

import pytest
import trio

from fedswarm.runtime.executor import ShardExecutor
from fedswarm.tasks.registry import TaskEstimate, TaskRegistry, check_cancelled

P = {"seed": 5, "size": 32, "iters": 4}


def registry_with(*tasks: object) -> TaskRegistry:
    r = TaskRegistry(plugins=False)
    for t in tasks:
        r.register(t)  # type: ignore[arg-type]
    return r


class Recorder:
    """A non-resumable task that records how it was called."""

    name = "recorder"

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def estimate(self, params: dict) -> TaskEstimate:
        return TaskEstimate(mem_bytes=1 << 10, ref_seconds=1.0)

    def run(self, params: dict, shard: int, **kw: object) -> dict:
        self.calls.append(kw)
        return {"shard": shard}


class Stepper:
    """A resumable task that checkpoints what the test tells it to, waiting
    on a gate between two checkpoints."""

    name = "stepper"
    resumable = True

    def __init__(self, dones: list[object], states: list[object] | None = None) -> None:
        self.dones = dones
        self.states = states or [b"s"] * len(dones)
        self.first = threading.Event()
        self.gate = threading.Event()
        self.ended = threading.Event()
        self.resumed: list[bytes | None] = []

    def estimate(self, params: dict) -> TaskEstimate:
        return TaskEstimate(mem_bytes=1 << 10, ref_seconds=1.0)

    def run(self, params: dict, shard: int, *, device: str, resume: bytes | None = None,
            checkpoint: object = None) -> dict:
        self.resumed.append(resume)
        try:
            for i, (done, st) in enumerate(zip(self.dones, self.states)):
                if checkpoint is not None:
                    checkpoint(done, st)  # type: ignore[operator]
                if i == 0:
                    self.first.set()
                    assert self.gate.wait(30)
            check_cancelled()
            return {"ok": True}
        finally:
            self.ended.set()


def test_checkpoints_and_a_resumed_run_through_the_executor() -> None:
    ex = ShardExecutor(TaskRegistry(plugins=False), device="cpu")
    got: list[tuple[float, bytes, str]] = []

    def on_checkpoint(done: float, state: bytes) -> None:
        got.append((done, state, threading.current_thread().name))

    async def main() -> None:
        full = await ex.run("tensor-map", P, 2, on_checkpoint=on_checkpoint)
        assert [d for d, _, _ in got] == [0.25, 0.5, 0.75]
        assert all(name == "shard tensor-map#2" for _, _, name in got)  # on the worker thread
        done, state, _ = got[1]
        resumed = await ex.run("tensor-map", P, 2, resume=state, left=1 - done)
        assert resumed.result == full.result
        assert resumed.ref_seconds == pytest.approx(full.ref_seconds * 0.5)
        # a resume state the task refuses fails the run, as bad params do
        with pytest.raises(ValueError, match="resume state"):
            await ex.run("tensor-map", {**P, "seed": 6}, 2, resume=state, left=0.5)
        with pytest.raises(ValueError):
            await ex.run("tensor-map", P, 2, resume=b"x" * (2 << 20), left=0.5)
        with pytest.raises(ValueError):
            await ex.run("tensor-map", P, 2, resume=state, left=0.0)

    trio.run(main)


def test_a_task_that_cannot_resume_runs_the_whole_shard() -> None:
    task = Recorder()
    ex = ShardExecutor(registry_with(task), device="cpu")

    async def main() -> None:
        res = await ex.run("recorder", {}, 1, resume=b"state", left=0.25, on_checkpoint=lambda d, s: None)
        assert res.result == {"shard": 1}
        assert res.ref_seconds == 1.0  # it did the whole shard's work

    trio.run(main)
    assert task.calls == [{"device": "cpu"}]  # never offered resume or checkpoint


def test_a_fresh_run_of_a_resumable_task_gets_no_resume() -> None:
    task = Stepper([0.5])
    task.gate.set()
    ex = ShardExecutor(registry_with(task), device="cpu")
    got: list[float] = []
    trio.run(lambda: ex.run("stepper", {}, 0, on_checkpoint=lambda d, s: got.append(d)))
    assert task.resumed == [None] and got == [0.5]


@pytest.mark.parametrize(
    "done, state",
    [(0.0, b"s"), (1.0, b"s"), (float("nan"), b"s"), (True, b"s"), ("0.5", b"s"), (0.5, b""),
     (0.5, "text"), (0.5, b"x" * ((1 << 20) + 1))],
)
def test_a_bad_checkpoint_is_the_tasks_bug(done: object, state: object) -> None:
    task = Stepper([done], [state])
    task.gate.set()
    ex = ShardExecutor(registry_with(task), device="cpu")
    got: list[float] = []
    with pytest.raises(ValueError, match="checkpoint"):
        trio.run(lambda: ex.run("stepper", {}, 0, on_checkpoint=lambda d, s: got.append(d)))
    assert got == []


def test_checkpoints_of_an_abandoned_run_are_dropped() -> None:
    task = Stepper([0.25, 0.5])
    ex = ShardExecutor(registry_with(task), device="cpu")
    got: list[float] = []

    async def main() -> None:
        with trio.move_on_after(30) as scope:
            async with trio.open_nursery() as n:
                async def run() -> None:
                    await ex.run("stepper", {}, 0, on_checkpoint=lambda d, s: got.append(d))

                n.start_soon(run)
                await trio.to_thread.run_sync(task.first.wait)
                n.cancel_scope.cancel()  # the shard is abandoned mid-run
        assert not scope.cancelled_caught
        task.gate.set()  # its thread goes on and checkpoints once more
        await trio.to_thread.run_sync(task.ended.wait)

    trio.run(main)
    assert got == [0.25]
