"""MemoryNetwork / MemoryTransport: what only the in-process transport does
(its addresses, faults, bounded inboxes). What every transport does is in
test_transport_contract.py, run against this one too."""

from __future__ import annotations

import pytest
import trio

from fedswarm.core.identity import Identity
from fedswarm.errors import PeerUnreachable, TransportTimeout
from fedswarm.net.memory import MemoryNetwork, MemoryTransport


def _ident(i: int) -> Identity:
    return Identity.from_seed(bytes([i]) * 32)


def _net(n: int, **kw) -> tuple[MemoryNetwork, list[MemoryTransport]]:
    net = MemoryNetwork(**kw)
    return net, [net.add(_ident(i + 1)) for i in range(n)]


def test_memory_addresses() -> None:
    async def main() -> None:
        net, (a, b) = _net(2)
        [addr] = b.listen_addrs()
        assert addr.startswith("/memory/")
        with pytest.raises(PeerUnreachable):
            await a.connect("/memory/99/p2p/" + b.peer_id)
        with pytest.raises(PeerUnreachable):
            await a.connect("/ip4/1.2.3.4/tcp/1")
        # a memory peer can send to itself
        await a.send(a.peer_id, b"marker")
        assert (await a.receive()).data == b"marker"

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


def test_aclose_leaves_buffered_messages_readable() -> None:
    async def main() -> None:
        net, (a, b) = _net(2)
        await a.send(b.peer_id, b"x" * 16)
        await b.aclose()
        assert b.listen_addrs() == []
        # buffered message still readable, then receive reports the closure
        assert (await b.receive()).data == b"x" * 16
        with pytest.raises(PeerUnreachable):
            await b.receive()

    trio.run(main)
