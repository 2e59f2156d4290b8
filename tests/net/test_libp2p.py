"""Libp2pTransport on 127.0.0.1: real py-libp2p hosts inside one trio run.

What only this transport does (libp2p keys, stream reuse and pooling, the
peerstore, the DHT, a peer's refusal of an oversize frame, gossipsub's
settings). What every transport does is in test_transport_contract.py, run
against this one too.

No fixed sleeps for readiness: conditions are polled with a short tick under
a ``trio.fail_after`` bound.
"""

from __future__ import annotations

from contextlib import AsyncExitStack

import pytest
import trio
from libp2p.crypto.ed25519 import Ed25519PrivateKey as LibEd25519PrivateKey
from libp2p.peer.id import ID

from helpers import until
from fedswarm.core.identity import Identity
from fedswarm.errors import LocalProtocolError, PeerUnreachable, TransportTimeout
from fedswarm.net.libp2p import Libp2pConfig, Libp2pTransport, open_libp2p_transport
from fedswarm.runtime.ports import Incoming

ECHO = "/fedswarm/echo/1.0.0"


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
            assert t.host.get_id().to_base58() == ident.peer_id
            [addr] = t.listen_addrs()
            assert addr.startswith("/ip4/127.0.0.1/tcp/")

    trio.run(main)


def test_send_reuses_one_stream_each_way() -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            a, b = await _open(stack, 2)
            await a.connect(b.listen_addrs()[0])
            for i in range(50):
                await a.send(b.peer_id, b"msg-%d" % i)
            for i in range(50):
                with trio.fail_after(5):
                    await b.receive()
            assert a.statistics().direct_streams_opened == 1
            assert b.statistics().direct_streams_accepted == 1
            # the reply goes over b's own single outbound stream
            await b.send(a.peer_id, b"pong")
            with trio.fail_after(5):
                await a.receive()
            assert b.statistics().direct_streams_opened == 1

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
            await until(lambda: a.dht_routing_table_size() >= 1
                         and b.dht_routing_table_size() >= 2)
            assert c.peer_id not in a.connected_peers()
            await a.send(c.peer_id, b"found-you")  # a never learnt c's address
            with trio.fail_after(5):
                assert await c.receive() == Incoming("direct", a.peer_id, b"found-you")
            s = a.statistics()
            assert s.dht_lookups == 1 and s.dht_found == 1

    trio.run(main)


def test_request_streams_are_pooled() -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            a, b = await _open(stack, 2)
            b.set_request_handler(ECHO, _echo)
            await a.connect(b.listen_addrs()[0])
            for i in range(30):
                await a.request(b.peer_id, ECHO, b"r%d" % i, timeout=5)
            assert a.statistics().request_streams_opened == 1  # one pooled stream

            arrived = 0
            all_in = trio.Event()

            async def gated(sender: str, data: bytes) -> bytes:
                nonlocal arrived
                arrived += 1
                if arrived == 8:
                    all_in.set()
                await all_in.wait()  # only completes if 8 requests are in flight at once
                return data

            b.set_request_handler("/fedswarm/gated/1", gated)

            async def wave() -> None:
                async with trio.open_nursery() as n:
                    for i in range(8):
                        n.start_soon(lambda i=i: a.request(b.peer_id, "/fedswarm/gated/1", b"%d" % i, timeout=10))

            await wave()
            # idle streams are pooled: a second concurrent wave opens no new stream
            before = a.statistics().request_streams_opened
            arrived, all_in = 0, trio.Event()
            await wave()
            assert a.statistics().request_streams_opened == before

    trio.run(main)


def test_small_answers_batch_their_yamux_credit_and_bulk_still_flows() -> None:
    """A reader gives its sender credit back once 64 KiB were read, not
    after every read (py-libp2p's own rule: a WINDOW_UPDATE frame for nearly
    every small answer); 8 MiB of 1 MiB frames still arrive whole."""

    async def main() -> None:
        async with AsyncExitStack() as stack:
            a, b = await _open(stack, 2)
            answer = bytes(2400)  # one SmolLM2 hidden state

            async def big(sender: str, data: bytes) -> bytes:
                return answer if data == b"small" else bytes(int(data))

            b.set_request_handler(ECHO, big)
            await a.connect(b.listen_addrs()[0])
            await a.request(b.peer_id, ECHO, b"small", timeout=5)
            (fs,) = a._idle[(b.peer_id, ECHO)]
            ys = fs.stream.muxed_stream  # the client's end of the pooled yamux stream
            owed = lambda: ys.target_recv_window - ys.recv_window  # read, not yet credited  # noqa: E731
            start = owed()
            for _ in range(20):  # 48 kB of answers: under 64 KiB, no credit yet
                await a.request(b.peer_id, ECHO, b"small", timeout=5)
            assert owed() - start == 20 * (4 + len(answer))
            for _ in range(20):  # past 64 KiB: credited
                await a.request(b.peer_id, ECHO, b"small", timeout=5)
            assert owed() < 64 * 1024
            for _ in range(8):
                assert len(await a.request(b.peer_id, ECHO, str(1 << 20).encode(), timeout=20)) == 1 << 20
            with pytest.raises(LocalProtocolError):
                async with open_libp2p_transport(Identity.generate(), config=Libp2pConfig(yamux_credit_bytes=0)):
                    pass

    trio.run(main)


def test_request_timeouts_are_counted_and_protocol_names_checked() -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            a, b = await _open(stack, 2)

            async def slow(sender: str, data: bytes) -> bytes:
                await trio.sleep_forever()
                return b""

            b.set_request_handler("/fedswarm/slow/1", slow)
            await a.connect(b.listen_addrs()[0])
            with pytest.raises(TransportTimeout):
                await a.request(b.peer_id, "/fedswarm/slow/1", b"x", timeout=0.2)
            assert a.statistics().request_timeouts == 1
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

            await until(settled)
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
            assert b.connected_peers() == [a.peer_id]

    trio.run(main)


def test_gossipsub_settings_and_pubsub_counters() -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            a, b = await _open(stack, 2)
            await b.connect(a.listen_addrs()[0])
            for t in (a, b):
                await t.subscribe("fedswarm/test")
            await until(lambda: a.mesh_peers("fedswarm/test") == [b.peer_id]
                         and b.mesh_peers("fedswarm/test") == [a.peer_id])
            await b.publish("fedswarm/test", b"from-b")
            with trio.fail_after(5):
                await a.receive()
            await a.publish("fedswarm/test", b"from-a")
            with trio.fail_after(5):
                await b.receive()
            assert (a.statistics().pubsub_in, a.statistics().pubsub_out) == (1, 1)
            gs = a.gossipsub
            assert (gs.degree, gs.degree_low, gs.degree_high, gs.heartbeat_interval) == (6, 4, 12, 1.0)

    trio.run(main)
