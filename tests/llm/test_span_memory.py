"""``--blocks auto`` placement run by the real runtime (``keep_placed``:
span loads on torch off the event loop, probes, signed-state adverts) over
the in-memory transport: peers that start together spread over the model,
and when the only holder of some blocks goes down a survivor moves into the
gap and drops its old span once drained."""

from __future__ import annotations

import random

import trio

from fedswarm.core.config import PeerConfig
from fedswarm.core.events import SetSpans
from fedswarm.core.peer import PeerCore
from fedswarm.core.spans import PlacementPolicy
from fedswarm.llm_serving import served_gaps, start_block_server
from fedswarm.net.memory import MemoryNetwork
from fedswarm.runtime.agent import Agent
from helpers import until
from llm_swarm_helpers import ident

POLICY = PlacementPolicy(n_blocks=2, tick_s=0.2, patience_s=1.0, probe_timeout_s=0.5, min_dwell_s=600.0)


def gaps(servers) -> list[int]:
    return served_gaps([{"spans": s.span_rows()} for s in servers], 4)


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
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_generation_through_a_peer_that_moves_keeps_its_tokens(tiny_dir):
    """A keeps itself placed at 0:2 next to B (fixed 2:4) and C (fixed 0:2,
    advertised slow so routes take A). B goes down mid-generation: A loads
    2:4 while its 0:2 still serves the generation's session, the client
    replays 2:4 into A (the same session id, the other span), the tokens are
    the undisturbed ones, and A drops 0:2 once the client closed it."""
    from fedswarm.client import open_client
    from fedswarm.core.wire import Span
    from fedswarm.llm_client import SwarmLLM
    from fedswarm.llm_serving import keep_placed
    from fedswarm.tasks.checkpoint import load_block_span, load_client_head, model_hash
    from fedswarm.tasks.llama import generate_greedy

    n_new = 16
    prompt = list(b"moving spans")
    head = load_client_head(tiny_dir)
    ref = generate_greedy(head, [load_block_span(tiny_dir, 0, 4)], prompt, n_new)
    mhash = model_hash(tiny_dir)

    async def main():
        net = MemoryNetwork()
        ids = [ident(i) for i in range(3)]
        cfg = PeerConfig(bootstrap=(ids[0].peer_id,), gossip_interval_s=0.2)
        async with trio.open_nursery() as nursery:
            servers, cores, transports = [], [], []
            for i, (idn, blocks) in enumerate(zip(ids, ["0:2", "2:4", "0:2"])):
                t = net.add(idn)
                core = PeerCore(idn, cfg, random.Random(i))
                await nursery.start(Agent(core, t).run)
                servers.append(await start_block_server(t, core, tiny_dir, blocks, return_server=True))
                cores.append(core)
                transports.append(t)
            a = servers[0]
            a.core.policy = POLICY  # A places itself, as --blocks auto does
            nursery.start_soon(keep_placed, a, cores[0], transports[0], lambda s, e: load_block_span(tiny_dir, s, e))
            cores[2].handle(0.0, SetSpans((Span(mhash, 0, 2, 1.0),)))
            cid = ident(1000)
            async with open_client(net.add(cid), cid, bootstrap=[ids[0].peer_id], seed=1) as client:
                llm = SwarmLLM(client.agent.transport, lambda: client.core.view.live(client.agent.now()), head,
                               mhash, request_timeout=2.0, route_timeout=20.0)
                await until(lambda: (r := llm.route()) is not None and r[0].peer == ids[0].peer_id
                            and {h.peer for h in llm.hops()} == {i.peer_id for i in ids}, 10.0)

                def on_token(i, tok):
                    if i == 5:
                        net.set_down(ids[1].peer_id)

                res = await llm.generate(prompt, n_new, on_token=on_token)
            assert res.token_ids == ref
            assert [h["blocks"] for h in res.route] == [[0, 2], [2, 4]]
            assert {h["peer"] for h in res.route} == {ids[0].peer_id}  # both hops on A, two spans
            assert any(r["failed"] == ids[1].peer_id for r in res.recoveries)
            await until(lambda: [(r["start"], r["end"]) for r in a.span_rows()] == [(2, 4)], 5.0)
            assert a.span_changes == 1 and a.core.sessions_dropped == 0 and a.sessions == {}
            nursery.cancel_scope.cancel()

    trio.run(main)
