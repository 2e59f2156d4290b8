"""Server-to-server forwarding (a decode step travels peer to peer along a
route the client signed) and the bad input a serving peer refuses.

Forwarded generations must give the tokens of client-driven ones, also when
a hop dies or refuses mid-generation (the client then drives that hop
itself and replays the cache on a replacement). A route that names peers
outside the view, loops or skips blocks, a forged or expired delegation, a
hidden state of the wrong shape or dtype, and a session id reused by another
client or tenant are refused with typed errors and counted, and the peer
goes on serving."""

from __future__ import annotations

import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import pytest
import torch
import trio

from fedswarm.llm_client import SwarmLLM, _inbox_of
from fedswarm.llm_protocol import (
    ERROR_CODES,
    OP_KEYS,
    BadHidden,
    DelegationRefused,
    RouteRefused,
    WireError,
    check_delegation,
    decode,
    encode,
    pack_tensor,
    sign_delegation,
    unpack_tensor,
)
from fedswarm.llm_serving import BlockServer
from fedswarm.net.memory import MemoryNetwork
from fedswarm.tasks.checkpoint import load_block_span, load_client_head, model_hash
from fedswarm.tasks.tokenizer import ByteTokenizer
from helpers import until
from llm_swarm_helpers import ident, memory_swarm

PROMPT = ByteTokenizer().encode("Hello, swarm!")
N_NEW = 14


@asynccontextmanager
async def forwarding_swarm(model_dir: Any, blocks: list[str], *, libp2p: bool = False) -> AsyncIterator[Any]:
    """The shared in-memory swarm (``libp2p``: on py-libp2p) with forwarding
    on, and beside its ``fwd`` client a ``plain`` (client-driven) one on the
    same transport."""
    async with memory_swarm(model_dir, blocks, forwarding=True, libp2p=libp2p, spot_check_rate=0.0,
                            request_timeout=5.0) as s:
        c = s.client
        plain = SwarmLLM(c.agent.transport, lambda: c.core.view.live(c.agent.now()), load_client_head(model_dir),
                         model_hash(model_dir), spot_check_rate=0.0, request_timeout=5.0, forward=False)
        yield {"net": s.net, "servers": s.servers, "ids": s.peer_ids, "fwd": s.llm, "plain": plain}


async def views_complete(s: dict[str, Any]) -> None:
    """Until every serving peer's view holds the others (a peer refuses a
    route naming a peer it has not heard of yet: the client would then
    drive the hops itself and the counts below would not be the point)."""
    await s["fwd"].wait_route()
    with trio.fail_after(10):
        while not all(p in srv.view_peers() for srv in s["servers"] for p in s["ids"] if p != srv.self_id):
            await trio.sleep(0.02)  # gossip rounds; as SwarmLLM.wait_route polls its view


def _server_of(s: dict[str, Any], peer: str) -> BlockServer:
    return s["servers"][s["ids"].index(peer)]


def test_forwarded_tokens_equal_client_driven(tiny_dir):
    async def main():
        async with forwarding_swarm(tiny_dir, ["0:1", "1:3", "3:4"]) as s:
            await views_complete(s)
            ref = await s["plain"].generate(PROMPT, N_NEW, greedy=True)
            assert s["plain"].forward_stats["steps"] == 0
            got = await s["fwd"].generate(PROMPT, N_NEW, greedy=True)
            assert got.token_ids == ref.token_ids and got.recoveries == []
            st = s["fwd"].forward_stats
            # every decode step but the first token's (the prefill) went peer to peer
            assert st["steps"] == st["complete"] == N_NEW - 1, st
            first, mid, last = s["servers"]
            assert first.forwarding["forwarded"] == mid.forwarding["forwarded"] == N_NEW - 1
            # the last hop sends the client every hop's output in one message
            assert last.forwarding["pushed"] == N_NEW - 1 and last.forwarding["forwarded"] == 0
            assert first.forwarding["pushed"] == mid.forwarding["pushed"] == 0
            assert all(srv.sessions == {} for srv in s["servers"])  # the client closed them

    trio.run(main)


def test_forwarded_steps_leave_from_the_worker_thread_on_lanes(tiny_dir):
    """Over real py-libp2p transports with direct lanes, each hop's worker
    thread writes the step's output to the next hop (and the last hop's to
    the client) the moment its forward ends. The tokens are those of the
    client-driven run, and once the lanes are up every forwarded step and
    push went that way."""

    async def main():
        async with forwarding_swarm(tiny_dir, ["0:1", "1:3", "3:4"], libp2p=True) as s:
            await views_complete(s)
            ref = await s["plain"].generate(PROMPT, N_NEW, greedy=True)
            first, mid, last = s["servers"]
            fwd = s["fwd"]

            async def settled() -> list[dict[str, int]]:
                """The servers' counters once every forwarded step so far
                has been answered (they count after the answer)."""
                await until(lambda: first.forwarding["forwarded"] == mid.forwarding["forwarded"]
                            == last.forwarding["pushed"] == fwd.forward_stats["complete"])
                return [dict(srv.forwarding) for srv in s["servers"]]

            # the client's and the peers' lanes to each other are up
            with trio.fail_after(10):
                while not (first.transport.lanes_live() >= 2 and mid.transport.lanes_live() >= 2
                           and last.transport.lanes_live() >= 2):
                    await fwd.generate(PROMPT, 2, greedy=True)
            before = await settled()
            got = await fwd.generate(PROMPT, N_NEW, greedy=True)
            assert got.token_ids == ref.token_ids and got.recoveries == []
            d = [{k: v - b[k] for k, v in now.items()} for now, b in zip(await settled(), before)]
            assert d[0]["forwarded"] == d[1]["forwarded"] == d[2]["pushed"] == N_NEW - 1, d
            assert [x["from_worker"] for x in d] == [N_NEW - 1] * 3, d
            assert all(x["forward_failures"] == x["push_failures"] == 0 for x in d), d

    trio.run(main)


def test_forwarded_steps_feed_the_route_book(tiny_dir):
    """A client that only forwards its decode steps learns every route
    peer's round trip from them (its prefill, several positions at once,
    measures none): estimates that add up to no more than a forwarded step
    took, the first hop's from its own answers."""

    async def main():
        async with forwarding_swarm(tiny_dir, ["0:1", "1:3", "3:4"]) as s:
            await views_complete(s)
            fwd = s["fwd"]
            assert fwd.book.rtt == {}
            got = await fwd.generate(PROMPT, N_NEW, greedy=True)
            assert fwd.forward_stats["complete"] == N_NEW - 1
            route = [h["peer"] for h in got.route]
            assert set(fwd.book.rtt) == set(route)
            assert all(fwd.book.rtt[p] > 0 for p in route)
            assert sum(fwd.book.rtt[p] for p in route) <= max(got.step_times)
            # the plain client drove no decode step here: its book is still empty
            assert s["plain"].book.rtt == {}

    trio.run(main)


def test_dead_next_hop_falls_back_and_replays(tiny_dir):
    """The route's second hop goes down after 5 tokens: the first hop cannot
    pass the step on and says so; the client drives that hop itself, bans it,
    replays the session's inputs on the other 2:4 peer and goes on
    forwarding along the new chain, with the undisturbed run's tokens."""

    async def main():
        async with forwarding_swarm(tiny_dir, ["0:2", "2:4", "2:4"]) as s:
            await views_complete(s)
            ref = await s["fwd"].generate(PROMPT, N_NEW, greedy=True)
            killed: list[str] = []

            def kill(i: int, tok: int) -> None:
                if i == 5:
                    (sess,) = s["fwd"].active
                    killed.append(sess.hops[1].hop.peer)
                    s["net"].set_down(killed[0])

            before = dict(s["fwd"].forward_stats)
            got = await s["fwd"].generate(PROMPT, N_NEW, greedy=True, on_token=kill)
            assert got.token_ids == ref.token_ids
            assert [r["failed"] for r in got.recoveries] == [killed[0]]
            st = {k: v - before[k] for k, v in s["fwd"].forward_stats.items()}
            assert st["fallbacks"] == 1 and st["complete"] == N_NEW - 2, st
            first = s["servers"][0]
            assert first.forwarding["forward_failures"] == first.forwarding["pushed"] == 1
            survivor = next(p for p in s["ids"][1:] if p != killed[0])
            assert _server_of(s, survivor).forwarding["pushed"] >= N_NEW - 7

    trio.run(main)


def test_refusing_next_hop_falls_back(tiny_dir):
    """The middle hop stops seeing the last one in its view: it refuses the
    forwarded steps (unknown-peer), the first hop tells the client, and the
    client drives the rest of the chain itself: same tokens."""

    async def main():
        async with forwarding_swarm(tiny_dir, ["0:1", "1:3", "3:4"]) as s:
            await views_complete(s)
            ref = await s["plain"].generate(PROMPT, N_NEW, greedy=True)
            mid = s["servers"][1]

            def blind(i: int, tok: int) -> None:
                if i == 4:
                    mid.view_peers = lambda: {s["ids"][0]}

            got = await s["fwd"].generate(PROMPT, N_NEW, greedy=True, on_token=blind)
            assert got.token_ids == ref.token_ids and got.recoveries == []
            st = s["fwd"].forward_stats
            assert st["complete"] == 4 and st["fallbacks"] == N_NEW - 5, st
            assert mid.stats.by_error["unknown-peer"] == N_NEW - 5
            assert mid.forwarding["refused"] == N_NEW - 5

    trio.run(main)


# ----------------------------------------------------------------- bad input

SID = bytes(range(16))


@pytest.fixture(scope="module")
def span02(tiny_dir):
    return load_block_span(tiny_dir, 0, 2)


def test_bad_input_is_refused_typed_and_counted(span02, tiny_dir):
    net = MemoryNetwork()
    me, nxt, client, other = (ident(i) for i in (50, 51, 52, 53))
    mh = model_hash(tiny_dir)
    srv = BlockServer(span02, mh, self_id=me.peer_id, transport=net.add(me),
                      view_peers=lambda: {nxt.peer_id})
    x = torch.randn(1, 64)

    def fwd(sid=SID, pos=0, hidden=x, **extra):
        return {"v": 1, "op": "forward", "model": mh, "span": [0, 2], "session": sid, "pos": pos,
                "max_length": 32, "hidden": pack_tensor(hidden) if isinstance(hidden, torch.Tensor) else hidden,
                **extra}

    def routed(route, *, signed_for=SID, expires=None):
        d = sign_delegation(client, signed_for, mh, route, time.time() + 60 if expires is None else expires)
        return fwd(route=d.wire())

    def call(msg, sender=client.peer_id):
        return decode(trio.run(srv.handle, sender, encode(msg)))

    good = [(me.peer_id, 0, 2), (nxt.peer_id, 2, 4)]
    forged = routed(good)
    forged["route"]["route"][1][0] = other.peer_id
    cases = {
        "unknown-peer": [routed([(me.peer_id, 0, 2), (other.peer_id, 2, 4)])],  # outside the view
        "bad-route": [
            routed([(me.peer_id, 0, 2), (nxt.peer_id, 2, 3), (me.peer_id, 3, 4)]),  # loops
            routed([(me.peer_id, 0, 2), (nxt.peer_id, 3, 4)]),  # skips block 2
            routed([(me.peer_id, 0, 2), (nxt.peer_id, 1, 4)]),  # overlaps
            routed([(me.peer_id, 0, 2)]),  # stops short of block 4
            routed([(nxt.peer_id, 0, 2), (other.peer_id, 2, 4)]),  # this peer is not on it
        ],
        "bad-delegation": [
            forged,  # the route changed after signing
            routed(good, expires=time.time() - 1),
            routed(good, signed_for=bytes(16)),  # signed for another session
            fwd(route={"client": client.peer_id}),
        ],
        "bad-request": [fwd(hidden=torch.randn(1, 63)),  # wrong shape
                        fwd(hidden={"dtype": "float64", "shape": [1, 64], "data": bytes(512)}),  # dtypes that cannot travel
                        fwd(hidden={"dtype": "int8", "shape": [1, 64], "data": bytes(64)}),
                        fwd(hidden=torch.full((1, 64), float("nan"))),
                        {**routed(good), "outs": [pack_tensor(x)]}],  # the first hop gets no earlier outputs
    }
    for code, msgs in cases.items():
        for m in msgs:
            r = call(m)
            assert r["ok"] is False and r["error"] == code, (code, r)
    # sent by a peer that is not the route's previous hop (nor the client)
    assert call(routed(good), sender=other.peer_id)["error"] == "bad-route"
    # a session id reused by another tenant (same client) or another client
    assert call(fwd(tenant="alice"))["ok"] is True
    assert call(fwd(pos=1, tenant="bob"))["error"] == "session-conflict"
    assert call(fwd(), sender=other.peer_id)["error"] == "session-conflict"
    assert call({"v": 1, "op": "step", "model": mh, "span": [0, 2], "sessions": [SID, bytes(16)], "pos": [1, 0],
                 "max_length": [32, 32], "hidden": pack_tensor(torch.randn(2, 64)), "tenant": "bob"}
                ) == {"ok": False, "error": "session-conflict", "index": 0,
                      "detail": "this session belongs to another tenant"}
    # the peer still serves everyone: the session goes on, another client opens one
    r = call(fwd(pos=1, tenant="alice"))
    assert r["ok"] is True and r["length"] == 2
    assert call(fwd(sid=bytes(16)), sender=other.peer_id)["ok"] is True
    by = srv.stats.by_error
    assert by["unknown-peer"] == 1 and by["bad-route"] == 6 and by["bad-delegation"] == 4
    assert by["bad-request"] == 5 and by["session-conflict"] == 3
    assert srv.forwarding["refused"] == sum(by[c] for c in ("unknown-peer", "bad-route", "bad-delegation",
                                                            "bad-request", "session-conflict"))
    assert set(by) <= set(ERROR_CODES)
    # the errors are typed: RemoteProtocolErrors by family
    with pytest.raises(RouteRefused):
        check_delegation(routed([(me.peer_id, 0, 2), (nxt.peer_id, 3, 4)])["route"], num_layers=4, now=time.time())
    with pytest.raises(DelegationRefused):
        check_delegation(forged["route"], num_layers=4, now=time.time())
    with pytest.raises(BadHidden):
        unpack_tensor({"dtype": "int8", "shape": [1], "data": b"\0"})
    assert issubclass(RouteRefused, WireError)


def test_client_refuses_outputs_it_did_not_ask_for():
    """The client's inbox takes a forwarded step's outputs only from the hop
    its route names (the last, or the one before a failed hop), for the
    position it waits for, one output per earlier hop."""
    from fedswarm.llm_client import _Expect

    net = MemoryNetwork()
    box = _inbox_of(net.add(ident(60)))
    box.expects[SID] = _Expect(5, (("hop-a", 0, 1), ("hop-b", 1, 3), ("hop-c", 3, 4)), 64)

    def h(n=64):
        return pack_tensor(torch.randn(1, n))

    def out(sender, **kw):
        m = {"v": 1, "op": "out", "model": "m", "session": SID, "span": [3, 4], "pos": 5, "hidden": h(),
             "outs": [h(), h()], **kw}
        return decode(trio.run(box.handle, sender, encode(m)))

    assert out("mallory")["ok"] is False  # not the route's hop
    assert out("hop-b")["ok"] is False  # the last hop sends the outputs
    assert out("hop-c", pos=6)["ok"] is False  # another position
    assert out("hop-c", hidden=h(65))["ok"] is False
    assert out("hop-c", outs=[h()])["ok"] is False  # one output per earlier hop
    assert out("hop-c", session=bytes(16))["error"] == "unknown-session"
    assert box.refused == 6 and box.expects[SID].got == {}
    assert out("hop-c")["ok"] is True and set(box.expects[SID].got) == {(1, 3), (3, 4)}
    assert box.expects[SID].ev.is_set()
    # the hop before a failed one reports it with the outputs so far
    box.expects[SID] = _Expect(5, (("hop-a", 0, 1), ("hop-b", 1, 3), ("hop-c", 3, 4)), 64)
    failed = {"error": "forward-failed", "detail": "transport: gone"}
    r = decode(trio.run(box.handle, "hop-b", encode({"v": 1, "op": "out", "model": "m", "session": SID,
                                                      "span": [3, 4], "pos": 5, "outs": [h(), h()], **failed})))
    assert r["ok"] is True and set(box.expects[SID].got) == {(1, 3)} and box.expects[SID].error
    assert OP_KEYS["out"] == {"v", "op", "model", "session", "span", "pos"}
