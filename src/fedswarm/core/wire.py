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
4. Decoding never trusts its input: unpack limits bound every length, every
   field is type- and range-checked in the message constructor, unknown kinds
   and versions are refused. Any failure is a ``RemoteProtocolError`` whose
   ``reason`` is a stable tag the core counts (``oversize``, ``malformed``,
   ``bad-version``, ``unknown-kind``, ``bad-field``, ``bad-signature``,
   ``unsigned``).

No pickle, no msgpack ext types: bytes, str, ints, floats, bools, None, lists
and string-keyed maps only.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Iterable

import msgpack

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


# --------------------------------------------------------------------------
# field validators: each returns the value or raises RemoteProtocolError


def _bad(name: str, why: str) -> RemoteProtocolError:
    return RemoteProtocolError("bad-field", f"{name}: {why}")


def _str(v: Any, name: str, max_len: int = 256, *, empty: bool = True) -> str:
    if type(v) is not str:
        raise _bad(name, "not a string")
    if len(v) > max_len or (not empty and not v):
        raise _bad(name, "bad length")
    return v


def _bytes(v: Any, name: str, max_len: int = MAX_MESSAGE_BYTES) -> bytes:
    if type(v) is not bytes:
        raise _bad(name, "not bytes")
    if len(v) > max_len:
        raise _bad(name, "too long")
    return v


def _int(v: Any, name: str, lo: int = 0, hi: int = 2**63 - 1) -> int:
    if type(v) is not int:
        raise _bad(name, "not an int")
    if not lo <= v <= hi:
        raise _bad(name, f"out of range [{lo}, {hi}]")
    return v


def _float(v: Any, name: str, lo: float = 0.0, hi: float = 1e18) -> float:
    if type(v) is int:
        v = float(v)
    if type(v) is not float or math.isnan(v):
        raise _bad(name, "not a float")
    if not lo <= v <= hi:
        raise _bad(name, f"out of range [{lo}, {hi}]")
    return v


def _bool(v: Any, name: str) -> bool:
    if type(v) is not bool:
        raise _bad(name, "not a bool")
    return v


def _list(v: Any, name: str, max_len: int = _MAX_ITEMS) -> list[Any]:
    if type(v) is not list:
        raise _bad(name, "not a list")
    if len(v) > max_len:
        raise _bad(name, "too many items")
    return v


def _opt_float(v: Any, name: str, lo: float = 0.0, hi: float = 1e18) -> float | None:
    return None if v is None else _float(v, name, lo, hi)


# --------------------------------------------------------------------------
# messages


class Message:
    """Base of wire messages: frozen slotted dataclasses validated eagerly.

    Subclasses define ``KIND`` and ``FIELDS`` (name, validator) in wire order;
    ``from_body`` validates a received body; ``to_body`` produces it.
    """

    KIND: ClassVar[int] = 0
    SIGNED: ClassVar[bool] = True

    def to_body(self) -> list[Any]:
        return [_to_wire(getattr(self, f.name)) for f in fields(self)]  # type: ignore[arg-type]

    @classmethod
    def from_body(cls, body: list[Any]) -> "Message":
        raise NotImplementedError


def _to_wire(v: Any) -> Any:
    if isinstance(v, (Device, PowerInfo, Span)):
        return v.to_list()
    if isinstance(v, tuple):
        return [_to_wire(x) for x in v]
    if isinstance(v, dict):
        return {k: _to_wire(x) for k, x in v.items()}
    return v


@dataclass(frozen=True, slots=True)
class Device:
    kind: str  # "cuda", "cpu", "rocm", "mps"
    name: str
    count: int
    mem_total: int  # bytes per device
    mem_free: int

    def to_list(self) -> list[Any]:
        return [self.kind, self.name, self.count, self.mem_total, self.mem_free]

    @classmethod
    def from_list(cls, v: Any) -> "Device":
        v = _list(v, "device", 5)
        if len(v) != 5:
            raise _bad("device", "needs 5 fields")
        return cls(
            _str(v[0], "device.kind", 16, empty=False),
            _str(v[1], "device.name", 128),
            _int(v[2], "device.count", 0, 4096),
            _int(v[3], "device.mem_total"),
            _int(v[4], "device.mem_free"),
        )


@dataclass(frozen=True, slots=True)
class PowerInfo:
    """Power state: watts now, the power curve and the levels it can run at.

    ``levels`` are relative clock frequencies in (0, 1]; power at level f is
    ``idle_w + (max_w - idle_w) * f ** alpha`` (see ``core.energy``).
    """

    now_w: float
    idle_w: float
    max_w: float
    cap_w: float
    alpha: float
    levels: tuple[float, ...]

    def to_list(self) -> list[Any]:
        return [self.now_w, self.idle_w, self.max_w, self.cap_w, self.alpha, list(self.levels)]

    @classmethod
    def from_list(cls, v: Any) -> "PowerInfo":
        v = _list(v, "power", 6)
        if len(v) != 6:
            raise _bad("power", "needs 6 fields")
        levels = tuple(_float(x, "power.level", 0.01, 1.0) for x in _list(v[5], "power.levels", 64))
        if not levels:
            raise _bad("power.levels", "empty")
        return cls(
            _float(v[0], "power.now_w", 0, 1e7),
            _float(v[1], "power.idle_w", 0, 1e7),
            _float(v[2], "power.max_w", 0, 1e7),
            _float(v[3], "power.cap_w", 0, 1e7),
            _float(v[4], "power.alpha", 0.5, 5.0),
            levels,
        )


@dataclass(frozen=True, slots=True)
class Span:
    """A contiguous span of transformer blocks ``[start, end)`` a peer serves."""

    model: str  # content hash of the model
    start: int
    end: int
    throughput: float  # tokens/s this peer sustains through the span

    def to_list(self) -> list[Any]:
        return [self.model, self.start, self.end, self.throughput]

    @classmethod
    def from_list(cls, v: Any) -> "Span":
        v = _list(v, "span", 4)
        if len(v) != 4:
            raise _bad("span", "needs 4 fields")
        start = _int(v[1], "span.start", 0, 100000)
        end = _int(v[2], "span.end", 0, 100000)
        if end <= start:
            raise _bad("span", "end <= start")
        return cls(_str(v[0], "span.model", 128, empty=False), start, end, _float(v[3], "span.throughput"))


@dataclass(frozen=True, slots=True)
class PeerState(Message):
    """A peer's signed advertisement of its capacity and power state.

    ``throughput`` maps a task kind (or ``"*"`` for any) to a speed relative to
    the reference device (1.0 = one reference GPU). ``ledger`` is the author's
    own row of the tenant ledger (tenant -> log-domain usage counter, see
    ``core.ledger``). ``seq`` orders a peer's states: the newest wins.
    """

    KIND: ClassVar[int] = 1
    seq: int
    ttl_s: float
    devices: tuple[Device, ...]
    slots: int
    throughput: dict[str, float]
    backlog_s: float
    power: PowerInfo
    energy_price: float  # currency units per kWh
    carbon_g_kwh: float
    spans: tuple[Span, ...]
    trust: str  # "volunteer" | "datacenter"
    membership: bytes  # federation signature admitting a trusted peer (or b"")
    addrs: tuple[str, ...]
    region: str
    leaving: bool
    ledger: dict[str, float]
    #: seconds until 1, 2, ... of its slots are free at once (running shards
    #: only; at most 64 entries, ascending). Lets a client rank peers for a
    #: gang, which needs several slots together. Absent from older peers.
    free_s: tuple[float, ...] = ()

    @classmethod
    def from_body(cls, body: list[Any]) -> "PeerState":
        if len(body) not in (16, 17):
            raise _bad("PeerState", "needs 16 or 17 fields")
        thr = body[4]
        if type(thr) is not dict or len(thr) > 64:
            raise _bad("throughput", "not a small map")
        ledger = body[15]
        if type(ledger) is not dict or len(ledger) > 256:
            raise _bad("ledger", "not a small map")
        return cls(
            seq=_int(body[0], "seq"),
            ttl_s=_float(body[1], "ttl_s", 0.1, 86400),
            devices=tuple(Device.from_list(d) for d in _list(body[2], "devices", 64)),
            slots=_int(body[3], "slots", 0, 4096),
            throughput={_str(k, "throughput.kind", 64): _float(v, "throughput", 0, 1e6) for k, v in thr.items()},
            backlog_s=_float(body[5], "backlog_s", 0, 1e9),
            power=PowerInfo.from_list(body[6]),
            energy_price=_float(body[7], "energy_price", 0, 1e6),
            carbon_g_kwh=_float(body[8], "carbon_g_kwh", 0, 1e5),
            spans=tuple(Span.from_list(s) for s in _list(body[9], "spans", 64)),
            trust=_str(body[10], "trust", 32),
            membership=_bytes(body[11], "membership", 512),
            addrs=tuple(_str(a, "addr", 512) for a in _list(body[12], "addrs", 16)),
            region=_str(body[13], "region", 64),
            leaving=_bool(body[14], "leaving"),
            ledger={_str(k, "ledger.tenant", 64): _float(v, "ledger", -1e12, 1e12) for k, v in ledger.items()},
            free_s=_free_times(body[16]) if len(body) == 17 else (),
        )


def _free_times(obj: Any) -> tuple[float, ...]:
    return _waits(obj, "free_s", 64)


def _waits(obj: Any, name: str, most: int) -> tuple[float, ...]:
    out = tuple(_float(x, name, 0, 1e9) for x in _list(obj, name, most))
    if any(b < a for a, b in zip(out, out[1:])):
        raise _bad(name, "not ascending")
    return out


MAX_BID_NEXT = 16  # waits a bid may list for a job's further shards
MAX_GOSSIP_REPLY = 255  # entries a gossip reply may be asked for (one is the replier's own)


@dataclass(frozen=True, slots=True)
class Gossip(Message):
    """Anti-entropy push: signed PeerState envelopes; ``reply`` asks for ours.

    ``want`` (optional, 0 = the replier's default) asks the reply to carry up
    to that many entries: a client pulls a large slice of a peer's view at
    once instead of assembling it from small pushes. Repliers cap it
    (``MAX_GOSSIP_REPLY``).
    """

    KIND: ClassVar[int] = 2
    SIGNED: ClassVar[bool] = False
    entries: tuple[bytes, ...]
    reply: bool
    want: int = 0

    @classmethod
    def from_body(cls, body: list[Any]) -> "Gossip":
        if len(body) not in (2, 3):
            raise _bad("Gossip", "needs 2 or 3 fields")
        return cls(
            tuple(_bytes(e, "entry", 16384) for e in _list(body[0], "entries", 256)),
            _bool(body[1], "reply"),
            _int(body[2], "want", 0, MAX_GOSSIP_REPLY) if len(body) == 3 else 0,
        )


@dataclass(frozen=True, slots=True)
class JobSpec(Message):
    """A tenant's signed job: ``shards`` shards of task ``task``.

    ``work_s`` is one shard's run time on ``gpus`` reference devices;
    ``chain`` jobs run shards one after another. ``deadline_s`` is relative to
    ``submitted_at``; ``lam`` weighs energy (J) against finish time (s) in the
    award rule; ``params`` is the task's msgpack-encoded parameter map.
    """

    KIND: ClassVar[int] = 3
    job_id: str
    task: str
    shards: int
    chain: bool
    work_s: float
    gpus: int
    mem_bytes: int
    deadline_s: float | None
    weight: float
    lam: float
    submitted_at: float
    params: bytes

    @classmethod
    def from_body(cls, body: list[Any]) -> "JobSpec":
        if len(body) != 12:
            raise _bad("JobSpec", "needs 12 fields")
        return cls(
            job_id=_str(body[0], "job_id", 128, empty=False),
            task=_str(body[1], "task", 64, empty=False),
            shards=_int(body[2], "shards", 1, 1_000_000),
            chain=_bool(body[3], "chain"),
            work_s=_float(body[4], "work_s", 0, 1e9),
            gpus=_int(body[5], "gpus", 0, 4096),
            mem_bytes=_int(body[6], "mem_bytes"),
            deadline_s=_opt_float(body[7], "deadline_s", 0, 1e9),
            weight=_float(body[8], "weight", 1e-6, 1e6),
            lam=_float(body[9], "lam", 0, 1e6),
            submitted_at=_float(body[10], "submitted_at", -1e12, 1e12),
            params=_bytes(body[11], "params", _MAX_PARAMS_BYTES),
        )


def _shard_list(v: Any, name: str) -> tuple[int, ...]:
    return tuple(_int(s, name, 0, 1_000_000) for s in _list(v, name, 4096))


@dataclass(frozen=True, slots=True)
class CallForBids(Message):
    """Client -> peer: bid on these shards of the (tenant-signed) job."""

    KIND: ClassVar[int] = 4
    job: bytes  # signed JobSpec envelope
    shards: tuple[int, ...]
    round: int

    @classmethod
    def from_body(cls, body: list[Any]) -> "CallForBids":
        if len(body) != 3:
            raise _bad("CallForBids", "needs 3 fields")
        return cls(_bytes(body[0], "job", _MAX_PARAMS_BYTES + 4096), _shard_list(body[1], "shards"), _int(body[2], "round"))


@dataclass(frozen=True, slots=True)
class Bid(Message):
    """Peer -> client: an offer for the listed shards of one auction round.

    ``start_s`` is the estimated wait before the first shard starts,
    ``run_s`` the estimated run time of one shard at ``level``; ``slots`` how
    many of them the peer runs side by side. Energy and carbon are per shard.
    ``next_s``: the waits before a second, third... shard of the job would
    start here (ascending, at most ``MAX_BID_NEXT``): a peer with 8 slots and
    one free says so. Absent from older peers.
    """

    KIND: ClassVar[int] = 5
    job_id: str
    round: int
    shards: tuple[int, ...]
    start_s: float
    run_s: float
    slots: int
    level: float
    energy_j: float
    carbon_g: float
    trust: str
    next_s: tuple[float, ...] = ()

    @classmethod
    def from_body(cls, body: list[Any]) -> "Bid":
        if len(body) not in (10, 11):
            raise _bad("Bid", "needs 10 or 11 fields")
        return cls(
            _str(body[0], "job_id", 128, empty=False),
            _int(body[1], "round"),
            _shard_list(body[2], "shards"),
            _float(body[3], "start_s", 0, 1e9),
            _float(body[4], "run_s", 0, 1e9),
            _int(body[5], "slots", 1, 4096),
            _float(body[6], "level", 0.01, 1.0),
            _float(body[7], "energy_j", 0, 1e15),
            _float(body[8], "carbon_g", 0, 1e12),
            _str(body[9], "trust", 32),
            _waits(body[10], "next_s", MAX_BID_NEXT) if len(body) == 11 else (),
        )


@dataclass(frozen=True, slots=True)
class Award(Message):
    """Client -> winning peer: run ``shard`` (attempt ``attempt``) under a lease."""

    KIND: ClassVar[int] = 6
    job: bytes  # signed JobSpec envelope
    peer: str  # the winner: an award replayed to another peer is refused
    shard: int
    attempt: int
    lease_s: float
    level: float

    @classmethod
    def from_body(cls, body: list[Any]) -> "Award":
        if len(body) != 6:
            raise _bad("Award", "needs 6 fields")
        return cls(
            _bytes(body[0], "job", _MAX_PARAMS_BYTES + 4096),
            _str(body[1], "peer", 128, empty=False),
            _int(body[2], "shard", 0, 1_000_000),
            _int(body[3], "attempt", 0, 1_000_000),
            _float(body[4], "lease_s", 0.01, 86400),
            _float(body[5], "level", 0.01, 1.0),
        )


def _shard_ref(body: list[Any], n: int, name: str) -> tuple[str, int, int]:
    if len(body) != n:
        raise _bad(name, f"needs {n} fields")
    return (
        _str(body[0], "job_id", 128, empty=False),
        _int(body[1], "shard", 0, 1_000_000),
        _int(body[2], "attempt", 0, 1_000_000),
    )


@dataclass(frozen=True, slots=True)
class AwardDecline(Message):
    KIND: ClassVar[int] = 7
    job_id: str
    shard: int
    attempt: int
    reason: str

    @classmethod
    def from_body(cls, body: list[Any]) -> "AwardDecline":
        j, s, a = _shard_ref(body, 4, "AwardDecline")
        return cls(j, s, a, _str(body[3], "reason", 256))


@dataclass(frozen=True, slots=True)
class LeaseRenew(Message):
    """Peer -> client: still holding the shard; ``running`` or queued; ETA."""

    KIND: ClassVar[int] = 8
    job_id: str
    shard: int
    attempt: int
    running: bool
    eta_s: float

    @classmethod
    def from_body(cls, body: list[Any]) -> "LeaseRenew":
        j, s, a = _shard_ref(body, 5, "LeaseRenew")
        return cls(j, s, a, _bool(body[3], "running"), _float(body[4], "eta_s", 0, 1e9))


@dataclass(frozen=True, slots=True)
class LeaseAck(Message):
    """Client -> peer: lease extended by ``lease_s`` (``ok``) or revoked."""

    KIND: ClassVar[int] = 9
    job_id: str
    shard: int
    attempt: int
    ok: bool
    lease_s: float

    @classmethod
    def from_body(cls, body: list[Any]) -> "LeaseAck":
        j, s, a = _shard_ref(body, 5, "LeaseAck")
        return cls(j, s, a, _bool(body[3], "ok"), _float(body[4], "lease_s", 0, 86400))


MAX_BATCH = 4096  # renewals (or acks) in one batch


def _batch(body: list[Any], name: str, field_name: str, item: Any) -> tuple[Any, ...]:
    """A batch body: one non-empty list of at most ``MAX_BATCH`` bodies of
    ``item`` (a message class), each validated as that message would be."""
    if len(body) != 1:
        raise _bad(name, "needs 1 field")
    items = _list(body[0], field_name, MAX_BATCH)
    if not items:
        raise _bad(field_name, "empty")
    return tuple(item.from_body(_list(x, field_name, 16)) for x in items)


class _Batch(Message):
    """Several messages of kind ``ITEM`` in one: the body is one non-empty
    list of their bodies (at most ``MAX_BATCH``), each checked as that
    message would be. The subclass's one field holds them."""

    __slots__ = ()
    ITEM: ClassVar[type[Message]]

    def to_body(self) -> list[Any]:
        return [[x.to_body() for x in getattr(self, fields(self)[0].name)]]  # type: ignore[arg-type]

    @classmethod
    def from_body(cls, body: list[Any]) -> "Message":
        return cls(_batch(body, cls.__name__, fields(cls)[0].name, cls.ITEM))  # type: ignore[arg-type, call-arg]


@dataclass(frozen=True, slots=True)
class LeaseRenewBatch(_Batch):
    """Peer -> client: the renewals of several of its shards held here, in
    one message per (peer, client) pair and renewal round."""

    KIND: ClassVar[int] = 14
    ITEM: ClassVar[type[Message]] = LeaseRenew
    renewals: tuple[LeaseRenew, ...]


@dataclass(frozen=True, slots=True)
class LeaseAckBatch(_Batch):
    """Client -> peer: the answers to one ``LeaseRenewBatch``, in its order."""

    KIND: ClassVar[int] = 15
    ITEM: ClassVar[type[Message]] = LeaseAck
    acks: tuple[LeaseAck, ...]


@dataclass(frozen=True, slots=True)
class ShardResult(Message):
    """Peer -> client: the outcome of one attempt of one shard."""

    KIND: ClassVar[int] = 10
    job_id: str
    shard: int
    attempt: int
    ok: bool
    result: bytes  # msgpack-encoded result map, or b"" on failure
    error: str
    gpu_s: float
    energy_j: float
    carbon_g: float

    @classmethod
    def from_body(cls, body: list[Any]) -> "ShardResult":
        j, s, a = _shard_ref(body, 9, "ShardResult")
        return cls(
            j,
            s,
            a,
            _bool(body[3], "ok"),
            _bytes(body[4], "result"),
            _str(body[5], "error", 1024),
            _float(body[6], "gpu_s", 0, 1e12),
            _float(body[7], "energy_j", 0, 1e15),
            _float(body[8], "carbon_g", 0, 1e12),
        )


@dataclass(frozen=True, slots=True)
class ResultAck(Message):
    KIND: ClassVar[int] = 11
    job_id: str
    shard: int
    attempt: int

    @classmethod
    def from_body(cls, body: list[Any]) -> "ResultAck":
        return cls(*_shard_ref(body, 3, "ResultAck"))


@dataclass(frozen=True, slots=True)
class Cancel(Message):
    """Tenant -> peer: drop these shards of the tenant's job (all if empty)."""

    KIND: ClassVar[int] = 12
    job_id: str
    shards: tuple[int, ...]

    @classmethod
    def from_body(cls, body: list[Any]) -> "Cancel":
        if len(body) != 2:
            raise _bad("Cancel", "needs 2 fields")
        return cls(_str(body[0], "job_id", 128, empty=False), _shard_list(body[1], "shards"))


@dataclass(frozen=True, slots=True)
class Accusation(Message):
    """A tenant's evidence that ``accused`` returned a wrong result.

    ``evidence`` holds signed ``ShardResult`` envelopes for one shard: the
    accused's, and at least a quorum of other peers' that agree with each
    other and not with it. Receivers check every signature themselves and act
    only if a peer *they* trust is among the agreeing ones.
    """

    KIND: ClassVar[int] = 13
    job_id: str
    shard: int
    accused: str
    evidence: tuple[bytes, ...]

    @classmethod
    def from_body(cls, body: list[Any]) -> "Accusation":
        if len(body) != 4:
            raise _bad("Accusation", "needs 4 fields")
        return cls(
            _str(body[0], "job_id", 128, empty=False),
            _int(body[1], "shard", 0, 1_000_000),
            _str(body[2], "accused", 128, empty=False),
            tuple(_bytes(e, "evidence", MAX_MESSAGE_BYTES // 8) for e in _list(body[3], "evidence", 16)),
        )


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
    )
}


# --------------------------------------------------------------------------
# envelopes


@dataclass(frozen=True, slots=True)
class Signed:
    """A decoded, verified envelope: the message and who said it, when."""

    msg: Message
    author: str
    issued_at: float
    nonce: int
    raw: bytes = field(repr=False)
    extras: dict[str, Any] = field(default_factory=dict, repr=False)


def _unpack(data: bytes, max_bytes: int) -> Any:
    if type(data) is not bytes:
        raise RemoteProtocolError("malformed", "not bytes")
    if len(data) > max_bytes:
        raise RemoteProtocolError("oversize", f"{len(data)} > {max_bytes}")
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
    body = msg.to_body()
    if check:
        # refuse to send what a receiver would refuse (h11: validate eagerly)
        try:
            type(msg).from_body(body)  # to_body gives exactly the wire types
        except RemoteProtocolError as exc:
            raise LocalProtocolError(exc.reason, exc.detail) from None
    payload = msgpack.packb(
        [VERSION, msg.KIND, author, float(issued_at), nonce, body, extras or {}],
        use_bin_type=True,
    )
    sig = identity.sign(payload) if identity is not None else b""
    return msgpack.packb([sig, payload], use_bin_type=True)


class VerifyCache:
    """Remembers envelopes already decoded and verified, by their exact bytes,
    so a gossiped state received from many neighbours is checked once.

    Decoding and verification are pure functions of the bytes (and of the
    size limit, part of the key), so one cache may be shared by every core
    in a process (netsim does; a daemon has one core anyway). Failures are
    never cached: bad input is re-examined and counted every time.
    """

    def __init__(self, capacity: int = 65536) -> None:
        self.capacity = capacity
        self._seen: dict[tuple[bytes, int], Signed] = {}
        self.hits = 0

    def get(self, raw: bytes, max_bytes: int) -> "Signed | None":
        got = self._seen.get((raw, max_bytes))
        if got is not None:
            self.hits += 1
        return got

    def add(self, raw: bytes, max_bytes: int, signed: "Signed") -> None:
        if len(self._seen) >= self.capacity:
            # drop the oldest half (dicts keep insertion order)
            for k in list(self._seen)[: self.capacity // 2]:
                del self._seen[k]
        self._seen[(raw, max_bytes)] = signed


def _decode(data: bytes, max_bytes: int, cache: VerifyCache | None, check_sig: bool) -> Signed:
    if cache is not None and check_sig:
        hit = cache.get(data, max_bytes)
        if hit is not None:
            return hit
    outer = _unpack(data, max_bytes)
    if type(outer) is not list or len(outer) != 2 or type(outer[0]) is not bytes or type(outer[1]) is not bytes:
        raise RemoteProtocolError("malformed", "envelope is not [sig, payload]")
    sig, payload = outer
    inner = _unpack(payload, max_bytes)
    if type(inner) is not list or len(inner) != 7:
        raise RemoteProtocolError("malformed", "payload is not a 7-list")
    version, kind, author, issued_at, nonce, body, extras = inner
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
    if type(body) is not list or type(extras) is not dict:
        raise RemoteProtocolError("malformed", "body/extras")
    if cls.SIGNED:
        if not sig:
            raise RemoteProtocolError("unsigned", cls.__name__)
        if check_sig:
            verify(author, sig, payload)
    try:
        msg = cls.from_body(body)
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
