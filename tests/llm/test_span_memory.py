"""``--blocks auto`` placement run by the real runtime (``keep_placed``:
span loads on torch off the event loop, probes, signed-state adverts) over
the in-memory transport: peers that start together spread over the model,
and when the only holder of some blocks goes down a survivor moves into the
gap and drops its old span once drained."""

from __future__ import annotations

import random

import trio

from fedswarm.core.config import PeerConfig
from fedswarm.core.peer import PeerCore
from fedswarm.core.spans import PlacementPolicy
from fedswarm.llm_serving import served_gaps, start_block_server
from fedswarm.net.memory import MemoryNetwork
from fedswarm.runtime.agent import Agent
from llm_swarm_helpers import ident

POLICY = PlacementPolicy(n_blocks=2, tick_s=0.2, patience_s=1.0, probe_timeout_s=0.5, min_dwell_s=600.0)


def gaps(servers) -> list[int]:
    return served_gaps([{"spans": s.span_rows()} for s in servers], 4)


async def until(pred, timeout: float) -> None:
    with trio.fail_after(timeout):
        while not pred():
            await trio.sleep(0.02)


def test_auto_peers_started_together_spread_and_close_a_gap(tiny_dir):
    async def main():
        net = MemoryNetwork()
        ids = [ident(i) for i in range(3)]
        cfg = PeerConfig(bootstrap=(ids[0].peer_id,), gossip_interval_s=0.2)
        async with trio.open_nursery() as nursery:
            servers = []
            for i, idn in enumerate(ids):  # all at once: nobody sees another's span when it picks
                t = net.add(idn)
                core = PeerCore(idn, cfg, random.Random(i))
                await nursery.start(Agent(core, t).run)
                servers.append(await start_block_server(t, core, tiny_dir, "auto", return_server=True,
                                                        nursery=nursery, policy=POLICY))
            await until(lambda: not gaps(servers), 20.0)
            before = [s.span_changes for s in servers]
            lone = next(i for i in range(3) if gaps(servers[:i] + servers[i + 1:]))
            net.set_down(ids[lone].peer_id)
            alive = servers[:lone] + servers[lone + 1:]
            assert gaps(alive)
            await until(lambda: not gaps(alive), 20.0)
            assert sum(s.span_changes for s in alive) > sum(before[i] for i in range(3) if i != lone)
            # the mover's old span had no sessions: it is dropped, one span each remains
            await until(lambda: all(len(s.span_rows()) == 1 for s in alive), 5.0)
            assert sorted((r["start"], r["end"]) for s in alive for r in s.span_rows()) == [(0, 2), (2, 4)]
            assert all(len(s._blocks) == 1 for s in alive)  # the torch span went with it
            # both survivors' probes found the downed peer gone (the mover's first)
            await until(lambda: all(s.core.gone(ids[lone].peer_id) for s in alive), 5.0)
            nursery.cancel_scope.cancel()

    trio.run(main)
