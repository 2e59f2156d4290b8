"""``Transport`` on py-libp2p 0.8.1 (trio): TCP + Noise + yamux + GossipSub.

Entry point::

    async with open_libp2p_transport(identity, "/ip4/127.0.0.1/tcp/0",
                                     bootstrap=[...], config=Libp2pConfig()) as t:
        await t.send(peer, b"...")

Stack choices
-------------
* **Security: Noise only** (``/noise``, XX handshake, ChaCha20-Poly1305 from
  ``cryptography``). py-libp2p's default ``sec_opt`` also offers TLS, SECIO and
  *plaintext*; we drop all three: plaintext and SECIO are insecure/deprecated
  and the TLS transport is flagged by py-libp2p itself as limited (mutual auth
  through Python's ``ssl``). Every fedswarm peer runs this code, so no fallback
  is needed.
* **Muxer: yamux only** (``/yamux/1.0.0``): per-stream flow control with
  auto-tuned windows (256 KiB growing to 16 MiB); mplex has no flow control
  (one slow stream stalls the connection) and is deprecated in the spec.
* **TCP, not QUIC**: py-libp2p 0.8.1's other stacks cost as much or more
  per message on loopback (``benchmarks/libp2p_roundtrip.py``,
  docs/benchmarks.md): a round trip over mplex costs 0.95-1.4x yamux's CPU
  (and mplex has no flow control), over QUIC (aioquic) 3-5x; a new stream
  per request 4-8x (hence the pooled streams below).
* **Key**: the host's key pair is built from ``identity``'s Ed25519 key, so
  ``transport.peer_id == identity.peer_id`` and the Noise-authenticated remote
  id is the fedswarm peer id.
* **Dial delay workaround**: py-libp2p's swarm waits a fixed 250 ms "happy
  eyeballs" delay after *every* dial unless the per-peer connection cap is
  reached (``swarm.dial_peer``: success only cancels when
  ``len(connections) >= max_connections_per_peer``, default 3). We set
  ``max_connections_per_peer=1`` which makes a successful dial return at once
  (connect: ~250 ms -> a few ms on loopback).
* **No SO_REUSEPORT**: py-libp2p 0.8.1 sets it on its listening (and
  hole-punch dialling) sockets, which lets a second daemon bind a port the
  first one listens on and take part of its connections. fedswarm does no
  hole punching, so ``_set_reuse_flags`` is replaced by one that sets
  SO_REUSEADDR only, and the listen port is checked free before the host
  starts (``addrs.check_tcp_free``): a port in use is an ``InputError``.
* **Advertised addresses**: ``listen_addrs()`` never shows a wildcard: a
  host listening on 0.0.0.0 (or ::) lists this machine's interface
  addresses; ``set_announce(addrs)`` replaces them with the operator's
  ``--announce`` addresses.

Framing (``/fedswarm/msg/1.0.0`` and every request/response protocol)
------------------------------------------------------------------------
Each frame is a **4-byte big-endian unsigned length** followed by that many
payload bytes (fixed-size header: one ``struct`` call, no varint loop, and
``max_frame`` stays far below 4 GiB anyway). A frame announcing more than
``config.max_frame`` bytes is refused: the stream is reset, the frame is
counted in ``oversize_rejected`` and the connection and transport keep working.
Sending a frame above our own ``max_frame`` raises ``LocalProtocolError``.

Stream reuse
------------
* ``send``: one long-lived outbound stream per peer, guarded by a per-peer
  lock so frames never interleave; a new stream is opened (once, then the
  error is raised) only when a write on the old one fails.
* ``request``: a pool of idle streams per ``(peer, protocol)``. A request
  borrows an idle stream (or opens one when all are busy, so concurrent
  requests proceed in parallel), writes one frame, reads one response frame
  and returns the stream to the pool, so a request to a connected peer with a
  warm pool costs exactly one round trip. A stream whose request timed out or
  failed is reset, never reused. The server reads requests sequentially per
  stream and answers each with one frame; a handler that raises resets the
  stream (the caller sees ``PeerUnreachable``).

Errors: anything py-libp2p raises while dialling, negotiating or doing stream
I/O is mapped to ``PeerUnreachable``; deadlines (``trio.fail_after``) to
``TransportTimeout``.

Peer discovery
--------------
Bootstrap multiaddrs are dialled on open; ``add_peer_addrs`` fills the
peerstore so ``send``/``request`` to a not-yet-connected peer dials it. A
Kademlia DHT (py-libp2p ``KadDHT``, **server/routing mode**, private protocol
``/fedswarm/kad/1.0.0``, random walk off) runs beside: every peer we connect
to (either direction) is added to its routing table, and when opening a
stream to a peer fails because we cannot dial it, ``find_peer`` asks the DHT
for its addresses (bounded by ``dial_timeout``) and the open is retried once.
Tested: A-B-C line, A finds C's address through B. Disable with
``Libp2pConfig(dht=False)``.
"""

from __future__ import annotations

import logging
import os
import struct
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, fields, make_dataclass
from typing import Any, AsyncIterator, Callable, Sequence

import multiaddr
import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import Ed25519PrivateKey as _LibEd25519PrivateKey
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.x25519 import create_new_key_pair as _new_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.network.config import ConnectionConfig
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.pubsub.gossipsub import PROTOCOL_ID as _MESHSUB_V10
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11 as _MESHSUB_V11
from libp2p.pubsub.gossipsub import GossipSub
from libp2p.pubsub.pubsub import Pubsub
from libp2p.pubsub.score import ScoreParams, TopicScoreParams
from libp2p.security.noise.transport import PROTOCOL_ID as _NOISE_ID
from libp2p.security.noise.transport import Transport as _NoiseTransport
import libp2p.stream_muxer.yamux.yamux as _yamux_mod
import libp2p.transport.tcp.tcp as _tcp_mod
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as _YAMUX_ID
from libp2p.stream_muxer.yamux.yamux import Yamux
from libp2p.tools.anyio_service import background_trio_service

import msgpack

from ..core.identity import Identity
from ..errors import LocalProtocolError, PeerUnreachable, TransportTimeout
from .addrs import advertised_addrs, check_tcp_free, parse_listen_maddr
from .lane import LANE_PROTOCOL, LaneConfig, LaneDown, Lanes, Sent
from ..runtime.ports import Incoming, RequestHandler

__all__ = [
    "Libp2pConfig",
    "Libp2pStatistics",
    "Libp2pTransport",
    "open_libp2p_transport",
    "MSG_PROTOCOL",
]

log = logging.getLogger(__name__)

MSG_PROTOCOL = "/fedswarm/msg/1.0.0"
_HDR = struct.Struct(">I")
_READ_CHUNK = 1 << 20
_ADDR_TTL = 24 * 3600
TEARDOWN_S = 10.0  # after the body: how long py-libp2p's services and host get to stop


def _set_reuseaddr_only(sock) -> None:  # noqa: ANN001 - trio socket
    """SO_REUSEADDR (restart on a port in TIME_WAIT), never SO_REUSEPORT."""
    import socket as _socket

    try:
        sock.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEADDR, 1)
    except OSError:
        pass


# see "No SO_REUSEPORT" above; the library looks the helper up at call time
_tcp_mod._set_reuse_flags = _set_reuseaddr_only


@dataclass(frozen=True)
class Libp2pConfig:
    """Knobs of the libp2p transport (defaults suit a real swarm)."""

    max_frame: int = 4 * 1024 * 1024
    #: bounded inbox between the network tasks and ``receive()``; when full,
    #: direct-stream readers wait (backpressure through yamux windows) and
    #: pubsub messages queue in py-libp2p's subscription channel.
    inbox_size: int = 1024
    dial_timeout: float = 10.0
    send_timeout: float = 30.0
    #: idle request streams kept per (peer, protocol)
    max_idle_request_streams: int = 16
    # --- GossipSub (spec values; see _make_gossipsub for py-libp2p's defaults)
    gossip_d: int = 6
    gossip_d_low: int = 4
    gossip_d_high: int = 12
    heartbeat_interval: float = 1.0
    heartbeat_initial_delay: float = 0.1
    gossip_window: int = 3
    gossip_history: int = 5
    fanout_ttl: int = 60
    prune_backoff: int = 60
    peer_scoring: bool = True
    #: pubsub "seen" cache TTL (seconds) for de-duplication
    seen_ttl: int = 120
    #: largest yamux DATA frame we *send* (py-libp2p default 64 KiB); see
    #: ``_tune_yamux``. ``None`` leaves the library value alone.
    yamux_max_message_size: int | None = 256 * 1024
    #: a yamux receiver gives the sender credit back once this many bytes
    #: (or half the stream's window, if less) were read; ``None``: py-libp2p
    #: 0.8.1 as is (a WINDOW_UPDATE after nearly every read). See ``_tune_yamux``.
    yamux_credit_bytes: int | None = 64 * 1024
    #: run a Kademlia DHT (server mode) to find addresses of unknown peers
    dht: bool = True
    #: direct lanes (``fedswarm.net.lane``): the requests of ``lane.protocols``
    #: (the LLM's hidden states) on a sealed TCP connection keyed over libp2p,
    #: listening on the libp2p listen host at ``lane_port`` (0: any free port)
    lane: bool = True
    lane_port: int = 0
    lane_config: LaneConfig = LaneConfig()


@dataclass(frozen=True, slots=True)
class Libp2pStatistics:
    """Counters; bytes are payload bytes of fedswarm frames (not headers)."""

    bytes_in: int = 0
    bytes_out: int = 0
    frames_in: int = 0
    frames_out: int = 0
    oversize_rejected: int = 0
    send_failures: int = 0
    direct_streams_opened: int = 0
    direct_streams_accepted: int = 0
    request_streams_opened: int = 0
    request_streams_accepted: int = 0
    requests_out: int = 0
    requests_in: int = 0
    request_timeouts: int = 0
    request_failures: int = 0
    direct_streams_broken: int = 0
    dht_lookups: int = 0
    dht_found: int = 0
    pubsub_in: int = 0
    pubsub_out: int = 0
    lanes_opened: int = 0
    lanes_accepted: int = 0
    lane_requests_out: int = 0
    lane_requests_in: int = 0
    lane_refused: int = 0
    lane_failures: int = 0
    lane_open_failures: int = 0


#: the mutable twin of ``Libp2pStatistics`` (same fields), updated in place
_Counters = make_dataclass("_Counters", [(f.name, int, 0) for f in fields(Libp2pStatistics)])


class _Oversize(Exception):
    pass


class _FramedStream:
    """A libp2p stream with a read buffer for length-prefixed frames."""

    __slots__ = ("stream", "_buf", "broken")

    def __init__(self, stream) -> None:  # noqa: ANN001 - py-libp2p INetStream
        self.stream = stream
        self._buf = bytearray()
        self.broken = False

    async def read_frame(self, max_frame: int) -> bytes | None:
        """Next frame; ``None`` on a clean EOF between frames."""
        buf = self._buf
        while len(buf) < 4:
            chunk = await self._read()
            if not chunk:
                if buf:
                    raise EOFError("EOF inside a frame header")
                return None
            buf += chunk
        (n,) = _HDR.unpack_from(buf)
        if n > max_frame:
            raise _Oversize(n)
        need = 4 + n
        while len(buf) < need:
            chunk = await self._read()
            if not chunk:
                raise EOFError("EOF inside a frame")
            buf += chunk
        data = bytes(buf[4:need])
        del buf[:need]
        return data

    async def _read(self) -> bytes:
        try:
            return await self.stream.read(_READ_CHUNK)
        except Exception as exc:  # StreamEOF, StreamReset, MuxedStream*, ...
            if type(exc).__name__ in ("StreamEOF", "MuxedStreamEOF", "EOFError"):
                return b""
            raise

    async def write_frame(self, data: bytes) -> None:
        await self.stream.write(_HDR.pack(len(data)) + data)

    async def reset(self) -> None:
        self.broken = True
        try:
            await self.stream.reset()
        except Exception:
            pass


def _tune_yamux(config: Libp2pConfig) -> None:
    """Throughput tuning of py-libp2p's yamux (process-wide: module globals/env).

    * ``MAX_MESSAGE_SIZE`` (64 KiB, copied from go-yamux's *sender* default)
      -> 256 KiB: per-frame Python overhead (header parsing, 2 locks, a task
      hop, a Noise record split) dominates bulk cost; measured CPU per MiB sent
      and received drops ~6.9 -> ~4.4 ms. Receivers accept DATA frames up to
      their window (py-libp2p: 16 MiB, go-yamux: window), and sends never
      exceed the peer's window, so this is wire-compatible. Larger frames add
      head-of-line delay for other streams of the same connection (~1 ms per
      256 KiB frame here), hence not 1 MiB.
    * ``PY_YAMUX_RELEASE_ON_READ=0`` (default "1"): meant to batch credit
      like go-yamux; in 0.8.1 it only turns off one of the library's branches
      that credit a read (see the next point). ``setdefault`` so an explicit
      environment value still wins; only used with ``yamux_credit_bytes=None``.
    * Credit (``yamux_credit_bytes``, 64 KiB): even with that setting
      py-libp2p 0.8.1 still sends a WINDOW_UPDATE for nearly every read (its
      "partial slack" branch credits any delta below the half-window
      threshold): a 2.4 kB request/response pair carried one update frame
      every second call, each costing both sides a Noise record, a socket
      write and a yamux frame parse. ``_batched_credit`` replaces the
      stream's credit step: credit once ``target - (window + buffered)``
      reaches 64 KiB or half the target (go-yamux's rule), with the
      library's own window auto-tuning. Small requests then send one update
      per ~27 calls (2.4 kB each); a bulk reader (reads of 256 KiB frames)
      still credits after every read, since the library's sender polls every
      10 ms once its window is empty (go-yamux's half-window rule alone
      took ``benchmarks/transport.py --bulk-mb 64`` from 181 to 102 MB/s in
      one run; with the 64 KiB bound it stays at the library's, 127-144
      against 144-153 MB/s in two runs). Round trips: see
      ``benchmarks/libp2p_roundtrip.py`` (``fedswarm`` against
      ``fedswarm-libcredit``) and docs/benchmarks.md.
    * Windows: already auto-tuned by py-libp2p (256 KiB initial, doubling up
      to 16 MiB per stream) - nothing to change.
    """
    os.environ.setdefault("PY_YAMUX_RELEASE_ON_READ", "0")
    if config.yamux_max_message_size is not None:
        _yamux_mod.MAX_MESSAGE_SIZE = int(config.yamux_max_message_size)
    global _CREDIT_BYTES
    if config.yamux_credit_bytes is None:
        _yamux_mod.YamuxStream._auto_tune_and_send_window_update = _LIBRARY_CREDIT  # type: ignore[method-assign]
    else:
        if config.yamux_credit_bytes < 1:
            raise LocalProtocolError("bad-config", "yamux_credit_bytes must be >= 1 (or None)")
        _CREDIT_BYTES = int(config.yamux_credit_bytes)
        _yamux_mod.YamuxStream._auto_tune_and_send_window_update = _batched_credit  # type: ignore[method-assign]


_LIBRARY_CREDIT = _yamux_mod.YamuxStream._auto_tune_and_send_window_update
_CREDIT_BYTES = 64 * 1024


async def _batched_credit(self, *, bytes_read: int = 0) -> None:  # noqa: ANN001 - a YamuxStream
    """Give the sender credit once ``_CREDIT_BYTES`` (or half the target
    window, if less) were consumed (read, not just buffered)."""
    async with self.window_lock:
        buffered = len(self.conn.stream_buffers.get(self.stream_id, b""))
        delta = self.target_recv_window - (self.recv_window + buffered)
        if delta <= 0 or delta < min(_CREDIT_BYTES, self._grow_threshold()):
            return
        total = self._grow_to_delta(buffered) + self._apply_autotune_epoch(buffered)
        self._pending_recv_release = 0
    if total > 0:
        await self.send_window_update(total, skip_lock=True)


def _keypair_from_identity(identity: Identity) -> KeyPair:
    sk = _LibEd25519PrivateKey.from_bytes(identity.private_bytes())
    return KeyPair(sk, sk.get_public_key())


def _score_params() -> ScoreParams:
    """GossipSub v1.1 peer scoring for a small cooperative swarm.

    py-libp2p's ``PeerScorer`` *subtracts* P4 (invalid messages), P5
    (behaviour penalty) and P7 (IP colocation) using positive weights (the
    spec writes negative weights and adds). Values:

    * P1 time in mesh: weight 0.01, cap 10 (tiny bonus for stable mesh peers);
    * P2 first deliveries: weight 1, cap 50, decay 0.9/heartbeat;
    * P3 mesh delivery deficit: off (needs activation windows py-libp2p lacks);
    * P4 invalid messages: weight 10, cap 100, decay 0.5 (fedswarm validates
      signatures above the transport; py-libp2p only counts topic-validator
      rejections and bad pubsub signatures here);
    * P5 behaviour penalty (spam, IWANT/IHAVE floods, GRAFT during backoff):
      weight 1 above a threshold of 5, decay 0.9;
    * P7 IP colocation: off - test swarms and lab clusters share one IP/NAT.

    Thresholds: gossip -10, publish -50, graylist -80, accept PX +10.
    """
    return ScoreParams(
        p1_time_in_mesh=TopicScoreParams(weight=0.01, cap=10.0, decay=1.0),
        p2_first_message_deliveries=TopicScoreParams(weight=1.0, cap=50.0, decay=0.9),
        p3_mesh_message_deliveries=TopicScoreParams(weight=0.0, cap=0.0, decay=1.0),
        p4_invalid_messages=TopicScoreParams(weight=10.0, cap=100.0, decay=0.5),
        p5_behavior_penalty_weight=1.0,
        p5_behavior_penalty_decay=0.9,
        p5_behavior_penalty_threshold=5.0,
        p7_ip_colocation_weight=0.0,
        publish_threshold=-50.0,
        gossip_threshold=-10.0,
        graylist_threshold=-80.0,
        accept_px_threshold=10.0,
    )


def _make_gossipsub(config: Libp2pConfig) -> GossipSub:
    """GossipSub with the spec's parameters.

    py-libp2p 0.8.1 defaults overridden here (spec value in brackets):

    * ``degree``/``degree_low``/``degree_high``: no defaults (its examples use
      3/2/4) [D=6, D_low=4, D_high=12];
    * ``heartbeat_interval=120`` s [1 s];
    * ``score_params=None`` -> all-zero weights, i.e. scoring inert [see
      ``_score_params``];
    * ``adaptive_gossip_enabled=True``: its "v2.0 adaptive" heartbeat code
      resets the heartbeat to 30-60 s (or >= 60 s) whenever its health score
      drops, e.g. when peers churn -> disabled;
    * ``spam_protection_enabled=True`` with ``max_messages_per_topic_per_second
      =10`` per forwarding peer: silently drops (and penalises) a peer's 11th
      message in a second - far too low for fedswarm bursts -> disabled (rate
      limiting is the core's business);
    * ``eclipse_protection_enabled=True`` with ``min_mesh_diversity_ips=3``:
      forces extra GRAFTs when the mesh lacks 3 distinct IPs, which is always
      the case on loopback/LAN test swarms -> disabled.

    Kept equal to the spec already: ``gossip_window=3``, ``gossip_history=5``,
    ``time_to_live`` (fanout TTL) = 60 s, ``prune_back_off=60``,
    ``heartbeat_initial_delay=0.1``. We speak ``/meshsub/1.1.0`` (fallback
    ``/meshsub/1.0.0``); py-libp2p's v1.2+ extras are not negotiated.
    """
    return GossipSub(
        protocols=[_MESHSUB_V11, _MESHSUB_V10],
        degree=config.gossip_d,
        degree_low=config.gossip_d_low,
        degree_high=config.gossip_d_high,
        time_to_live=config.fanout_ttl,
        gossip_window=config.gossip_window,
        gossip_history=config.gossip_history,
        heartbeat_initial_delay=config.heartbeat_initial_delay,
        heartbeat_interval=config.heartbeat_interval,  # type: ignore[arg-type]
        prune_back_off=config.prune_backoff,
        score_params=_score_params() if config.peer_scoring else None,
        adaptive_gossip_enabled=False,
        spam_protection_enabled=False,
        eclipse_protection_enabled=False,
    )


def _strip_p2p(addr: str) -> str:
    i = addr.find("/p2p/")
    return addr if i < 0 else addr[:i]


def _to_id(peer_id: str) -> ID:
    try:
        return ID.from_base58(peer_id)
    except Exception:
        raise PeerUnreachable(f"invalid peer id {peer_id!r}") from None


class Libp2pTransport:
    """``fedswarm.runtime.ports.Transport`` on a py-libp2p host.

    Create it with ``open_libp2p_transport``; the constructor is internal.
    """

    def __init__(self, identity: Identity, host, pubsub: Pubsub, gossipsub: GossipSub,
                 config: Libp2pConfig, nursery: trio.Nursery,
                 dht: KadDHT | None = None) -> None:  # noqa: ANN001
        self._identity = identity
        self._dht = dht
        self._host = host
        self._pubsub = pubsub
        self.gossipsub = gossipsub
        self.config = config
        self._nursery = nursery
        self._c = _Counters()
        self._in_send, self._in_recv = trio.open_memory_channel[Incoming](config.inbox_size)
        self._out: dict[str, _FramedStream] = {}
        self._out_locks: dict[str, trio.Lock] = {}
        self._idle: dict[tuple[str, str], list[_FramedStream]] = {}
        self._handlers: dict[str, RequestHandler] = {}
        self._topics: set[str] = set()
        self._closed = False
        self._my_id_bytes = host.get_id().to_bytes()
        host.set_stream_handler(TProtocol(MSG_PROTOCOL), self._serve_direct)
        self._lanes: Lanes | None = None
        if dht is not None:
            host.get_network().register_notifee(_DhtNotifee(self))
            for pid in host.get_connected_peers():
                self._nursery.start_soon(self._dht_add, pid)

    async def _dht_add(self, pid: ID) -> None:
        """Add a connected peer to the DHT routing table.

        For an *inbound* connection py-libp2p only learns the peer's listen
        addresses once identify has run, and ``add_peer`` refuses a peer
        without addresses, so retry with backoff (0.1 s .. ~6 s in all).
        """
        delay = 0.1
        for _ in range(7):
            if self._dht is None or self._closed:
                return
            try:
                if await self._dht.add_peer(pid, skip_server_mode_check=True):
                    return
            except Exception as exc:
                log.debug("DHT add_peer %s: %r", pid, exc)
            await trio.sleep(delay)
            delay *= 2

    async def _dht_lookup(self, pid: ID) -> bool:
        """Ask the DHT for ``pid``'s addresses; True if some were found."""
        if self._dht is None:
            return False
        self._c.dht_lookups += 1
        try:
            with trio.move_on_after(self.config.dial_timeout):
                info = await self._dht.find_peer(pid)
                if info is not None and info.addrs:
                    self._host.get_peerstore().add_addrs(pid, info.addrs, _ADDR_TTL)
                    self._c.dht_found += 1
                    return True
        except Exception as exc:
            log.debug("DHT find_peer %s: %r", pid, exc)
        return False

    # -- identity / addresses ------------------------------------------------
    @property
    def peer_id(self) -> str:
        return self._identity.peer_id

    @property
    def host(self):  # noqa: ANN201 - escape hatch for diagnostics/tests
        return self._host

    def set_announce(self, addrs: Sequence[str]) -> None:
        """Advertise ``addrs`` (``--announce``) instead of the listen addresses."""
        self._announce = list(addrs)

    def listen_addrs(self) -> list[str]:
        """Addresses to dial this peer at (with ``/p2p/``; never a wildcard)."""
        return advertised_addrs([str(a) for a in self._host.get_addrs()], self.peer_id,
                                getattr(self, "_announce", None))

    def add_peer_addrs(self, peer_id: str, addrs: Sequence[str]) -> None:
        pid = _to_id(peer_id)
        maddrs = []
        for a in addrs:
            try:
                maddrs.append(multiaddr.Multiaddr(_strip_p2p(a)))
            except Exception:
                log.debug("ignoring bad multiaddr %r for %s", a, peer_id)
        if maddrs:
            self._host.get_peerstore().add_addrs(pid, maddrs, _ADDR_TTL)

    async def connect(self, multiaddr_str: str) -> str:
        self._check_open()
        try:
            info = info_from_p2p_addr(multiaddr.Multiaddr(multiaddr_str))
        except Exception as exc:
            raise PeerUnreachable(f"bad multiaddr {multiaddr_str!r}: {exc}") from None
        # an explicit dial (a bootstrap peer, tried again after a failure) is
        # not refused by py-libp2p's negative cache of recently failed peers
        unblock = getattr(self._host.get_network(), "unblock_peer", None)
        if unblock is not None:
            unblock(info.peer_id)
        try:
            with trio.fail_after(self.config.dial_timeout):
                await self._host.connect(info)
        except trio.TooSlowError:
            raise TransportTimeout(f"dialling {multiaddr_str} timed out") from None
        except Exception as exc:
            raise PeerUnreachable(f"cannot dial {multiaddr_str}: {exc!r}") from None
        return info.peer_id.to_base58()

    def connected_peers(self) -> list[str]:
        return [p.to_base58() for p in self._host.get_connected_peers()]

    # -- direct messages -----------------------------------------------------
    async def send(self, peer_id: str, data: bytes) -> None:
        self._check_open()
        self._check_size(data)
        lock = self._out_locks.get(peer_id)
        if lock is None:
            lock = self._out_locks[peer_id] = trio.Lock()
        try:
            with trio.fail_after(self.config.send_timeout):
                async with lock:
                    for attempt in (0, 1):
                        fs = self._out.get(peer_id)
                        if fs is None or fs.broken:
                            fs = await self._open(peer_id, MSG_PROTOCOL)
                            self._c.direct_streams_opened += 1
                            self._out[peer_id] = fs
                            self._nursery.start_soon(self._watch_out, peer_id, fs)
                        try:
                            await fs.write_frame(data)
                            break
                        except Exception as exc:
                            self._out.pop(peer_id, None)
                            if not fs.broken:
                                self._c.direct_streams_broken += 1
                            await fs.reset()
                            if attempt == 1:
                                raise PeerUnreachable(
                                    f"send to {peer_id[:16]} failed: {exc!r}") from None
        except trio.TooSlowError:
            self._c.send_failures += 1
            self._drop_out(peer_id)
            raise TransportTimeout(f"send to {peer_id[:16]} timed out") from None
        except PeerUnreachable:
            self._c.send_failures += 1
            raise
        self._c.frames_out += 1
        self._c.bytes_out += len(data)

    def _drop_out(self, peer_id: str) -> None:
        fs = self._out.pop(peer_id, None)
        if fs is not None:
            fs.broken = True
            self._nursery.start_soon(fs.reset)

    async def _watch_out(self, peer_id: str, fs: _FramedStream) -> None:
        """Notice at once when the peer resets/closes our outbound stream.

        The receiver never writes on a direct stream, so any read completing
        (EOF or reset, e.g. after it refused an oversize frame) means the
        stream is dead: drop it so the next ``send`` opens a fresh one instead
        of losing a frame on it.
        """
        try:
            await fs.stream.read(1)
        except Exception:
            pass
        if not fs.broken:
            self._c.direct_streams_broken += 1
        fs.broken = True
        if self._out.get(peer_id) is fs:
            del self._out[peer_id]

    async def _read_bounded(self, fs: "_FramedStream", sender: str, what: str) -> bytes | None:
        """Next frame of an incoming stream, counted; None at its end or after
        refusing (and resetting) one larger than ``max_frame``."""
        try:
            data = await fs.read_frame(self.config.max_frame)
        except _Oversize as exc:
            self._c.oversize_rejected += 1
            log.warning("refusing %d-byte %s from %s", exc.args[0], what, sender)
            await fs.reset()
            return None
        if data is not None:
            self._c.frames_in += 1
            self._c.bytes_in += len(data)
        return data

    async def _serve_direct(self, stream) -> None:  # noqa: ANN001
        sender = stream.muxed_conn.peer_id.to_base58()
        self._c.direct_streams_accepted += 1
        fs = _FramedStream(stream)
        try:
            while not self._closed:
                data = await self._read_bounded(fs, sender, "frame")
                if data is None:
                    return
                await self._in_send.send(Incoming("direct", sender, data))
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            await fs.reset()
        except Exception as exc:
            log.debug("direct stream from %s ended: %r", sender, exc)
            await fs.reset()

    # -- request/response -----------------------------------------------------
    def set_request_handler(self, protocol: str, handler: RequestHandler) -> None:
        if not protocol.startswith("/fedswarm/"):
            raise LocalProtocolError("bad-protocol", f"{protocol} is not under /fedswarm/")
        if protocol == MSG_PROTOCOL:
            raise LocalProtocolError("bad-protocol", f"{protocol} is reserved")
        new = protocol not in self._handlers
        self._handlers[protocol] = handler
        if new:
            async def serve(stream, _p=protocol) -> None:  # noqa: ANN001
                await self._serve_requests(_p, stream)

            self._host.set_stream_handler(TProtocol(protocol), serve)

    async def request(self, peer_id: str, protocol: str, data: bytes, *, timeout: float) -> bytes:
        self._check_open()
        self._check_size(data)
        self._c.requests_out += 1
        if self._lanes is not None and self._lanes.carries(protocol):
            resp = await self._lane_request(peer_id, protocol, data, timeout)
            if resp is not None:
                return resp
        key = (peer_id, protocol)
        fs: _FramedStream | None = None
        try:
            with trio.fail_after(timeout):
                for attempt in (0, 1):
                    pool = self._idle.get(key)
                    reused = bool(pool)
                    if pool:
                        fs = pool.pop()
                    else:
                        fs = await self._open(peer_id, protocol)
                        self._c.request_streams_opened += 1
                    try:
                        await fs.write_frame(data)
                        resp = await fs.read_frame(self.config.max_frame)
                        if resp is None:
                            raise EOFError("stream closed by peer")
                    except _Oversize as exc:
                        self._c.oversize_rejected += 1
                        await fs.reset()
                        fs = None
                        raise PeerUnreachable(
                            f"response of {exc.args[0]} bytes exceeds max_frame") from None
                    except Exception as exc:
                        await fs.reset()
                        fs = None
                        # a pooled stream may have died while idle: retry once
                        if reused and attempt == 0:
                            continue
                        raise PeerUnreachable(
                            f"request {protocol} to {peer_id[:16]} failed: {exc!r}") from None
                    pool = self._idle.setdefault(key, [])
                    if len(pool) < self.config.max_idle_request_streams and not self._closed:
                        pool.append(fs)
                    else:
                        self._nursery.start_soon(fs.reset)
                    fs = None
                    self._count_round_trip(len(data), len(resp))
                    return resp
                raise AssertionError("unreachable")
        except trio.TooSlowError:
            self._c.request_timeouts += 1
            if fs is not None:  # request in flight: the stream state is unknown
                fs.broken = True
                self._nursery.start_soon(fs.reset)
            raise TransportTimeout(f"request {protocol} to {peer_id[:16]} timed out") from None
        except PeerUnreachable:
            self._c.request_failures += 1
            raise

    def _count_round_trip(self, sent: int, got: int) -> None:
        """Count a request of ``sent`` bytes and its answer of ``got``."""
        self._c.frames_out += 1
        self._c.bytes_out += sent
        self._c.frames_in += 1
        self._c.bytes_in += got

    async def _lane_request(self, peer_id: str, protocol: str, data: bytes, timeout: float) -> bytes | None:
        """The request on our lane to ``peer_id``; None when there is none
        (one is opening now) or it broke before the request left."""
        assert self._lanes is not None
        lane = self._lanes.get(peer_id)
        if lane is None:
            return None
        try:
            return await self._lane_answer(lane, lane.frames_in, lane.request(protocol, data), peer_id,
                                           protocol, len(data), timeout)
        except LaneDown:  # it broke before the request left
            return None

    async def _lane_answer(self, lane: Any, frames_before: int, answer: Any, peer_id: str, protocol: str,
                           size: int, timeout: float) -> bytes:
        """Await a lane request's ``answer`` and count it; a ``LaneDown``
        before the request left passes through."""
        assert self._lanes is not None
        try:
            with trio.fail_after(timeout):
                resp: bytes = await answer
        except trio.TooSlowError:
            self._c.request_timeouts += 1
            self._lanes.timed_out(lane, frames_before)
            raise TransportTimeout(f"request {protocol} to {peer_id[:16]} timed out") from None
        except LaneDown as exc:
            if not exc.sent:
                raise
            self._c.request_failures += 1
            raise PeerUnreachable(f"request {protocol} to {peer_id[:16]} failed: "
                                  f"the lane broke ({exc})") from None
        except PeerUnreachable:
            self._c.request_failures += 1
            raise
        self._c.lane_requests_out += 1
        self._count_round_trip(size, len(resp))
        return resp

    def thread_sender(self, peer_id: str, protocol: str) -> Callable[[bytes], Sent | None] | None:
        """For a request whose bytes a worker thread will make (a served
        model's step output): a function that thread may call to write it on
        the live lane to ``peer_id`` at once, returning a ``Sent`` for
        ``sent_answer``, or None (nothing written: send it with ``request``).
        None here when no lane to ``peer_id`` is up (asking opens one)."""
        if self._closed or self._lanes is None or not self._lanes.carries(protocol):
            return None
        lane = self._lanes.get(peer_id)
        if lane is None:
            return None
        max_frame = self.config.max_frame

        def send(data: bytes) -> Sent | None:
            return lane.send_from_thread(protocol, data) if len(data) <= max_frame else None

        return send

    async def sent_answer(self, peer_id: str, sent: Sent, *, timeout: float) -> bytes:
        """The answer to a request a worker thread wrote (``thread_sender``);
        raises as ``request`` does."""
        self._c.requests_out += 1
        return await self._lane_answer(sent.lane, sent.frames_before, sent.answer(), peer_id, sent.protocol,
                                       sent.size, timeout)

    async def _serve_requests(self, protocol: str, stream) -> None:  # noqa: ANN001
        sender = stream.muxed_conn.peer_id.to_base58()
        self._c.request_streams_accepted += 1
        fs = _FramedStream(stream)
        try:
            while not self._closed:
                data = await self._read_bounded(fs, sender, "request")
                if data is None:
                    return
                self._c.requests_in += 1
                handler = self._handlers[protocol]
                try:
                    resp = await handler(sender, data)
                except Exception:
                    log.exception("request handler for %s failed", protocol)
                    await fs.reset()
                    return
                if len(resp) > self.config.max_frame:
                    log.error("handler for %s returned %d bytes > max_frame", protocol, len(resp))
                    await fs.reset()
                    return
                await fs.write_frame(resp)
                self._c.frames_out += 1
                self._c.bytes_out += len(resp)
        except Exception as exc:
            log.debug("request stream %s from %s ended: %r", protocol, sender, exc)
            await fs.reset()

    # -- lanes ------------------------------------------------------------------
    async def _start_lanes(self, host_ip: str) -> None:
        """Listen for lanes on the libp2p listen host and answer hellos."""
        lanes = Lanes(self.config.lane_config, self._handlers, self._nursery, self._c, self._lane_hello,
                      max_frame=self.config.max_frame)
        await lanes.listen(host_ip, self.config.lane_port)
        self._lanes = lanes
        self.set_request_handler(LANE_PROTOCOL, lanes.on_hello)

    async def _lane_hello(self, peer_id: str) -> tuple[str, bytes]:
        """Ask ``peer_id`` for a lane over libp2p: (the IP our connection
        reached, its offer)."""
        fs = await self._open(peer_id, LANE_PROTOCOL)
        try:
            await fs.write_frame(msgpack.packb({"v": 1}))
            raw = await fs.read_frame(4096)
            addr = fs.stream.get_remote_address()
        finally:
            await fs.reset()
        if raw is None or not addr:
            raise PeerUnreachable(f"no lane offer from {peer_id[:16]}")
        return str(addr[0]), raw

    @property
    def lane_port(self) -> int:
        """The TCP port of our lane listener (0: lanes are off)."""
        return 0 if self._lanes is None else self._lanes.port

    def lanes_live(self) -> int:
        """Lanes held now (both directions)."""
        return 0 if self._lanes is None else self._lanes.live()

    async def _open(self, peer_id: str, protocol: str) -> _FramedStream:
        pid = _to_id(peer_id)
        connected = pid in self._host.get_network().connections
        try:
            return await self._open_once(pid, peer_id, protocol)
        except PeerUnreachable:
            # could not dial: maybe we do not know a (current) address
            if connected or not await self._dht_lookup(pid):
                raise
        return await self._open_once(pid, peer_id, protocol)

    async def _open_once(self, pid: ID, peer_id: str, protocol: str) -> _FramedStream:
        try:
            with trio.fail_after(self.config.dial_timeout):
                stream = await self._host.new_stream(pid, [TProtocol(protocol)])
        except trio.TooSlowError:
            raise TransportTimeout(f"opening {protocol} to {peer_id[:16]} timed out") from None
        except Exception as exc:
            raise PeerUnreachable(f"cannot open {protocol} to {peer_id[:16]}: {exc!r}") from None
        return _FramedStream(stream)

    # -- pubsub ----------------------------------------------------------------
    async def subscribe(self, topic: str) -> None:
        self._check_open()
        if topic in self._topics:
            return
        self._topics.add(topic)
        sub = await self._pubsub.subscribe(topic)
        self._nursery.start_soon(self._pump, topic, sub)

    async def _pump(self, topic: str, sub) -> None:  # noqa: ANN001
        try:
            while True:
                msg = await sub.get()
                if msg.from_id == self._my_id_bytes:
                    continue  # py-libp2p delivers our own publications locally
                try:
                    author = ID(msg.from_id).to_base58()
                except Exception:
                    continue
                self._c.pubsub_in += 1
                self._c.bytes_in += len(msg.data)
                await self._in_send.send(Incoming("pubsub", author, bytes(msg.data), topic))
        except (trio.ClosedResourceError, trio.BrokenResourceError, trio.EndOfChannel):
            return

    async def publish(self, topic: str, data: bytes) -> None:
        self._check_open()
        self._check_size(data)
        try:
            await self._pubsub.publish(topic, data)
        except Exception as exc:
            self._c.send_failures += 1
            raise PeerUnreachable(f"publish on {topic} failed: {exc!r}") from None
        self._c.pubsub_out += 1
        self._c.bytes_out += len(data)

    def mesh_peers(self, topic: str) -> list[str]:
        """Peers in our GossipSub mesh for ``topic`` (diagnostics, tests)."""
        return [p.to_base58() for p in self.gossipsub.mesh.get(topic, ())]

    def dht_routing_table_size(self) -> int:
        """Peers in our Kademlia routing table (0 when the DHT is off)."""
        return self._dht.get_routing_table_size() if self._dht is not None else 0

    def topic_peers(self, topic: str) -> list[str]:
        """Connected peers known to be subscribed to ``topic``."""
        return [p.to_base58() for p in self._pubsub.peer_topics.get(topic, ())]

    # -- receive / stats / close ------------------------------------------------
    async def receive(self) -> Incoming:
        try:
            return await self._in_recv.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise PeerUnreachable("transport closed") from None

    def statistics(self) -> Libp2pStatistics:
        return Libp2pStatistics(**self._c.__dict__)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._lanes is not None:
            self._lanes.close()
        self._nursery.cancel_scope.cancel()
        self._in_send.close()
        with trio.CancelScope(shield=True):
            with trio.move_on_after(5):
                try:
                    await self._host.close()
                except Exception as exc:
                    log.debug("host close: %r", exc)

    def _check_open(self) -> None:
        if self._closed:
            raise PeerUnreachable("transport closed")

    def _check_size(self, data: bytes) -> None:
        if len(data) > self.config.max_frame:
            self._c.oversize_rejected += 1
            raise LocalProtocolError(
                "frame-too-large", f"{len(data)} bytes > max_frame {self.config.max_frame}")

    def __repr__(self) -> str:
        return f"<Libp2pTransport {self.peer_id[:16]}>"


@asynccontextmanager
async def open_libp2p_transport(
    identity: Identity,
    listen_multiaddr: str = "/ip4/127.0.0.1/tcp/0",
    *,
    bootstrap: Sequence[str] = (),
    config: Libp2pConfig = Libp2pConfig(),
) -> AsyncIterator[Libp2pTransport]:
    """Start a host listening on ``listen_multiaddr``, dial ``bootstrap``
    (best effort, concurrently, bounded by ``config.dial_timeout``), yield the
    transport, and close everything on exit."""
    _tune_yamux(config)
    kp = _keypair_from_identity(identity)
    host = new_host(
        key_pair=kp,
        sec_opt={TProtocol(_NOISE_ID): _NoiseTransport(
            kp, noise_privkey=_new_x25519_key_pair().private_key)},
        muxer_opt={TProtocol(_YAMUX_ID): Yamux},
        connection_config=ConnectionConfig(max_connections_per_peer=1),
    )
    if host.get_id().to_base58() != identity.peer_id:  # pragma: no cover - invariant
        raise LocalProtocolError("bad-key", "libp2p peer id differs from identity")
    gossipsub = _make_gossipsub(config)
    pubsub = Pubsub(
        host,
        gossipsub,
        seen_ttl=config.seen_ttl,
        strict_signing=True,
        max_inbound_rpc_size=config.max_frame + 64 * 1024,
    )
    host_ip, port = parse_listen_maddr(listen_multiaddr)  # InputError for a bad one
    check_tcp_free(host_ip, port, "listen port")
    if config.lane:
        check_tcp_free(host_ip, config.lane_port, "lane port")
    maddr = multiaddr.Multiaddr(listen_multiaddr)
    dht = (KadDHT(host, DHTMode.SERVER, enable_random_walk=False,
                  protocol_prefix=TProtocol("/fedswarm")) if config.dht else None)
    # The teardown (py-libp2p's services and host) gets a deadline once the
    # caller's body has ended: a service that does not finish on cancellation
    # must not keep an interrupted command from exiting.
    with trio.CancelScope() as teardown:
        async with host.run([maddr]), AsyncExitStack() as services:
            await services.enter_async_context(background_trio_service(pubsub))
            await services.enter_async_context(background_trio_service(gossipsub))
            if dht is not None:
                await services.enter_async_context(background_trio_service(dht))
            await pubsub.wait_until_ready()
            async with trio.open_nursery() as outer:
                # background tasks live in their own nursery/cancel scope so that
                # aclose() cancels them without cancelling the caller's body.
                svc: trio.Nursery = await outer.start(_service_nursery)
                transport = Libp2pTransport(identity, host, pubsub, gossipsub, config, svc, dht)
                try:
                    if config.lane:
                        await transport._start_lanes(host_ip)
                    if bootstrap:
                        async with trio.open_nursery() as dials:
                            for addr in bootstrap:
                                dials.start_soon(_dial_quietly, transport, addr)
                    yield transport
                finally:
                    teardown.deadline = trio.current_time() + TEARDOWN_S
                    with trio.CancelScope(shield=True):
                        await transport.aclose()


class _DhtNotifee:
    """Adds every newly connected peer to the DHT routing table."""

    def __init__(self, transport: Libp2pTransport) -> None:
        self._t = transport

    async def connected(self, network, conn) -> None:  # noqa: ANN001
        t = self._t
        if not t._closed:
            t._nursery.start_soon(t._dht_add, conn.muxed_conn.peer_id)

    async def disconnected(self, network, conn) -> None:  # noqa: ANN001
        pass

    async def opened_stream(self, network, stream) -> None:  # noqa: ANN001
        pass

    async def closed_stream(self, network, stream) -> None:  # noqa: ANN001
        pass

    async def listen(self, network, multiaddr) -> None:  # noqa: ANN001
        pass

    async def listen_close(self, network, multiaddr) -> None:  # noqa: ANN001
        pass


async def _service_nursery(task_status=trio.TASK_STATUS_IGNORED) -> None:  # noqa: ANN001
    async with trio.open_nursery() as n:
        task_status.started(n)
        await trio.sleep_forever()


async def _dial_quietly(transport: Libp2pTransport, addr: str) -> None:
    try:
        await transport.connect(addr)
    except (PeerUnreachable, TransportTimeout) as exc:
        log.info("bootstrap %s unreachable: %s", addr, exc)
