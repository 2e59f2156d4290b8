"""The trio agent driver over the in-memory transport, in virtual time.

Runs under the ``mock_clock`` fixture (``trio.testing.MockClock(autojump_threshold=0)``):
whenever every task is blocked the clock jumps to the next deadline, so lease
timeouts of many seconds take no wall time. trio randomises task order, so these tests
assert properties (every shard delivered once, correct results), not traces.
"""

from __future__ import annotations

import random
from typing import Any

import trio
from trio.testing import MockClock

from fedswarm.client import JobRequest, open_client
from fedswarm.core.config import ClientConfig, PeerConfig
from fedswarm.core.events import RunShard, ShardFinished
from fedswarm.core.peer import PeerCore
from fedswarm.net.memory import MemoryNetwork
from fedswarm.runtime.agent import Agent, TrioClock
from helpers import ident


class VirtualRunner:
    """Runs a shard by waiting its expected run time on trio's clock and
    returning a deterministic function of (job, shard)."""

    def __init__(self, slow: float = 1.0) -> None:
        self.slow = slow
        self.started: list[tuple[str, int]] = []

    async def run_shard(self, eff: RunShard) -> ShardFinished:
        self.started.append((eff.job_id, eff.shard))
        await trio.sleep(eff.run_s * self.slow)
        result = b"%s:%d" % (eff.job_id.encode(), eff.shard * eff.shard)
        return ShardFinished(eff.tenant, eff.job_id, eff.shard, eff.attempt, True, result, run_s=eff.run_s)


def _swarm_config(boot: str) -> PeerConfig:
    return PeerConfig(bootstrap=(boot,), renew_interval_s=1.0, lease_grace_s=6.0)


async def _start_peers(nursery: trio.Nursery, net: MemoryNetwork, n: int, clock: TrioClock) -> list[Agent]:
    ids = [ident(i, 99) for i in range(n)]
    agents = []
    for i, idn in enumerate(ids):
        core = PeerCore(idn, _swarm_config(ids[0].peer_id), random.Random(i))
        agent = Agent(core, net.add(idn), runner=VirtualRunner(), clock=clock)
        await nursery.start(agent.run)
        agents.append(agent)
    return agents


def test_job_completes_with_one_result_per_shard(mock_clock: MockClock) -> None:
    async def main() -> None:
        net = MemoryNetwork()
        clock = TrioClock()
        async with trio.open_nursery() as nursery:
            agents = await _start_peers(nursery, net, 4, clock)
            cid = ident(500, 99)
            cfg = ClientConfig(lease_s=4.0)
            async with open_client(net.add(cid), cid, bootstrap=[agents[0].core.id], config=cfg, clock=clock, seed=1) as client:
                await client.wait_for_peers(4, timeout=30)
                outs = await client.run(JobRequest("sim", shards=12, work_s=2.0), timeout=120)
                assert [o.shard for o in outs] == list(range(12))
                for o in outs:
                    assert o.result == b"%s:%d" % (o.job_id.encode(), o.shard * o.shard)
                assert len({o.peer for o in outs}) >= 2  # the work spread out
            nursery.cancel_scope.cancel()

    trio.run(main, clock=mock_clock)


def test_crashed_peer_shards_are_reauctioned(mock_clock: MockClock) -> None:
    async def main() -> None:
        net = MemoryNetwork()
        clock = TrioClock()
        async with trio.open_nursery() as nursery:
            agents = await _start_peers(nursery, net, 4, clock)
            cid = ident(501, 99)
            cfg = ClientConfig(lease_s=4.0)
            async with open_client(net.add(cid), cid, bootstrap=[agents[0].core.id], config=cfg, clock=clock, seed=2) as client:
                await client.wait_for_peers(4, timeout=30)
                job = await client.submit(JobRequest("sim", shards=16, work_s=5.0))
                # crash the peer that holds the most leases, once it holds some
                while not any(a.core.leases for a in agents):
                    await trio.sleep(0.1)
                victim = max(agents, key=lambda a: len(a.core.leases))
                net.set_down(victim.core.id, True)
                victim.stop()
                outs = await job.wait(timeout=300)
                assert sorted(o.shard for o in outs) == list(range(16))
                assert all(o.peer != victim.core.id or o.attempt == 0 for o in outs)
                assert client.core.stats["leases_lapsed"] >= 1
                assert client.core.stats["shards_delivered"] == 16
            nursery.cancel_scope.cancel()

    trio.run(main, clock=mock_clock)


def test_graceful_leave_hands_back_queued_shards(mock_clock: MockClock) -> None:
    async def main() -> None:
        net = MemoryNetwork()
        clock = TrioClock()
        async with trio.open_nursery() as nursery:
            agents = await _start_peers(nursery, net, 3, clock)
            cid = ident(502, 99)
            async with open_client(net.add(cid), cid, bootstrap=[agents[0].core.id], clock=clock, seed=3) as client:
                await client.wait_for_peers(3, timeout=30)
                job = await client.submit(JobRequest("sim", shards=9, work_s=3.0))
                while not any(len(a.core.leases) >= 2 for a in agents):
                    await trio.sleep(0.1)
                leaver = max(agents, key=lambda a: len(a.core.leases))
                await leaver.leave(grace_s=10.0)
                assert not leaver.core.leases
                assert leaver.core.stats["shards_handed_back"] >= 1
                leaver.stop()
                outs = await job.wait(timeout=300)
                assert sorted(o.shard for o in outs) == list(range(9))
                assert client.core.stats["declines"] >= 1
                assert client.core.stats["leases_lapsed"] == 0  # handed back, not lost
            nursery.cancel_scope.cancel()

    trio.run(main, clock=mock_clock)


class _AddrBook:
    """The real in-memory transport, noting what the agent tells it about
    how to dial peers (``add_peer_addrs``)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.told: dict[str, list[list[str]]] = {}

    def add_peer_addrs(self, peer_id: str, addrs: Any) -> None:
        self.told.setdefault(peer_id, []).append(list(addrs))
        self._inner.add_peer_addrs(peer_id, addrs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def test_the_agent_tells_the_transport_the_addresses_sends_carry(mock_clock: MockClock) -> None:
    async def main() -> None:
        net = MemoryNetwork()
        clock = TrioClock()
        ids = [ident(i, 98) for i in range(2)]
        async with trio.open_nursery() as nursery:
            for i, idn in enumerate(ids):
                cfg = PeerConfig(bootstrap=(ids[0].peer_id,), addrs=(f"/memory/peer-{i}",))
                agent = Agent(PeerCore(idn, cfg, random.Random(i)), net.add(idn), runner=VirtualRunner(), clock=clock)
                await nursery.start(agent.run)
            cid = ident(503, 98)
            book = _AddrBook(net.add(cid))
            async with open_client(book, cid, bootstrap=[ids[0].peer_id], clock=clock, seed=4) as client:
                await client.wait_for_peers(2, timeout=30)
                await client.run(JobRequest("sim", shards=4, work_s=1.0), timeout=120)
            # each peer's address once (it did not change), from its signed state
            assert book.told == {idn.peer_id: [[f"/memory/peer-{i}"]] for i, idn in enumerate(ids)}
            nursery.cancel_scope.cancel()

    trio.run(main, clock=mock_clock)
