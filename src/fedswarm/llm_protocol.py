"""The LLM serving wire protocol ``/fedswarm/llm/1.0.0``: one vocabulary for
both sides. The serving peer (``fedswarm.llm_serving``) and the client
(``fedswarm.llm_client``) both import this module; neither imports the other.

One request frame, one response frame, both strict msgpack maps (no ext
types, bounded sizes, unknown keys refused, never any object deserialisation).
Tensors travel as ``{"dtype": "float32"|"bfloat16"|"float16", "shape": [..],
"data": <raw little-endian bytes>}``.

Requests (``"v": 1`` in all):

* ``{"op": "forward", "model": HASH, "span": [A, B], "session": <16 bytes>,
  "pos": P, "max_length": M, "hidden": TENSOR(T, hidden_size)}`` runs the
  span on ``T`` new positions ``P .. P+T-1`` of a session. The session is
  created when unknown and ``P == 0`` (with a cache of ``M`` positions). If
  the server's cache is longer than ``P`` it is rolled back to ``P`` (a
  client retrying a step); if it is shorter the answer is ``pos-mismatch``
  with the server's ``length``; an unknown session with ``P > 0`` gives
  ``unknown-session`` (expired, or the peer restarted): the client replays.
  Answer: ``{"ok": true, "hidden": TENSOR(T, hidden_size), "length": P+T}``.
* ``{"op": "step", "model": HASH, "span": [A, B], "sessions": [<16 bytes>,
  ..N], "pos": [P1, ..N], "max_length": [M1, ..N], "hidden": TENSOR(N,
  hidden_size)}``: one decode position for each of N of the sender's open
  sessions, computed in one batch (a client serving several streams sends
  their steps together, so they share the peer's forward). All-or-nothing:
  every session is checked before any cache moves; the first one that fails
  makes the answer an error with its ``index`` (and ``length`` for a
  ``pos-mismatch``), and the client retries those steps one ``forward`` each.
  Sessions must already exist and appear once. Answer: ``{"ok": true,
  "hidden": TENSOR(N, hidden_size), "length": [P1+1, ..]}``.
* ``forward`` and ``step`` may carry ``"tenant": NAME`` and ``"weight": W``:
  when more steps wait than one forward takes, a serving peer takes those of
  the tenants with the least usage (its ledger, as for batch shards) over
  weight first. Without them the tenant is the sender, weight 1.
* ``forward`` may carry ``"route": DELEGATION`` (server-to-server
  forwarding, below).
* ``{"op": "close", "model": HASH, "session": <16 bytes>}`` frees a session.
* ``{"op": "info"}``: model hash, span, limits and counters.

Errors are answers, never crashes: ``{"ok": false, "error": CODE, "detail":
TEXT}`` with CODE one of ``ERROR_CODES``.

Sessions are keyed by (transport-authenticated sender, session id), so a
client can touch only its own; a forwarded request is keyed by the client
that signed its delegation.

Forwarding. A client that wants a decode step to travel peer to peer sends
the chain's first hop a ``forward`` with ``"route"``: a delegation it signed
with its Ed25519 key (``sign_delegation``): ``{"client": PEER_ID, "session":
<16 bytes>, "model": HASH, "route": [[PEER, A, B], ..], "expires": UNIX_S,
"sig": <64 bytes>}``. A serving peer checks it (``check_delegation``: the
signature, the session and model, the expiry, a route that covers blocks
contiguously to the model's last block and names each peer once, this peer
on it with the request's span, the sender the client or the route's previous
hop, every hop a live peer of its view), computes, sends the same ``forward``
to the route's next hop with its output as ``hidden`` and the outputs of the
hops before it as ``"outs": [TENSOR, ..]``. The last hop sends the client
(on ``OUT_PROTOCOL``) ``{"op": "out", "model", "session", "span": [A, B],
"pos": P, "hidden": TENSOR, "outs": [..]}``: its output and, in route order,
every earlier hop's. A hop that
could not reach the next one (or was refused) sends ``out`` naming the next
hop's span with ``"outs"`` (the outputs up to its own), ``"error"`` and
``"detail"`` instead of ``"hidden"``. The client answers ``{"ok": true}``; it
drives every hop whose output did not come itself. Each hop answers its
sender too: the first hop the client, with its output, once the next hop's
request is out; a later hop the previous one, with ``length`` only, once it
passed the step on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch

from .core.identity import Identity, verify
from .core.spans import tenant_problem, weight_problem
from .errors import RemoteProtocolError
from .tasks.llama import DTYPES

__all__ = [
    "PROTOCOL", "OUT_PROTOCOL", "WIRE_VERSION", "SESSION_ID_BYTES", "MAX_FRAME", "WIRE_DTYPES", "ERROR_CODES", "OP_KEYS",
    "OPTIONAL_KEYS", "tenant_of", "WireError", "RouteRefused", "DelegationRefused", "SessionConflict", "BadHidden",
    "Delegation", "sign_delegation", "check_delegation", "DELEGATION_KEYS", "MAX_ROUTE", "encode", "decode", "pack_tensor", "unpack_tensor", "finite", "get_field", "elem_bytes",
]

PROTOCOL = "/fedswarm/llm/1.0.0"
#: serving peer -> client: outputs of forwarded steps (``out``)
OUT_PROTOCOL = "/fedswarm/llm-out/1.0.0"
WIRE_VERSION = 1
SESSION_ID_BYTES = 16
MAX_FRAME = 4 * 1024 * 1024
WIRE_DTYPES = ("float32", "bfloat16", "float16")
_ELEM = {"float32": 4, "bfloat16": 2, "float16": 2}


def elem_bytes(dtype_name: str) -> int:
    """Bytes per element of a wire dtype."""
    return _ELEM[dtype_name]
ERROR_CODES = (
    "bad-request", "wrong-model", "wrong-span", "too-large", "full", "busy",
    "pos-mismatch", "unknown-session", "internal",
    # forwarding and bad input (see the module docstring)
    "bad-route", "unknown-peer", "bad-delegation", "session-conflict", "forward-failed",
)


class WireError(RemoteProtocolError):
    """A message broke the wire rules; ``code`` (the ``reason`` tag) is the
    error code to answer with."""

    @property
    def code(self) -> str:
        return self.reason


class RouteRefused(WireError):
    """A delegated route that loops, skips or overlaps blocks, does not reach
    the model's last block, leaves out this peer's span or its sender
    (``bad-route``), or names a peer outside this peer's view
    (``unknown-peer``)."""


class DelegationRefused(WireError):
    """A delegation that is malformed, expired, for another session or
    model, or not signed by the client it names (``bad-delegation``)."""


class SessionConflict(WireError):
    """A session id already open here for another client or tenant
    (``session-conflict``)."""


class BadHidden(WireError):
    """A hidden-state tensor of the wrong shape or dtype, or non-finite
    (``bad-request``, as for any malformed field)."""


# ----------------------------------------------------------------- codec

def encode(msg: dict[str, Any]) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def decode(data: bytes, *, max_bytes: int = MAX_FRAME) -> dict[str, Any]:
    """Strict msgpack map decode (bounded sizes, no ext types, str keys)."""
    if not isinstance(data, (bytes, bytearray, memoryview)) or len(data) > max_bytes:
        raise WireError("too-large", "frame too large")
    try:
        msg = msgpack.unpackb(
            bytes(data), raw=False, strict_map_key=True, use_list=True,
            max_bin_len=max_bytes, max_str_len=4096, max_array_len=64, max_map_len=32, max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises a zoo of exception types
        raise WireError("bad-request", f"not strict msgpack: {type(exc).__name__}") from None
    if type(msg) is not dict:
        raise WireError("bad-request", "message is not a map")
    return msg


def pack_tensor(t: torch.Tensor) -> dict[str, Any]:
    name = {v: k for k, v in DTYPES.items()}.get(t.dtype)
    if name not in WIRE_DTYPES:
        raise ValueError(f"dtype {t.dtype} cannot travel")
    t = t.detach().to("cpu").contiguous()
    return {"dtype": name, "shape": list(t.shape), "data": t.view(torch.uint8).numpy().tobytes()}


def unpack_tensor(v: Any, *, max_ndim: int = 4, max_bytes: int = MAX_FRAME) -> torch.Tensor:
    dt, shape = check_tensor(v, max_ndim=max_ndim, max_bytes=max_bytes)
    return tensor_of(dt, shape, v["data"])


def tensor_of(dt: str, shape: list[int], data: bytes) -> torch.Tensor:
    """The tensor of a packed tensor that ``check_tensor`` accepted."""
    if not data:
        return torch.empty(shape, dtype=DTYPES[dt])
    return torch.frombuffer(bytearray(data), dtype=DTYPES[dt]).reshape(shape)


def check_tensor(v: Any, *, max_ndim: int = 4, max_bytes: int = MAX_FRAME) -> tuple[str, list[int]]:
    """``unpack_tensor``'s checks, without building the tensor: its
    (dtype, shape). A serving peer checks a step's hidden state on its event
    loop this way and builds the tensor in its forward thread
    (``tensor_of``): torch's first calls after a sleep cost far more than
    Python's (docs/benchmarks.md)."""
    if type(v) is not dict or set(v) != {"dtype", "shape", "data"}:
        raise BadHidden("bad-request", "tensor must be {dtype, shape, data}")
    dt, shape, data = v["dtype"], v["shape"], v["data"]
    if dt not in WIRE_DTYPES:
        raise BadHidden("bad-request", f"dtype must be one of {WIRE_DTYPES}")
    if type(shape) is not list or not 1 <= len(shape) <= max_ndim or any(
        type(s) is not int or not 0 <= s <= (1 << 24) for s in shape
    ):
        raise BadHidden("bad-request", "bad tensor shape")
    if type(data) is not bytes:
        raise BadHidden("bad-request", "tensor data must be bytes")
    n = math.prod(shape) * _ELEM[dt]
    if n > max_bytes:
        raise WireError("too-large", "tensor too large")
    if n != len(data):
        raise BadHidden("bad-request", f"tensor data is {len(data)} bytes, shape needs {n}")
    return dt, shape


#: each wire dtype's exponent bits: a value is inf or NaN exactly when all are set
_EXPONENT = {"float32": (np.uint32, 0x7F800000), "bfloat16": (np.uint16, 0x7F80), "float16": (np.uint16, 0x7C00)}


#: float32 tensors up to this many values are checked in plain Python
_SUM_MAX = 8192


def finite(v: dict[str, Any]) -> bool:
    """Whether a packed tensor that ``unpack_tensor`` accepted holds only
    finite values, tested on its bytes rather than with ``torch.isfinite``.
    A float32 decode step's few thousand values are summed in Python (an
    inf or NaN makes the sum one; finite float32 values cannot overflow a
    double's sum): after the sleep a serving peer takes between steps, that
    took 38 us where numpy took 150 us (docs/benchmarks.md). Larger ones,
    and the 16-bit dtypes, are tested on the exponent bits with numpy."""
    data = v["data"]
    if v["dtype"] == "float32" and len(data) <= 4 * _SUM_MAX:
        return math.isfinite(sum(memoryview(data).cast("f")))
    ut, bits = _EXPONENT[v["dtype"]]
    a = np.frombuffer(data, dtype=ut)
    return not bool(((a & ut(bits)) == ut(bits)).any())


def get_field(msg: dict[str, Any], key: str, typ: type, *, lo: int | None = None, hi: int | None = None) -> Any:
    if key not in msg:
        raise WireError("bad-request", f"missing {key!r}")
    v: Any = msg[key]
    if type(v) is not typ:
        raise WireError("bad-request", f"{key!r} must be {typ.__name__}")
    if isinstance(v, int) and ((lo is not None and v < lo) or (hi is not None and v > hi)):
        raise WireError("bad-request", f"{key!r} out of range")
    return v


OP_KEYS = {
    "forward": {"v", "op", "model", "span", "session", "pos", "max_length", "hidden"},
    # serving peer -> client: a forwarded step's output (or why it stopped)
    "out": {"v", "op", "model", "session", "span", "pos"},
    "step": {"v", "op", "model", "span", "sessions", "pos", "max_length", "hidden"},
    "close": {"v", "op", "model", "session"},
    "info": {"v", "op"},
}
#: keys an op may carry: ``tenant`` (1..64 characters; default: the sender)
#: and its ``weight`` (0 < w <= 1000; default 1) order queued steps when a
#: serving peer's forwards are full (fair sessions)
OPTIONAL_KEYS = {"forward": {"tenant", "weight", "route", "outs"}, "step": {"tenant", "weight"},
                 "out": {"hidden", "outs", "error", "detail"}}
def tenant_of(msg: dict[str, Any], sender: str) -> tuple[str, float]:
    """The request's (tenant, weight), checked; the sender and 1 by default."""
    tenant = msg.get("tenant", sender)
    if "tenant" in msg:
        problem = "must be a string" if type(tenant) is not str else tenant_problem(tenant)
        if problem:
            raise WireError("bad-request", f"'tenant': {problem}")
    weight = msg.get("weight", 1.0)
    problem = "must be a number" if type(weight) not in (int, float) else weight_problem(weight)
    if problem:
        raise WireError("bad-request", f"'weight': {problem}")
    return tenant, float(weight)


# ----------------------------------------------------------------- delegation

MAX_ROUTE = 64  # hops in a delegated route
DELEGATION_KEYS = {"client", "session", "model", "route", "expires", "sig"}
_DELEGATION_TAG = "fedswarm-llm-route/1"


@dataclass(frozen=True)
class Delegation:
    """A route a client signed for one session: ``route`` is ``((peer, a,
    b), ..)`` in block order; valid until ``expires`` (Unix seconds)."""

    client: str
    session: bytes
    model: str
    route: tuple[tuple[str, int, int], ...]
    expires: float
    sig: bytes

    def wire(self) -> dict[str, Any]:
        return {"client": self.client, "session": self.session, "model": self.model,
                "route": [list(h) for h in self.route], "expires": self.expires, "sig": self.sig}

    def index_of(self, peer: str, span: tuple[int, int]) -> int | None:
        for i, (p, a, b) in enumerate(self.route):
            if p == peer and (a, b) == span:
                return i
        return None


def _signed_bytes(client: str, session: bytes, model: str, route: Any, expires: float) -> bytes:
    body = [_DELEGATION_TAG, client, session, model, [list(h) for h in route], float(expires)]
    return msgpack.packb(body, use_bin_type=True)


def sign_delegation(identity: Identity, session: bytes, model: str, route: Any, expires: float) -> Delegation:
    """The client's signed delegation of ``route`` (``[(peer, a, b), ..]``)
    for ``session``."""
    hops = tuple((str(p), int(a), int(b)) for p, a, b in route)
    sig = identity.sign(_signed_bytes(identity.peer_id, session, model, hops, expires))
    return Delegation(identity.peer_id, session, model, hops, float(expires), sig)


def check_delegation(v: Any, *, num_layers: int, now: float,
                     verified: dict[bytes, Delegation] | None = None) -> Delegation:
    """Parse and check a delegation from the wire: its fields, a route that
    covers ``[a0, num_layers)`` block after block with each peer once, the
    expiry and the client's signature (skipped when ``verified`` already
    holds this signature: the caller's cache of good ones).

    Raises:
        DelegationRefused: malformed, expired or badly signed.
        RouteRefused: the route loops, skips or overlaps blocks, or stops short.
    """
    if type(v) is not dict or set(v) != DELEGATION_KEYS:
        raise DelegationRefused("bad-delegation", f"a delegation has exactly the keys {sorted(DELEGATION_KEYS)}")
    client, session, model, route, expires, sig = (v[k] for k in ("client", "session", "model", "route",
                                                                   "expires", "sig"))
    if (type(client) is not str or not 1 <= len(client) <= 128 or type(session) is not bytes
            or len(session) != SESSION_ID_BYTES or type(model) is not str or type(sig) is not bytes
            or len(sig) != 64 or type(expires) not in (int, float) or not math.isfinite(expires)):
        raise DelegationRefused("bad-delegation", "bad delegation field")
    if type(route) is not list or not 1 <= len(route) <= MAX_ROUTE:
        raise RouteRefused("bad-route", f"a route has 1..{MAX_ROUTE} hops")
    hops: list[tuple[str, int, int]] = []
    for h in route:
        if (type(h) is not list or len(h) != 3 or type(h[0]) is not str or not 1 <= len(h[0]) <= 128
                or type(h[1]) is not int or type(h[2]) is not int or not 0 <= h[1] < h[2] <= num_layers):
            raise RouteRefused("bad-route", f"a hop is [peer, A, B] with 0 <= A < B <= {num_layers}")
        hops.append((h[0], h[1], h[2]))
    for (_, _, b), (p, a, _) in zip(hops, hops[1:]):
        if a != b:
            raise RouteRefused("bad-route", f"the route {'skips' if a > b else 'overlaps'} blocks at {b} ({p[:16]})")
    if hops[-1][2] != num_layers:
        raise RouteRefused("bad-route", f"the route stops at block {hops[-1][2]}, not {num_layers}")
    peers = [p for p, _, _ in hops]
    if len(set(peers)) != len(peers) or client in peers:
        raise RouteRefused("bad-route", "the route loops (a peer appears twice)")
    if expires <= now:
        raise DelegationRefused("bad-delegation", "the delegation expired")
    d = Delegation(client, session, model, tuple(hops), float(expires), sig)
    if verified is not None and verified.get(sig) == d:
        return d
    try:
        verify(client, sig, _signed_bytes(client, session, model, hops, expires))
    except (RemoteProtocolError, ValueError) as exc:
        raise DelegationRefused("bad-delegation", f"not signed by {client[:16]}: {exc}") from None
    if verified is not None:
        if len(verified) >= 4096:
            verified.clear()
        verified[sig] = d
    return d
