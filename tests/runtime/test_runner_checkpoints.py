"""Checkpointed re-runs through the daemon's pieces, in one process: the
``ExecutorRunner`` hands a running task's checkpoints to a real
``PeerCore`` (as ``ShardProgress``, on the trio loop), the peer sends them
to a real ``ClientCore``, and when the peer is lost the shard goes on at
another peer from the last checkpoint. Real agents, executors and worker
threads over the in-memory transport, on the wall clock (the tasks run on
threads, so trio's virtual clock cannot stand in for their time)."""

from __future__ import annotations

import random
import threading

import trio
import trio.testing

from fedswarm.client import JobRequest, open_client
from fedswarm.core.config import ClientConfig, PeerConfig
from fedswarm.core.events import RunShard, ShardProgress
from fedswarm.core.peer import PeerCore
from fedswarm.daemon.runner import ExecutorRunner
from fedswarm.net.memory import MemoryNetwork
from fedswarm.runtime.agent import Agent
from fedswarm.runtime.executor import ShardExecutor
from fedswarm.tasks.registry import TaskEstimate, TaskRegistry, check_cancelled
from helpers import ident, until


class HalfwayTask:
    """Resumable: a fresh run checkpoints at half way (state ``b"half"``)
    and then waits for the gate; a run resumed from ``b"half"`` finishes at
    once. The result says where it started."""

    name = "halfway"
    resumable = True

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.runs: list[bytes | None] = []

    def estimate(self, params: dict) -> TaskEstimate:
        return TaskEstimate(mem_bytes=1 << 10, ref_seconds=2.0)

    def run(self, params: dict, shard: int, *, device: str, resume: bytes | None = None,
            checkpoint: object = None) -> dict:
        self.runs.append(resume)
        if resume is None:
            assert checkpoint is not None
            checkpoint(0.5, b"half")  # type: ignore[operator]
            assert self.gate.wait(60)
            check_cancelled()
        elif resume != b"half":
            raise ValueError("bad resume state")
        return {"shard": shard, "from": "start" if resume is None else resume.decode()}


def _peer(net: MemoryNetwork, i: int, boot: str, task: HalfwayTask) -> tuple[Agent, ExecutorRunner]:
    reg = TaskRegistry(builtins=False, plugins=False)
    reg.register(task)
    # checkpoint_min_s = 0: each checkpoint goes out (the default forwards one per 10 s)
    idn = ident(i, 77)
    core = PeerCore(idn, PeerConfig(bootstrap=(boot,), renew_interval_s=0.2, lease_grace_s=5.0,
                                    checkpoint_min_s=0.0), random.Random(i))
    runner = ExecutorRunner(ShardExecutor(reg, device="cpu"), core)
    agent = Agent(core, net.add(idn), runner=runner)
    runner.feed = agent.feed  # as the daemon wires it (daemon.serve)
    return agent, runner


def test_the_runner_hands_progress_to_the_core_on_the_loop_and_drops_it_after_the_run() -> None:
    """A ``ShardProgress`` per checkpoint reaches ``feed`` on the trio
    thread while the run is live; none once it ended."""
    task = HalfwayTask()
    reg = TaskRegistry(builtins=False, plugins=False)
    reg.register(task)
    core = PeerCore(ident(1, 76), PeerConfig(), random.Random(1))
    runner = ExecutorRunner(ShardExecutor(reg, device="cpu"), core)
    fed: list[tuple[object, str]] = []
    runner.feed = lambda inp: fed.append((inp, threading.current_thread().name))
    eff = RunShard("t", "j", 4, 2, "halfway", b"\x80", 2.0, 1, 0, 1.0, 2.0)

    async def main() -> None:
        loop_thread = threading.current_thread().name
        async with trio.open_nursery() as n:
            n.start_soon(runner.run_shard, eff)
            await until(lambda: any(isinstance(i, ShardProgress) for i, _ in fed))
            task.gate.set()
        progress = [(i, t) for i, t in fed if isinstance(i, ShardProgress)]
        assert progress == [(ShardProgress("t", "j", 4, 2, 0.5, b"half"), loop_thread)]
        fin = await runner.run_shard(RunShard("t", "j", 4, 3, "halfway", b"\x80", 2.0, 1, 0, 1.0, 1.0,
                                              left=0.5, resume=b"half"))
        assert fin.ok

    trio.run(main)
    assert task.runs == [None, b"half"]


def test_the_relay_hands_over_only_the_latest_checkpoint_and_nothing_after_close() -> None:
    """Checkpoints faster than the loop turns are superseded, not queued;
    one still pending when the run ends is dropped."""
    from fedswarm.daemon.runner import _ProgressRelay

    eff = RunShard("t", "j", 0, 1, "halfway", b"\x80", 2.0, 1, 0, 1.0, 2.0)

    async def main() -> None:
        fed: list[object] = []
        relay = _ProgressRelay(eff, fed.append, trio.lowlevel.current_trio_token())
        relay.offer(0.25, b"a")
        relay.offer(0.5, b"b")  # before the loop took the first
        await trio.testing.wait_all_tasks_blocked()
        assert fed == [ShardProgress("t", "j", 0, 1, 0.5, b"b")]
        relay.offer(0.75, b"c")
        relay.close()  # the run ended before the loop took it
        relay.offer(0.9, b"d")
        await trio.testing.wait_all_tasks_blocked()
        assert fed == [ShardProgress("t", "j", 0, 1, 0.5, b"b")]

    trio.run(main)


def test_a_lost_peers_shard_goes_on_elsewhere_from_its_checkpoint() -> None:
    task = HalfwayTask()

    async def main() -> None:
        net = MemoryNetwork()
        boot = ident(0, 77).peer_id
        async with trio.open_nursery() as nursery:
            agents = []
            for i in range(2):
                agent, _ = _peer(net, i, boot, task)
                await nursery.start(agent.run)
                agents.append(agent)
            cid = ident(600, 77)
            cfg = ClientConfig(lease_s=1.0, verify="none")
            async with open_client(net.add(cid), cid, bootstrap=[boot], config=cfg, seed=5) as client:
                await client.wait_for_peers(2, timeout=30)
                job = await client.submit(JobRequest("halfway", shards=1, params={}, work_s=2.0))
                await until(lambda: client.core.stats["checkpoints"] >= 1, 30)
                (victim,) = [a for a in agents if a.core.leases]
                assert victim.core.stats["checkpoints_sent"] == 1
                net.set_down(victim.core.id, True)  # gone, mid-run, without a word
                victim.stop()
                (out,) = await job.wait(timeout=60)
                other = next(a for a in agents if a is not victim)
                assert out.peer == other.core.id and out.attempt >= 1
                assert out.result == {"shard": 0, "from": "half"}
                assert other.core.stats["shards_resumed"] == 1
                assert client.core.stats["awards_resumed"] >= 1
            task.gate.set()  # the victim's abandoned thread ends
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert task.runs[0] is None and task.runs[-1] == b"half"
