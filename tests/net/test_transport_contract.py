"""The Transport contract (``fedswarm.runtime.ports.Transport``), one suite run
against both implementations: the in-memory transport the tests and netsim
use, and py-libp2p on 127.0.0.1 (real hosts inside one trio run).

What only one of them has (libp2p's stream pooling, DHT, gossipsub settings,
the memory network's faults) is tested in test_libp2p.py / test_memory.py.
No fixed sleeps for readiness: what libp2p does in the background (the other
side's view of a connection, the pubsub mesh) is polled under a bound.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import trio

from helpers import until
from fedswarm.core.identity import Identity
from fedswarm.errors import LocalProtocolError, PeerUnreachable, TransportTimeout
from fedswarm.runtime.ports import Incoming

ECHO = "/fedswarm/echo/1.0.0"
TOPIC = "fedswarm/contract"


@dataclass(frozen=True)
class Kit:
    """How to open ``n`` transports of one kind that can reach each other."""

    name: str
    open: Callable[..., AbstractAsyncContextManager[list[Any]]]
    #: wait until a publication of any subscriber reaches every other one
    pubsub_ready: Callable[[Sequence[Any], str], Any]
    #: how long "nothing else arrives" is watched for (delivery in memory is
    #: immediate; libp2p's is not). Not 0: trio's receive checks for
    #: cancellation before it looks at the buffer, so a 0 s watch sees nothing
    quiet_s: float


def _identities(n: int, given: Sequence[Identity]) -> list[Identity]:
    return [*given, *(Identity.generate() for _ in range(n - len(given)))]


@asynccontextmanager
async def _open_memory(n: int, *, max_frame: int | None = None,
                       identities: Sequence[Identity] = ()) -> AsyncIterator[list[Any]]:
    from fedswarm.net.memory import MemoryNetwork

    net = MemoryNetwork(**({"max_frame": max_frame} if max_frame else {}))
    yield [net.add(ident) for ident in _identities(n, identities)]


async def _memory_pubsub_ready(transports: Sequence[Any], topic: str) -> None:
    await trio.lowlevel.checkpoint()


@asynccontextmanager
async def _open_libp2p(n: int, *, max_frame: int | None = None,
                       identities: Sequence[Identity] = ()) -> AsyncIterator[list[Any]]:
    from fedswarm.net.libp2p import Libp2pConfig, open_libp2p_transport

    cfg = Libp2pConfig(max_frame=max_frame) if max_frame else Libp2pConfig()
    async with AsyncExitStack() as stack:
        yield [await stack.enter_async_context(open_libp2p_transport(ident, config=cfg))
               for ident in _identities(n, identities)]


async def _libp2p_pubsub_ready(transports: Sequence[Any], topic: str) -> None:
    # a full mesh among few peers (D_low=4 > candidates, so all are grafted)
    others = {t.peer_id: {o.peer_id for o in transports if o is not t} for t in transports}
    await until(lambda: all(set(t.mesh_peers(topic)) == others[t.peer_id] for t in transports))


KITS = {
    "memory": Kit("memory", _open_memory, _memory_pubsub_ready, quiet_s=0.05),
    "libp2p": Kit("libp2p", _open_libp2p, _libp2p_pubsub_ready, quiet_s=0.3),
}


@pytest.fixture(params=sorted(KITS))
def kit(request: pytest.FixtureRequest) -> Kit:
    return KITS[request.param]


async def _echo(sender: str, data: bytes) -> bytes:
    return sender.encode()[:8] + data


def test_peer_id_addresses_and_connect(kit: Kit) -> None:
    async def main() -> None:
        ident = Identity.from_seed(b"\x07" * 32)
        async with kit.open(2, identities=[ident]) as (b, a):
            assert b.peer_id == ident.peer_id
            [addr] = b.listen_addrs()
            assert addr.endswith(f"/p2p/{b.peer_id}")
            assert a.connected_peers() == []
            assert await a.connect(addr) == b.peer_id
            assert a.connected_peers() == [b.peer_id]
            await until(lambda: b.connected_peers() == [a.peer_id])
            a.add_peer_addrs(b.peer_id, [addr])  # known already: accepted, harmless
            assert a.connected_peers() == [b.peer_id]

    trio.run(main)


def test_send_delivers_in_order_with_the_sender(kit: Kit) -> None:
    async def main() -> None:
        async with kit.open(2) as (a, b):
            await a.connect(b.listen_addrs()[0])
            msgs = [b"msg-%d" % i for i in range(30)]
            for m in msgs:
                await a.send(b.peer_id, m)
            for m in msgs:
                with trio.fail_after(5):
                    assert await b.receive() == Incoming("direct", a.peer_id, m)
            sa, sb = a.statistics(), b.statistics()
            assert (sa.frames_out, sa.bytes_out) == (30, sum(map(len, msgs)))
            assert (sb.frames_in, sb.bytes_in) == (30, sum(map(len, msgs)))
            await b.send(a.peer_id, b"pong")  # and back over the same connection
            with trio.fail_after(5):
                assert await a.receive() == Incoming("direct", b.peer_id, b"pong")

    trio.run(main)


def test_pubsub_reaches_other_subscribers_only(kit: Kit) -> None:
    async def main() -> None:
        async with kit.open(4) as (a, b, c, d):
            for t in (b, c, d):
                await t.connect(a.listen_addrs()[0])
            await c.connect(b.listen_addrs()[0])
            for t in (a, b, c):
                await t.subscribe(TOPIC)
            await kit.pubsub_ready((a, b, c), TOPIC)
            await a.publish(TOPIC, b"hello")
            await b.publish(TOPIC, b"from-b")
            with trio.fail_after(5):
                assert await b.receive() == Incoming("pubsub", a.peer_id, b"hello", TOPIC)
            with trio.fail_after(5):  # two publishers: arrival order is not defined
                got_c = {await c.receive(), await c.receive()}
            assert got_c == {Incoming("pubsub", a.peer_id, b"hello", TOPIC),
                             Incoming("pubsub", b.peer_id, b"from-b", TOPIC)}
            with trio.fail_after(5):
                assert await a.receive() == Incoming("pubsub", b.peer_id, b"from-b", TOPIC)
            # neither the publisher's own message nor anything to a non-subscriber
            for t in (a, d):
                with trio.move_on_after(kit.quiet_s):
                    extra = await t.receive()
                    raise AssertionError(f"unexpected {extra}")

    trio.run(main)


def test_requests_run_concurrently_with_the_sender(kit: Kit) -> None:
    async def main() -> None:
        async with kit.open(2) as (a, b):
            arrived = 0
            all_in = trio.Event()

            async def gated(sender: str, data: bytes) -> bytes:
                nonlocal arrived
                assert sender == a.peer_id
                arrived += 1
                if arrived == 8:
                    all_in.set()
                await all_in.wait()  # only completes if 8 requests are in flight at once
                return data.upper()

            b.set_request_handler("/fedswarm/gated/1", gated)
            b.set_request_handler(ECHO, _echo)
            await a.connect(b.listen_addrs()[0])
            assert await a.request(b.peer_id, ECHO, b"one", timeout=5) == a.peer_id.encode()[:8] + b"one"
            results: dict[int, bytes] = {}

            async def one(i: int) -> None:
                results[i] = await a.request(b.peer_id, "/fedswarm/gated/1", b"req%d" % i, timeout=10)

            async with trio.open_nursery() as n:
                for i in range(8):
                    n.start_soon(one, i)
            assert results == {i: b"REQ%d" % i for i in range(8)}
            assert b.statistics().requests_in == 9
            assert a.statistics().requests_out == 9

    trio.run(main)


def test_request_timeout_failing_handler_and_unknown_protocol(kit: Kit) -> None:
    async def main() -> None:
        async with kit.open(2) as (a, b):
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
            with pytest.raises(PeerUnreachable):
                await a.request(b.peer_id, "/fedswarm/broken/1", b"x", timeout=5)
            with pytest.raises(PeerUnreachable):
                await a.request(b.peer_id, "/fedswarm/nobody/1", b"x", timeout=5)
            # the connection is fine afterwards
            assert await a.request(b.peer_id, ECHO, b"ok", timeout=5) == a.peer_id.encode()[:8] + b"ok"

    trio.run(main)


def test_an_oversize_frame_is_refused_before_it_is_sent(kit: Kit) -> None:
    async def main() -> None:
        async with kit.open(2, max_frame=64 * 1024) as (a, b):
            b.set_request_handler(ECHO, _echo)
            await a.connect(b.listen_addrs()[0])
            with pytest.raises(LocalProtocolError):
                await a.send(b.peer_id, b"x" * (64 * 1024 + 1))
            with pytest.raises(LocalProtocolError):
                await a.request(b.peer_id, ECHO, b"x" * (64 * 1024 + 1), timeout=5)
            assert a.statistics().frames_out == 0
            await a.send(b.peer_id, b"x" * (64 * 1024))  # the limit itself is allowed
            with trio.fail_after(5):
                assert (await b.receive()).data == b"x" * (64 * 1024)
            assert a.connected_peers() == [b.peer_id]

    trio.run(main)


def test_a_closed_peer_is_unreachable(kit: Kit) -> None:
    async def main() -> None:
        async with kit.open(2) as (a, b):
            b.set_request_handler(ECHO, _echo)
            addr = b.listen_addrs()[0]
            await a.connect(addr)
            assert await a.request(b.peer_id, ECHO, b"hi", timeout=5)
            await b.aclose()
            await until(lambda: b.peer_id not in a.connected_peers())
            with pytest.raises((PeerUnreachable, TransportTimeout)):
                await a.request(b.peer_id, ECHO, b"hi", timeout=5)
            with pytest.raises((PeerUnreachable, TransportTimeout)):
                await a.send(b.peer_id, b"hi")
            with pytest.raises((PeerUnreachable, TransportTimeout)):
                await a.connect(addr)
            assert a.statistics().send_failures >= 1
            # and the closed side refuses to work
            with pytest.raises(PeerUnreachable):
                await b.send(a.peer_id, b"x")
            with pytest.raises(PeerUnreachable):
                await b.receive()

    trio.run(main)
