"""The vocabulary between the sans-IO cores and the worlds that drive them.

Inputs are facts and requests handed to ``PeerCore.handle`` /
``ClientCore.handle``; effects are imperatives the driver performs (the trio
runtime over a real transport, or netsim's event loop). Nothing here does I/O.
Every core satisfies ``core.contract.Core``.

Inputs: from the network and the executor (``MessageReceived``,
``ShardFinished``, ``ShardProgress``), from the operator (``Leave``, ``HandBackRunning``), from
the executor's measurements (``SetThroughput``, ``SetPower``), from the LLM
server (``SetSpans``), and from the tenant (``Submit``, ``CancelJob``). A core
refuses an input it has no use for (``LocalProtocolError("bad-input")``).

Driving contract (all cores)::

    effects = core.start(now)
    loop:
        perform(effects)
        wait until a message arrives, a shard finishes, or now >= core.next_deadline()
        effects = core.handle(now, input)   # or core.poll(now) on a deadline

``poll`` may be called early or late; it does whatever is due at ``now``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "JobRequest",
    "Input",
    "MessageReceived",
    "ShardFinished",
    "ShardProgress",
    "Leave",
    "HandBackRunning",
    "SetThroughput",
    "SetPower",
    "SetSpans",
    "Submit",
    "CancelJob",
    "Effect",
    "Send",
    "Publish",
    "RunShard",
    "CancelShard",
    "SetLevel",
    "ShardDelivered",
    "JobAccepted",
    "JobFinished",
    "TOPIC_PEERS",
    "TOPIC_ACCUSATIONS",
]

TOPIC_PEERS = "fedswarm/peers/1"
TOPIC_ACCUSATIONS = "fedswarm/accusations/1"


@dataclass(frozen=True)
class JobRequest:
    """What a tenant asks for. ``work_s``: one shard's run time on ``gpus``
    reference devices (an estimate; it steers bids and the energy choice).
    (Defined here, beside ``Submit``, and not in ``client_core``: that
    module may run compiled, and compiled classes keep no docstring.)"""

    task: str
    shards: int
    params: dict[str, Any] = field(default_factory=dict)
    work_s: float = 1.0
    gpus: int = 1
    mem_bytes: int = 0
    chain: bool = False
    deadline_s: float | None = None
    weight: float = 1.0
    lam: float = 0.0
    job_id: str = ""


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
class ShardProgress(Input):
    """The executor saved a running shard's progress (a checkpoint).

    ``done``: the share of the whole shard's work behind it (0 < done < 1,
    counting what an earlier attempt did before this run resumed);
    ``state``: the task's encoding of that progress, from which a run on
    another peer can go on (``RunShard.resume``)."""

    tenant: str
    job_id: str
    shard: int
    attempt: int
    done: float
    state: bytes


@dataclass(frozen=True, slots=True)
class Leave(Input):
    """Graceful shutdown requested: stop bidding, hand back queued shards."""


@dataclass(frozen=True, slots=True)
class HandBackRunning(Input):
    """Peer: the leave's grace period is over; give back the shards still running."""


@dataclass(frozen=True, slots=True)
class SetThroughput(Input):
    """Peer: the executor measured its speed for a task kind (1.0: the reference)."""

    kind: str
    value: float


@dataclass(frozen=True, slots=True)
class SetPower(Input):
    """Peer: the device now draws ``now_w`` watts (gossiped in the peer's state)."""

    now_w: float


@dataclass(frozen=True, slots=True)
class SetSpans(Input):
    """Peer: the LLM block spans this peer serves now (``core.spans.Span``s)."""

    spans: tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class Submit(Input):
    """Client: open a job. Its effects begin with ``JobAccepted`` (the job's id)."""

    req: JobRequest


@dataclass(frozen=True, slots=True)
class CancelJob(Input):
    """Client: cancel a job (its holders are told to stop; ``JobFinished`` follows)."""

    job_id: str


class Effect:
    """Base class of effects."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class Send(Effect):
    """Deliver ``data`` to peer ``to`` (best effort). ``kind`` is for metrics.

    ``addrs``: where ``to`` says it can be dialled (its signed state in the
    core's view; empty when the view has none), for a transport that needs
    addresses to reach a peer it is not connected to.
    """

    to: str
    data: bytes
    kind: str
    addrs: tuple[str, ...] = ()


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

    ``resume``: when not empty, an earlier attempt's checkpoint state; the
    run goes on from it, with ``left`` of the shard's work still to do
    (``run_s`` counts only that). A task that cannot resume runs the whole
    shard. An executor that can save progress says so with ``ShardProgress``.
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
    left: float = 1.0
    resume: bytes = b""


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
class JobAccepted(Effect):
    """Client side: a ``Submit`` opened job ``job_id`` (the first effect it returns)."""

    job_id: str


@dataclass(frozen=True, slots=True)
class JobFinished(Effect):
    """Client side: every shard delivered (``ok``), or the job failed/cancelled."""

    job_id: str
    ok: bool
    error: str = ""
