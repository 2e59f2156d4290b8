"""Libp2pTransport on 127.0.0.1: real py-libp2p hosts inside one trio run.

No fixed sleeps for readiness: conditions are polled with a short tick under
a ``trio.fail_after`` bound.
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from typing import Callable

import pytest
import trio
from libp2p.crypto.ed25519 import Ed25519PrivateKey as LibEd25519PrivateKey
from libp2p.peer.id import ID

from fedswarm.core.identity import Identity
from fedswarm.errors import LocalProtocolError, PeerUnreachable, TransportTimeout
from fedswarm.net.libp2p import Libp2pConfig, Libp2pTransport, open_libp2p_transport
from fedswarm.runtime.ports import Incoming

ECHO = "/fedswarm/echo/1.0.0"


async def _until(cond: Callable[[], bool], bound: float = 10.0) -> None:
    with trio.fail_after(bound):
        while not cond():
            await trio.sleep(0.01)


async def _echo(sender: str, data: bytes) -> bytes:
    return sender.encode()[:8] + data


async def _open(stack: AsyncExitStack, n: int, config: Libp2pConfig | None = None,
                **kw) -> list[Libp2pTransport]:
    out = []
    for _ in range(n):
        cfg = config or Libp2pConfig()
        out.append(await stack.enter_async_context(
            open_libp2p_transport(Identity.generate(), config=cfg, **kw)))
    return out


def test_peer_id_matches_identity_and_libp2p_key() -> None:
    ident = Identity.from_seed(b"\x07" * 32)
    lib = LibEd25519PrivateKey.from_bytes(ident.private_bytes())
    assert ID.from_pubkey(lib.get_public_key()).to_base58() == ident.peer_id

    async def main() -> None:
        async with open_libp2p_transport(ident) as t:
            assert t.peer_id == ident.peer_id
            assert t.host.get_id().to_base58() == ident.peer_id
            [addr] = t.listen_addrs()
            assert addr.startswith("/ip4/127.0.0.1/tcp/")
            assert addr.endswith(f"/p2p/{ident.peer_id}")

    trio.run(main)


def test_send_sender_and_stream_reuse() -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            a, b = await _open(stack, 2)
            assert await a.connect(b.listen_addrs()[0]) == b.peer_id
            assert a.connected_peers() == [b.peer_id]
            await _until(lambda: b.connected_peers() == [a.peer_id])
            for i in range(50):
                await a.send(b.peer_id, b"msg-%d" % i)
            for i in range(50):
                with trio.fail_after(5):
                    got = await b.receive()
                assert got == Incoming("direct", a.peer_id, b"msg-%d" % i)
            sa, sb = a.statistics(), b.statistics()
            assert sa.direct_streams_opened == 1 and sa.frames_out == 50
            assert sb.direct_streams_accepted == 1 and sb.frames_in == 50
            assert sb.bytes_in == sa.bytes_out == sum(len(b"msg-%d" % i) for i in range(50))
            # reply path reuses b's own single outbound stream
            await b.send(a.peer_id, b"pong")
            with trio.fail_after(5):
                assert await a.receive() == Incoming("direct", b.peer_id, b"pong")

    trio.run(main)


def test_send_dials_via_peerstore_and_bootstrap() -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            (a,) = await _open(stack, 1)
            b = await stack.enter_async_context(
                open_libp2p_transport(Identity.generate(), bootstrap=a.listen_addrs()))
            assert b.connected_peers() == [a.peer_id]  # bootstrap dialled on open
            (c,) = await _open(stack, 1, Libp2pConfig(dht=False))
            with pytest.raises(PeerUnreachable):  # no address known, no DHT
                await c.send(a.peer_id, b"x")
            c.add_peer_addrs(a.peer_id, a.listen_addrs())
            await c.send(a.peer_id, b"via-peerstore")
            with trio.fail_after(5):
                assert await a.receive() == Incoming("direct", c.peer_id, b"via-peerstore")

    trio.run(main)


def test_dht_finds_address_of_unknown_peer() -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            a, b, c = await _open(stack, 3)
            await a.connect(b.listen_addrs()[0])
            await c.connect(b.listen_addrs()[0])
            # routing tables are filled from connection notifications
            await _until(lambda: a.dht_routing_table_size() >= 1
                         and b.dht_routing_table_size() >= 2)
            assert c.peer_id not in a.connected_peers()
            await a.send(c.peer_id, b"found-you")  # a never learnt c's address
            with trio.fail_after(5):
                assert await c.receive() == Incoming("direct", a.peer_id, b"found-you")
            s = a.statistics()
            assert s.dht_lookups == 1 and s.dht_found == 1

    trio.run(main)


def test_request_response_reuse_and_concurrency() -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            a, b = await _open(stack, 2)
            b.set_request_handler(ECHO, _echo)
            await a.connect(b.listen_addrs()[0])
            for i in range(30):
                resp = await a.request(b.peer_id, ECHO, b"r%d" % i, timeout=5)
                assert resp == a.peer_id.encode()[:8] + b"r%d" % i
            assert a.statistics().request_streams_opened == 1  # one pooled stream
            assert b.statistics().requests_in == 30

            arrived = 0
            all_in = trio.Event()

            async def gated(sender: str, data: bytes) -> bytes:
                nonlocal arrived
                arrived += 1
                if arrived == 8:
                    all_in.set()
                await all_in.wait()  # only completes if 8 requests are in flight at once
                return data * 2

            b.set_request_handler("/fedswarm/gated/1", gated)
            results: dict[int, bytes] = {}

            async def one(i: int) -> None:
                results[i] = await a.request(b.peer_id, "/fedswarm/gated/1", b"%03d" % i, timeout=10)

            async with trio.open_nursery() as n:
                for i in range(8):
                    n.start_soon(one, i)
            assert results == {i: (b"%03d" % i) * 2 for i in range(8)}
            # idle streams are pooled: a second concurrent wave opens no new stream
            before = a.statistics().request_streams_opened
            arrived, all_in = 0, trio.Event()
            async with trio.open_nursery() as n:
                for i in range(8):
                    n.start_soon(one, i)
            assert a.statistics().request_streams_opened == before

    trio.run(main)


def test_request_timeout_handler_failure_and_unknown_protocol() -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            a, b = await _open(stack, 2)
            release = trio.Event()

            async def slow(sender: str, data: bytes) -> bytes:
                await release.wait()
                return b"late"

            async def broken(sender: str, data: bytes) -> bytes:
                raise RuntimeError("handler bug")

            b.set_request_handler("/fedswarm/slow/1", slow)
            b.set_request_handler("/fedswarm/broken/1", broken)
            b.set_request_handler(ECHO, _echo)
            await a.connect(b.listen_addrs()[0])
            with pytest.raises(TransportTimeout):
                await a.request(b.peer_id, "/fedswarm/slow/1", b"x", timeout=0.2)
            release.set()
            assert a.statistics().request_timeouts == 1
            with pytest.raises(PeerUnreachable):
                await a.request(b.peer_id, "/fedswarm/broken/1", b"x", timeout=5)
            with pytest.raises(PeerUnreachable):
                await a.request(b.peer_id, "/fedswarm/nobody/1", b"x", timeout=5)
            # the connection is fine afterwards
            assert await a.request(b.peer_id, ECHO, b"ok", timeout=5) == a.peer_id.encode()[:8] + b"ok"
            with pytest.raises(LocalProtocolError):
                b.set_request_handler("/other/1", _echo)

    trio.run(main)


def test_oversize_frame_rejected_then_transport_still_works() -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            (a,) = await _open(stack, 1, Libp2pConfig(max_frame=1 << 20))
            (b,) = await _open(stack, 1, Libp2pConfig(max_frame=64 * 1024))
            b.set_request_handler(ECHO, _echo)
            await a.connect(b.listen_addrs()[0])
            await a.send(b.peer_id, b"small-1")
            with trio.fail_after(5):
                assert (await b.receive()).data == b"small-1"
            # a's limit allows it, b's refuses: b resets the stream, counts it
            await a.send(b.peer_id, b"Z" * (200 * 1024))
            # a may lose the race and retry the big frame once on a fresh stream
            # (its write failed mid-frame): wait until every stream a opened was
            # refused by b and reset, whatever the count.

            def settled() -> bool:
                sa, sb = a.statistics(), b.statistics()
                return (sb.oversize_rejected >= 1
                        and sb.oversize_rejected == sa.direct_streams_opened
                        and sa.direct_streams_broken == sb.oversize_rejected)

            await _until(settled)
            opened = a.statistics().direct_streams_opened
            await a.send(b.peer_id, b"small-2")
            with trio.fail_after(5):
                assert await b.receive() == Incoming("direct", a.peer_id, b"small-2")
            assert a.statistics().direct_streams_opened == opened + 1
            # oversize request: stream reset -> PeerUnreachable, then requests work
            rejected = b.statistics().oversize_rejected
            with pytest.raises(PeerUnreachable):
                await a.request(b.peer_id, ECHO, b"Q" * (100 * 1024), timeout=5)
            assert b.statistics().oversize_rejected == rejected + 1
            assert await a.request(b.peer_id, ECHO, b"q", timeout=5) == a.peer_id.encode()[:8] + b"q"
            # locally oversize: refused before anything is written
            with pytest.raises(LocalProtocolError):
                await b.send(a.peer_id, b"x" * (64 * 1024 + 1))
            assert b.connected_peers() == [a.peer_id]

    trio.run(main)


def test_pubsub_reaches_other_subscribers_not_self() -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            a, b, c = await _open(stack, 3)
            await b.connect(a.listen_addrs()[0])
            await c.connect(a.listen_addrs()[0])
            await c.connect(b.listen_addrs()[0])
            for t in (a, b, c):
                await t.subscribe("fedswarm/test")
            others = {t.peer_id: {o.peer_id for o in (a, b, c) if o is not t} for t in (a, b, c)}
            # full mesh among 3 peers (D_low=4 > 2 candidates, so all are grafted)
            await _until(lambda: all(set(t.mesh_peers("fedswarm/test")) == others[t.peer_id]
                                     for t in (a, b, c)), bound=10)
            await a.publish("fedswarm/test", b"hello-mesh")
            await b.publish("fedswarm/test", b"from-b")
            with trio.fail_after(5):
                assert await b.receive() == Incoming("pubsub", a.peer_id, b"hello-mesh", "fedswarm/test")
            with trio.fail_after(5):  # two publishers: arrival order is not defined
                got_c = {await c.receive(), await c.receive()}
            assert got_c == {Incoming("pubsub", a.peer_id, b"hello-mesh", "fedswarm/test"),
                             Incoming("pubsub", b.peer_id, b"from-b", "fedswarm/test")}
            with trio.fail_after(5):
                got = await a.receive()  # a gets b's message, never its own
            assert got == Incoming("pubsub", b.peer_id, b"from-b", "fedswarm/test")
            with trio.move_on_after(0.3):  # nothing else (own publication) arrives
                extra = await a.receive()
                raise AssertionError(f"unexpected {extra}")
            assert a.statistics().pubsub_in == 1 and a.statistics().pubsub_out == 1
            gs = a.gossipsub
            assert (gs.degree, gs.degree_low, gs.degree_high, gs.heartbeat_interval) == (6, 4, 12, 1.0)

    trio.run(main)


def test_dead_peer_is_unreachable() -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            (a,) = await _open(stack, 1)
            ident = Identity.generate()
            async with open_libp2p_transport(ident) as dead:
                addrs = dead.listen_addrs()
                dead.set_request_handler(ECHO, _echo)
                await a.connect(addrs[0])
                assert await a.request(ident.peer_id, ECHO, b"hi", timeout=5)
            # dead is closed now (listener and connections gone)
            await _until(lambda: ident.peer_id not in a.connected_peers())
            with pytest.raises((PeerUnreachable, TransportTimeout)):
                await a.request(ident.peer_id, ECHO, b"hi", timeout=5)
            with pytest.raises((PeerUnreachable, TransportTimeout)):
                await a.send(ident.peer_id, b"hi")
            with pytest.raises((PeerUnreachable, TransportTimeout)):
                await a.connect(addrs[0])
            assert a.statistics().send_failures >= 1

    trio.run(main)
