"""In-process ``Transport`` over trio memory channels (tests, simulator trio mode).

Usage (everything lives in one ``trio.run``)::

    net = MemoryNetwork()
    a = net.add(Identity.generate())      # a MemoryTransport, ready at once
    b = net.add(Identity.generate())
    await a.connect(b.listen_addrs()[0])  # optional: send() auto-"dials"
    await a.send(b.peer_id, b"hi")
    msg = await b.receive()               # Incoming("direct", a.peer_id, b"hi")

No background tasks are needed: delivery is a ``send_nowait`` into the
receiver's bounded inbox, so ``net.add`` is a plain function and nothing has
to be entered or closed (``aclose`` detaches a transport from the network).

Semantics, chosen to mimic the libp2p transport closely enough for tests:

* addresses are fake multiaddrs ``/memory/<n>/p2p/<peer_id>``;
* ``send``/``request`` to a peer that is down, closed or unknown raises
  ``PeerUnreachable``; a message is *not* delivered when the ``drop`` hook
  returns true for it (counted in ``net.dropped``), nor when the receiver's
  inbox is full (bounded; counted in ``net.overflowed`` and in the receiving
  transport's ``overflowed``) - best effort, like a real network;
* ``publish`` delivers to every *other* live transport subscribed to the topic
  (no mesh: full flooding) with ``sender`` = the publisher; our own
  publications are not delivered back to us;
* a ``request`` runs the remote handler in the caller's task (bounded by
  ``trio.fail_after(timeout)`` -> ``TransportTimeout``); a missing handler or
  a handler that raises gives ``PeerUnreachable`` (like a reset stream).
* frames larger than ``max_frame`` raise ``LocalProtocolError("frame-too-large")``.

Knobs: ``net.set_down(peer_id, True)`` makes a peer unreachable (both ways:
it can neither send nor receive); ``net.drop = fn(channel, sender, receiver,
data) -> bool`` drops chosen messages (``channel`` is ``"direct"``,
``"pubsub"`` or ``"request"``; a dropped request raises ``TransportTimeout``
immediately without waiting).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import trio

from ..core.identity import Identity
from ..errors import LocalProtocolError, PeerUnreachable, TransportTimeout
from ..runtime.ports import Incoming, RequestHandler

__all__ = ["MemoryNetwork", "MemoryTransport", "MemoryStatistics", "DropFn"]

#: ``drop(channel, sender_peer_id, receiver_peer_id, data) -> True to drop``
DropFn = Callable[[str, str, str, bytes], bool]


@dataclass(frozen=True, slots=True)
class MemoryStatistics:
    frames_in: int
    frames_out: int
    bytes_in: int
    bytes_out: int
    requests_in: int
    requests_out: int
    overflowed: int
    send_failures: int


class MemoryNetwork:
    """The shared medium: a registry of transports plus failure knobs."""

    def __init__(self, *, inbox_size: int = 1024, max_frame: int = 4 * 1024 * 1024) -> None:
        self.inbox_size = inbox_size
        self.max_frame = max_frame
        self.drop: DropFn | None = None
        self.dropped = 0
        self.overflowed = 0
        self._peers: dict[str, MemoryTransport] = {}
        self._down: set[str] = set()
        self._counter = 0

    def add(self, identity: Identity, *, inbox_size: int | None = None) -> "MemoryTransport":
        if identity.peer_id in self._peers:
            raise LocalProtocolError("duplicate-peer", identity.peer_id)
        self._counter += 1
        t = MemoryTransport(self, identity, self._counter, inbox_size or self.inbox_size)
        self._peers[identity.peer_id] = t
        return t

    def set_down(self, peer_id: str, down: bool = True) -> None:
        """Make ``peer_id`` unreachable (``down=True``) or reachable again."""
        if down:
            self._down.add(peer_id)
            for t in self._peers.values():
                t._connected.discard(peer_id)
            if peer_id in self._peers:
                self._peers[peer_id]._connected.clear()
        else:
            self._down.discard(peer_id)

    def is_down(self, peer_id: str) -> bool:
        return peer_id in self._down

    def transports(self) -> list["MemoryTransport"]:
        return list(self._peers.values())

    # -- internals ---------------------------------------------------------
    def _reachable(self, src: str, dst: str) -> "MemoryTransport":
        t = self._peers.get(dst)
        if t is None or t._closed or dst in self._down or src in self._down:
            raise PeerUnreachable(f"memory peer {dst[:16]} unreachable")
        return t

    def _dropped(self, channel: str, src: str, dst: str, data: bytes) -> bool:
        if self.drop is not None and self.drop(channel, src, dst, data):
            self.dropped += 1
            return True
        return False


class MemoryTransport:
    """One peer on a ``MemoryNetwork``; implements ``fedswarm.runtime.ports.Transport``."""

    def __init__(self, net: MemoryNetwork, identity: Identity, index: int, inbox_size: int) -> None:
        self._net = net
        self._identity = identity
        self._addr = f"/memory/{index}/p2p/{identity.peer_id}"
        self._send, self._recv = trio.open_memory_channel[Incoming](inbox_size)
        self._topics: set[str] = set()
        self._handlers: dict[str, RequestHandler] = {}
        self._connected: set[str] = set()
        self._known_addrs: dict[str, list[str]] = {}
        self._closed = False
        self.overflowed = 0
        self._frames_in = self._frames_out = self._bytes_in = self._bytes_out = 0
        self._requests_in = self._requests_out = self._send_failures = 0

    # -- identity / addresses ------------------------------------------------
    @property
    def peer_id(self) -> str:
        return self._identity.peer_id

    def listen_addrs(self) -> list[str]:
        return [] if self._closed else [self._addr]

    def add_peer_addrs(self, peer_id: str, addrs: Sequence[str]) -> None:
        known = self._known_addrs.setdefault(peer_id, [])
        for a in addrs:
            if a not in known:
                known.append(a)

    async def connect(self, multiaddr: str) -> str:
        await trio.lowlevel.checkpoint()
        self._check_open()
        parts = multiaddr.strip("/").split("/")
        if len(parts) != 4 or parts[0] != "memory" or parts[2] != "p2p":
            raise PeerUnreachable(f"not a memory multiaddr: {multiaddr}")
        peer = parts[3]
        target = self._net._reachable(self.peer_id, peer)
        if target._addr != multiaddr:
            raise PeerUnreachable(f"no memory peer listens on {multiaddr}")
        self._link(target)
        return peer

    def connected_peers(self) -> list[str]:
        return sorted(
            p for p in self._connected if p in self._net._peers and not self._net._peers[p]._closed
        )

    # -- messaging -----------------------------------------------------------
    async def send(self, peer_id: str, data: bytes) -> None:
        await trio.lowlevel.checkpoint()
        self._check_open()
        self._check_size(data)
        try:
            target = self._net._reachable(self.peer_id, peer_id)
        except PeerUnreachable:
            self._send_failures += 1
            raise
        self._link(target)
        self._frames_out += 1
        self._bytes_out += len(data)
        if self._net._dropped("direct", self.peer_id, peer_id, data):
            return
        target._deliver(Incoming("direct", self.peer_id, bytes(data)))

    async def subscribe(self, topic: str) -> None:
        await trio.lowlevel.checkpoint()
        self._check_open()
        self._topics.add(topic)

    async def publish(self, topic: str, data: bytes) -> None:
        await trio.lowlevel.checkpoint()
        self._check_open()
        self._check_size(data)
        if self.peer_id in self._net._down:
            return
        self._frames_out += 1
        self._bytes_out += len(data)
        for pid, t in list(self._net._peers.items()):
            if pid == self.peer_id or t._closed or topic not in t._topics or pid in self._net._down:
                continue
            if self._net._dropped("pubsub", self.peer_id, pid, data):
                continue
            t._deliver(Incoming("pubsub", self.peer_id, bytes(data), topic))

    async def receive(self) -> Incoming:
        try:
            return await self._recv.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise PeerUnreachable("transport closed") from None

    def set_request_handler(self, protocol: str, handler: RequestHandler) -> None:
        self._handlers[protocol] = handler

    async def request(self, peer_id: str, protocol: str, data: bytes, *, timeout: float) -> bytes:
        self._check_open()
        self._check_size(data)
        try:
            with trio.fail_after(timeout):
                await trio.lowlevel.checkpoint()
                target = self._net._reachable(self.peer_id, peer_id)
                self._link(target)
                self._requests_out += 1
                self._bytes_out += len(data)
                if self._net._dropped("request", self.peer_id, peer_id, data):
                    raise TransportTimeout(f"request to {peer_id[:16]} dropped")
                handler = target._handlers.get(protocol)
                if handler is None:
                    raise PeerUnreachable(f"{peer_id[:16]} does not serve {protocol}")
                target._requests_in += 1
                target._bytes_in += len(data)
                try:
                    response = await handler(self.peer_id, bytes(data))
                except trio.Cancelled:
                    raise
                except Exception as exc:
                    raise PeerUnreachable(f"handler for {protocol} failed: {exc!r}") from None
                # the peer may have gone down while the handler ran
                self._net._reachable(self.peer_id, peer_id)
                self._bytes_in += len(response)
                return bytes(response)
        except trio.TooSlowError:
            raise TransportTimeout(f"request {protocol} to {peer_id[:16]} timed out") from None
        except PeerUnreachable:
            self._send_failures += 1
            raise

    def statistics(self) -> MemoryStatistics:
        return MemoryStatistics(
            frames_in=self._frames_in,
            frames_out=self._frames_out,
            bytes_in=self._bytes_in,
            bytes_out=self._bytes_out,
            requests_in=self._requests_in,
            requests_out=self._requests_out,
            overflowed=self.overflowed,
            send_failures=self._send_failures,
        )

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()
        if self._closed:
            return
        self._closed = True
        for pid in list(self._connected):
            other = self._net._peers.get(pid)
            if other is not None:
                other._connected.discard(self.peer_id)
        self._connected.clear()
        self._send.close()

    # -- internals -----------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise PeerUnreachable("transport closed")

    def _check_size(self, data: bytes) -> None:
        if len(data) > self._net.max_frame:
            raise LocalProtocolError(
                "frame-too-large", f"{len(data)} bytes > max_frame {self._net.max_frame}"
            )

    def _link(self, other: "MemoryTransport") -> None:
        self._connected.add(other.peer_id)
        other._connected.add(self.peer_id)

    def _deliver(self, msg: Incoming) -> None:
        try:
            self._send.send_nowait(msg)
        except trio.WouldBlock:
            self.overflowed += 1
            self._net.overflowed += 1
            return
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            return
        self._frames_in += 1
        self._bytes_in += len(msg.data)

    def __repr__(self) -> str:
        return f"<MemoryTransport {self.peer_id[:16]}>"
