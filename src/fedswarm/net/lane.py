"""Direct lanes: latency-bound requests on a sealed TCP connection, keyed over libp2p.

Why
---
A decode step of a served model crosses one network hop per serving peer, and
each hop carries a few kilobytes (one hidden state). Over py-libp2p a round trip
of 2.4 kB costs about 1 ms and 0.5 ms of CPU on each side, nearly all of it in
the pure-Python yamux and Noise layers (docs/benchmarks.md,
``benchmarks/libp2p_roundtrip.py``); raw TCP costs a tenth of that. A lane
keeps libp2p for what it is good at (finding, dialling and authenticating
peers) and moves the hot request path onto one plain TCP connection per pair
of peers, sealed with ChaCha20-Poly1305 from ``cryptography`` (C code).

Handshake
---------
1. The opener asks the peer for a lane over libp2p, on ``LANE_PROTOCOL``
   (``/fedswarm/lane/1.0.0``). That stream is Noise-encrypted and
   authenticated, so each side knows the other's peer id.
2. The acceptor answers ``{"v": 1, "port", "ticket", "key"}``: the TCP port of
   its lane listener, a random 16-byte one-time ticket and a random 32-byte key,
   both tied to the opener's peer id and valid for ``ticket_s`` seconds.
3. The opener connects to that port at the address its libp2p connection
   reached, and sends ``MAGIC`` and the ticket.
4. The acceptor takes the ticket out of its table (a ticket works once) and
   answers with a sealed ``HELLO`` frame, which proves it holds the key; the
   opener uses the lane only after that frame.

Who can do what: only the two peers know the key (it travelled inside Noise).
Someone who sees or guesses a ticket can at most spend it first, which makes
the opener's lane fail and its requests keep going over libp2p. Every frame
is authenticated; a frame that does not open (forged, altered, replayed or
reordered: the nonce is a per-direction counter) ends the lane. The sender
handed to a request handler is the peer id the ticket was issued to, as
authenticated by libp2p.

Frames
------
``u32 length`` (big-endian) then ``length`` bytes of ChaCha20-Poly1305 output;
the length header is the AEAD's associated data. The nonce is 4 bytes naming
the direction (opener to acceptor or back) and a 64-bit frame counter. Inside:
``u8 kind, u32 request id, u16 protocol length`` (``_BODY``), the protocol
name (requests only) and the payload. Kinds: ``REQ``, ``RESP``, ``ERR`` (the
handler failed or there is none; the caller sees ``PeerUnreachable``, as with
a reset libp2p stream) and ``HELLO``. Either side may send requests on a lane,
whoever opened it, as on a libp2p connection: a serving peer answers a client
on the lane the client opened, so a client that cannot be dialled still gets
its pushes this way.

Falling back
------------
A lane is only an accelerator. Until one is up (it opens in the background on
the first request to a peer), after it breaks, or when the peer offers none
(an older version, ``Libp2pConfig(lane=False)``, a firewalled port), requests
go over libp2p as before; a failed open is retried after ``retry_s``,
doubling up to ``retry_max_s``. A request already written on a lane that
breaks fails with ``PeerUnreachable`` rather than being sent twice. A
request that times out on a lane that received nothing meanwhile ends the
lane: a peer gone without a reset (a half-open connection) costs one timeout,
not one per request.
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import msgpack
import trio
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from ..errors import PeerUnreachable
from ..runtime.ports import RequestHandler

__all__ = ["LANE_PROTOCOL", "LaneConfig", "Lanes", "LaneDown", "Sent"]

log = logging.getLogger(__name__)

LANE_PROTOCOL = "/fedswarm/lane/1.0.0"
MAGIC = b"FSL1"
TICKET_BYTES = 16
KEY_BYTES = 32
TAG_BYTES = 16
_HDR = struct.Struct(">I")
_BODY = struct.Struct(">BIH")
REQ, RESP, ERR, HELLO = 0, 1, 2, 3
_OPENER_TX = b"\x00\x00\x00\x01"
_ACCEPTOR_TX = b"\x00\x00\x00\x02"
_READ_CHUNK = 1 << 18


@dataclass(frozen=True)
class LaneConfig:
    """Knobs of the lanes (part of ``Libp2pConfig``)."""

    #: request protocols carried on lanes (prefix match)
    protocols: tuple[str, ...] = ("/fedswarm/llm/", "/fedswarm/llm-out/")
    #: how long a ticket stays valid, and how many may wait at once
    ticket_s: float = 10.0
    max_tickets: int = 256
    #: open a lane (libp2p hello, TCP connect, sealed HELLO) within this
    open_timeout_s: float = 5.0
    retry_s: float = 30.0
    retry_max_s: float = 600.0
    #: lanes held at once (both directions, with connections still to show
    #: a ticket), and requests served at once per lane
    max_lanes: int = 1024
    #: lanes and unspent tickets one peer may hold here; past it, its oldest goes
    max_per_peer: int = 4
    max_inflight: int = 64
    send_timeout_s: float = 30.0


class LaneDown(Exception):
    """The lane broke; ``sent`` says whether the request had left."""

    def __init__(self, why: str, sent: bool) -> None:
        super().__init__(why)
        self.sent = sent


class _Wait:
    __slots__ = ("event", "kind", "data")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.kind = -1
        self.data = b""


class Sent:
    """A request written on a lane, by the event loop (``_Lane.request``)
    or by a worker thread (``_Lane.send_from_thread``), whose answer the
    event loop awaits with ``answer``: the answer's bytes, or
    ``PeerUnreachable`` (the handler failed), or ``LaneDown`` with
    ``sent=True`` (the lane broke after the request left)."""

    __slots__ = ("lane", "protocol", "rid", "wait", "size", "frames_before", "broken")

    def __init__(self, lane: "_Lane", protocol: str, rid: int, wait: _Wait, size: int) -> None:
        self.lane = lane
        self.protocol = protocol
        self.rid = rid
        self.wait = wait
        self.size = size
        self.frames_before = lane.frames_in
        self.broken: str | None = None

    async def answer(self) -> bytes:
        try:
            if self.broken is not None:
                raise LaneDown(self.broken, sent=True)
            await self.wait.event.wait()
        finally:
            self.lane._waiting.pop(self.rid, None)
        return self.lane._outcome(self.protocol, self.wait)

    def forget(self) -> None:
        """Nobody will await the answer (it is dropped when it comes)."""
        self.lane._waiting.pop(self.rid, None)


class _Lane:
    """One sealed TCP connection to one peer, carrying requests both ways."""

    def __init__(self, stream: trio.SocketStream, peer: str, key: bytes, opener: bool,
                 owner: "Lanes") -> None:
        self.stream = stream
        self.peer = peer
        aead = ChaCha20Poly1305(key)
        self._seal = aead.encrypt
        self._unseal = aead.decrypt
        self._tx = _OPENER_TX if opener else _ACCEPTOR_TX
        self._rx = _ACCEPTOR_TX if opener else _OPENER_TX
        self._tx_n = 0
        self._rx_n = 0
        self._wlock = trio.Lock()
        # held while a frame is sealed and written, by the event loop (under
        # _wlock, across the write's awaits) or by a worker thread
        # (``send_from_thread``, which only tries it): one frame at a time, in
        # nonce order. Reentrant: a failed write kills the lane under it.
        self._tlock = threading.RLock()
        self._ids = itertools.count(1)  # next() is atomic: threads take ids too
        self._waiting: dict[int, _Wait] = {}
        self._owner = owner
        self._inflight = trio.Semaphore(owner.config.max_inflight)
        self._max_wire = owner.max_frame + 1024 + TAG_BYTES
        self.alive = True
        self.hello = trio.Event()
        #: frames received so far: a request that times out on a lane that
        #: received nothing meanwhile ends the lane (``Lanes.timed_out``)
        self.frames_in = 0

    # -- writing ---------------------------------------------------------------
    def _frame(self, plain: bytes) -> bytes:
        """Seal ``plain`` as the next frame (call with ``_tlock`` held)."""
        n = self._tx_n
        self._tx_n = n + 1
        hdr = _HDR.pack(len(plain) + TAG_BYTES)
        return hdr + self._seal(self._tx + n.to_bytes(8, "big"), plain, hdr)

    async def write(self, plain: bytes) -> None:
        async with self._wlock:
            # a worker thread may be writing a frame (a full socket keeps it
            # at most its write_timeout): wait without blocking the event loop
            while not self._tlock.acquire(blocking=False):
                await trio.sleep(0.0005)
            try:
                if not self.alive:
                    raise LaneDown("lane closed", sent=False)
                try:
                    await self.stream.send_all(self._frame(plain))
                except BaseException:
                    # part of the frame may be on the wire: nothing after it can be
                    self.kill()
                    raise
            finally:
                self._tlock.release()

    @staticmethod
    def _request_body(rid: int, protocol: str, data: bytes) -> bytes:
        p = protocol.encode()
        return _BODY.pack(REQ, rid, len(p)) + p + data

    def _expect(self, protocol: str, size: int) -> Sent:
        """A new request id, its answer awaited from now on (before the
        request leaves: the answer may come at once)."""
        rid = next(self._ids) & 0xFFFFFFFF
        wait = self._waiting[rid] = _Wait()
        return Sent(self, protocol, rid, wait, size)

    async def request(self, protocol: str, data: bytes) -> bytes:
        sent = self._expect(protocol, len(data))
        try:  # a LaneDown from write (the lane was already closed) passes through: sent=False
            await self.write(self._request_body(sent.rid, protocol, data))
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            sent.broken = f"write failed: {exc!r}"  # the answer raises LaneDown, sent=True
        except BaseException:
            sent.forget()
            raise
        return await sent.answer()

    def _outcome(self, protocol: str, wait: _Wait) -> bytes:
        if wait.kind == RESP:
            return wait.data
        if wait.kind == ERR:
            raise PeerUnreachable(f"{protocol} on the lane to {self.peer[:16]}: "
                                  f"{wait.data.decode(errors='replace')}")
        raise LaneDown("lane closed while waiting", sent=True)

    def send_from_thread(self, protocol: str, data: bytes, *, write_timeout: float = 1.0) -> "Sent | None":
        """A worker thread writes a request on this lane itself, without a
        trip through the event loop: the step's output leaves the moment the
        forward that made it ends (docs/llm.md, "Direct lanes"). Returns the
        request's handle, whose answer the event loop awaits later
        (``Sent.answer``); None when the lane is closed, or the event loop
        has been writing on it for ``write_timeout`` (a full socket): the
        caller then sends as usual, nothing was written. A frame that cannot
        be written whole within ``write_timeout`` ends the lane, as a failed
        write does."""
        if not self.alive or not self._tlock.acquire(timeout=write_timeout):
            return None
        try:
            if not self.alive:
                return None
            sent = self._expect(protocol, len(data))
            view = memoryview(self._frame(self._request_body(sent.rid, protocol, data)))
            fd = self.stream.socket.fileno()
            deadline = time.monotonic() + write_timeout
            try:
                while view:
                    try:
                        view = view[os.write(fd, view):]
                        continue
                    except BlockingIOError:
                        pass
                    left = deadline - time.monotonic()
                    if left <= 0 or not select.select([], [fd], [], left)[1]:
                        raise TimeoutError("the lane's socket stayed full")
            except OSError as exc:
                # part of the frame may be on the wire: the lane must end (in
                # the event loop, which owns it); the request failed after
                # leaving, as a failed write on the loop does
                self.alive = False
                self._owner.kill_soon(self)
                sent.broken = f"write failed: {exc!r}"
            if not self.alive and sent.broken is None:  # ended meanwhile: kill() may not have seen its waiter
                sent.broken = "lane closed"
            return sent
        finally:
            self._tlock.release()

    async def reply(self, rid: int, kind: int, data: bytes) -> None:
        with trio.move_on_after(self._owner.config.send_timeout_s) as scope:
            try:
                await self.write(_BODY.pack(kind, rid, 0) + data)
            except (LaneDown, trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                return
        if scope.cancelled_caught:
            self.kill()

    # -- reading ---------------------------------------------------------------
    async def run(self) -> None:
        """Read and dispatch frames until the lane ends; then fail its waiters."""
        buf = bytearray()
        why = "closed by peer"
        try:
            while True:
                chunk = await self.stream.receive_some(_READ_CHUNK)
                if not chunk:
                    break
                buf += chunk
                while len(buf) >= 4:
                    (n,) = _HDR.unpack_from(buf)
                    if n > self._max_wire or n < TAG_BYTES + _BODY.size:
                        self._owner.count("lane_failures")
                        why = f"bad frame length {n}"
                        return
                    if len(buf) < 4 + n:
                        break
                    hdr = bytes(buf[:4])
                    sealed = bytes(buf[4:4 + n])
                    del buf[:4 + n]
                    try:
                        plain = self._unseal(self._rx + self._rx_n.to_bytes(8, "big"), sealed, hdr)
                    except InvalidTag:
                        self._owner.count("lane_failures")
                        why = "a frame failed authentication"
                        log.warning("lane from %s: %s", self.peer[:16], why)
                        return
                    self._rx_n += 1
                    self.frames_in += 1
                    req = self._dispatch(plain)
                    if req is False:
                        self._owner.count("lane_failures")
                        why = "bad frame kind"
                        return
                    if req is not True:
                        # a request: served in its own task, at most
                        # max_inflight at once (then we stop reading)
                        try:
                            self._inflight.acquire_nowait()  # no scheduling round when there is room
                        except trio.WouldBlock:
                            await self._inflight.acquire()
                        self._owner.serve(self, *req)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            why = repr(exc)
        finally:
            log.debug("lane to %s ends: %s", self.peer[:16], why)
            self.kill()

    def _dispatch(self, plain: bytes) -> bool | tuple[int, bytes, bytes]:
        """Deliver a response or HELLO (True); a request is returned as
        ``(request id, protocol, payload)``; False for a frame that breaks the rules."""
        kind, rid, plen = _BODY.unpack_from(plain)
        if kind == REQ:
            return rid, plain[_BODY.size:_BODY.size + plen], plain[_BODY.size + plen:]
        if kind in (RESP, ERR) and plen == 0:
            wait = self._waiting.get(rid)
            if wait is not None:  # else: its caller gave up (timeout)
                wait.kind = kind
                wait.data = plain[_BODY.size:]
                wait.event.set()
            return True
        if kind == HELLO and rid == 0 and plen == 0:
            self.hello.set()
            return True
        return False

    def kill(self) -> None:
        if not self.alive and self not in self._owner._all:
            return
        self.alive = False  # a worker thread writes no new frame from here
        try:  # and one writing now fails at once instead of waiting on a full socket
            self.stream.socket.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._owner.forget(self)
        for wait in list(self._waiting.values()):  # a copy: worker threads add to it
            wait.event.set()  # kind -1: LaneDown
        self.hello.set()
        with self._tlock:  # no worker thread is inside os.write when the descriptor goes
            try:
                self.stream.socket.close()
            except Exception:
                pass


@dataclass
class _Ticket:
    peer: str
    key: bytes
    expires: float


#: ``hello(peer_id) -> (the address our libp2p connection to it reached, reply bytes)``
Hello = Callable[[str], Awaitable[tuple[str, bytes]]]


class Lanes:
    """A transport's lanes: the listener, the tickets, one lane per peer.

    ``Libp2pTransport`` owns one; it answers ``LANE_PROTOCOL`` hellos with
    ``on_hello``, asks ``get`` for a lane before each request under one of
    ``config.protocols``, and passes ``hello`` to reach a peer over libp2p.
    """

    def __init__(self, config: LaneConfig, handlers: dict[str, RequestHandler],
                 nursery: trio.Nursery, counters: Any, hello: Hello, *, max_frame: int) -> None:
        self.config = config
        #: the largest request or answer (the transport's ``max_frame``)
        self.max_frame = max_frame
        self._handlers = handlers
        self._nursery = nursery
        self._c = counters
        self._hello = hello
        self.port = 0
        self._tickets: dict[bytes, _Ticket] = {}
        self._lanes: dict[str, _Lane] = {}
        self._all: dict[_Lane, None] = {}  # oldest first
        self._pending = 0  # accepted connections that have not shown a ticket yet
        self._opening: set[str] = set()
        self._retry: dict[str, tuple[float, float]] = {}  # peer -> (not before, backoff)
        self._token = trio.lowlevel.current_trio_token()  # worker threads end lanes through it

    def count(self, name: str) -> None:
        setattr(self._c, name, getattr(self._c, name) + 1)

    def carries(self, protocol: str) -> bool:
        return protocol.startswith(self.config.protocols)

    # -- the acceptor's side ----------------------------------------------------
    async def listen(self, host: str, port: int) -> None:
        """Open the lane listener on ``host`` (the libp2p listen address)."""
        listeners = await trio.open_tcp_listeners(port, host=host)
        self.port = listeners[0].socket.getsockname()[1]
        self._nursery.start_soon(trio.serve_listeners, self._accept, listeners)

    async def on_hello(self, sender: str, data: bytes) -> bytes:
        """``LANE_PROTOCOL`` handler: a one-time ticket and key for ``sender``."""
        try:
            msg = msgpack.unpackb(data, raw=False, max_bin_len=0, max_str_len=16,
                                  max_map_len=4, max_array_len=0)
        except Exception:
            msg = None
        if not isinstance(msg, dict) or msg.get("v") != 1 or self.port == 0:
            return msgpack.packb({"v": 1, "error": "bad-hello" if self.port else "no-lane"})
        now = trio.current_time()
        for t in [t for t, v in self._tickets.items() if v.expires <= now]:
            del self._tickets[t]
        while len(self._tickets) >= self.config.max_tickets:
            del self._tickets[next(iter(self._tickets))]  # the oldest
        mine = [t for t, v in self._tickets.items() if v.peer == sender]
        for t in mine[:max(len(mine) - self.config.max_per_peer + 1, 0)]:
            del self._tickets[t]  # one peer cannot fill the table
        ticket = secrets.token_bytes(TICKET_BYTES)
        key = secrets.token_bytes(KEY_BYTES)
        self._tickets[ticket] = _Ticket(sender, key, now + self.config.ticket_s)
        return msgpack.packb({"v": 1, "port": self.port, "ticket": ticket, "key": key})

    async def _accept(self, stream: trio.SocketStream) -> None:
        if len(self._all) + self._pending >= self.config.max_lanes:
            self.count("lane_refused")
            await stream.aclose()
            return
        need = len(MAGIC) + TICKET_BYTES
        got = bytearray()
        self._pending += 1
        try:
            with trio.move_on_after(self.config.open_timeout_s):
                while len(got) < need:
                    chunk = await stream.receive_some(need - len(got))
                    if not chunk:
                        break
                    got += chunk
        except (trio.BrokenResourceError, OSError):
            pass
        finally:
            self._pending -= 1
        t = self._tickets.pop(bytes(got[len(MAGIC):]), None) if got[:len(MAGIC)] == MAGIC else None
        if t is None or t.expires <= trio.current_time() or len(got) != need:
            self.count("lane_refused")
            await stream.aclose()
            return
        mine = [lane for lane in self._all if lane.peer == t.peer]
        for old in mine[:max(len(mine) - self.config.max_per_peer + 1, 0)]:
            old.kill()  # one peer cannot hold every lane
        lane = _Lane(stream, t.peer, t.key, opener=False, owner=self)
        self._add(lane, current=False)
        try:
            await lane.write(_BODY.pack(HELLO, 0, 0))
        except (LaneDown, trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            return
        self._lanes[lane.peer] = lane  # after HELLO: nothing of ours may precede it
        self.count("lanes_accepted")
        await lane.run()

    def serve(self, lane: _Lane, rid: int, proto: bytes, data: bytes) -> None:
        self._nursery.start_soon(self._serve, lane, rid, proto, data)

    async def _serve(self, lane: _Lane, rid: int, proto: bytes, data: bytes) -> None:
        try:
            await self._answer(lane, rid, proto, data)
        finally:
            lane._inflight.release()

    async def _answer(self, lane: _Lane, rid: int, proto: bytes, data: bytes) -> None:
        self.count("lane_requests_in")
        self._c.bytes_in += len(data)
        name = proto.decode(errors="replace")
        handler = self._handlers.get(name) if self.carries(name) else None
        if handler is None:
            await lane.reply(rid, ERR, b"no handler for " + proto[:64])
            return
        try:
            resp = await handler(lane.peer, data)
        except Exception:
            log.exception("request handler for %s failed (lane)", name)
            await lane.reply(rid, ERR, b"handler failed")
            return
        if len(resp) > self.max_frame:
            log.error("handler for %s returned %d bytes > max_frame", name, len(resp))
            await lane.reply(rid, ERR, b"response too large")
            return
        self._c.bytes_out += len(resp)
        await lane.reply(rid, RESP, resp)

    # -- the opener's side -------------------------------------------------------
    def get(self, peer: str) -> _Lane | None:
        """The live lane to ``peer``, if any; else start opening one (once)."""
        lane = self._lanes.get(peer)
        if lane is not None and lane.alive:
            return lane
        if peer not in self._opening and trio.current_time() >= self._retry.get(peer, (0.0, 0.0))[0]:
            self._opening.add(peer)
            self._nursery.start_soon(self._open, peer)
        return None

    async def _open(self, peer: str) -> None:
        stream: trio.SocketStream | None = None
        lane: _Lane | None = None
        try:
            with trio.fail_after(self.config.open_timeout_s):
                addr, raw = await self._hello(peer)
                port, ticket, key = _parse_offer(raw)
                stream = await trio.open_tcp_stream(addr, port)
                await stream.send_all(MAGIC + ticket)
                lane = _Lane(stream, peer, key, opener=True, owner=self)
                self._add(lane, current=False)
                self._nursery.start_soon(lane.run)
                await lane.hello.wait()
            if not lane.alive:
                raise LaneDown("refused", sent=False)
        except Exception as exc:
            self.count("lane_open_failures")
            backoff = self._retry.get(peer, (0.0, self.config.retry_s / 2))[1]
            backoff = min(2 * backoff, self.config.retry_max_s)
            self._retry[peer] = (trio.current_time() + backoff, backoff)
            log.debug("no lane to %s (retry in %.0f s): %r", peer[:16], backoff, exc)
            if lane is not None:
                lane.kill()
            elif stream is not None:
                stream.socket.close()
            return
        finally:
            self._opening.discard(peer)
        self._retry.pop(peer, None)
        self._lanes[peer] = lane
        self.count("lanes_opened")

    # -- bookkeeping ------------------------------------------------------------
    def _add(self, lane: _Lane, current: bool = True) -> None:
        self._all[lane] = None
        if current:
            self._lanes[lane.peer] = lane

    def kill_soon(self, lane: _Lane) -> None:
        """From a worker thread: end ``lane`` in the event loop."""
        try:
            self._token.run_sync_soon(lane.kill)
        except trio.RunFinishedError:
            pass

    def forget(self, lane: _Lane) -> None:
        self._all.pop(lane, None)
        if self._lanes.get(lane.peer) is lane:
            del self._lanes[lane.peer]

    def timed_out(self, lane: _Lane, frames_before: int) -> None:
        """A request on ``lane`` got no answer in time. If nothing at all
        arrived on the lane meanwhile, it is taken for dead (a peer gone
        without a reset, a half-open connection): it ends, so the next request
        opens a new lane or goes over libp2p instead of waiting again."""
        if lane.frames_in == frames_before:
            lane.kill()

    def close(self) -> None:
        for lane in list(self._all):
            lane.kill()

    def live(self) -> int:
        return len(self._all)


def _parse_offer(raw: bytes) -> tuple[int, bytes, bytes]:
    """The acceptor's answer to a hello: ``(port, ticket, key)``; ValueError if bad."""
    msg = msgpack.unpackb(raw, raw=False, max_bin_len=64, max_str_len=64, max_map_len=8,
                          max_array_len=0)
    if not isinstance(msg, dict) or msg.get("v") != 1:
        raise ValueError(f"bad lane offer {msg!r:.80}")
    if "error" in msg:
        raise ValueError(f"lane refused: {msg['error']!r:.40}")
    port, ticket, key = msg.get("port"), msg.get("ticket"), msg.get("key")
    if (type(port) is not int or not 0 < port < 65536 or not isinstance(ticket, bytes)
            or len(ticket) != TICKET_BYTES or not isinstance(key, bytes) or len(key) != KEY_BYTES):
        raise ValueError("bad lane offer fields")
    return port, ticket, key
