"""Petals-style LLM layer serving: a peer serves decoder blocks ``[start, end)``.

A client holds the embeddings and the LM head and drives a *chain* of peers
that together cover every block (see ``fedswarm.llm_client``). Each peer keeps
one KV cache per (client, session) and batches the decode steps of concurrent
sessions.

The wire protocol (``/fedswarm/llm/1.0.0``: ``forward``, ``step``, ``close``,
``info``) lives in ``fedswarm.llm_protocol``, shared with the client.

What to do is decided by the sans-IO ``fedswarm.core.spans.ServingCore``:
the session table (keyed by transport-authenticated sender, session id and
span, so a client can touch only its own), admission against
``ServerLimits``, expiry after ``idle_timeout_s`` without a request (swept on
every request and on the placement timer), which queued steps form the next
forward, and -- with ``--blocks auto`` -- where this peer's span should be.
``BlockServer`` performs it: KV caches and forwards on torch, run in a worker
thread (``ForwardThread``) so the event loop -- and the peer's gossip --
stays live; steps that arrive while a forward runs make up the
next batch (rows may sit at different positions: ``LlamaBlockSpan`` handles
per-row positions).

Placement (``keep_placed``): every ``tick_s`` the core re-reads the spans of
this model in the swarm view and its probes of their holders; when it moves,
the new span is loaded while the old one still serves, then advertised in
the peer's signed state (``PeerCore.set_spans``); the old span takes no new
routes and is dropped once its sessions are done (at most ``drain_s``).
"""

from __future__ import annotations

import logging
import os
import queue
import statistics
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import trio

from .core.events import SetSpans
from .core.spans import (
    Advertise,
    DropSpan,
    LoadSpan,
    PlacementPolicy,
    Probe,
    ProbeDone,
    Refusal,
    ServerLimits,
    ServerStats,
    ServingCore,
    Session,
    SessionKey,
    SetSpanLevel,
    SpanAd,
    SpanLoaded,
    SpanLoadFailed,
    auto_span_size,
    choose_span,
    per_block,
)
from .errors import InputError, TransportError
from .llm_protocol import (
    MAX_FRAME,
    OUT_PROTOCOL,
    OP_KEYS,
    OPTIONAL_KEYS,
    PROTOCOL,
    SESSION_ID_BYTES,
    WIRE_VERSION,
    BadHidden,
    Delegation,
    DelegationRefused,
    RouteRefused,
    SessionConflict,
    WireError,
    check_delegation,
    decode,
    check_tensor,
    elem_bytes,
    encode,
    finite,
    get_field,
    tenant_of,
    pack_tensor,
    tensor_of,
    unpack_tensor,
)
from .tasks.checkpoint import load_block_span, load_config, model_hash
from .tasks.llama import DTYPES, LlamaBlockSpan

__all__ = [
    "PROTOCOL",
    "WIRE_VERSION",
    "ServerLimits",
    "ServerStats",
    "PlacementPolicy",
    "BlockServer",
    "WireError",
    "pack_tensor",
    "unpack_tensor",
    "encode",
    "decode",
    "parse_blocks",
    "parse_auto",
    "choose_span",
    "measure_throughput",
    "start_block_server",
    "swarm_spans",
    "served_gaps",
    "keep_level",
    "keep_placed",
]

log = logging.getLogger("fedswarm.llm")

# ----------------------------------------------------------------- server

@dataclass
class _Item:
    key: SessionKey
    session: Session
    #: the step's input (T, H) in the span's dtype; None until ``tensor``
    #: builds it from ``packed`` in the forward thread (a forwarded step)
    hidden: torch.Tensor | None
    #: a forwarded step's input as it came (wire dtype, shape, bytes), checked
    packed: tuple[str, list[int], bytes] | None = None
    result: bytes | None = None
    error: str | None = None
    batch: int = 0  # sessions in the forward that computed it
    tenant: str = ""
    weight: float = 1.0
    #: a forwarded step: called in the worker thread with ``result`` to send
    #: it on to the route's next hop (or the client) at once; what it returns
    #: (a ``Sent``, or None when it could not) goes in ``sent``
    after: Callable[[bytes], Any] | None = None
    sent: Any = None

    @property
    def tokens(self) -> int:
        """T, the positions this step computes."""
        if self.hidden is not None:
            return int(self.hidden.shape[0])
        assert self.packed is not None
        return self.packed[1][0]

    def tensor(self, dtype: torch.dtype) -> torch.Tensor:
        """The input in ``dtype``, built from ``packed`` on first use."""
        if self.hidden is None:
            assert self.packed is not None
            self.hidden = tensor_of(*self.packed).to(dtype)
        return self.hidden


class ForwardThread:
    """The thread that runs a serving peer's span forwards.

    ``trio.to_thread.run_sync`` first yields to the event loop (its thread
    limiter's checkpoint), then wakes a cached thread through trio's thread
    cache. On this project's 2-vCPU machine, after the 30 ms sleep a
    serving peer takes between steps, that took 257-260 us from the call to
    the worker's start, against 181-188 us for a put on a queue that a
    waiting thread reads (a ``/tmp`` script, three runs, 2026-12-06). A
    forward is on every decode step's critical path, so the peer keeps one
    thread of its own for it. ``run`` hands it a call and waits, shielded
    from cancellation as ``to_thread.run_sync`` is: the call's caches and
    tensors stay in use until it returns. The thread ends after
    ``idle_s`` without work and starts again on the next call.
    """

    def __init__(self, name: str = "fedswarm-forward", idle_s: float = 30.0) -> None:
        self.name = name
        self.idle_s = idle_s
        self._jobs: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...], list[Any], Any, trio.Event]] = (
            queue.SimpleQueue())
        self._lock = threading.Lock()  # a job is never put for a thread that has decided to end
        self._thread: threading.Thread | None = None

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        done = trio.Event()
        box: list[Any] = []
        with self._lock:
            self._jobs.put((fn, args, box, trio.lowlevel.current_trio_token(), done))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._thread.start()
        with trio.CancelScope(shield=True):
            await done.wait()
        ok, value = box[0]
        if ok:
            return value
        raise value

    def _loop(self) -> None:
        while True:
            try:
                fn, args, box, token, done = self._jobs.get(timeout=self.idle_s)
            except queue.Empty:
                with self._lock:
                    if self._jobs.empty():
                        self._thread = None
                        return
                continue
            try:
                box.append((True, fn(*args)))
            except BaseException as exc:  # handed to the waiting task, which raises it
                box.append((False, exc))
            try:
                token.run_sync_soon(done.set)
            except trio.RunFinishedError:  # the event loop is gone: nobody waits
                pass


class LivePeers:
    """The peer ids of ``view.live(now)``, as a container a route's hops are
    looked up in one by one (``View.is_live``). A set of them, built for
    every forwarded step, cost O(view) per hop: about 1,000 entries in a
    swarm of 1,000 peers, on the step's critical path."""

    __slots__ = ("view", "now")

    def __init__(self, view: Any, now: float) -> None:
        self.view, self.now = view, now

    def __contains__(self, peer: object) -> bool:
        return type(peer) is str and bool(self.view.is_live(peer, self.now))


def _bytes_per_pos(span: LlamaBlockSpan) -> int:
    """KV-cache bytes one session position costs on ``span``."""
    cfg = span.config
    elem = span.new_cache(1).k.element_size()
    return 2 * span.num_layers * cfg.num_key_value_heads * cfg.head_dim * elem


class BlockServer:
    """Serves ``LlamaBlockSpan``s over the LLM protocol.

    ``await server.handle(sender, request_bytes) -> response_bytes`` is the
    transport request handler; it never raises for a bad request. What to
    admit, expire and batch is decided by the sans-IO ``ServingCore``
    (``self.core``); this class performs it: torch forwards in a worker
    thread, KV caches, and (``keep_placed``, for ``--blocks auto``) span
    loads, probes and the advertised spans.
    """

    def __init__(
        self,
        span: LlamaBlockSpan,
        model_hash: str,
        *,
        limits: ServerLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_frame: int = MAX_FRAME,
        self_id: str = "",
        policy: PlacementPolicy | None = None,
        throughput: float = 0.0,
        transport: Any = None,
        view_peers: Callable[[], Any] | None = None,  # a container of live peer ids (``in``)
        nursery: trio.Nursery | None = None,
        wall: Callable[[], float] = time.time,
        forward_timeout: float = 10.0,
    ) -> None:
        self.model_hash = model_hash
        self.self_id = self_id
        # server-to-server forwarding (see _pass_on): the transport to reach
        # the route's next hop and the client; the live peer ids of our view
        # (a route naming anyone else is refused); a nursery to pass outputs
        # on after answering (without one they are passed on before); the
        # wall clock that delegations expire on
        self.transport = transport
        self.view_peers = view_peers
        self.nursery = nursery
        self.wall = wall
        self.forward_timeout = forward_timeout
        self._verified: dict[bytes, Delegation] = {}  # signatures already checked
        self._tenants: dict[tuple[str, bytes], str] = {}  # (owner, session id) -> its tenant
        #: forwarded: steps passed on to the next hop; pushed: outputs sent
        #: to the client; refused: requests refused for their route,
        #: delegation, hidden state or session id (by code in stats.by_error);
        #: from_worker: forwarded steps and pushes the worker thread wrote on a
        #: lane itself, the moment the forward ended (``_sender``)
        self.forwarding = {"forwarded": 0, "forward_failures": 0, "pushed": 0, "push_failures": 0, "refused": 0,
                           "from_worker": 0}
        self.limits = limits or ServerLimits()
        self.clock = clock
        self.max_frame = max_frame
        cfg = span.config
        self.num_layers = cfg.num_hidden_layers
        self.hidden_size = cfg.hidden_size
        self.dtype_name = {v: k for k, v in DTYPES.items()}[span.dtype]
        # every span here is loaded with one dtype; ``span.dtype`` walks the
        # module's parameters (~26 us per request), this does not
        self._dtype = span.dtype
        # where a step's input goes and its output comes back from (a Ray span: the CPU, its actor moves them)
        self._device = span.device
        #: where the spans compute (a Ray span: the actor's device, not the driver's)
        self.device_name = str(getattr(span, "actor_device", None) or span.device)
        max_length = min(self.limits.max_session_length, cfg.max_position_embeddings)
        # a request and its answer must fit in a frame (with room for the envelope)
        fit = (max_frame - 4096) // (self.hidden_size * elem_bytes(self.dtype_name))
        max_tokens = max(1, min(self.limits.max_tokens_per_request, fit))
        self.core = ServingCore(self_id, self.limits, max_length=max_length, max_tokens=max_tokens,
                                num_layers=cfg.num_hidden_layers, policy=policy)
        self._blocks: dict[tuple[int, int], LlamaBlockSpan] = {(span.start, span.end): span}
        self.core.add_span(clock(), span.start, span.end, bytes_per_pos=_bytes_per_pos(span), throughput=throughput)
        self._changed = trio.Event()
        self._forwards = ForwardThread()
        self.model_name: str | None = None
        #: called with the clock level the core picks for the spans (the
        #: daemon's runner applies it with the batch shards' levels)
        self.on_level: Callable[[float], None] | None = None
        #: called as ``fn(tokens, seconds, batch)`` after each forward
        #: request is answered (metrics: per-hop and per-token latency)
        self.observers: list[Callable[[int, float, int], None]] = []
        #: ``fn(tenant, seconds)``: a forward's compute time, charged to the
        #: tenants of its rows (see ``use_ledger``)
        self.charge: Callable[[str, float], None] | None = None

    def use_ledger(self, ledger: Any, peer_id: str, now: Callable[[], float]) -> None:
        """Fair sessions: charge each forward's compute seconds to its rows'
        tenants in ``ledger`` (the peer's tenant ledger, gossiped with its
        state, the one batch shards are charged to) and take queued steps in
        the order of the tenants' shares of it (lowest share over weight
        first) when they do not fit one forward."""
        self.charge = lambda tenant, seconds: ledger.add(peer_id, tenant, seconds, now())
        self.core.share = lambda tenant: ledger.shares(now()).get(tenant, 0.0)

    # -- public ------------------------------------------------------------
    @property
    def span(self) -> LlamaBlockSpan:
        """The span new sessions go to (during a move: the new one)."""
        assert self.core.primary is not None
        return self._blocks[self.core.primary]

    @property
    def start(self) -> int:
        return self.span.start

    @property
    def end(self) -> int:
        return self.span.end

    @property
    def max_length(self) -> int:
        return self.core.max_length

    @property
    def max_tokens(self) -> int:
        return self.core.max_tokens

    @property
    def sessions(self) -> dict[SessionKey, Session]:
        """Open sessions by (sender, session id, span start, span end); each
        has its KV cache as ``.cache``."""
        return self.core.sessions

    @property
    def cache_bytes(self) -> int:
        return self.core.cache_bytes

    @property
    def stats(self) -> ServerStats:
        return self.core.stats

    @property
    def span_changes(self) -> int:
        return self.core.span_changes

    def span_rows(self) -> list[dict[str, Any]]:
        """What ``/status`` lists under ``spans``: every span held here."""
        c = self.core
        return [{"model": self.model_hash, "start": a, "end": b, "sessions": c.span_sessions((a, b)),
                 "state": "draining" if slot.draining else "serving", "throughput": slot.throughput,
                 "device": self.device_name, "dtype": self.dtype_name}
                for (a, b), slot in sorted(c.spans.items())]

    def info(self) -> dict[str, Any]:
        st = asdict(self.stats)
        st["compute_s"] = round(st["compute_s"], 6)
        return {
            "model": self.model_hash,
            "span": [self.start, self.end],
            "dtype": self.dtype_name,
            "device": self.device_name,
            "hidden_size": self.hidden_size,
            "limits": {**asdict(self.limits), "max_tokens_per_request": self.max_tokens, "max_session_length": self.max_length},
            "sessions": len(self.sessions),
            "cache_bytes": self.cache_bytes,
            "stats": st,
            "forwarding": dict(self.forwarding),
            "energy": self.core.energy_state(self.clock()),
        }

    def apply_level(self, level: float) -> None:
        """The core chose a clock level for the spans (``SetSpanLevel``):
        hand it to whoever sets the device's clocks (``on_level``)."""
        if self.on_level is not None:
            self.on_level(level)

    async def handle(self, sender: str, data: bytes) -> bytes:
        self.stats.requests += 1
        try:
            msg = decode(data, max_bytes=self.max_frame)
            return encode(await self._dispatch(sender, msg))
        except WireError as exc:
            if isinstance(exc, (RouteRefused, DelegationRefused, SessionConflict, BadHidden)):
                self.forwarding["refused"] += 1
            return self._error(exc.code, exc.detail)
        except (trio.Cancelled, KeyboardInterrupt):
            raise
        except Exception as exc:  # a bug must not take the peer down
            log.exception("llm request failed")
            return self._error("internal", type(exc).__name__)

    def expire(self, now: float | None = None) -> int:
        """Drop sessions idle for longer than ``idle_timeout_s``; return how many."""
        return self.core.expire(self.clock() if now is None else now)

    # -- internals -----------------------------------------------------------
    def _count_error(self, code: str) -> None:
        self.stats.errors += 1
        self.stats.by_error[code] = self.stats.by_error.get(code, 0) + 1

    def _error(self, code: str, detail: str = "", **extra: Any) -> bytes:
        self._count_error(code)
        return encode({"ok": False, "error": code, "detail": detail[:300], **extra})

    def _refuse(self, code: str, index: int, detail: str, **extra: Any) -> dict[str, Any]:
        """A ``step`` refused because of its ``index``-th session (counted as an error)."""
        self._count_error(code)
        return {"ok": False, "error": code, "index": index, "detail": detail, **extra}

    def _free(self, key: SessionKey) -> None:
        self.core.free(key)

    def _span_of(self, msg: dict[str, Any]) -> tuple[int, int]:
        span = get_field(msg, "span", list)
        if len(span) != 2 or any(type(x) is not int for x in span) or not self.core.accepts((span[0], span[1])):
            raise WireError("wrong-span", f"this peer serves blocks [{self.start}, {self.end})")
        return span[0], span[1]

    async def _dispatch(self, sender: str, msg: dict[str, Any]) -> dict[str, Any]:
        if msg.get("v") != WIRE_VERSION:
            raise WireError("bad-request", f"unsupported version {msg.get('v')!r}")
        op = msg.get("op")
        if op not in OP_KEYS:
            raise WireError("bad-request", f"unknown op {op!r}")
        extra = set(msg) - OP_KEYS[op] - OPTIONAL_KEYS.get(op, set())
        missing = OP_KEYS[op] - set(msg)
        if extra or missing:
            raise WireError("bad-request", f"bad keys for {op}: extra {sorted(extra)} missing {sorted(missing)}")
        now = self.clock()
        self.expire(now)
        if op == "info":
            return {"ok": True, **self.info()}
        if get_field(msg, "model", str) != self.model_hash:
            raise WireError("wrong-model", f"this peer serves model {self.model_hash}")
        if op == "step":
            return await self._step(sender, msg, now)
        sid = get_field(msg, "session", bytes)
        if len(sid) != SESSION_ID_BYTES:
            raise WireError("bad-request", f"session id must be {SESSION_ID_BYTES} bytes")
        if op == "close":
            return {"ok": True, "closed": self.core.close(sender, sid)}
        return await self._forward(sender, sid, msg, now)

    def _answered(self, tokens: int, t0: float, batch: int) -> None:
        took = time.perf_counter() - t0
        for fn in self.observers:
            try:
                fn(tokens, took, batch)
            except Exception:  # an observer's bug must not fail the request
                log.exception("observer failed")

    async def _compute_items(self, items: list[_Item], tokens: list[int]) -> float:
        """Run ``items`` (already admitted and busy) through their span; the
        sessions are released whatever happens. Returns the start time."""
        sessions = [it.session for it in items]
        t0 = time.perf_counter()
        try:
            await self._run(*items)
        finally:
            ok = all(it.result is not None for it in items)
            self.core.finish(self.clock(), sessions, tokens, ok)
            if not ok:
                for s in sessions:
                    if s.cache is not None and s.cache.length != s.length:
                        s.cache.truncate(s.length)
        bad = next((it.error for it in items if it.error is not None), None)
        if bad is not None:
            raise WireError("internal", bad)
        return t0

    async def _forward(self, sender: str, sid: bytes, msg: dict[str, Any], now: float) -> dict[str, Any]:
        span = self._span_of(msg)
        pos = get_field(msg, "pos", int, lo=0, hi=1 << 24)
        max_length = get_field(msg, "max_length", int, lo=1, hi=1 << 24)
        # a forwarded step belongs to the client that signed its route
        deleg, hop_i = self._check_route(sender, sid, span, msg["route"]) if "route" in msg else (None, 0)
        owner = sender if deleg is None else deleg.client
        tenant, weight = tenant_of(msg, owner)  # checked before any session is admitted
        # checked here, built as a tensor in the forward thread (_Item.tensor)
        wire_dtype, shape = check_tensor(msg["hidden"], max_ndim=2, max_bytes=self.max_frame)
        if len(shape) != 2 or shape[1] != self.hidden_size:
            raise BadHidden("bad-request", f"hidden must be (tokens, {self.hidden_size})")
        t = shape[0]
        if not 1 <= t <= self.max_tokens:
            raise WireError("too-large", f"1..{self.max_tokens} tokens per request")
        if not finite(msg["hidden"]):
            raise BadHidden("bad-request", "hidden holds non-finite values")
        if deleg is not None and hop_i >= 2 and "outs" not in msg:
            raise BadHidden("bad-request", "a forwarded step past the second hop carries 'outs'")
        if "outs" in msg:  # the outputs of the route's hops before the sender's (passed on to the client)
            outs = msg["outs"]
            if deleg is None or type(outs) is not list or len(outs) != max(hop_i - 1, 0):
                raise BadHidden("bad-request", "'outs' holds one output per hop before the sender's")
            for o in outs:
                if check_tensor(o, max_ndim=2, max_bytes=self.max_frame)[1] != [t, self.hidden_size]:
                    raise BadHidden("bad-request", f"each of 'outs' must be ({t}, {self.hidden_size})")
        self._check_owner(owner, sid, span, pos, tenant)
        adm = self.core.admit_forward(now, owner, sid, span, pos, t, max_length)
        if isinstance(adm, Refusal):
            raise WireError(adm.code, adm.detail)
        s = adm.session
        if adm.created:
            s.cache = self._blocks[span].new_cache(max_length)
            self._own(owner, sid, tenant)
        if adm.refusal is not None:
            r = adm.refusal
            if r.code == "pos-mismatch":  # an answer, not an error: the client resyncs
                return {"ok": False, "error": "pos-mismatch", "detail": r.detail, "length": r.length}
            raise WireError(r.code, r.detail)
        s.cache.truncate(pos)  # a no-op unless the client is retrying a step
        item = _Item(adm.key, s, None, (wire_dtype, shape, msg["hidden"]["data"]), tenant=tenant, weight=weight)
        if deleg is not None:
            item.after = self._sender(deleg, hop_i, msg, t)
        try:
            t0 = await self._compute_items([item], [t])
        except BaseException:
            if item.sent is not None:  # sent, but this step failed here: nobody awaits the answer
                item.sent.forget()
            raise
        self.stats.tokens += t
        self._answered(t, t0, item.batch)
        out = {"dtype": self.dtype_name, "shape": [t, self.hidden_size], "data": item.result}
        length = s.cache.length
        if deleg is not None:
            # the first hop answers the client (which waits for it) once the
            # next hop's request is out; a later hop answers the previous one
            # (which waits for nobody) after passing the step on, which keeps
            # fewer processes busy on the step's critical path
            if self.nursery is not None and hop_i == 0:
                await self.nursery.start(self._pass_on, deleg, hop_i, msg, out, item.sent)
            else:
                await self._pass_on(deleg, hop_i, msg, out, item.sent)
            if sender != deleg.client:  # the previous hop: our output went to the client
                return {"ok": True, "length": length}
        return {"ok": True, "hidden": out, "length": length}

    # -- forwarding ------------------------------------------------------------
    def _check_route(self, sender: str, sid: bytes, span: tuple[int, int], v: Any) -> tuple[Delegation, int]:
        """The delegation of a forwarded step, checked: signed by its client
        for this session and model, not expired, a route that covers the
        blocks once each, with this peer's span on it, sent by the client (to
        the first hop) or by the hop before ours, every hop a live peer of
        our view. Returns it and our index on its route."""
        if self.transport is None:
            raise RouteRefused("bad-route", "this peer does not forward")
        d = check_delegation(v, num_layers=self.num_layers, now=self.wall(), verified=self._verified)
        if d.session != sid or d.model != self.model_hash:
            raise DelegationRefused("bad-delegation", "the delegation is for another session or model")
        i = d.index_of(self.self_id, span)
        if i is None:
            raise RouteRefused("bad-route", f"the route does not hold this peer's span {list(span)}")
        if sender != (d.client if i == 0 else d.route[i - 1][0]):
            raise RouteRefused("bad-route", "the sender is neither the client nor the route's previous hop")
        if self.view_peers is not None:
            live = self.view_peers()
            unknown = [p for p, _, _ in d.route if p != self.self_id and p not in live]
            if unknown:
                raise RouteRefused("unknown-peer", f"the route names peers outside this peer's view: "
                                                   f"{[p[:16] for p in unknown]}")
        return d, i

    def _check_owner(self, owner: str, sid: bytes, span: tuple[int, int], pos: int, tenant: str) -> None:
        """A session id is one client's and one tenant's: refuse to open it
        for another client, or to go on with it for another tenant (another
        client continuing it finds no session of its own: unknown-session)."""
        if pos == 0 and (owner, sid, *span) not in self.core.sessions and any(
                k[1] == sid and k[0] != owner for k in self.core.sessions):
            raise SessionConflict("session-conflict", "this session id is open here for another client")
        held = self._tenants.get((owner, sid))
        if held is not None and held != tenant and any(k[0] == owner and k[1] == sid for k in self.core.sessions):
            raise SessionConflict("session-conflict", f"this session belongs to tenant {held[:64]!r}")

    def _own(self, owner: str, sid: bytes, tenant: str) -> None:
        if len(self._tenants) > 4 * self.limits.max_sessions:  # forget the closed and expired ones
            live = {(k[0], k[1]) for k in self.core.sessions}
            self._tenants = {k: v for k, v in self._tenants.items() if k in live}
        self._tenants[(owner, sid)] = tenant

    @staticmethod
    def _receiver(d: Delegation, i: int) -> tuple[str, str]:
        """Who gets our output of a forwarded step, and on which protocol:
        the route's next hop, or, from the last hop, the client."""
        return (d.client, OUT_PROTOCOL) if i + 1 >= len(d.route) else (d.route[i + 1][0], PROTOCOL)

    def _out_message(self, d: Delegation, msg: dict[str, Any], span: list[int], **rest: Any) -> dict[str, Any]:
        """An ``out`` to the client about ``msg``'s step: the outputs (or the
        failure) from ``span`` on."""
        return {"v": WIRE_VERSION, "op": "out", "model": self.model_hash, "session": d.session, "pos": msg["pos"],
                "span": span, **rest}

    def _onward(self, d: Delegation, i: int, msg: dict[str, Any], out: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
        """Where our output of a forwarded step goes (``_receiver``), and the
        message: the same ``forward`` with our output to the route's next
        hop, or, from the last hop, an ``out`` with every hop's output."""
        prior = [*msg.get("outs", ()), msg["hidden"]] if i > 0 else []
        peer, protocol = self._receiver(d, i)
        if protocol == OUT_PROTOCOL:
            return peer, protocol, self._out_message(d, msg, [d.route[i][1], d.route[i][2]], hidden=out, outs=prior)
        _, a, b = d.route[i + 1]
        return peer, protocol, {**msg, "span": [a, b], "hidden": out, "outs": prior}

    async def _send_onward(self, peer: str, protocol: str, m: dict[str, Any], sent: Any) -> bytes:
        """Send ``m`` to ``peer`` and return the answer; ``sent``: the worker
        thread already wrote it (``_sender``), only the answer is awaited."""
        if sent is not None:
            raw: bytes = await self.transport.sent_answer(peer, sent, timeout=self.forward_timeout)
            return raw
        raw = await self.transport.request(peer, protocol, encode(m), timeout=self.forward_timeout)
        return raw

    def _sender(self, d: Delegation, i: int, msg: dict[str, Any], t: int) -> Callable[[bytes], Any] | None:
        """For a forwarded step: a function the worker thread calls with our
        output the moment the forward ends, which writes the onward message on
        the lane to its receiver (the transport's ``thread_sender``), so the
        step does not wait for the event loop to wake first. None without a
        live lane there (then ``_pass_on`` sends it from the event loop)."""
        make = getattr(self.transport, "thread_sender", None)
        if make is None:
            return None
        send = make(*self._receiver(d, i))
        if send is None:
            return None
        shape, dtype = [t, self.hidden_size], self.dtype_name

        def after(result: bytes) -> Any:
            return send(encode(self._onward(d, i, msg, {"dtype": dtype, "shape": shape, "data": result})[2]))

        return after

    async def _pass_on(self, d: Delegation, i: int, msg: dict[str, Any], out: dict[str, Any], sent: Any = None, *,
                       task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """After our part of a forwarded step: send the same ``forward`` with
        our output to the route's next hop, carrying the outputs of the hops
        before us (``outs``), so that the last hop can send the client every
        hop's output in one ``out`` message (``_onward``). ``sent``: the
        worker thread already wrote that message (``_sender``); only its
        answer is awaited. When the next hop cannot be reached or refuses,
        the client gets the outputs so far and the error, and drives that hop
        itself. Never raises."""
        told = False
        try:
            peer, protocol, onward = self._onward(d, i, msg, out)
            if sent is not None:
                self.forwarding["from_worker"] += 1
            told = True
            task_status.started()  # the caller answers once we block (the request below is written)
            if protocol == OUT_PROTOCOL:
                await self._push(d.client, onward, sent)
                return
            try:
                resp = decode(await self._send_onward(peer, protocol, onward, sent))
                why = "" if resp.get("ok") is True else f"{resp.get('error')}: {str(resp.get('detail', ''))}"
            except Exception as exc:  # unreachable, timed out, garbled, too large: the client drives it
                why = f"transport: {type(exc).__name__}: {exc}"
            if not why:
                self.forwarding["forwarded"] += 1
                return
            self.forwarding["forward_failures"] += 1
            await self._push(d.client, self._out_message(d, msg, onward["span"], outs=[*onward["outs"], out],
                                                         error="forward-failed", detail=why[:300]))
        except Exception:  # a bug here must not take the peer (or its nursery) down
            log.exception("passing a forwarded step on failed")
            if not told:
                task_status.started()

    async def _push(self, client: str, m: dict[str, Any], sent: Any = None) -> None:
        try:
            ok = decode(await self._send_onward(client, OUT_PROTOCOL, m, sent)).get("ok") is True
        except (TransportError, WireError):
            ok = False
        self.forwarding["pushed" if ok else "push_failures"] += 1

    async def _step(self, sender: str, msg: dict[str, Any], now: float) -> dict[str, Any]:
        """``step``: one decode position for each of N open sessions of
        ``sender``, in one batch. Every session is checked before any cache
        moves (all or nothing)."""
        span = self._span_of(msg)
        sids, poss, lens = (get_field(msg, k, list) for k in ("sessions", "pos", "max_length"))
        n = len(sids)
        if not 1 <= n <= self.limits.max_batch:
            raise WireError("too-large", f"1..{self.limits.max_batch} sessions per step")
        if len(poss) != n or len(lens) != n:
            raise WireError("bad-request", "sessions, pos and max_length differ in length")
        if len(set(sids)) != n:
            raise WireError("bad-request", "a session appears twice in one step")
        tenant, weight = tenant_of(msg, sender)
        hidden = unpack_tensor(msg["hidden"], max_ndim=2, max_bytes=self.max_frame)
        if tuple(hidden.shape) != (n, self.hidden_size):
            raise BadHidden("bad-request", f"hidden must be ({n}, {self.hidden_size})")
        if not finite(msg["hidden"]):
            raise BadHidden("bad-request", "hidden holds non-finite values")
        sessions: list[Session] = []
        for i, (sid, pos, ml) in enumerate(zip(sids, poss, lens)):
            if type(sid) is not bytes or len(sid) != SESSION_ID_BYTES:
                raise WireError("bad-request", f"session id must be {SESSION_ID_BYTES} bytes (index {i})")
            if type(pos) is not int or type(ml) is not int or not 0 <= pos < (1 << 24) or not 1 <= ml < (1 << 24):
                raise WireError("bad-request", f"pos and max_length must be small non-negative ints (index {i})")
            got = self.core.check_step(sender, sid, span, pos)
            if isinstance(got, Refusal):
                extra = {"length": got.length} if got.length is not None else {}
                return self._refuse(got.code, i, got.detail, **extra)
            if self._tenants.get((sender, sid), tenant) != tenant:
                self.forwarding["refused"] += 1
                return self._refuse("session-conflict", i, "this session belongs to another tenant")
            sessions.append(got)
        hidden = hidden.to(self._dtype)
        self.core.begin(now, sessions, poss)
        items = []
        for i, (s, sid, pos) in enumerate(zip(sessions, sids, poss)):
            s.cache.truncate(pos)
            items.append(_Item((sender, sid, *span), s, hidden[i : i + 1], tenant=tenant, weight=weight))
        t0 = await self._compute_items(items, [1] * n)
        self.stats.tokens += n
        self.stats.step_requests += 1
        self._answered(n, t0, max(it.batch for it in items))
        data = b"".join(it.result or b"" for it in items)
        return {"ok": True, "hidden": {"dtype": self.dtype_name, "shape": [n, self.hidden_size], "data": data},
                "length": [s.cache.length for s in sessions]}

    async def _run(self, *items: _Item) -> None:
        """Queue ``items`` for the next forward and wait until each is computed
        (the caller that finds no forward running computes the batch the core
        picks)."""
        core = self.core
        for it in items:
            core.enqueue(it, it.key, it.tokens, tenant=it.tenant, weight=it.weight)
        try:
            while any(it.result is None and it.error is None for it in items):
                if core.running:
                    await self._changed.wait()
                    continue
                batch: list[_Item] = core.take_batch()
                try:
                    block = self._blocks.get(batch[0].key[2:])
                    took = await self._forwards.run(self._compute, block, batch)
                    if took:  # the demand the clock level is chosen for, in full-clock seconds
                        core.record_forward(self.clock() - took, took * core.level)
                    if self.charge is not None and took:
                        for it in batch:  # each row's part of the forward, to its tenant
                            self.charge(it.tenant or it.key[0], took / len(batch))
                finally:
                    core.batch_done()
                    ev, self._changed = self._changed, trio.Event()
                    ev.set()
        finally:
            for it in items:
                core.cancel(it)  # cancelled while queued

    def _compute(self, block: LlamaBlockSpan | None, batch: list[_Item]) -> float:
        """Worker thread: one forward for the whole batch; fills each item.
        Returns the seconds it took (0 when nothing ran)."""
        t0 = time.perf_counter()
        live = [it for it in batch if not it.session.closed]
        for it in batch:
            if it.session.closed:
                it.error = "session closed"
        if not live or block is None:
            for it in live:
                it.error = "span dropped"
            return 0.0
        try:
            x = torch.stack([it.tensor(self._dtype) for it in live])
            if self._device.type != "cpu":
                x = x.to(self._device)
            with torch.inference_mode():
                out = block(x, [it.session.cache for it in live])
            raw = out.cpu().contiguous().view(torch.uint8).numpy()
            for i, it in enumerate(live):
                it.result = raw[i].tobytes()
                it.batch = len(live)
        except Exception as exc:  # pragma: no cover - validated before, but never crash
            log.exception("span forward failed")
            for it in live:
                it.error = type(exc).__name__
            return 0.0
        finally:
            took = time.perf_counter() - t0
            self.stats.compute_s += took
        for it in live:  # forwarded steps go on from here, not after a trip through the event loop
            if it.after is not None and it.result is not None:
                try:
                    it.sent = it.after(it.result)
                except Exception:  # then the event loop sends it
                    log.exception("sending a forwarded step from the worker failed")
        n = len(live)
        self.stats.forwards += 1
        self.stats.steps += n
        if n > 1:
            self.stats.batched_steps += n
        self.stats.max_batch = max(self.stats.max_batch, n)
        return took


# ----------------------------------------------------------------- spans

def parse_blocks(text: str | None, num_layers: int) -> tuple[int, int]:
    """``"A:B"`` -> ``(A, B)``, validated against the model's layer count."""
    if not text:
        return 0, num_layers
    try:
        a, b = text.split(":")
        start, end = int(a), int(b)
    except ValueError:
        raise ValueError(f"--blocks must be A:B (blocks A..B-1), got {text!r}") from None
    if not 0 <= start < end <= num_layers:
        raise ValueError(f"--blocks {text}: need 0 <= A < B <= {num_layers}")
    return start, end


SERVE_DTYPES = ("auto", *DTYPES)


def serving_device(choice: str = "auto", *, here: bool = True) -> str:
    """``peer start --serve-device``: where a peer's spans live. ``auto`` is
    the first CUDA device torch sees, else the CPU; ``cuda`` and ``cuda:N``
    must name a device torch sees here. ``here=False`` (the spans live on
    another machine, a Ray node) checks the spelling only."""
    if choice == "auto" and here:
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    if choice in ("cpu", "auto"):
        return choice
    kind, _, index = choice.partition(":")
    if kind != "cuda" or (index and not index.isdigit()):
        raise InputError(f"--serve-device {choice!r} is not a device", "use auto, cpu, cuda or cuda:N")
    if not here:
        return choice
    if not torch.cuda.is_available():
        raise InputError(f"--serve-device {choice}: torch sees no CUDA device here",
                         "use --serve-device cpu, or install a CUDA build of torch")
    n = int(index or 0)
    if n >= torch.cuda.device_count():
        raise InputError(f"--serve-device {choice}: torch sees {torch.cuda.device_count()} CUDA device(s)",
                         f"use cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return f"cuda:{n}"


def serving_dtype(choice: str, device: str) -> str | None:
    """``peer start --serve-dtype``: the spans' weights and activations.
    ``auto`` is bfloat16 on a GPU that computes in it (float16 on an older
    one) and the checkpoint's own dtype on the CPU (None)."""
    if choice != "auto":
        if choice not in DTYPES:
            raise InputError(f"--serve-dtype {choice!r} is not a dtype", f"use one of {', '.join(SERVE_DTYPES)}")
        return choice
    if device.startswith("cuda"):
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return None


def measure_throughput(span: LlamaBlockSpan, *, steps: int = 5) -> float:
    """Single-session decode tokens/s through ``span`` (median of ``steps``)."""
    cache = span.new_cache(steps + 2)
    x = torch.zeros(1, 1, span.config.hidden_size, dtype=span.dtype, device=span.device)
    times = []
    # a GPU runs the step after the call returns: wait for it, or this times the kernel launches
    sync = torch.cuda.synchronize if x.device.type == "cuda" else (lambda: None)
    with torch.inference_mode():
        span(x, cache)  # warm-up
        sync()
        for _ in range(steps):
            t0 = time.perf_counter()
            span(x, cache)
            sync()
            times.append(time.perf_counter() - t0)
    tps = 1.0 / max(statistics.median(times), 1e-6)
    return float(f"{tps:.3g}")


def parse_auto(blocks: str | None, num_layers: int, *, block_bytes: int = 0, mem_bytes: int = 0,
               cache_bytes: int = 0) -> int | None:
    """``auto`` -> half the model's blocks (fewer if they do not fit in
    memory: ``auto_span_size``), ``auto:N`` -> N (at most all of them); None
    for a fixed span."""
    if not blocks or not blocks.startswith("auto"):
        return None
    if ":" in blocks:
        return max(1, min(int(blocks.split(":", 1)[1]), num_layers))
    return auto_span_size(num_layers, block_bytes, mem_bytes, cache_bytes)


def block_bytes(cfg: Any, dtype: str | None = None) -> int:
    """Bytes of one decoder block's weights (attention, MLP, norms)."""
    h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    params = h * q * 2 + h * kv * 2 + 3 * h * cfg.intermediate_size + 2 * h
    return params * (2 if dtype in ("bfloat16", "float16") else 4)


def served_gaps(statuses: Any, num_layers: int) -> list[int]:
    """The blocks that no peer of these ``/status`` documents serves (a span
    it drains does not count)."""
    held = [(s["start"], s["end"], 1.0) for st in statuses for s in st.get("spans", [])
            if s.get("state", "serving") == "serving"]
    return [i for i, x in enumerate(per_block(held, num_layers)) if x == 0.0]


def swarm_spans(core: Any, model: str, now: float) -> list[SpanAd]:
    """The spans of ``model`` that the live, not leaving peers of ``core``'s
    view advertise (our own entry included: the serving core skips it)."""
    return [
        SpanAd(e.peer, sp.start, sp.end, sp.throughput)
        for e in core.view.live(now)
        if not e.state.leaving
        for sp in e.state.spans
        if sp.model == model
    ]


async def keep_placed(server: BlockServer, core: Any, transport: Any, load: Callable[[int, int], LlamaBlockSpan],
                      *, now: Callable[[], float] = time.time) -> None:
    """The placement timer of a ``--blocks auto`` peer, until cancelled: feed
    ``server.core`` the swarm's spans every tick and perform what it decides
    (load a span off the event loop, probe holders, advertise, drop)."""
    from .core.wire import Span

    sc = server.core

    def perform(effects: list[Any], nursery: trio.Nursery) -> None:
        for e in effects:
            if isinstance(e, LoadSpan):
                nursery.start_soon(load_one, e, nursery)
            elif isinstance(e, Probe):
                nursery.start_soon(probe, e)
            elif isinstance(e, Advertise):
                core.handle(now(), SetSpans(tuple(Span(server.model_hash, a, b, thr) for a, b, thr in e.spans)))
                log.info("span change", extra={"fields": {"spans": [[a, b] for a, b, _ in e.spans],
                                                          "span_changes": sc.span_changes}})
            elif isinstance(e, SetSpanLevel):
                server.apply_level(e.level)
            elif isinstance(e, DropSpan):
                server._blocks.pop((e.start, e.end), None)
                log.info("span dropped", extra={"fields": {"span": [e.start, e.end],
                                                           "sessions_dropped": sc.sessions_dropped}})

    async def load_one(e: LoadSpan, nursery: trio.Nursery) -> None:
        t0 = time.perf_counter()
        try:
            span = await trio.to_thread.run_sync(load, e.start, e.end)
            thr = await trio.to_thread.run_sync(measure_throughput, span)
        except Exception as exc:  # a failed load leaves the old span serving
            log.exception("span load failed")
            effects = sc.handle(server.clock(), SpanLoadFailed(e.start, e.end, type(exc).__name__))
        else:
            server._blocks[(e.start, e.end)] = span
            effects = sc.handle(server.clock(), SpanLoaded(e.start, e.end, thr, _bytes_per_pos(span),
                                                           time.perf_counter() - t0))
        perform(effects, nursery)

    async def probe(e: Probe) -> None:
        ok = False
        with trio.move_on_after(e.timeout_s + 1.0):
            try:
                raw = await transport.request(e.peer, PROTOCOL, encode({"v": WIRE_VERSION, "op": "info"}),
                                              timeout=e.timeout_s)
                ok = decode(raw).get("ok") is True
            except Exception:  # unreachable, refused, garbled: all say the same
                ok = False
        sc.handle(server.clock(), ProbeDone(e.peer, ok))

    async with trio.open_nursery() as nursery:
        while True:
            perform(sc.poll(server.clock(), swarm_spans(core, server.model_hash, now())), nursery)
            await trio.sleep(max(sc.next_deadline() - server.clock(), 0.05))


async def keep_level(server: BlockServer) -> None:
    """For a fixed span: the core's timer (session expiry and the clock
    level) without placement."""
    sc = server.core
    while True:
        for e in sc.poll(server.clock()):
            if isinstance(e, SetSpanLevel):
                server.apply_level(e.level)
        await trio.sleep(max(sc.next_deadline() - server.clock(), 0.05))


async def start_block_server(
    transport: Any,
    core: Any,
    model_dir: str | os.PathLike[str],
    blocks: str | None,
    *,
    limits: ServerLimits | None = None,
    device: str = "cpu",
    dtype: str | None = None,
    return_server: bool = False,
    nursery: trio.Nursery | None = None,
    policy: PlacementPolicy | None = None,
    now: Callable[[], float] = time.time,
    load_span: Callable[..., Any] | None = None,
    on_level: Callable[[float], None] | None = None,
) -> Any:
    """Load blocks ``A..B-1`` of the checkpoint (only those tensors), serve
    them under ``PROTOCOL`` on ``transport`` and advertise the span in the
    core's signed ``PeerState``.

    ``blocks`` is ``"A:B"``; ``None`` serves all; ``"auto"`` / ``"auto:N"``
    takes the N-block window (default: half the model) with the least serving
    throughput among the spans in the view, and -- given a ``nursery`` --
    keeps it placed (``keep_placed``, with ``policy`` or the default
    ``PlacementPolicy``). ``now`` is the view's clock. ``load_span(dir,
    start, end, device=, dtype=)`` loads a span (default: ``load_block_span``
    in this process; a peer in front of a Ray cluster passes
    ``runtime.ray_engine.span_loader``, which puts it in a Ray actor).
    ``on_level(level)``, given a ``nursery``, takes the clock level the
    core picks for the spans from the profile's power model (``span_level``:
    the least-energy level that keeps demand under half the device's time,
    full clock when steps wait for a batch).
    Returns a JSON-able description (or the ``BlockServer`` with
    ``return_server=True``).
    """
    from .core.wire import Span

    from .tasks.checkpoint import resolve_model

    # the operator's --serve-model: a name, a HF directory or a .gguf file
    d = resolve_model(model_dir, allow_paths=True)
    cfg = load_config(d)
    t0 = time.perf_counter()
    mhash = await trio.to_thread.run_sync(model_hash, d)
    devices = getattr(getattr(core, "config", None), "devices", ())
    mem = min((d.mem_free for d in devices if d.kind == device.split(":")[0]), default=0)
    n_auto = parse_auto(blocks, cfg.num_hidden_layers, block_bytes=block_bytes(cfg, dtype), mem_bytes=mem,
                        cache_bytes=(limits or ServerLimits()).max_cache_bytes)
    if n_auto is not None:
        ads = swarm_spans(core, mhash, now())
        start, end = choose_span([(a.peer, a.start, a.end, a.throughput) for a in ads], cfg.num_hidden_layers,
                                 n_auto, self_id=core.id)
    else:
        start, end = parse_blocks(blocks, cfg.num_hidden_layers)

    loader = load_span or load_block_span

    def load(a: int, b: int) -> LlamaBlockSpan:
        return loader(d, a, b, device=device, dtype=dtype)  # type: ignore[no-any-return]

    span = await trio.to_thread.run_sync(load, start, end)
    load_s = time.perf_counter() - t0
    thr = await trio.to_thread.run_sync(measure_throughput, span)
    placing = n_auto is not None and nursery is not None
    if placing and policy is None:
        policy = PlacementPolicy(n_blocks=end - start)
    server = BlockServer(span, mhash, limits=limits, self_id=core.id, policy=policy if placing else None,
                         throughput=thr, transport=transport, nursery=nursery,
                         view_peers=lambda: LivePeers(core.view, now()))
    server.model_name = Path(str(model_dir)).name  # what the dashboard calls it
    if getattr(core, "ledger", None) is not None:
        server.use_ledger(core.ledger, core.id, now)
    transport.set_request_handler(PROTOCOL, server.handle)
    core.handle(now(), SetSpans((Span(mhash, start, end, thr),)))
    if on_level is not None and nursery is not None:
        server.on_level = on_level
        server.core.power = getattr(getattr(core, "config", None), "power", None)
    if placing:
        assert nursery is not None
        nursery.start_soon(lambda: keep_placed(server, core, transport, load, now=now))
    elif server.on_level is not None:
        assert nursery is not None
        nursery.start_soon(keep_level, server)
    desc = {"model": mhash, "dir": str(d), "blocks": [start, end], "throughput": thr, "load_s": round(load_s, 3),
            "protocol": PROTOCOL, "placement": "auto" if placing else "fixed",
            "where": "ray" if load_span is not None else "local", "device": server.device_name,
            "dtype": server.dtype_name}
    log.info("serving blocks", extra={"fields": desc})
    return server if return_server else desc
