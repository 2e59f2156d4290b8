"""Strict, versioned MessagePack wire format with Ed25519 signatures.

Rules
-----
1. Every fedswarm message is one *envelope*: ``msgpack([signature, payload])``
   where ``payload`` is itself ``msgpack([VERSION, kind, author, issued_at,
   nonce, body, extras])`` and ``signature`` is the author's Ed25519 signature
   over the payload bytes exactly as sent. Signing the bytes (not a
   re-encoding) makes verification independent of msgpack canonicalisation.
2. ``kind`` selects a message class from ``KINDS``; ``body`` is that class's
   positional field list; ``extras`` is a map that newer senders may fill and
   older readers ignore (forward compatibility without a version bump).
3. Only ``Gossip`` may travel unsigned (empty signature): it is a container of
   signed ``PeerState`` envelopes and claims nothing itself.
4. Decoding never trusts its input. Messages are msgspec ``Struct`` types
   encoded as arrays; their annotations carry every bound (lengths, ranges,
   non-empty strings), and msgspec's decoder checks them and the types in C,
   strictly: a missing field, an extra one, a bool for an int or a NaN are
   refused. A few rules that annotations cannot say (a span ends after it
   starts, waits ascend) are checked after decoding (``_check``). Unknown
   kinds and versions are refused. Any failure is a ``RemoteProtocolError``
   whose ``reason`` is a stable tag the core counts (``oversize``,
   ``malformed``, ``bad-version``, ``unknown-kind``, ``bad-field``,
   ``bad-signature``, ``unsigned``).

No pickle, no msgpack ext types: bytes, str, ints, floats, bools, None, lists
and string-keyed maps only. The bytes a message encodes to are the same as
those of the ``msgpack`` package's ``packb`` of its field list (floats as
float64, the smallest int encodings, bin for bytes), so peers built on either
interoperate and a signature covers the same bytes.
"""

from __future__ import annotations

import hashlib
import math
from typing import Annotated, Any, ClassVar, Iterable, TypeVar

import msgpack
import msgspec
from msgspec import Meta, Struct

from ..errors import LocalProtocolError, RemoteProtocolError
from .identity import Identity, verify

__all__ = [
    "VERSION",
    "MAX_MESSAGE_BYTES",
    "Message",
    "Device",
    "PowerInfo",
    "Span",
    "PeerState",
    "Gossip",
    "JobSpec",
    "CallForBids",
    "Bid",
    "Award",
    "AwardDecline",
    "SlotOffer",
    "LeaseRenew",
    "LeaseAck",
    "ShardResult",
    "ResultAck",
    "Cancel",
    "Accusation",
    "Signed",
    "KINDS",
    "LeaseRenewBatch",
    "LeaseAckBatch",
    "ShardCheckpoint",
    "MAX_CHECKPOINT_BYTES",
    "encode",
    "decode",
    "decode_unverified",
    "pack_params",
    "unpack_params",
    "VerifyCache",
]

VERSION = 1
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
_MAX_ITEMS = 4096
_MAX_PARAMS_BYTES = 1024 * 1024
MAX_BID_NEXT = 16  # waits a bid may list for a job's further shards
MAX_GOSSIP_REPLY = 255  # entries a gossip reply may be asked for (one is the replier's own)
MAX_BATCH = 4096  # renewals (or acks) in one batch
MAX_CHECKPOINT_BYTES = 1024 * 1024  # a resumable shard's saved state (ShardCheckpoint, Award)


# --------------------------------------------------------------------------
# field types: the bounds a receiver enforces, as msgspec annotations
#
# A float field takes an int (as a float); its lower bound also refuses NaN.

U63 = Annotated[int, Meta(ge=0, le=2**63 - 1)]
Count = Annotated[int, Meta(ge=0, le=4096)]
BlockNo = Annotated[int, Meta(ge=0, le=100_000)]
ShardNo = Annotated[int, Meta(ge=0, le=1_000_000)]
Name = Annotated[str, Meta(min_length=1, max_length=128)]
Text256 = Annotated[str, Meta(max_length=256)]
Short = Annotated[str, Meta(max_length=64)]
Trust = Annotated[str, Meta(max_length=32)]
Watts = Annotated[float, Meta(ge=0.0, le=1e7)]
Level = Annotated[float, Meta(ge=0.01, le=1.0)]
Seconds = Annotated[float, Meta(ge=0.0, le=1e9)]
LeaseSeconds = Annotated[float, Meta(ge=0.0, le=86400.0)]
Joules = Annotated[float, Meta(ge=0.0, le=1e15)]
Grams = Annotated[float, Meta(ge=0.0, le=1e12)]
ShardList = Annotated[tuple[ShardNo, ...], Meta(max_length=4096)]
#: the share of a shard's work still to do: 1 for a fresh run, less when it
#: resumes from a checkpoint
WorkLeft = Annotated[float, Meta(gt=0.0, le=1.0)]
CheckpointState = Annotated[bytes, Meta(max_length=MAX_CHECKPOINT_BYTES)]
EnvelopeBytes = Annotated[bytes, Meta(max_length=_MAX_PARAMS_BYTES + 4096)]


def _bad(name: str, why: str) -> RemoteProtocolError:
    return RemoteProtocolError("bad-field", f"{name}: {why}")


def _ascending(xs: tuple[float, ...], name: str) -> None:
    for a, b in zip(xs, xs[1:]):
        if b < a:
            raise _bad(name, "not ascending")


# --------------------------------------------------------------------------
# messages

W = TypeVar("W", bound="_Wire")


class _Wire(Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """Base of everything on the wire: frozen, positional (a msgpack array
    in field order), with no field a receiver does not know."""

    def _check(self) -> None:
        """Rules the annotations cannot express; raise ``RemoteProtocolError``."""

    def to_body(self) -> list[Any]:
        """The field list as plain msgpack types (what ``from_body`` reads),
        as ``encode`` sends it."""
        out: list[Any] = msgspec.msgpack.decode(_encode_body(self) if isinstance(self, Message) else _ENC.encode(self))
        return out

    @classmethod
    def from_body(cls: type[W], body: Any) -> W:
        """Validate a decoded field list as this class (strictly, as on the wire)."""
        try:
            msg = msgspec.convert(body, cls)
        except (msgspec.ValidationError, TypeError, ValueError) as exc:
            raise _bad(cls.__name__, str(exc)) from None
        msg._check()
        return msg


class Message(_Wire, frozen=True):
    """Base of wire messages. Subclasses define ``KIND`` and their fields in
    wire order; optional trailing fields (with defaults) are what older
    peers may leave out."""

    KIND: ClassVar[int] = 0
    SIGNED: ClassVar[bool] = True
    #: leave trailing fields that hold their defaults out of the bytes (as
    #: an older sender, who had no such fields, would): set where fields
    #: were added that most messages leave at their defaults
    OMIT_DEFAULT_TAIL: ClassVar[bool] = False


class Device(_Wire, frozen=True):
    kind: Annotated[str, Meta(min_length=1, max_length=16)]  # "cuda", "cpu", "rocm", "mps"
    name: Annotated[str, Meta(max_length=128)]
    count: Count
    mem_total: U63  # bytes per device
    mem_free: U63


class PowerInfo(_Wire, frozen=True):
    """Power state: watts now, the power curve and the levels it can run at.

    ``levels`` are relative clock frequencies in (0, 1]; power at level f is
    ``idle_w + (max_w - idle_w) * f ** alpha`` (see ``core.energy``).
    """

    now_w: Watts
    idle_w: Watts
    max_w: Watts
    cap_w: Watts
    alpha: Annotated[float, Meta(ge=0.5, le=5.0)]
    levels: Annotated[tuple[Level, ...], Meta(min_length=1, max_length=64)]


class Span(_Wire, frozen=True):
    """A contiguous span of transformer blocks ``[start, end)`` a peer serves."""

    model: Name  # content hash of the model
    start: BlockNo
    end: BlockNo
    throughput: Annotated[float, Meta(ge=0.0, le=1e18)]  # tokens/s this peer sustains through the span

    def _check(self) -> None:
        if self.end <= self.start:
            raise _bad("span", "end <= start")


class PeerState(Message, frozen=True):
    """A peer's signed advertisement of its capacity and power state.

    ``throughput`` maps a task kind (or ``"*"`` for any) to a speed relative to
    the reference device (1.0 = one reference GPU). ``ledger`` is the author's
    own row of the tenant ledger (tenant -> log-domain usage counter, see
    ``core.ledger``). ``seq`` orders a peer's states: the newest wins.
    """

    KIND: ClassVar[int] = 1
    seq: U63
    ttl_s: Annotated[float, Meta(ge=0.1, le=86400.0)]
    devices: Annotated[tuple[Device, ...], Meta(max_length=64)]
    slots: Count
    throughput: Annotated[dict[Short, Annotated[float, Meta(ge=0.0, le=1e6)]], Meta(max_length=64)]
    backlog_s: Seconds
    power: PowerInfo
    energy_price: Annotated[float, Meta(ge=0.0, le=1e6)]  # currency units per kWh
    carbon_g_kwh: Annotated[float, Meta(ge=0.0, le=1e5)]
    spans: Annotated[tuple[Span, ...], Meta(max_length=64)]
    trust: Trust  # "volunteer" | "datacenter"
    membership: Annotated[bytes, Meta(max_length=512)]  # federation signature admitting a trusted peer (or b"")
    addrs: Annotated[tuple[Annotated[str, Meta(max_length=512)], ...], Meta(max_length=16)]
    region: Short
    leaving: bool
    ledger: Annotated[dict[Short, Annotated[float, Meta(ge=-1e12, le=1e12)]], Meta(max_length=256)]
    #: seconds until 1, 2, ... of its slots are free at once (running shards
    #: only; at most 64 entries, ascending). Lets a client rank peers for a
    #: gang, which needs several slots together. Absent from older peers.
    free_s: Annotated[tuple[Seconds, ...], Meta(max_length=64)] = ()

    def _check(self) -> None:
        for s in self.spans:
            s._check()
        _ascending(self.free_s, "free_s")


class Gossip(Message, frozen=True):
    """Anti-entropy push: signed PeerState envelopes; ``reply`` asks for ours.

    ``want`` (optional, 0 = the replier's default) asks the reply to carry up
    to that many entries: a client pulls a large slice of a peer's view at
    once instead of assembling it from small pushes. Repliers cap it
    (``MAX_GOSSIP_REPLY``).
    """

    KIND: ClassVar[int] = 2
    SIGNED: ClassVar[bool] = False
    entries: Annotated[tuple[Annotated[bytes, Meta(max_length=16384)], ...], Meta(max_length=256)]
    reply: bool
    want: Annotated[int, Meta(ge=0, le=MAX_GOSSIP_REPLY)] = 0


class JobSpec(Message, frozen=True):
    """A tenant's signed job: ``shards`` shards of task ``task``.

    ``work_s`` is one shard's run time on ``gpus`` reference devices;
    ``chain`` jobs run shards one after another. ``deadline_s`` is relative to
    ``submitted_at``; ``lam`` weighs energy (J) against finish time (s) in the
    award rule; ``params`` is the task's msgpack-encoded parameter map.
    """

    KIND: ClassVar[int] = 3
    job_id: Name
    task: Annotated[str, Meta(min_length=1, max_length=64)]
    shards: Annotated[int, Meta(ge=1, le=1_000_000)]
    chain: bool
    work_s: Seconds
    gpus: Count
    mem_bytes: U63
    deadline_s: Seconds | None
    weight: Annotated[float, Meta(ge=1e-6, le=1e6)]
    lam: Annotated[float, Meta(ge=0.0, le=1e6)]
    submitted_at: Annotated[float, Meta(ge=-1e12, le=1e12)]
    params: Annotated[bytes, Meta(max_length=_MAX_PARAMS_BYTES)]


class CallForBids(Message, frozen=True):
    """Client -> peer: bid on these shards of the (tenant-signed) job.

    ``left``: the share of each listed shard's work still to do; below 1
    when they resume from a checkpoint, and bids price that share. Left out
    of the bytes when 1 (``OMIT_DEFAULT_TAIL``): a fresh call is the bytes
    an older client sends, and an older peer reads it."""

    KIND: ClassVar[int] = 4
    OMIT_DEFAULT_TAIL: ClassVar[bool] = True
    job: EnvelopeBytes  # signed JobSpec envelope
    shards: ShardList
    round: U63
    left: WorkLeft = 1.0


class Bid(Message, frozen=True):
    """Peer -> client: an offer for the listed shards of one auction round.

    ``start_s`` is the estimated wait before the first shard starts,
    ``run_s`` the estimated run time of one shard at ``level``; ``slots`` how
    many of them the peer runs side by side. Energy and carbon are per shard.
    ``next_s``: the waits before a second, third... shard of the job would
    start here (ascending, at most ``MAX_BID_NEXT``): a peer with 8 slots and
    one free says so. Absent from older peers.
    """

    KIND: ClassVar[int] = 5
    job_id: Name
    round: U63
    shards: ShardList
    start_s: Seconds
    run_s: Seconds
    slots: Annotated[int, Meta(ge=1, le=4096)]
    level: Level
    energy_j: Joules
    carbon_g: Grams
    trust: Trust
    next_s: Annotated[tuple[Seconds, ...], Meta(max_length=MAX_BID_NEXT)] = ()

    def _check(self) -> None:
        _ascending(self.next_s, "next_s")


class Award(Message, frozen=True):
    """Client -> winning peer: run ``shard`` (attempt ``attempt``) under a lease.

    ``resume``: the state of an earlier attempt's last checkpoint
    (``ShardCheckpoint``), from which the run continues with ``left`` of
    the shard's work to do; empty (and ``left`` 1) for a fresh run. Both
    are left out of the bytes for a fresh run (``OMIT_DEFAULT_TAIL``), which
    is then the award an older client sends."""

    KIND: ClassVar[int] = 6
    OMIT_DEFAULT_TAIL: ClassVar[bool] = True
    job: EnvelopeBytes  # signed JobSpec envelope
    peer: Name  # the winner: an award replayed to another peer is refused
    shard: ShardNo
    attempt: ShardNo
    lease_s: Annotated[float, Meta(ge=0.01, le=86400.0)]
    level: Level
    left: WorkLeft = 1.0
    resume: CheckpointState = b""

    def _check(self) -> None:
        if (self.left < 1.0) != bool(self.resume):
            raise _bad("resume", "a resumed run needs both its state and left < 1")


class AwardDecline(Message, frozen=True):
    """Peer -> client: this peer will not run (or no longer holds) a shard.

    ``reason`` says why ("late", "leaving", "moved", or why it cannot serve
    the job). ``to``, with "moved": a peer that this one's view showed idle
    and that would finish the queued shard sooner; the client invites it to
    the shard's next round. Left out of the bytes when empty
    (``OMIT_DEFAULT_TAIL``), which is then the decline an older peer sends."""

    KIND: ClassVar[int] = 7
    OMIT_DEFAULT_TAIL: ClassVar[bool] = True
    job_id: Name
    shard: ShardNo
    attempt: ShardNo
    reason: Text256
    to: Annotated[str, Meta(max_length=128)] = ""


class LeaseRenew(Message, frozen=True):
    """Peer -> client: still holding the shard; ``running`` or queued; ETA."""

    KIND: ClassVar[int] = 8
    job_id: Name
    shard: ShardNo
    attempt: ShardNo
    running: bool
    eta_s: Seconds


class LeaseAck(Message, frozen=True):
    """Client -> peer: lease extended by ``lease_s`` (``ok``) or revoked."""

    KIND: ClassVar[int] = 9
    job_id: Name
    shard: ShardNo
    attempt: ShardNo
    ok: bool
    lease_s: LeaseSeconds


class LeaseRenewBatch(Message, frozen=True):
    """Peer -> client: the renewals of several of its shards held here, in
    one message per (peer, client) pair and renewal round. The body is one
    non-empty list of at most ``MAX_BATCH`` renewal bodies, each checked as
    a ``LeaseRenew`` is."""

    KIND: ClassVar[int] = 14
    renewals: Annotated[tuple[LeaseRenew, ...], Meta(min_length=1, max_length=MAX_BATCH)]


class LeaseAckBatch(Message, frozen=True):
    """Client -> peer: the answers to one ``LeaseRenewBatch``, in its order."""

    KIND: ClassVar[int] = 15
    acks: Annotated[tuple[LeaseAck, ...], Meta(min_length=1, max_length=MAX_BATCH)]


class ShardResult(Message, frozen=True):
    """Peer -> client: the outcome of one attempt of one shard."""

    KIND: ClassVar[int] = 10
    job_id: Name
    shard: ShardNo
    attempt: ShardNo
    ok: bool
    result: Annotated[bytes, Meta(max_length=MAX_MESSAGE_BYTES)]  # msgpack-encoded result map, or b"" on failure
    error: Annotated[str, Meta(max_length=1024)]
    gpu_s: Annotated[float, Meta(ge=0.0, le=1e12)]
    energy_j: Joules
    carbon_g: Grams


class ResultAck(Message, frozen=True):
    KIND: ClassVar[int] = 11
    job_id: Name
    shard: ShardNo
    attempt: ShardNo


class Cancel(Message, frozen=True):
    """Tenant -> peer: drop these shards of the tenant's job (all if empty)."""

    KIND: ClassVar[int] = 12
    job_id: Name
    shards: ShardList


class Accusation(Message, frozen=True):
    """A tenant's evidence that ``accused`` returned a wrong result.

    ``evidence`` holds signed ``ShardResult`` envelopes for one shard: the
    accused's, and at least a quorum of other peers' that agree with each
    other and not with it. Receivers check every signature themselves and act
    only if a peer *they* trust is among the agreeing ones.
    """

    KIND: ClassVar[int] = 13
    job_id: Name
    shard: ShardNo
    accused: Name
    evidence: Annotated[tuple[Annotated[bytes, Meta(max_length=MAX_MESSAGE_BYTES // 8)], ...], Meta(max_length=16)]


class ShardCheckpoint(Message, frozen=True):
    """Peer -> client: a running shard saved its progress. ``done`` of the
    shard's work is behind it, and ``state`` (opaque to the client, the
    task's own encoding) lets another peer go on from there if this one is
    lost. Best effort: a lost checkpoint leaves the previous one in force."""

    KIND: ClassVar[int] = 16
    job_id: Name
    shard: ShardNo
    attempt: ShardNo
    done: Annotated[float, Meta(gt=0.0, lt=1.0)]
    state: Annotated[bytes, Meta(min_length=1, max_length=MAX_CHECKPOINT_BYTES)]


class SlotOffer(Message, frozen=True):
    """Peer -> peer: the sender has ``free`` slots and nothing queued.

    Its receiver hands queued shards that would finish sooner there back to
    their clients with an ``AwardDecline("moved", to=sender)``; it sends
    nothing back otherwise. The late binding of a central queue, pulled by
    the peer whose slot freed (``PeerCore``, "Slot offers")."""

    KIND: ClassVar[int] = 17
    free: Annotated[int, Meta(ge=1, le=4096)]


KINDS: dict[int, type[Message]] = {
    c.KIND: c
    for c in (
        PeerState,
        Gossip,
        JobSpec,
        CallForBids,
        Bid,
        Award,
        AwardDecline,
        LeaseRenew,
        LeaseAck,
        ShardResult,
        ResultAck,
        Cancel,
        Accusation,
        LeaseRenewBatch,
        LeaseAckBatch,
        ShardCheckpoint,
        SlotOffer,
    )
}

_ENC = msgspec.msgpack.Encoder()
_DECODERS: dict[int, msgspec.msgpack.Decoder[Any]] = {k: msgspec.msgpack.Decoder(c) for k, c in KINDS.items()}


# --------------------------------------------------------------------------
# envelopes


class Signed(Struct, frozen=True):
    """A decoded, verified envelope: the message and who said it, when.

    Never on the wire itself: a Struct because one is made for every
    envelope decoded (and, in netsim's fast mode, sent), and a Struct is
    made in C, where a frozen dataclass sets each field through
    ``object.__setattr__``."""

    msg: Message
    author: str
    issued_at: float
    nonce: int
    raw: bytes
    extras: dict[str, Any] = msgspec.field(default_factory=dict)

    def __repr__(self) -> str:  # the bytes and extras left out
        return f"Signed(msg={self.msg!r}, author={self.author!r}, issued_at={self.issued_at!r}, nonce={self.nonce!r})"


class _Payload(Struct, array_like=True, forbid_unknown_fields=True):
    """The signed payload as it arrives: the header fields are checked one
    by one (each failure has its own reason), the body is decoded by its
    kind's struct and the extras map with the strict unpack limits."""

    version: Any
    kind: Any
    author: Any
    issued_at: Any
    nonce: Any
    body: msgspec.Raw
    extras: msgspec.Raw


_OUTER = msgspec.msgpack.Decoder(tuple[bytes, bytes])
_PAYLOAD = msgspec.msgpack.Decoder(_Payload)
_EMPTY_MAP = b"\x80"
# the first byte of a msgpack array: fixarray, array 16, array 32
_ARRAY_HEADS = frozenset(range(0x90, 0xA0)) | {0xDC, 0xDD}


def _sized(data: bytes, max_bytes: int) -> None:
    """Refuse anything but bytes of at most ``max_bytes``, before decoding."""
    if type(data) is not bytes:
        raise RemoteProtocolError("malformed", "not bytes")
    if len(data) > max_bytes:
        raise RemoteProtocolError("oversize", f"{len(data)} > {max_bytes}")


def _unpack(data: bytes, max_bytes: int) -> Any:
    _sized(data, max_bytes)
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=max_bytes,
            max_bin_len=max_bytes,
            max_array_len=_MAX_ITEMS,
            max_map_len=_MAX_ITEMS,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several unrelated types
        raise RemoteProtocolError("malformed", type(exc).__name__) from None


def _check_body(cls: type[Message], body: bytes | msgspec.Raw) -> Message:
    """Decode and validate one message body of class ``cls``."""
    try:
        msg: Message = _DECODERS[cls.KIND].decode(body)
    except msgspec.ValidationError as exc:
        raise _bad(cls.__name__, str(exc)) from None
    except msgspec.DecodeError as exc:
        raise RemoteProtocolError("malformed", f"{cls.__name__}: {exc}") from None
    msg._check()
    return msg


def _encode_body(msg: Message) -> bytes:
    """The body's bytes: the field array, less its trailing fields that
    hold their defaults where the class says so (``OMIT_DEFAULT_TAIL``;
    msgspec's decoder fills them back in)."""
    if not msg.OMIT_DEFAULT_TAIL:
        return _ENC.encode(msg)
    names = msg.__struct_fields__
    defaults = msg.__struct_defaults__
    first = len(names) - len(defaults)  # the first field with a default
    values = [getattr(msg, name) for name in names]
    n = len(values)
    while n > first and values[n - 1] == defaults[n - 1 - first]:
        n -= 1
    return _ENC.encode(values[:n]) if n < len(values) else _ENC.encode(msg)


def encode(
    msg: Message,
    identity: Identity | None,
    *,
    issued_at: float,
    nonce: int,
    extras: dict[str, Any] | None = None,
    check: bool = True,
) -> bytes:
    """Encode and sign ``msg`` as ``identity`` (``None`` only for unsigned kinds).

    Raises:
        LocalProtocolError: ``msg`` would not pass the receiver's validation
            (unless ``check=False``, which tests use to craft bad input).
    """
    if identity is None and msg.SIGNED:
        raise LocalProtocolError("unsigned", f"{type(msg).__name__} must be signed")
    author = identity.peer_id if identity is not None else ""
    body = _encode_body(msg)
    if check:
        # refuse to send what a receiver would refuse (h11: validate eagerly)
        try:
            _check_body(type(msg), body)
        except RemoteProtocolError as exc:
            raise LocalProtocolError(exc.reason, exc.detail) from None
    payload = _ENC.encode([VERSION, msg.KIND, author, float(issued_at), nonce, msgspec.Raw(body), extras or {}])
    sig = identity.sign(payload) if identity is not None else b""
    return _ENC.encode((sig, payload))


class VerifyCache:
    """Remembers envelopes already decoded and verified, by their exact bytes,
    so a gossiped state received from many neighbours is checked once.

    Decoding and verification are pure functions of the bytes (and of the
    size limit, part of the key), so one cache may be shared by every core
    in a process (netsim does; a daemon has one core anyway). Failures are
    never cached: bad input is re-examined and counted every time.

    Peer states are kept apart from the other messages, each part holding
    ``capacity`` entries: a state is gossiped on for as long as it lives
    (minutes), while a message is received once, within its flight. In one
    table the stream of messages pushed the states out within seconds at
    10,000 peers, and every state older than that was verified again.
    """

    def __init__(self, capacity: int = 65536, *, trusted: bool = False) -> None:
        self.capacity = capacity
        #: every envelope decoded with this cache comes from an honest core
        #: in this process, which may sign with a placeholder (netsim's
        #: ``PlaceholderSigner``): decoding checks everything but the
        #: signature. Only netsim's fast mode sets it; a cache that sees
        #: the network must not.
        self.trusted = trusted
        self._seen: dict[tuple[bytes, int], Signed] = {}
        self._states: dict[tuple[bytes, int], Signed] = {}
        self.hits = 0

    def get(self, raw: bytes, max_bytes: int) -> "Signed | None":
        key = (raw, max_bytes)
        got = self._states.get(key)
        if got is None:
            got = self._seen.get(key)
        if got is not None:
            self.hits += 1
        return got

    def add(self, raw: bytes, max_bytes: int, signed: "Signed") -> None:
        seen = self._states if type(signed.msg) is PeerState else self._seen
        if len(seen) >= self.capacity:
            # drop the oldest half (dicts keep insertion order)
            for k in list(seen)[: self.capacity // 2]:
                del seen[k]
        seen[(raw, max_bytes)] = signed

    def remember(self, raw: bytes, max_bytes: int, msg: "Message", author: str, issued_at: float,
                 nonce: int) -> None:
        """Enter an envelope this process has just encoded, with the message
        object it encoded, as its receivers' decode would give it: they find
        it here and decode nothing. Only a ``trusted`` cache takes it (its
        receivers are honest cores of this process, netsim's fast mode), and
        only within ``max_bytes``, the size its receivers accept."""
        if not self.trusted:
            raise ValueError("only a trusted cache takes envelopes unchecked")
        if len(raw) <= max_bytes:
            self.add(raw, max_bytes, Signed(msg, author, float(issued_at), nonce, raw))


def _decode(data: bytes, max_bytes: int, cache: VerifyCache | None, check_sig: bool) -> Signed:
    if cache is not None and check_sig:
        hit = cache.get(data, max_bytes)
        if hit is not None:
            return hit
    _sized(data, max_bytes)
    try:
        sig, payload = _OUTER.decode(data)
    except Exception:  # msgspec's DecodeError or ValidationError
        raise RemoteProtocolError("malformed", "envelope is not [sig, payload]") from None
    try:
        p = _PAYLOAD.decode(payload)
    except Exception:
        raise RemoteProtocolError("malformed", "payload is not a 7-list") from None
    body = p.body
    raw_extras = bytes(p.extras)
    extras = {} if raw_extras == _EMPTY_MAP else _unpack(raw_extras, max_bytes)
    version, kind, author, issued_at, nonce = p.version, p.kind, p.author, p.issued_at, p.nonce
    if version != VERSION or type(version) is not int:
        raise RemoteProtocolError("bad-version", repr(version)[:32])
    cls = KINDS.get(kind) if type(kind) is int else None
    if cls is None:
        raise RemoteProtocolError("unknown-kind", repr(kind)[:32])
    if type(author) is not str or len(author) > 128:
        raise RemoteProtocolError("bad-field", "author")
    if type(issued_at) is not float or not math.isfinite(issued_at):
        raise RemoteProtocolError("bad-field", "issued_at")
    if type(nonce) is not int or not 0 <= nonce < 2**64:
        raise RemoteProtocolError("bad-field", "nonce")
    if len(body) == 0 or memoryview(body)[0] not in _ARRAY_HEADS or type(extras) is not dict:
        raise RemoteProtocolError("malformed", "body/extras")
    if cls.SIGNED:
        if not sig:
            raise RemoteProtocolError("unsigned", cls.__name__)
        if check_sig and (cache is None or not cache.trusted):
            verify(author, sig, payload)
    try:
        msg = _check_body(cls, body)
    except RemoteProtocolError:
        raise
    except Exception as exc:  # a validator bug must still not crash the agent
        raise RemoteProtocolError("bad-field", f"{cls.__name__}: {type(exc).__name__}") from None
    signed = Signed(msg, author, issued_at, nonce, data, extras)
    if cache is not None and check_sig and cls.SIGNED:
        # an unsigned envelope (Gossip) saves no verify and is almost never
        # received twice: caching it only pushes signed states out
        cache.add(data, max_bytes, signed)
    return signed


def decode(data: bytes, *, max_bytes: int = MAX_MESSAGE_BYTES, cache: VerifyCache | None = None) -> Signed:
    """Decode, validate and verify one envelope.

    Raises:
        RemoteProtocolError: on anything but a well-formed, correctly signed
            message of a known kind. Nothing else escapes.
    """
    return _decode(data, max_bytes, cache, True)


def decode_unverified(data: bytes, *, max_bytes: int = MAX_MESSAGE_BYTES) -> Signed:
    """Decode and validate without checking the signature (tools, tests)."""
    return _decode(data, max_bytes, None, False)


def peek_kind(data: bytes) -> str | None:
    """The name of the message kind an envelope says it holds, or None if
    its header does not parse. Reads the header only: nothing is checked or
    verified (tools that sort traffic by kind, such as netsim.timing)."""
    try:
        cls = KINDS.get(_PAYLOAD.decode(_OUTER.decode(data)[1]).kind)
    except Exception:  # msgspec's DecodeError or ValidationError, or an unhashable kind
        return None
    return cls.__name__ if cls is not None else None


# --------------------------------------------------------------------------
# task parameters


def pack_params(params: dict[str, Any]) -> bytes:
    return msgpack.packb(params, use_bin_type=True)


def unpack_params(data: bytes) -> dict[str, Any]:
    """Decode a task parameter map received from a tenant (strict limits)."""
    v = _unpack(data, _MAX_PARAMS_BYTES)
    if type(v) is not dict:
        raise RemoteProtocolError("bad-field", "params is not a map")
    return v


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def iter_kinds() -> Iterable[type[Message]]:
    return KINDS.values()
