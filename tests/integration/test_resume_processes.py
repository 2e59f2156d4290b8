"""Checkpointed re-runs between real daemons: two ``peer start`` processes
on 127.0.0.1 and a client in this process (py-libp2p, torch). A long
tensor-map shard checkpoints as it runs; once the client holds a
checkpoint, the peer running it is killed (SIGKILL: no goodbye), and the
other peer finishes the shard from that checkpoint, with exactly the result
of an uninterrupted run.

Every wait is on an observable condition (a status page, the client's
counters), bounded; nothing sleeps a fixed time to guess readiness.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from fedswarm.client import JobRequest, open_swarm_client
from fedswarm.core.config import ClientConfig
from fedswarm.tasks.tensor_map import TensorMapTask
from fedswarm.testing.localswarm import LocalSwarm, repo_root

pytestmark = pytest.mark.slow

# ~30 ms an iteration on one core of a recent CPU: several seconds a shard,
# long enough to kill its peer mid-run on a slower or busier machine too
PARAMS = {"seed": 21, "size": 1024, "iters": 200}


async def poll(cond, bound: float, what: str) -> None:
    """Wait (polling) until ``cond()`` holds, at most ``bound`` seconds."""
    with trio.move_on_after(bound):
        while not await cond():
            await trio.sleep(0.05)
        return
    raise AssertionError(f"timed out waiting for {what}")


def test_a_killed_peers_shard_resumes_from_its_checkpoint_on_the_other_peer(tmp_path: Path) -> None:
    # leases renewed twice a second, so the client may let them lapse after 3 s
    profile = tmp_path / "cpu-laptop-fast-leases.toml"
    profile.write_text((repo_root() / "peers" / "cpu-laptop.toml").read_text()
                       + "\n[lease]\nrenew_interval_s = 0.5\n")
    task = TensorMapTask()
    est = task.estimate(PARAMS)
    req = JobRequest("tensor-map", shards=1, params=PARAMS, work_s=est.ref_seconds, mem_bytes=est.mem_bytes)
    # verify "none": the client takes checkpoints from untrusted peers; no
    # straggler backups: only the lost lease re-runs the shard
    cfg = ClientConfig(lease_s=3.0, verify="none", straggler_factor=0.0)

    with LocalSwarm(2, tmp_path / "swarm", profile=str(profile)) as swarm:
        async def main():
            async with open_swarm_client([swarm.bootstrap], min_peers=2, config=cfg) as client:
                job = await client.submit(req)
                running = []

                async def running_peer() -> bool:
                    for peer in swarm.peers:
                        st = await trio.to_thread.run_sync(peer.status)
                        if any(lease["state"] == "running" for lease in st["leases"]):
                            running[:] = [peer]
                            return True
                    return False

                async def checkpointed() -> bool:
                    return client.core.stats["checkpoints"] >= 1

                await poll(checkpointed, 60, "the client to hold a checkpoint")
                await poll(running_peer, 10, "the peer running the shard")
                assert not job.finished, "the shard ended before its peer could be killed: make it longer"
                (victim,) = running
                victim.kill()  # SIGKILL mid-run
                (out,) = await job.wait(timeout=120)
                return victim, out, dict(client.core.stats)

        victim, out, stats = trio.run(main)
        (other,) = [p for p in swarm.peers if p is not victim]
        assert out.peer == other.peer_id and out.attempt >= 1
        resumed = other.status()["stats"]
        assert resumed.get("shards_resumed") == 1, resumed
        assert stats["checkpoints"] >= 1 and stats["awards_resumed"] >= 1, stats

    expected = task.run(PARAMS, 0, device="cpu")  # uninterrupted, in this process
    assert out.result == expected
