"""MemoryNetwork / MemoryTransport: the in-process Transport used by tests."""

from __future__ import annotations

import pytest
import trio

from fedswarm.core.identity import Identity
from fedswarm.errors import LocalProtocolError, PeerUnreachable, TransportTimeout
from fedswarm.net.memory import MemoryNetwork, MemoryTransport
from fedswarm.runtime.ports import Incoming


def _ident(i: int) -> Identity:
    return Identity.from_seed(bytes([i]) * 32)


def _net(n: int, **kw) -> tuple[MemoryNetwork, list[MemoryTransport]]:
    net = MemoryNetwork(**kw)
    return net, [net.add(_ident(i + 1)) for i in range(n)]


def test_addresses_connect_and_peer_ids() -> None:
    async def main() -> None:
        net, (a, b) = _net(2)
        assert a.peer_id == _ident(1).peer_id
        [addr] = b.listen_addrs()
        assert addr.startswith("/memory/") and addr.endswith(f"/p2p/{b.peer_id}")
        assert a.connected_peers() == []
        assert await a.connect(addr) == b.peer_id
        assert a.connected_peers() == [b.peer_id]
        assert b.connected_peers() == [a.peer_id]
        with pytest.raises(PeerUnreachable):
            await a.connect("/memory/99/p2p/" + b.peer_id)
        with pytest.raises(PeerUnreachable):
            await a.connect("/ip4/1.2.3.4/tcp/1")
        a.add_peer_addrs(b.peer_id, [addr])  # accepted, harmless

    trio.run(main)


def test_send_delivers_in_order_with_sender() -> None:
    async def main() -> None:
        net, (a, b) = _net(2)
        for i in range(10):
            await a.send(b.peer_id, b"m%d" % i)
        for i in range(10):
            assert await b.receive() == Incoming("direct", a.peer_id, b"m%d" % i)
        s = a.statistics()
        assert (s.frames_out, s.bytes_out) == (10, 20)
        assert b.statistics().frames_in == 10
        assert a.connected_peers() == [b.peer_id]

    trio.run(main)


def test_pubsub_reaches_other_subscribers_only() -> None:
    async def main() -> None:
        net, (a, b, c, d) = _net(4)
        for t in (a, b, c):
            await t.subscribe("jobs")
        await a.publish("jobs", b"hello")
        for t in (b, c):
            assert await t.receive() == Incoming("pubsub", a.peer_id, b"hello", "jobs")
        # not delivered to the publisher itself, nor to a non-subscriber
        await a.send(a.peer_id, b"marker")
        assert (await a.receive()).data == b"marker"
        d_msgs = []
        with trio.move_on_after(0):
            d_msgs.append(await d.receive())
        assert d_msgs == []

    trio.run(main)


def test_request_response_and_concurrency() -> None:
    async def main() -> None:
        net, (a, b) = _net(2)
        arrived = 0
        all_in = trio.Event()

        async def handler(sender: str, data: bytes) -> bytes:
            nonlocal arrived
            assert sender == a.peer_id
            arrived += 1
            if arrived == 10:
                all_in.set()
            await all_in.wait()  # proves the 10 requests run concurrently
            return data.upper()

        b.set_request_handler("/fedswarm/echo/1", handler)
        results: dict[int, bytes] = {}

        async def one(i: int) -> None:
            results[i] = await a.request(b.peer_id, "/fedswarm/echo/1", b"req%d" % i, timeout=5)

        async with trio.open_nursery() as n:
            for i in range(10):
                n.start_soon(one, i)
        assert results == {i: b"REQ%d" % i for i in range(10)}
        with pytest.raises(PeerUnreachable):
            await a.request(b.peer_id, "/fedswarm/none/1", b"", timeout=1)

    trio.run(main)


def test_request_timeout_and_failing_handler() -> None:
    async def main() -> None:
        net, (a, b) = _net(2)

        async def slow(sender: str, data: bytes) -> bytes:
            await trio.sleep_forever()
            return b""

        async def broken(sender: str, data: bytes) -> bytes:
            raise RuntimeError("boom")

        b.set_request_handler("/fedswarm/slow/1", slow)
        b.set_request_handler("/fedswarm/broken/1", broken)
        with pytest.raises(TransportTimeout):
            await a.request(b.peer_id, "/fedswarm/slow/1", b"x", timeout=0.05)
        with pytest.raises(PeerUnreachable):
            await a.request(b.peer_id, "/fedswarm/broken/1", b"x", timeout=1)

    trio.run(main)


def test_set_down_drop_and_overflow() -> None:
    async def main() -> None:
        net, (a, b, c) = _net(3, inbox_size=2)

        async def echo(sender: str, data: bytes) -> bytes:
            return data

        b.set_request_handler("/fedswarm/echo/1", echo)
        net.set_down(b.peer_id, True)
        with pytest.raises(PeerUnreachable):
            await a.send(b.peer_id, b"x")
        with pytest.raises(PeerUnreachable):
            await a.request(b.peer_id, "/fedswarm/echo/1", b"x", timeout=1)
        with pytest.raises(PeerUnreachable):
            await b.send(a.peer_id, b"x")  # a down peer cannot send either
        assert a.statistics().send_failures == 2
        net.set_down(b.peer_id, False)
        assert await a.request(b.peer_id, "/fedswarm/echo/1", b"ok", timeout=1) == b"ok"

        net.drop = lambda ch, src, dst, data: data.startswith(b"drop")
        await a.send(c.peer_id, b"drop-me")
        await a.send(c.peer_id, b"keep")
        with pytest.raises(TransportTimeout):
            await a.request(b.peer_id, "/fedswarm/echo/1", b"drop-req", timeout=1)
        assert net.dropped == 2
        net.drop = None
        assert (await c.receive()).data == b"keep"

        # bounded inbox: the third undelivered message is dropped and counted
        for i in range(3):
            await a.send(c.peer_id, b"%d" % i)
        assert c.overflowed == 1 and net.overflowed == 1
        assert [(await c.receive()).data for _ in range(2)] == [b"0", b"1"]

        with pytest.raises(PeerUnreachable):
            await a.send("12D3KooWunknown", b"x")

    trio.run(main)


def test_max_frame_and_aclose() -> None:
    async def main() -> None:
        net, (a, b) = _net(2, max_frame=16)
        with pytest.raises(LocalProtocolError):
            await a.send(b.peer_id, b"x" * 17)
        await a.send(b.peer_id, b"x" * 16)
        await b.aclose()
        assert b.listen_addrs() == []
        assert a.connected_peers() == []
        with pytest.raises(PeerUnreachable):
            await a.send(b.peer_id, b"x")
        # buffered message still readable, then receive reports the closure
        assert (await b.receive()).data == b"x" * 16
        with pytest.raises(PeerUnreachable):
            await b.receive()

    trio.run(main)
