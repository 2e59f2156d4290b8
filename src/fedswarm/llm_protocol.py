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
* ``{"op": "close", "model": HASH, "session": <16 bytes>}`` frees a session.
* ``{"op": "info"}``: model hash, span, limits and counters.

Errors are answers, never crashes: ``{"ok": false, "error": CODE, "detail":
TEXT}`` with CODE one of ``ERROR_CODES``.

Sessions are keyed by (transport-authenticated sender, session id), so a
client can touch only its own.
"""

from __future__ import annotations

import math
from typing import Any

import msgpack
import torch

from .core.spans import tenant_problem, weight_problem
from .errors import RemoteProtocolError
from .tasks.llama import DTYPES

__all__ = [
    "PROTOCOL", "WIRE_VERSION", "SESSION_ID_BYTES", "MAX_FRAME", "WIRE_DTYPES", "ERROR_CODES", "OP_KEYS",
    "OPTIONAL_KEYS", "tenant_of", "WireError", "encode", "decode", "pack_tensor", "unpack_tensor", "get_field", "elem_bytes",
]

PROTOCOL = "/fedswarm/llm/1.0.0"
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
)


class WireError(RemoteProtocolError):
    """A message broke the wire rules; ``code`` (the ``reason`` tag) is the
    error code to answer with."""

    @property
    def code(self) -> str:
        return self.reason


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
    if type(v) is not dict or set(v) != {"dtype", "shape", "data"}:
        raise WireError("bad-request", "tensor must be {dtype, shape, data}")
    dt, shape, data = v["dtype"], v["shape"], v["data"]
    if dt not in WIRE_DTYPES:
        raise WireError("bad-request", f"dtype must be one of {WIRE_DTYPES}")
    if type(shape) is not list or not 1 <= len(shape) <= max_ndim or any(
        type(s) is not int or not 0 <= s <= (1 << 24) for s in shape
    ):
        raise WireError("bad-request", "bad tensor shape")
    if type(data) is not bytes:
        raise WireError("bad-request", "tensor data must be bytes")
    n = math.prod(shape) * _ELEM[dt]
    if n > max_bytes:
        raise WireError("too-large", "tensor too large")
    if n != len(data):
        raise WireError("bad-request", f"tensor data is {len(data)} bytes, shape needs {n}")
    if n == 0:
        return torch.empty(shape, dtype=DTYPES[dt])
    return torch.frombuffer(bytearray(data), dtype=DTYPES[dt]).reshape(shape)


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
    "step": {"v", "op", "model", "span", "sessions", "pos", "max_length", "hidden"},
    "close": {"v", "op", "model", "session"},
    "info": {"v", "op"},
}
#: keys an op may carry: ``tenant`` (1..64 characters; default: the sender)
#: and its ``weight`` (0 < w <= 1000; default 1) order queued steps when a
#: serving peer's forwards are full (fair sessions)
OPTIONAL_KEYS = {"forward": {"tenant", "weight"}, "step": {"tenant", "weight"}}
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
