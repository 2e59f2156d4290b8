"""The vocabulary between the sans-IO cores and the worlds that drive them.

Inputs are past-tense facts handed to ``PeerCore.handle`` /
``ClientCore.handle``; effects are imperatives the driver performs (the trio
runtime over a real transport, or netsim's event loop). Nothing here does I/O.

Driving contract (both cores)::

    effects = core.start(now)
    loop:
        perform(effects)
        wait until a message arrives, a shard finishes, or now >= core.next_deadline()
        effects = core.handle(now, input)   # or core.poll(now) on a deadline

``poll`` may be called early or late; it does whatever is due at ``now``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "Input",
    "MessageReceived",
    "ShardFinished",
    "Leave",
    "Effect",
    "Send",
    "Publish",
    "RunShard",
    "CancelShard",
    "SetLevel",
    "ShardDelivered",
    "JobFinished",
    "TOPIC_PEERS",
    "TOPIC_ACCUSATIONS",
]

TOPIC_PEERS = "fedswarm/peers/1"
TOPIC_ACCUSATIONS = "fedswarm/accusations/1"


class Input:
    """Base class of inputs."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class MessageReceived(Input):
    """Bytes arrived from ``sender`` (the transport-authenticated hop)."""

    sender: str
    data: bytes
    topic: str = ""


@dataclass(frozen=True, slots=True)
class ShardFinished(Input):
    """The executor finished (or failed) a ``RunShard``."""

    tenant: str
    job_id: str
    shard: int
    attempt: int
    ok: bool
    result: bytes = b""
    error: str = ""
    run_s: float = 0.0
    energy_j: float = 0.0


@dataclass(frozen=True, slots=True)
class Leave(Input):
    """Graceful shutdown requested: stop bidding, hand back queued shards."""


class Effect:
    """Base class of effects."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class Send(Effect):
    """Deliver ``data`` to peer ``to`` (best effort). ``kind`` is for metrics."""

    to: str
    data: bytes
    kind: str


@dataclass(frozen=True, slots=True)
class Publish(Effect):
    """Publish ``data`` on a pubsub topic."""

    topic: str
    data: bytes
    kind: str


@dataclass(frozen=True, slots=True)
class RunShard(Effect):
    """Start running one shard on the local executor.

    ``work_s`` is the declared run time on ``gpus`` reference devices at full
    clock; ``level`` the relative clock chosen for it; ``run_s`` the time the
    core expects it to take here.
    """

    tenant: str
    job_id: str
    shard: int
    attempt: int
    task: str
    params: bytes
    work_s: float
    gpus: int
    mem_bytes: int
    level: float
    run_s: float


@dataclass(frozen=True, slots=True)
class SetLevel(Effect):
    """Change the clock level of a running shard (speed up when a queue forms).

    ``run_s`` is the new expected total run time from the shard's start.
    """

    tenant: str
    job_id: str
    shard: int
    attempt: int
    level: float
    run_s: float


@dataclass(frozen=True, slots=True)
class CancelShard(Effect):
    tenant: str
    job_id: str
    shard: int
    attempt: int


@dataclass(frozen=True, slots=True)
class ShardDelivered(Effect):
    """Client side: the result of a shard, delivered exactly once per shard."""

    job_id: str
    shard: int
    peer: str
    attempt: int
    result: bytes
    energy_j: float
    carbon_g: float
    gpu_s: float


@dataclass(frozen=True, slots=True)
class JobFinished(Effect):
    """Client side: every shard delivered (``ok``), or the job failed/cancelled."""

    job_id: str
    ok: bool
    error: str = ""
