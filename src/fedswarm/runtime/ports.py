"""Ports: the interfaces the trio runtime is written against.

The sans-IO core never sees these; the runtime (``fedswarm.runtime.agent``)
turns core effects into calls on a ``Transport`` and a ``Clock`` and feeds what
arrives back into the core. Implementations:

* ``fedswarm.net.libp2p.Libp2pTransport``: py-libp2p (TCP, Noise, yamux,
  GossipSub) for real swarms;
* ``fedswarm.net.memory.MemoryNetwork/MemoryTransport``: trio memory
  channels, for tests and the simulator's trio mode.

All message payloads are opaque ``bytes`` here: framing/encoding of fedswarm
messages is the core's business (``fedswarm.core.wire``), sizes are bounded by
the transport (``max_frame``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Awaitable, Callable, Protocol, Sequence

__all__ = ["Incoming", "RequestHandler", "Transport", "Clock"]


@dataclass(frozen=True, slots=True)
class Incoming:
    """One message that arrived from the network.

    ``channel`` is ``"direct"`` for a one-way message sent to us with
    ``Transport.send`` and ``"pubsub"`` for a message received on a topic; for
    pubsub ``topic`` names it. ``sender`` is the transport-authenticated peer
    id (base58 libp2p id string) of the hop that delivered it; the core still
    verifies the author's signature inside ``data``.
    """

    channel: str
    sender: str
    data: bytes
    topic: str = ""


#: ``handler(sender_peer_id, request_bytes) -> response_bytes``
RequestHandler = Callable[[str, bytes], Awaitable[bytes]]


class Transport(Protocol):
    """A peer's connection to the swarm.

    Errors: methods raise ``fedswarm.errors.PeerUnreachable`` or
    ``TransportTimeout``; no library-specific exception escapes.
    """

    @property
    def peer_id(self) -> str:
        """Our own peer id (libp2p base58 form, e.g. ``12D3KooW...``)."""
        ...

    def listen_addrs(self) -> list[str]:
        """Full multiaddrs others can dial, ending in ``/p2p/<peer_id>``."""
        ...

    def add_peer_addrs(self, peer_id: str, addrs: Sequence[str]) -> None:
        """Remember how to dial a peer learnt about through gossip."""
        ...

    async def connect(self, multiaddr: str) -> str:
        """Dial a full multiaddr (with ``/p2p/``); return the peer id."""
        ...

    async def send(self, peer_id: str, data: bytes) -> None:
        """Deliver one opaque message to a peer, best effort, reusing a stream."""
        ...

    async def publish(self, topic: str, data: bytes) -> None:
        """Publish on a pubsub topic we are subscribed to."""
        ...

    async def subscribe(self, topic: str) -> None:
        """Start receiving a topic's messages through ``receive``."""
        ...

    async def receive(self) -> Incoming:
        """Wait for the next direct or pubsub message."""
        ...

    def set_request_handler(self, protocol: str, handler: RequestHandler) -> None:
        """Serve request/response calls under ``protocol`` (``/fedswarm/...``)."""
        ...

    async def request(self, peer_id: str, protocol: str, data: bytes, *, timeout: float) -> bytes:
        """One request/response round trip over a reused stream."""
        ...

    def connected_peers(self) -> list[str]:
        """Peer ids with a live connection."""
        ...

    async def aclose(self) -> None:
        """Close every connection and stop listening."""
        ...


class Clock(Protocol):
    """Where the runtime gets time from (``trio.current_time`` based, or wall)."""

    def now(self) -> float:
        """Seconds on the clock the core's timestamps use."""
        ...
