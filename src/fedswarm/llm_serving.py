"""Petals-style LLM layer serving: a peer serves decoder blocks ``[start, end)``.

A client holds the embeddings and the LM head and drives a *chain* of peers
that together cover every block (see ``fedswarm.llm_client``). Each peer keeps
one KV cache per (client, session) and batches the decode steps of concurrent
sessions.

The wire protocol (``/fedswarm/llm/1.0.0``: ``forward``, ``step``, ``close``,
``info``) lives in ``fedswarm.llm_protocol``, shared with the client.

Sessions are keyed by (transport-authenticated sender, session id), so a
client can touch only its own. They expire after ``idle_timeout_s`` without a
request (swept on every request) and are freed by ``close``.

Batching: a request's forward joins a queue; whoever finds no forward running
takes every queued step with the same number of new tokens (decode steps are
all ``T == 1``), stacks them into one batch (rows may sit at different
positions: ``LlamaBlockSpan`` handles per-row positions) and runs it in a
worker thread (``trio.to_thread.run_sync``) so the event loop -- and the
peer's gossip -- stays live. Steps that arrive while a forward runs make up
the next batch.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import trio

from .llm_protocol import (
    MAX_FRAME,
    OP_KEYS,
    PROTOCOL,
    SESSION_ID_BYTES,
    WIRE_VERSION,
    WireError,
    decode,
    elem_bytes,
    encode,
    get_field,
    pack_tensor,
    unpack_tensor,
)
from .tasks.checkpoint import load_block_span, load_config, model_hash
from .tasks.llama import DTYPES, KVCache, LlamaBlockSpan

__all__ = [
    "PROTOCOL",
    "WIRE_VERSION",
    "ServerLimits",
    "BlockServer",
    "WireError",
    "pack_tensor",
    "unpack_tensor",
    "encode",
    "decode",
    "parse_blocks",
    "choose_span",
    "measure_throughput",
    "start_block_server",
]

log = logging.getLogger("fedswarm.llm")

# ----------------------------------------------------------------- server

@dataclass(frozen=True)
class ServerLimits:
    """What one serving peer accepts (every request is checked against these)."""

    max_tokens_per_request: int = 1024  # new positions in one forward request
    max_sessions: int = 64
    max_session_length: int = 2048  # positions per session (also <= max_position_embeddings)
    max_cache_bytes: int = 128 * 1024 * 1024  # KV caches of all sessions together
    max_batch: int = 32  # sessions' steps batched into one forward
    idle_timeout_s: float = 300.0


@dataclass
class _Session:
    cache: KVCache
    last_used: float
    busy: bool = False
    closed: bool = False


@dataclass
class _Item:
    session: _Session
    hidden: torch.Tensor  # (T, H)
    result: bytes | None = None
    error: str | None = None
    batch: int = 0  # sessions in the forward that computed it


@dataclass
class ServerStats:
    requests: int = 0
    step_requests: int = 0  # multi-session ``step`` requests answered
    errors: int = 0
    forwards: int = 0  # forward calls on the span (batches)
    steps: int = 0  # session steps computed
    batched_steps: int = 0  # steps that shared a forward with another session
    max_batch: int = 0
    tokens: int = 0
    sessions_opened: int = 0
    sessions_closed: int = 0
    sessions_expired: int = 0
    compute_s: float = 0.0
    by_error: dict[str, int] = field(default_factory=dict)


class BlockServer:
    """Serves one ``LlamaBlockSpan`` over the LLM protocol.

    ``await server.handle(sender, request_bytes) -> response_bytes`` is the
    transport request handler; it never raises for a bad request.
    """

    def __init__(
        self,
        span: LlamaBlockSpan,
        model_hash: str,
        *,
        limits: ServerLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_frame: int = MAX_FRAME,
    ) -> None:
        self.span = span
        self.model_hash = model_hash
        self.limits = limits or ServerLimits()
        self.clock = clock
        self.max_frame = max_frame
        cfg = span.config
        self.hidden_size = cfg.hidden_size
        self.dtype_name = {v: k for k, v in DTYPES.items()}[span.dtype]
        self.max_length = min(self.limits.max_session_length, cfg.max_position_embeddings)
        elem = span.new_cache(1).k.element_size()
        self._cache_bytes_per_pos = 2 * span.num_layers * cfg.num_key_value_heads * cfg.head_dim * elem
        # a request and its answer must fit in a frame (with room for the envelope)
        fit = (max_frame - 4096) // (self.hidden_size * elem_bytes(self.dtype_name))
        self.max_tokens = max(1, min(self.limits.max_tokens_per_request, fit))
        self.sessions: dict[tuple[str, bytes], _Session] = {}
        self.cache_bytes = 0
        self.stats = ServerStats()
        self._pending: list[_Item] = []
        self._running = False
        self._changed = trio.Event()
        self.model_name: str | None = None
        #: called as ``fn(tokens, seconds, batch)`` after each forward
        #: request is answered (metrics: per-hop and per-token latency)
        self.observers: list[Callable[[int, float, int], None]] = []

    # -- public ------------------------------------------------------------
    @property
    def start(self) -> int:
        return self.span.start

    @property
    def end(self) -> int:
        return self.span.end

    def info(self) -> dict[str, Any]:
        st = asdict(self.stats)
        st["compute_s"] = round(st["compute_s"], 6)
        return {
            "model": self.model_hash,
            "span": [self.start, self.end],
            "dtype": self.dtype_name,
            "hidden_size": self.hidden_size,
            "limits": {**asdict(self.limits), "max_tokens_per_request": self.max_tokens, "max_session_length": self.max_length},
            "sessions": len(self.sessions),
            "cache_bytes": self.cache_bytes,
            "stats": st,
        }

    async def handle(self, sender: str, data: bytes) -> bytes:
        self.stats.requests += 1
        try:
            msg = decode(data, max_bytes=self.max_frame)
            return encode(await self._dispatch(sender, msg))
        except WireError as exc:
            return self._error(exc.code, exc.detail)
        except (trio.Cancelled, KeyboardInterrupt):
            raise
        except Exception as exc:  # a bug must not take the peer down
            log.exception("llm request failed")
            return self._error("internal", type(exc).__name__)

    def expire(self, now: float | None = None) -> int:
        """Drop sessions idle for longer than ``idle_timeout_s``; return how many."""
        now = self.clock() if now is None else now
        dead = [k for k, s in self.sessions.items() if not s.busy and now - s.last_used > self.limits.idle_timeout_s]
        for k in dead:
            self._free(k)
        self.stats.sessions_expired += len(dead)
        return len(dead)

    # -- internals -----------------------------------------------------------
    def _error(self, code: str, detail: str = "", **extra: Any) -> bytes:
        self.stats.errors += 1
        self.stats.by_error[code] = self.stats.by_error.get(code, 0) + 1
        return encode({"ok": False, "error": code, "detail": detail[:300], **extra})

    def _refuse(self, code: str, index: int, detail: str, **extra: Any) -> dict[str, Any]:
        """A ``step`` refused because of its ``index``-th session (counted as an error)."""
        self.stats.errors += 1
        self.stats.by_error[code] = self.stats.by_error.get(code, 0) + 1
        return {"ok": False, "error": code, "index": index, "detail": detail, **extra}

    def _free(self, key: tuple[str, bytes]) -> None:
        s = self.sessions.pop(key, None)
        if s is not None:
            s.closed = True
            self.cache_bytes -= s.cache.nbytes

    async def _dispatch(self, sender: str, msg: dict[str, Any]) -> dict[str, Any]:
        if msg.get("v") != WIRE_VERSION:
            raise WireError("bad-request", f"unsupported version {msg.get('v')!r}")
        op = msg.get("op")
        if op not in OP_KEYS:
            raise WireError("bad-request", f"unknown op {op!r}")
        extra = set(msg) - OP_KEYS[op]
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
        key = (sender, sid)
        if op == "close":
            s = self.sessions.get(key)
            if s is not None:
                self._free(key)
                self.stats.sessions_closed += 1
            return {"ok": True, "closed": s is not None}
        return await self._forward(key, msg, now)

    async def _forward(self, key: tuple[str, bytes], msg: dict[str, Any], now: float) -> dict[str, Any]:
        span = get_field(msg, "span", list)
        if span != [self.start, self.end]:
            raise WireError("wrong-span", f"this peer serves blocks [{self.start}, {self.end})")
        pos = get_field(msg, "pos", int, lo=0, hi=1 << 24)
        max_length = get_field(msg, "max_length", int, lo=1, hi=1 << 24)
        hidden = unpack_tensor(msg["hidden"], max_ndim=2, max_bytes=self.max_frame)
        if hidden.dim() != 2 or hidden.shape[1] != self.hidden_size:
            raise WireError("bad-request", f"hidden must be (tokens, {self.hidden_size})")
        t = hidden.shape[0]
        if not 1 <= t <= self.max_tokens:
            raise WireError("too-large", f"1..{self.max_tokens} tokens per request")
        if not torch.isfinite(hidden).all():
            raise WireError("bad-request", "hidden holds non-finite values")
        s = self.sessions.get(key)
        if s is None:
            if pos != 0:
                raise WireError("unknown-session", "no such session (expired?): replay from position 0")
            if max_length > self.max_length:
                raise WireError("too-large", f"max_length above {self.max_length}")
            if len(self.sessions) >= self.limits.max_sessions:
                raise WireError("full", f"{len(self.sessions)} sessions open")
            nbytes = max_length * self._cache_bytes_per_pos
            if self.cache_bytes + nbytes > self.limits.max_cache_bytes:
                raise WireError("full", "KV cache memory exhausted")
            s = _Session(self.span.new_cache(max_length), now)
            self.sessions[key] = s
            self.cache_bytes += s.cache.nbytes
            self.stats.sessions_opened += 1
        if s.busy:
            raise WireError("busy", "a step of this session is running")
        if pos > s.cache.length:
            return {"ok": False, "error": "pos-mismatch", "detail": "server is behind", "length": s.cache.length}
        if pos + t > s.cache.max_length:
            raise WireError("too-large", f"session length {s.cache.max_length} exceeded")
        s.cache.truncate(pos)  # a no-op unless the client is retrying a step
        s.last_used = now
        item = _Item(s, hidden.to(self.span.dtype))
        s.busy = True
        t0 = time.perf_counter()
        try:
            await self._run(item)
        finally:
            s.busy = False
            s.last_used = self.clock()
        if item.error is not None:
            raise WireError("internal", item.error)
        self.stats.tokens += t
        took = time.perf_counter() - t0
        for fn in self.observers:
            try:
                fn(t, took, item.batch)
            except Exception:  # an observer's bug must not fail the request
                log.exception("observer failed")
        return {"ok": True, "hidden": {"dtype": self.dtype_name, "shape": [t, self.hidden_size], "data": item.result},
                "length": s.cache.length}

    async def _step(self, sender: str, msg: dict[str, Any], now: float) -> dict[str, Any]:
        """``step``: one decode position for each of N open sessions of
        ``sender``, in one batch. Every session is checked before any cache
        moves (all or nothing)."""
        span = get_field(msg, "span", list)
        if span != [self.start, self.end]:
            raise WireError("wrong-span", f"this peer serves blocks [{self.start}, {self.end})")
        sids, poss, lens = (get_field(msg, k, list) for k in ("sessions", "pos", "max_length"))
        n = len(sids)
        if not 1 <= n <= self.limits.max_batch:
            raise WireError("too-large", f"1..{self.limits.max_batch} sessions per step")
        if len(poss) != n or len(lens) != n:
            raise WireError("bad-request", "sessions, pos and max_length differ in length")
        if len(set(sids)) != n:
            raise WireError("bad-request", "a session appears twice in one step")
        hidden = unpack_tensor(msg["hidden"], max_ndim=2, max_bytes=self.max_frame)
        if tuple(hidden.shape) != (n, self.hidden_size):
            raise WireError("bad-request", f"hidden must be ({n}, {self.hidden_size})")
        if not torch.isfinite(hidden).all():
            raise WireError("bad-request", "hidden holds non-finite values")
        sessions: list[_Session] = []
        for i, (sid, pos, ml) in enumerate(zip(sids, poss, lens)):
            if type(sid) is not bytes or len(sid) != SESSION_ID_BYTES:
                raise WireError("bad-request", f"session id must be {SESSION_ID_BYTES} bytes (index {i})")
            if type(pos) is not int or type(ml) is not int or not 0 <= pos < (1 << 24) or not 1 <= ml < (1 << 24):
                raise WireError("bad-request", f"pos and max_length must be small non-negative ints (index {i})")
            s = self.sessions.get((sender, sid))
            if s is None:
                return self._refuse("unknown-session", i, "no such session (expired?): replay from position 0")
            if s.busy:
                return self._refuse("busy", i, "a step of this session is running")
            if pos > s.cache.length:
                return self._refuse("pos-mismatch", i, "server is behind", length=s.cache.length)
            if pos + 1 > s.cache.max_length:
                return self._refuse("too-large", i, f"session length {s.cache.max_length} exceeded")
            sessions.append(s)
        hidden = hidden.to(self.span.dtype)
        items = []
        for i, (s, pos) in enumerate(zip(sessions, poss)):
            s.cache.truncate(pos)
            s.last_used = now
            s.busy = True
            items.append(_Item(s, hidden[i : i + 1]))
        t0 = time.perf_counter()
        try:
            await self._run(*items)
        finally:
            for s in sessions:
                s.busy = False
                s.last_used = self.clock()
        bad = next((it.error for it in items if it.error is not None), None)
        if bad is not None:
            raise WireError("internal", bad)
        self.stats.tokens += n
        self.stats.step_requests += 1
        took = time.perf_counter() - t0
        for fn in self.observers:
            try:
                fn(n, took, max(it.batch for it in items))
            except Exception:  # an observer's bug must not fail the request
                log.exception("observer failed")
        data = b"".join(it.result or b"" for it in items)
        return {"ok": True, "hidden": {"dtype": self.dtype_name, "shape": [n, self.hidden_size], "data": data},
                "length": [s.cache.length for s in sessions]}

    async def _run(self, *items: _Item) -> None:
        """Queue ``items`` for the next forward and wait until each is computed
        (the caller that finds no forward running computes one batch)."""
        self._pending.extend(items)
        try:
            while any(it.result is None and it.error is None for it in items):
                if self._running:
                    await self._changed.wait()
                    continue
                batch = self._take()
                self._running = True
                try:
                    await trio.to_thread.run_sync(self._compute, batch)
                finally:
                    self._running = False
                    ev, self._changed = self._changed, trio.Event()
                    ev.set()
        finally:
            for it in items:
                if it in self._pending:  # cancelled while queued
                    self._pending.remove(it)

    def _take(self) -> list[_Item]:
        t = self._pending[0].hidden.shape[0]
        batch, rest = [], []
        for it in self._pending:
            if it.hidden.shape[0] == t and len(batch) < self.limits.max_batch and len(batch) * t < self.max_tokens:
                batch.append(it)
            else:
                rest.append(it)
        self._pending = rest
        return batch

    def _compute(self, batch: list[_Item]) -> None:
        """Worker thread: one forward for the whole batch; fills each item."""
        t0 = time.perf_counter()
        live = [it for it in batch if not it.session.closed]
        for it in batch:
            if it.session.closed:
                it.error = "session closed"
        if not live:
            return
        try:
            x = torch.stack([it.hidden for it in live])
            with torch.inference_mode():
                out = self.span(x, [it.session.cache for it in live]).contiguous()
            raw = out.view(torch.uint8).numpy()
            for i, it in enumerate(live):
                it.result = raw[i].tobytes()
                it.batch = len(live)
        except Exception as exc:  # pragma: no cover - validated before, but never crash
            log.exception("span forward failed")
            for it in live:
                it.error = type(exc).__name__
            return
        finally:
            self.stats.compute_s += time.perf_counter() - t0
        n = len(live)
        self.stats.forwards += 1
        self.stats.steps += n
        if n > 1:
            self.stats.batched_steps += n
        self.stats.max_batch = max(self.stats.max_batch, n)


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


def choose_span(
    spans: list[tuple[str, int, int, float]],
    num_layers: int,
    n_blocks: int,
    *,
    self_id: str = "",
    current: tuple[int, int] | None = None,
    min_gain: float = 1.5,
) -> tuple[int, int]:
    """Petals-style allocation: the ``n_blocks`` window whose weakest block has
    the least serving throughput among ``spans`` ((peer, start, end, tok/s)).

    Our own spans are ignored. With ``current`` given, it is kept unless the
    best window's bottleneck is ``min_gain`` times worse than current's (so
    peers do not flap between equally good choices). Ties break on a hash of
    ``self_id`` so peers that join together spread out.
    """
    import hashlib

    n_blocks = max(1, min(n_blocks, num_layers))
    per_block = [0.0] * num_layers
    for peer, a, b, thr in spans:
        if peer == self_id:
            continue
        for i in range(max(a, 0), min(b, num_layers)):
            per_block[i] += max(thr, 0.0)

    def key(s: int) -> tuple[float, float, bytes]:
        w = per_block[s : s + n_blocks]
        return (min(w), sum(w), hashlib.sha256(f"{self_id}:{s}".encode()).digest())

    best = min(range(num_layers - n_blocks + 1), key=key)
    if current is not None and current[1] - current[0] == n_blocks:
        cur = per_block[current[0] : current[1]]
        if min(cur) <= min_gain * key(best)[0] or min(cur) == 0:
            return current
    return best, best + n_blocks


def measure_throughput(span: LlamaBlockSpan, *, steps: int = 5) -> float:
    """Single-session decode tokens/s through ``span`` (median of ``steps``)."""
    cache = span.new_cache(steps + 2)
    x = torch.zeros(1, 1, span.config.hidden_size, dtype=span.dtype, device=span.device)
    times = []
    with torch.inference_mode():
        span(x, cache)  # warm-up
        for _ in range(steps):
            t0 = time.perf_counter()
            span(x, cache)
            times.append(time.perf_counter() - t0)
    tps = 1.0 / max(statistics.median(times), 1e-6)
    return float(f"{tps:.3g}")


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
) -> Any:
    """Load blocks ``A..B-1`` of the checkpoint (only those tensors), serve
    them under ``PROTOCOL`` on ``transport`` and advertise the span in the
    core's signed ``PeerState``.

    Returns a JSON-able description (or the ``BlockServer`` with
    ``return_server=True``). ``blocks`` is ``"A:B"``; ``None`` serves all.
    """
    from .core.wire import Span

    from .tasks.checkpoint import resolve_model

    # the operator's --serve-model: a name, a HF directory or a .gguf file
    d = resolve_model(model_dir, allow_paths=True)
    cfg = load_config(d)
    t0 = time.perf_counter()
    mhash = await trio.to_thread.run_sync(model_hash, d)
    if blocks == "auto" or (blocks or "").startswith("auto"):
        # "auto" or "auto:N": the N-block window (default: half the model)
        # with the least serving throughput among the spans in our view
        n = int(blocks.split(":", 1)[1]) if ":" in blocks else max(1, cfg.num_hidden_layers // 2)
        entries = [core.view.get(p) for p in core.view.peers()]
        spans = [
            (e.peer, sp.start, sp.end, sp.throughput)
            for e in entries
            if e is not None and not e.state.leaving
            for sp in e.state.spans
            if sp.model == mhash
        ]
        start, end = choose_span(spans, cfg.num_hidden_layers, n, self_id=core.id)
    else:
        start, end = parse_blocks(blocks, cfg.num_hidden_layers)
    span = await trio.to_thread.run_sync(lambda: load_block_span(d, start, end, device=device, dtype=dtype))
    load_s = time.perf_counter() - t0
    thr = await trio.to_thread.run_sync(measure_throughput, span)
    server = BlockServer(span, mhash, limits=limits)
    server.model_name = Path(str(model_dir)).name  # what the dashboard calls it
    transport.set_request_handler(PROTOCOL, server.handle)
    core.set_spans((Span(mhash, start, end, thr),))
    desc = {"model": mhash, "dir": str(d), "blocks": [start, end], "throughput": thr, "load_s": round(load_s, 3),
            "protocol": PROTOCOL}
    log.info("serving blocks", extra={"fields": desc})
    return server if return_server else desc
