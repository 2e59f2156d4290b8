"""Direct lanes (``fedswarm.net.lane``) between real py-libp2p hosts on 127.0.0.1.

A lane carries the LLM protocols' requests on a sealed TCP connection keyed
over libp2p. These tests hold what it promises: the same answers and the same
authenticated sender as over libp2p, both directions on one lane, libp2p as
the fallback whenever there is no lane, and a lane that ends (and is counted)
on anything that is not a well-formed frame sealed with its key.

No fixed sleeps for readiness: conditions are polled under a bound.
"""

from __future__ import annotations

import struct
from contextlib import AsyncExitStack

import msgpack
import pytest
import trio

from helpers import until
from fedswarm.core.identity import Identity
from fedswarm.errors import PeerUnreachable, TransportTimeout
from fedswarm.net.lane import MAGIC, LaneConfig, _parse_offer
from fedswarm.net.libp2p import Libp2pConfig, Libp2pTransport, open_libp2p_transport

LLM = "/fedswarm/llm/1.0.0"
OUT = "/fedswarm/llm-out/1.0.0"
ECHO = "/fedswarm/echo/1.0.0"


async def _pair(stack: AsyncExitStack, b_config: Libp2pConfig | None = None
                ) -> tuple[Libp2pTransport, Libp2pTransport]:
    b = await stack.enter_async_context(
        open_libp2p_transport(Identity.generate(), config=b_config or Libp2pConfig()))
    a = await stack.enter_async_context(
        open_libp2p_transport(Identity.generate(), bootstrap=b.listen_addrs()))
    return a, b


def _tagged(seen: list[str]):
    async def handler(sender: str, data: bytes) -> bytes:
        seen.append(sender)
        return b"re:" + data
    return handler


async def _lane_up(a: Libp2pTransport, b: Libp2pTransport) -> None:
    await a.request(b.peer_id, LLM, b"first", timeout=10)  # over libp2p; opens the lane
    await until(lambda: a.lanes_live() == 1 and b.lanes_live() == 1)


def test_llm_requests_move_to_the_lane_with_the_same_answers_and_sender() -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            a, b = await _pair(stack)
            seen_b: list[str] = []
            seen_a: list[str] = []
            b.set_request_handler(LLM, _tagged(seen_b))
            b.set_request_handler(ECHO, _tagged(seen_b))
            a.set_request_handler(OUT, _tagged(seen_a))
            await _lane_up(a, b)
            streams = a.statistics().request_streams_opened
            big = bytes(range(256)) * 4096  # 1 MiB: many TCP reads per frame
            for payload in (b"x" * 2400, b"", big):
                assert await a.request(b.peer_id, LLM, payload, timeout=10) == b"re:" + payload
            assert a.statistics().lane_requests_out == 3
            assert b.statistics().lane_requests_in == 3
            assert a.statistics().request_streams_opened == streams  # no libp2p stream for them
            assert set(seen_b) == {a.peer_id}
            # the other way, on the lane a opened (as a serving peer pushes to a client)
            assert await b.request(a.peer_id, OUT, b"push", timeout=10) == b"re:push"
            assert seen_a == [b.peer_id]
            assert b.statistics().lane_requests_out == 1 and b.statistics().lanes_opened == 0
            # a protocol the lane does not carry stays on libp2p
            await a.request(b.peer_id, ECHO, b"e", timeout=10)
            assert a.statistics().lane_requests_out == 3
            # concurrent requests on one lane each get their own answer
            got: dict[int, bytes] = {}

            async def one(i: int) -> None:
                got[i] = await a.request(b.peer_id, LLM, str(i).encode(), timeout=10)

            async with trio.open_nursery() as n:
                for i in range(50):
                    n.start_soon(one, i)
            assert got == {i: b"re:" + str(i).encode() for i in range(50)}

    trio.run(main)


def test_a_peer_without_lanes_is_served_over_libp2p() -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            a, b = await _pair(stack, Libp2pConfig(lane=False))
            assert b.lane_port == 0
            b.set_request_handler(LLM, _tagged([]))
            assert await a.request(b.peer_id, LLM, b"1", timeout=10) == b"re:1"
            await until(lambda: a.statistics().lane_open_failures == 1)
            for i in range(5):
                assert await a.request(b.peer_id, LLM, b"%d" % i, timeout=10) == b"re:%d" % i
            st = a.statistics()
            assert st.lane_requests_out == 0 and st.lane_open_failures == 1  # backed off, not retried
            assert a.lanes_live() == 0

    trio.run(main)


def test_handler_failure_and_timeout_on_a_lane_leave_it_serving() -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            a, b = await _pair(stack)
            release = trio.Event()

            async def handler(sender: str, data: bytes) -> bytes:
                if data == b"boom":
                    raise RuntimeError("handler bug")
                if data == b"slow":
                    await release.wait()
                return b"ok"

            b.set_request_handler(LLM, handler)
            await _lane_up(a, b)
            with pytest.raises(PeerUnreachable):
                await a.request(b.peer_id, LLM, b"boom", timeout=10)
            assert await a.request(b.peer_id, LLM, b"fine", timeout=10) == b"ok"
            assert a.lanes_live() == 1 and a.statistics().lanes_opened == 1  # a failed handler ends nothing

            # a timeout while other answers arrive on the lane leaves it serving;
            # its late answer finds no one waiting and is dropped
            async def busy() -> None:
                for _ in range(5):
                    await a.request(b.peer_id, LLM, b"fine", timeout=10)
                    await trio.sleep(0.03)

            async with trio.open_nursery() as n:
                n.start_soon(busy)
                with pytest.raises(TransportTimeout):
                    await a.request(b.peer_id, LLM, b"slow", timeout=0.1)
            release.set()
            assert await a.request(b.peer_id, LLM, b"fine", timeout=10) == b"ok"
            assert a.lanes_live() == 1 and a.statistics().lanes_opened == 1

            # a timeout on a lane that heard nothing meanwhile ends it (a peer
            # gone without a reset): the next requests go on without waiting on it
            release = trio.Event()
            with pytest.raises(TransportTimeout):
                await a.request(b.peer_id, LLM, b"slow", timeout=0.2)
            assert a.lanes_live() == 0
            release.set()
            assert await a.request(b.peer_id, LLM, b"fine", timeout=10) == b"ok"  # over libp2p
            await until(lambda: a.statistics().lanes_opened == 2)
            assert a.statistics().lane_failures == 0 and b.statistics().lane_failures == 0

    trio.run(main)


def test_a_lane_that_breaks_fails_the_request_in_flight_and_a_new_one_opens() -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            a, b = await _pair(stack)
            entered = trio.Event()

            async def handler(sender: str, data: bytes) -> bytes:
                if data == b"hang":
                    entered.set()
                    await trio.sleep_forever()
                return b"ok"

            b.set_request_handler(LLM, handler)
            await _lane_up(a, b)

            async def break_it() -> None:
                await entered.wait()
                b._lanes.close()  # as if the peer's side of the TCP connection died

            async with trio.open_nursery() as n:
                n.start_soon(break_it)
                with pytest.raises(PeerUnreachable, match="lane broke"):
                    await a.request(b.peer_id, LLM, b"hang", timeout=10)  # sent once, never twice
            assert await a.request(b.peer_id, LLM, b"again", timeout=10) == b"ok"  # over libp2p
            await until(lambda: a.statistics().lanes_opened == 2)
            assert await a.request(b.peer_id, LLM, b"lane", timeout=10) == b"ok"
            assert b.statistics().lanes_accepted == 2

    trio.run(main)


def test_a_worker_thread_writes_requests_on_the_lane_in_order_with_the_loops_own() -> None:
    """``thread_sender``: a worker thread writes a request on the lane itself
    (a served model's step output, sent the moment its forward ends). Its
    frames interleave with the event loop's requests on the same lane under
    one nonce sequence, every answer reaches its caller, and without a lane
    there is nothing to write with (the caller sends as usual)."""
    async def main() -> None:
        async with AsyncExitStack() as stack:
            a, b = await _pair(stack)
            seen: list[str] = []
            b.set_request_handler(LLM, _tagged(seen))
            b.set_request_handler(ECHO, _tagged(seen))
            assert a.thread_sender(b.peer_id, ECHO) is None  # not a lane protocol
            assert a.thread_sender(b.peer_id, LLM) is None  # no lane yet: asking opens one
            await until(lambda: a.lanes_live() == 1 and b.lanes_live() == 1)
            send = a.thread_sender(b.peer_id, LLM)
            assert send is not None
            before = a.statistics().lane_requests_out
            got: dict[str, bytes] = {}

            def burst(tag: str) -> list:
                return [send(f"{tag}{i}".encode() * 100) for i in range(20)]

            async def loop_side() -> None:
                for i in range(20):
                    got[f"l{i}"] = await a.request(b.peer_id, LLM, f"l{i}".encode() * 100, timeout=10)

            async with trio.open_nursery() as n:
                n.start_soon(loop_side)
                sent = await trio.to_thread.run_sync(burst, "t")
                n.start_soon(loop_side)
            assert all(x is not None for x in sent)  # the thread waited out the loop's writes
            for i, x in enumerate(sent):
                assert await a.sent_answer(b.peer_id, x, timeout=10) == b"re:" + f"t{i}".encode() * 100
            assert got == {f"l{i}": b"re:" + f"l{i}".encode() * 100 for i in range(20)}
            assert a.statistics().lane_requests_out == before + 60
            assert a.lanes_live() == 1 and b.statistics().lane_failures == 0 and set(seen) == {a.peer_id}
            assert send(b"x" * (a.config.max_frame + 1)) is None  # too large: sent the usual way (and refused)

            # the lane breaks after a thread wrote: its answer fails as a lane
            # request in flight does, never by waiting for the timeout
            entered = trio.Event()

            async def hang(sender: str, data: bytes) -> bytes:
                entered.set()
                await trio.sleep_forever()
                return b""

            b.set_request_handler(LLM, hang)
            x = await trio.to_thread.run_sync(send, b"hang")
            assert x is not None
            await entered.wait()
            b._lanes.close()
            with pytest.raises(PeerUnreachable, match="lane broke"):
                await a.sent_answer(b.peer_id, x, timeout=10)
            await until(lambda: a.lanes_live() == 0)
            assert await trio.to_thread.run_sync(send, b"late") is None  # that lane is gone

    trio.run(main)


async def _raw(port: int) -> trio.SocketStream:
    return await trio.open_tcp_stream("127.0.0.1", port)


async def _closed(stream: trio.SocketStream) -> bool:
    """True when the other side ends the connection (EOF or reset)."""
    with trio.fail_after(10):
        try:
            while await stream.receive_some(65536):
                pass
        except trio.BrokenResourceError:
            pass
    return True


def test_lane_listener_refuses_bad_tickets_and_forged_frames() -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            a, b = await _pair(stack)
            b.set_request_handler(LLM, _tagged([]))
            # no ticket, a made-up ticket: refused
            for junk in (b"GET / HTTP/1.1\r\n\r\n", MAGIC + b"\x00" * 16):
                s = await _raw(b.lane_port)
                await s.send_all(junk)
                assert await _closed(s)
            await until(lambda: b.statistics().lane_refused == 2)
            # a real ticket (asked over libp2p as a's), spent twice: the second is refused
            _, raw = await a._lane_hello(b.peer_id)
            port, ticket, _key = _parse_offer(raw)
            assert port == b.lane_port
            s1 = await _raw(port)
            await s1.send_all(MAGIC + ticket)
            s2 = await _raw(port)
            await s2.send_all(MAGIC + ticket)
            assert await _closed(s2)
            await until(lambda: b.statistics().lane_refused == 3)
            # the first holds the ticket but not... a frame sealed with another key: ended, counted
            hello = await s1.receive_some(65536)
            assert len(hello) == 4 + 7 + 16  # the sealed HELLO
            forged = b"\x00" * 40
            await s1.send_all(struct.pack(">I", len(forged)) + forged)
            assert await _closed(s1)
            await until(lambda: b.statistics().lane_failures == 1)
            # an oversize length: ended before any of it is read
            _, raw = await a._lane_hello(b.peer_id)
            _, ticket, _key = _parse_offer(raw)
            s3 = await _raw(port)
            await s3.send_all(MAGIC + ticket)
            await s3.receive_some(65536)
            await s3.send_all(struct.pack(">I", 1 << 30))
            assert await _closed(s3)
            await until(lambda: b.statistics().lane_failures == 2)
            # and b still serves a over a good lane
            await _lane_up(a, b)
            assert await a.request(b.peer_id, LLM, b"still", timeout=10) == b"re:still"

    trio.run(main)


def test_a_hello_that_is_not_one_gets_no_ticket() -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            a, b = await _pair(stack)
            for junk in (b"", b"\xc1", msgpack.packb({"v": 2}), msgpack.packb([1, 2])):
                raw = await a.request(b.peer_id, "/fedswarm/lane/1.0.0", junk, timeout=10)
                with pytest.raises(ValueError, match="refused"):
                    _parse_offer(raw)
            assert b._lanes is not None and not b._lanes._tickets

    trio.run(main)


def test_tickets_are_bounded() -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            a, b = await _pair(stack, Libp2pConfig(lane_config=LaneConfig(max_tickets=4)))
            for _ in range(10):
                await a._lane_hello(b.peer_id)
            assert b._lanes is not None and len(b._lanes._tickets) == 4

    trio.run(main)


def test_connections_without_a_ticket_count_against_the_lane_bound() -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            a, b = await _pair(stack, Libp2pConfig(lane_config=LaneConfig(max_lanes=2)))
            b.set_request_handler(LLM, _tagged([]))
            idle = [await _raw(b.lane_port) for _ in range(2)]  # connected, silent
            await until(lambda: b._lanes is not None and b._lanes._pending == 2)
            s = await _raw(b.lane_port)
            assert await _closed(s)  # refused at once: the bound is full
            assert b.statistics().lane_refused == 1
            for c in idle:
                await c.aclose()
            await until(lambda: b._lanes is not None and b._lanes._pending == 0)
            await _lane_up(a, b)  # room again
            assert await a.request(b.peer_id, LLM, b"ok", timeout=10) == b"re:ok"

    trio.run(main)


def test_one_peer_cannot_hold_every_ticket_or_lane() -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            a, b = await _pair(stack, Libp2pConfig(lane_config=LaneConfig(max_per_peer=2)))
            b.set_request_handler(LLM, _tagged([]))
            offers = [_parse_offer((await a._lane_hello(b.peer_id))[1]) for _ in range(4)]
            assert b._lanes is not None and len(b._lanes._tickets) == 2  # a's two newest
            socks = []
            for port, ticket, _key in offers:  # the two oldest are gone
                s = await _raw(port)
                await s.send_all(MAGIC + ticket)
                socks.append(s)
            assert await _closed(socks[0]) and await _closed(socks[1])
            await until(lambda: b.lanes_live() == 2)
            await a.request(b.peer_id, LLM, b"first", timeout=10)  # a third lane from a ...
            await until(lambda: a.lanes_live() == 1)
            assert await _closed(socks[2])  # ... and the oldest of a's goes
            assert b.lanes_live() == 2
            assert await a.request(b.peer_id, LLM, b"x", timeout=10) == b"re:x"

    trio.run(main)


def test_a_lane_holds_frames_to_the_transports_max_frame() -> None:
    from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

    async def main() -> None:
        async with AsyncExitStack() as stack:
            a, b = await _pair(stack, Libp2pConfig(max_frame=64 * 1024))
            b.set_request_handler(LLM, _tagged([]))
            port, ticket, key = _parse_offer((await a._lane_hello(b.peer_id))[1])
            s = await _raw(port)
            await s.send_all(MAGIC + ticket)
            await s.receive_some(65536)  # the sealed HELLO
            # a well-sealed request of 100 kB: within the default 4 MiB, past this transport's 64 KiB
            plain = struct.pack(">BIH", 0, 1, len(LLM)) + LLM.encode() + b"x" * 100_000
            hdr = struct.pack(">I", len(plain) + 16)
            nonce = b"\x00\x00\x00\x01" + (0).to_bytes(8, "big")
            try:
                await s.send_all(hdr + ChaCha20Poly1305(key).encrypt(nonce, plain, hdr))
            except trio.BrokenResourceError:
                pass  # refused on its header, while the rest was still on its way
            assert await _closed(s)
            await until(lambda: b.statistics().lane_failures == 1)
            assert b.statistics().lane_requests_in == 0

    trio.run(main)
