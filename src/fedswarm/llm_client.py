"""Client side of LLM layer serving: generate through a chain of peers.

The client holds the embeddings, the final norm and the LM head
(``LlamaClientHead``); peers serve contiguous spans of decoder blocks
(``fedswarm.llm_serving``) and advertise them as ``Span`` entries of their
signed, gossiped ``PeerState``.

Routing: the spans in the swarm view form a graph over block boundaries
``0..L``; a chain is a cheapest path ``0 -> L`` where a hop costs its
measured decode round trip (an EWMA per peer) or, before we have one,
``1/throughput`` plus a default network latency. Peers that failed us are
avoided for ``ban_s``.

Recovery: the client keeps, for every block boundary of its chain, the hidden
states that entered it at every position so far (``positions x hidden_size``
floats per boundary: small). When a hop fails (peer gone, timeout, error
answer), the client bans the peer, finds a replacement path for the same
blocks (or for everything from there on), replays the stored inputs into the
new peers' fresh sessions -- which rebuilds their KV caches -- and goes on.
Replayed positions produce exactly the hidden states the dead peer would have
produced, so the generated tokens do not change.

Forwarding (``forward=True``, with the client's ``identity``): a decode step
of a lone session travels peer to peer. The client signs the chain as a
delegation (``llm_protocol.sign_delegation``), sends the first hop a
``forward`` carrying it, and each hop sends its output straight to the next
and to the client (``OUT_PROTOCOL``). The outputs that arrive stand in for
the answers the client would have fetched hop by hop (``StepPlan`` walks the
chain as before and takes them), so the per-boundary history, spot checks
and recovery are unchanged: from the first hop whose output did not come
(a hop down, a refusal, a timeout) the client drives the chain itself and
replays what a replacement needs. A step that came back whole feeds the
per-peer round trips the routes are chosen by (``RouteBook.observe_chain``:
the first hop's answer time for it, the rest of the chain's time split over
the later hops).
"""

from __future__ import annotations

import math
import os
import random
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import trio

from .core.llm_route import (
    DEFAULT_HOP_LATENCY,
    Chain,
    Done,
    GiveUp,
    Hop,
    HopOutput,
    HopState,
    NeedRoute,
    RouteBook,
    Send,
    StepPlan,
    find_route,
    live_spans,
)
from .core.spans import tenant_problem, weight_problem
from .core.identity import Identity
from .errors import FederationError, InputError, TransportError
from .llm_protocol import (
    OP_KEYS,
    OPTIONAL_KEYS,
    OUT_PROTOCOL,
    PROTOCOL,
    SESSION_ID_BYTES,
    WIRE_VERSION,
    Delegation,
    WireError,
    decode,
    encode,
    finite,
    pack_tensor,
    sign_delegation,
    unpack_tensor,
)
from .tasks.llama import LlamaClientHead
from .tasks.sampling import Sampler, SamplingParams, StopMatcher

__all__ = [
    "Hop",
    "NoRoute",
    "SwarmLLM",
    "InferenceSession",
    "GenerationResult",
    "find_route",
    "live_spans",
    "common_prefix",
]

class NoRoute(FederationError):
    """No chain of live peers covers the model's blocks."""


class _HopFailed(Exception):
    def __init__(self, peer: str, reason: str, *, moved: bool = False) -> None:
        super().__init__(f"{peer[:16]}: {reason}")
        self.peer = peer
        self.reason = reason
        self.moved = moved  # the peer answered wrong-span: it serves other blocks now


@dataclass
class GenerationResult:
    token_ids: list[int]
    prompt_len: int
    ttft_s: float
    total_s: float
    decode_tokens_per_s: float
    step_times: list[float]
    recoveries: list[dict[str, Any]]
    route: list[dict[str, Any]]
    text: str | None = None  # shown text (no stop string, no half characters); None without a tokenizer
    finish_reason: str = "length"  # "stop" (EOS or a stop string) or "length"
    seed: int | None = None  # the sampler's seed (drawn when none was given)
    prefill_tokens: int = 0  # prompt positions sent through the chain (less when a session is reused)
    reused_tokens: int = 0  # prompt positions already in the session's KV caches


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class SwarmLLM:
    """Generate with a model whose blocks live on swarm peers.

    Args:
        transport: the client's transport (``Transport`` protocol).
        view: returns the live swarm view entries (e.g.
            ``lambda: client.core.view.live(client.agent.now())``).
        head: the local embeddings + LM head.
        model_hash: ``model_hash`` of the checkpoint; peers serving another
            hash are never used (and refuse our requests anyway).
    """

    def __init__(
        self,
        transport: Any,
        view: Callable[[], Sequence[Any]],
        head: LlamaClientHead,
        model_hash: str,
        *,
        request_timeout: float = 10.0,
        ban_s: float = 60.0,
        max_chunk: int = 256,
        route_timeout: float = 10.0,
        spot_check_rate: float = 0.05,
        spot_check_tol: float = 1e-2,
        seed: int | None = None,
        max_step_batch: int = 32,
        cohort_wait: float = 0.5,
        tenant: str | None = None,
        weight: float | None = None,
        identity: Identity | None = None,
        forward: bool = True,
        delegation_ttl: float = 600.0,
    ) -> None:
        self.transport = transport
        # server-to-server forwarding of a lone session's decode steps (needs
        # our key, to sign the route; see the module docstring)
        self.identity = identity
        self.forward = forward and identity is not None
        self.delegation_ttl = delegation_ttl
        self.forward_stats = {"steps": 0, "complete": 0, "fallbacks": 0, "refused": 0}
        self._inbox = _inbox_of(transport) if self.forward else None
        # sent with forward and step requests: whom the serving peers' fair
        # session order counts these sessions for (default: our peer id, weight 1)
        self.tenant_fields: dict[str, Any] = {}
        if tenant is not None:
            problem = tenant_problem(tenant)
            if problem:
                raise InputError(problem)
            self.tenant_fields["tenant"] = tenant
        if weight is not None:
            problem = weight_problem(weight)
            if problem:
                raise InputError(problem)
            self.tenant_fields["weight"] = float(weight)
        self.view = view
        self.head = head
        self.model_hash = model_hash
        self.num_layers = head.config.num_hidden_layers
        self.request_timeout = request_timeout
        self.ban_s = ban_s
        self.max_chunk = max_chunk
        self.route_timeout = route_timeout
        # bans and one-token round trips (sans-IO, fedswarm.core.llm_route); times are monotonic
        self.book = RouteBook(ban_s=ban_s)
        self.stats = {"requests": 0, "failures": 0, "recoveries": 0,
                      "spot_checks": 0, "spot_mismatches": 0, "spot_banned": 0}
        # spot checks: now and then an untrusted hop's outputs are recomputed
        # by another peer serving the same span and compared (see _spot_check)
        self.spot_check_rate = spot_check_rate
        self.spot_check_tol = spot_check_tol
        self.rng = random.Random(seed)
        self.active: set[InferenceSession] = set()  # open sessions (their .hops is the chain)
        self._dialed: set[str] = set()  # peers we opened a connection to by their advertised address
        self._head_queue: list[dict[str, Any]] = []
        self._head_busy = False
        self.head_batches = {"calls": 0, "batches": 0, "max_batch": 0}
        # decode steps of concurrent sessions to the same hop travel as one
        # ``step`` request (see _step_together); 1 turns that off
        self.max_step_batch = max_step_batch
        self._steps: dict[tuple[str, int, int], _StepQueue] = {}
        self.step_batches = {"steps": 0, "requests": 0, "max_batch": 0, "fallbacks": 0, "cohort_waits": 0,
                             "cohort_timeouts": 0}
        # sessions in their decode loop; at the chain's first hop a step waits
        # (at most cohort_wait seconds) for the others to arrive, so all of
        # them decode in one batch instead of in cohorts that never merge
        self.cohort_wait = cohort_wait
        self._decoding: set[InferenceSession] = set()
        self._laggards: set[InferenceSession] = set()
        self._members_changed = trio.Event()

    async def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``(vocab,)`` for one position's final hidden state.

        Concurrent sessions (API streams) whose steps finish together share
        one LM-head matmul: one ``(B, hidden) x (hidden, vocab)`` product reads
        the head's weights once instead of B times (8 SmolLM2 streams: 24 ms
        instead of 90 ms per step here). A lone session computes exactly what
        it did unbatched.
        """
        slot: dict[str, Any] = {"h": hidden.to(self.head.embed_tokens.weight.dtype), "ev": trio.Event()}
        self._head_queue.append(slot)
        self.head_batches["calls"] += 1
        if not self._head_busy:
            self._head_busy = True
            try:
                if len(self.active) > 1:  # sessions whose answers arrived together join
                    await _settle(lambda: len(self._head_queue))
            finally:
                while self._head_queue:  # no checkpoint in here: always served, even when cancelled
                    batch, self._head_queue = self._head_queue, []
                    out = self.head.logits(torch.stack([b["h"] for b in batch]))
                    self.head_batches["batches"] += 1
                    self.head_batches["max_batch"] = max(self.head_batches["max_batch"], len(batch))
                    for b, row in zip(batch, out):
                        b["out"] = row
                        b["ev"].set()
                self._head_busy = False
        await slot["ev"].wait()
        return slot["out"]

    async def _step_together(self, sess: "InferenceSession", hs: "HopState", x: torch.Tensor) -> torch.Tensor | None:
        """Send this session's decode step ``x`` (1, hidden) for hop ``hs``
        together with the other sessions' steps to the same peer and span:
        one ``step`` request, one batched forward on the peer.

        Whoever finds no step request in flight for that hop sends everything
        queued for it (after one scheduler tick, so sessions whose previous
        answers arrived together leave together); steps that arrive meanwhile
        go in the next request. Sessions served together stay together from
        hop to hop, so 8 API streams cost each peer about one forward per
        token position instead of eight.

        Returns the hop's output (1, hidden), or None when the step must be
        sent on its own (the batch was refused, or its sender was cancelled):
        ``forward`` then handles resyncs and replays as for any step. A
        transport failure raises ``_HopFailed`` for every session in it.
        """
        key = (hs.hop.peer, hs.hop.start, hs.hop.end)
        q = self._steps.get(key)
        if q is None:
            q = self._steps[key] = _StepQueue()
        item = _StepItem(sess, hs, x)
        q.items.append(item)
        if hs.hop.start == 0:
            self._member_event()  # a leader gathering the cohort rechecks who is missing
        self.step_batches["steps"] += 1
        try:
            while not item.done:
                if q.busy:
                    await q.changed.wait()
                    continue
                q.busy = True
                batch: list[_StepItem] = []
                try:
                    if hs.hop.start == 0:
                        await self._gather_cohort(q, key)
                    await _settle(lambda: len(q.items))
                    batch, q.items = q.items[: self.max_step_batch], q.items[self.max_step_batch :]
                    await self._send_step(hs.hop, batch)
                finally:
                    for it in batch:
                        it.done = True  # unanswered ones (we were cancelled) fall back to forward
                    q.busy = False
                    ev, q.changed = q.changed, trio.Event()
                    ev.set()
        finally:
            if item in q.items:  # cancelled while queued
                q.items.remove(item)
            if not q.items and not q.busy and self._steps.get(key) is q:
                del self._steps[key]
        if item.failed is not None:
            raise item.failed
        return item.out

    async def _gather_cohort(self, q: "_StepQueue", key: tuple[str, int, int]) -> None:
        """At the first hop: wait until every session in its decode loop whose
        chain starts at this hop has queued its step here too (or left the
        loop), for at most ``cohort_wait`` seconds. Sessions that made us
        time out (a reroute, a replay) are not waited for again until they
        arrive here once."""
        def missing() -> list[InferenceSession]:
            queued = {it.sess for it in q.items}
            self._laggards -= queued
            return [m for m in self._decoding if m not in queued and m not in self._laggards
                    and m.hops and (m.hops[0].hop.peer, m.hops[0].hop.start, m.hops[0].hop.end) == key]

        if self.cohort_wait <= 0 or not missing():
            return
        self.step_batches["cohort_waits"] += 1
        with trio.move_on_after(self.cohort_wait) as cs:
            while missing():
                ev = self._members_changed
                await ev.wait()
        if cs.cancelled_caught:
            self.step_batches["cohort_timeouts"] += 1
            self._laggards.update(missing())

    def _decode_member(self, sess: "InferenceSession", on: bool) -> None:
        (self._decoding.add if on else self._decoding.discard)(sess)
        if not on:
            self._laggards.discard(sess)
        self._member_event()

    def _member_event(self) -> None:
        ev, self._members_changed = self._members_changed, trio.Event()
        ev.set()

    async def _send_step(self, hop: "Hop", batch: list["_StepItem"]) -> None:
        if len(batch) == 1:  # a lone step is an ordinary forward
            return
        self.step_batches["requests"] += 1
        self.step_batches["max_batch"] = max(self.step_batches["max_batch"], len(batch))
        msg = {
            "v": WIRE_VERSION, "op": "step", "model": self.model_hash, "span": [hop.start, hop.end],
            "sessions": [it.sess.id for it in batch], "pos": [it.hs.pos for it in batch],
            "max_length": [it.sess.max_length for it in batch],
            "hidden": pack_tensor(torch.cat([it.x for it in batch])), **self.tenant_fields,
        }
        t0 = time.perf_counter()
        try:
            resp = await self._request(hop.peer, msg)
        except _HopFailed as exc:
            for it in batch:
                it.failed = exc
            return
        dt = time.perf_counter() - t0
        if resp.get("ok") is not True:
            self.step_batches["fallbacks"] += len(batch)
            return  # each step goes again on its own, with forward's error handling
        lengths = resp.get("length")
        try:
            out = unpack_tensor(resp.get("hidden"), max_ndim=2)
        except WireError as exc:
            for it in batch:
                it.failed = _HopFailed(hop.peer, f"bad hidden: {exc}")
            return
        if (tuple(out.shape) != (len(batch), self.head.config.hidden_size) or type(lengths) is not list
                or lengths != [it.hs.pos + 1 for it in batch]):
            for it in batch:
                it.failed = _HopFailed(hop.peer, "step answer does not match the request")
            return
        self.book.observe(hop.peer, dt)
        for i, it in enumerate(batch):
            it.out = out[i : i + 1]

    # -- routing -------------------------------------------------------------
    def hops(self) -> list[Hop]:
        return live_spans(self.view(), self.model_hash)

    @property
    def rtt(self) -> dict[str, float]:
        """One-token round trips per peer (EWMA), the routes' hop costs."""
        return self.book.rtt

    def excluded(self) -> set[str]:
        return self.book.excluded(time.monotonic())

    def cost(self, h: Hop) -> float:
        return self.book.cost(h)

    def route(self, start: int = 0, end: int | None = None) -> list[Hop] | None:
        end = self.num_layers if end is None else end
        return self.book.route(self.hops(), start, end, time.monotonic())

    async def wait_route(self, start: int = 0, end: int | None = None, *, timeout: float | None = None) -> list[Hop]:
        """Wait (bounded) until the view holds a chain ``start -> end``."""
        timeout = self.route_timeout if timeout is None else timeout
        deadline = trio.current_time() + timeout
        while True:
            r = self.route(start, end)
            if r is not None:
                return r
            if trio.current_time() >= deadline:
                have = sorted({(h.start, h.end) for h in self.hops()})
                raise NoRoute(f"no live chain covers blocks [{start}, {end or self.num_layers}) "
                              f"after {timeout}s; spans seen: {have}")
            await trio.sleep(0.02)

    async def warm_up(self, timeout: float = 5.0) -> list[Hop]:
        """Find a chain and open a connection to each of its peers at once
        (an ``info`` request each, in parallel), so the first generation does
        not dial them one after another. Failures are left to ``generate``."""
        route = await self.wait_route()

        async def one(peer: str) -> None:
            try:
                await self.info(peer, timeout)
            except _HopFailed:
                pass

        async with trio.open_nursery() as n:
            for peer in sorted({h.peer for h in route}):
                n.start_soon(one, peer)
        return route

    def ban(self, peer: str, seconds: float | None = None) -> None:
        self.book.ban(peer, time.monotonic(), seconds)

    def trusted(self, peer: str) -> bool:
        return any(e.peer == peer and getattr(e, "trusted", False) for e in self.view())

    # -- requests --------------------------------------------------------------
    async def _dial(self, peer: str) -> None:
        """Connect to ``peer`` at the addresses its signed state advertises.

        A request to a peer we have no connection to yet lets the libp2p
        transport find an address itself, which took 0.75-1.9 s here (mostly
        waiting); dialling an advertised multiaddr directly takes ~10 ms. Best
        effort: on failure the request dials as before."""
        self._dialed.add(peer)
        connect = getattr(self.transport, "connect", None)
        if connect is None:
            return
        addrs = next((tuple(getattr(e.state, "addrs", ()) or ()) for e in self.view() if e.peer == peer), ())
        for a in addrs:
            if not isinstance(a, str):
                continue
            a = a if "/p2p/" in a else f"{a}/p2p/{peer}"
            try:
                with trio.move_on_after(2.0):
                    if await connect(a) == peer:
                        return
            except (TransportError, ValueError, OSError):
                continue

    async def _request(self, peer: str, msg: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        self.stats["requests"] += 1
        if peer not in self._dialed:
            await self._dial(peer)
        try:
            raw = await self.transport.request(peer, PROTOCOL, encode(msg), timeout=timeout or self.request_timeout)
        except TransportError as exc:
            raise _HopFailed(peer, f"transport: {exc}") from None
        try:
            return decode(raw)
        except WireError as exc:
            raise _HopFailed(peer, f"bad answer: {exc}") from None

    async def info(self, peer: str, timeout: float = 5.0) -> dict[str, Any]:
        """A serving peer's span, limits and counters."""
        resp = await self._request(peer, {"v": WIRE_VERSION, "op": "info"}, timeout)
        if resp.get("ok") is not True:
            raise _HopFailed(peer, str(resp.get("error")))
        return resp

    def session(self, max_length: int) -> "InferenceSession":
        return InferenceSession(self, max_length)

    # -- generation --------------------------------------------------------------
    async def generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int | None = None,
        *,
        params: SamplingParams | None = None,
        greedy: bool = True,
        temperature: float = 1.0,
        seed: int | None = None,
        eos_id: int | None = None,
        tokenizer: Any = None,
        on_token: Callable[[int, int], Any] | None = None,
        on_text: Callable[[str], Any] | None = None,
        session: "InferenceSession | None" = None,
    ) -> GenerationResult:
        """Prefill ``prompt_ids`` through the chain, then decode token by token.

        ``params`` (a :class:`SamplingParams`) says how to sample and when to
        stop; without it the older keywords apply (``max_new_tokens``,
        ``greedy``, ``temperature``, ``seed``; EOS only if ``eos_id`` is given).
        With a ``tokenizer`` the text is decoded incrementally: ``on_text(s)``
        gets each newly showable piece (never half a UTF-8 character, never a
        stop string), the EOS set is the tokenizer's, and stop strings apply.
        ``on_token(index, token)`` is called after each new token. Both
        callbacks may be async.

        ``session``: an open :class:`InferenceSession` to continue (a chat):
        the positions it already holds that agree with ``prompt_ids`` are
        kept, the rest is rolled back, and only the new suffix is prefilled.
        """
        prompt = [int(i) for i in prompt_ids]
        if not prompt:
            raise InputError("empty prompt")
        if params is None:
            if max_new_tokens is None:
                raise TypeError("generate() needs max_new_tokens or params")
            if max_new_tokens < 0:
                raise InputError("max_new_tokens must be >= 0")
            if not greedy and not temperature > 0:
                raise InputError("temperature must be > 0")
            if max_new_tokens == 0:
                return GenerationResult([], len(prompt), 0.0, 0.0, 0.0, [], [], [], "" if tokenizer else None)
            params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, greedy=greedy, seed=seed,
                                    stop_at_eos=eos_id is not None)
        elif max_new_tokens is not None:
            params = params.with_(max_new_tokens=max_new_tokens)
        if eos_id is not None:
            eos: frozenset[int] = frozenset({int(eos_id)})
        elif tokenizer is not None:
            eos = frozenset(tokenizer.eos_ids)
        else:
            eos = _config_eos(self.head.config)
        if not params.stop_at_eos:
            eos = frozenset()
        sampler = Sampler(params)
        decoder = tokenizer.stream_decoder() if tokenizer is not None else None
        stops = StopMatcher(params.stop)
        if any(not 0 <= i < self.head.config.vocab_size for i in prompt):
            raise InputError(f"prompt token ids must be in [0, {self.head.config.vocab_size})")
        need = len(prompt) + params.max_new_tokens
        ctx = self.head.config.max_position_embeddings
        if need > ctx:
            raise InputError(f"prompt of {len(prompt)} tokens + {params.max_new_tokens} new tokens exceeds the "
                             f"model's context of {ctx} tokens", "shorten the prompt or ask for fewer tokens")
        if session is not None and session.max_length < need:
            raise InputError(f"the conversation needs {need} positions, the session holds {session.max_length}",
                             "start a new conversation (/reset)")

        async def emit(cb: Callable[..., Any] | None, *args: Any) -> None:
            if cb is not None:
                r = cb(*args)
                if hasattr(r, "__await__"):
                    await r

        out: list[int] = []
        steps: list[float] = []
        t0 = time.perf_counter()
        ttft = 0.0
        finish = "length"
        own = session is None
        sess = await self.session(need).__aenter__() if own else session
        assert sess is not None
        try:
            keep = min(common_prefix(sess.tokens, prompt), len(prompt) - 1)
            sess.rollback(keep)
            ids = prompt[keep:]
            history = list(prompt)
            for i in range(params.max_new_tokens):
                ts = time.perf_counter()
                if i == 1:
                    self._decode_member(sess, True)
                h = await sess.step(ids)
                tok = sampler.pick(await self.logits(h[-1]), history)
                now = time.perf_counter()
                if i == 0:
                    ttft = now - t0
                else:
                    steps.append(now - ts)
                out.append(tok)
                history.append(tok)
                await emit(on_token, i, tok)
                if tok in eos:
                    finish = "stop"
                    break
                if decoder is not None:
                    piece = stops.push(decoder.push(tok))
                    if piece:
                        await emit(on_text, piece)
                    if stops.stopped is not None:
                        finish = "stop"
                        break
                ids = [tok]
            if decoder is not None and stops.stopped is None:
                piece = stops.finish(decoder.flush())
                if piece:
                    await emit(on_text, piece)
                if stops.stopped is not None:
                    finish = "stop"
            route = [{"peer": s.hop.peer, "blocks": [s.hop.start, s.hop.end]} for s in sess.hops]
            recoveries = list(sess.recoveries)
        finally:
            self._decode_member(sess, False)
            if own:
                await sess.close()
        total = time.perf_counter() - t0
        tps = len(steps) / sum(steps) if steps and sum(steps) > 0 else 0.0
        return GenerationResult(out, len(prompt), ttft, total, tps, steps, recoveries, route,
                                text=stops.output if decoder is not None else None, finish_reason=finish,
                                seed=sampler.seed, prefill_tokens=len(prompt) - keep, reused_tokens=keep)


def _config_eos(cfg: Any) -> frozenset[int]:
    e = cfg.extra.get("eos_token_id")
    if isinstance(e, int):
        return frozenset({e})
    if isinstance(e, list):
        return frozenset(i for i in e if isinstance(i, int))
    return frozenset()


class _Inputs:
    """The hidden states that entered one block boundary, positions
    ``[0, length)``, in a buffer that doubles as it fills.

    A step appends a row or a few. Rebuilding the whole history with
    ``torch.cat`` on each step copied all of it every time: a SmolLM2 token
    (576 wide) through 2 peers, three boundaries, spent 1.2 ms on it at
    2,048 positions and 7.3 ms at 8,192, against 0.06 and 0.16 ms with this
    (benchmarks/llm_client_history.py, docs/benchmarks.md). A write lands past the kept rows, or
    in a new buffer (a write below ``length``: a resync, a recomputed hop;
    a full buffer; a wider dtype), and only ``keep`` makes it part of the
    history: what a spot check rejects is never kept, and kept rows are
    never written over in place."""

    __slots__ = ("buf", "length", "_pending")

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None
        self.length = 0
        self._pending: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.length

    def upto(self, end: int) -> torch.Tensor:
        """Kept rows ``[0, end)``, a view (fewer if fewer are kept)."""
        assert self.buf is not None
        return self.buf[: min(end, self.length)]

    def write(self, at: int, x: torch.Tensor) -> torch.Tensor:
        """Rows ``[0, at)`` of the history followed by ``x``, not yet kept."""
        end = at + len(x)
        buf = self.buf
        if (buf is None or at < self.length or end > len(buf) or buf.dtype != x.dtype
                or buf.shape[1:] != x.shape[1:]):
            dtype = x.dtype if buf is None else torch.promote_types(buf.dtype, x.dtype)
            new = torch.empty((max(end, 2 * len(buf) if buf is not None else 0, 16), *x.shape[1:]), dtype=dtype)
            if buf is not None and at:
                new[:at] = buf[:at]
            buf = new
        buf[at:end] = x
        self._pending = buf
        return buf[:end]

    def keep(self, length: int) -> None:
        """The last ``write`` is history: rows ``[0, length)``."""
        if self._pending is not None:
            self.buf, self._pending = self._pending, None
        self.length = length

    def truncate(self, length: int) -> None:
        """Forget rows ``[length, ...)`` (and any write not kept)."""
        self._pending = None
        self.length = min(self.length, length)


class InferenceSession:
    """One generation session through a chain of peers (``async with``)."""

    def __init__(self, llm: SwarmLLM, max_length: int) -> None:
        self.llm = llm
        self.max_length = max_length
        self.id = os.urandom(SESSION_ID_BYTES)
        self.length = 0  # positions processed through the whole chain
        self.tokens: list[int] = []  # the token ids of those positions
        self.prefilled = 0  # positions sent through the chain in all (a chat's turns add up here)
        # the chain and where each peer's cache stands (sans-IO, fedswarm.core.llm_route)
        self.chain = Chain(llm.num_layers)
        # hidden states entering each block boundary, positions [0, length)
        self.hist: dict[int, _Inputs] = {}
        self.recoveries: list[dict[str, Any]] = []
        self._delegation: Delegation | None = None  # the signed route of our forwarded steps
        self._forward_off_until = 0.0  # a first hop refused our route: drive hops ourselves until then

    @property
    def hops(self) -> list[HopState]:
        """The session's chain, first block first."""
        return self.chain.hops

    async def __aenter__(self) -> "InferenceSession":
        self.llm.active.add(self)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        """Close our sessions on every peer (best effort, bounded)."""
        self.llm.active.discard(self)
        todo = self.chain.hops + self.chain.take_stale()
        self.chain.hops = []
        if not todo:
            return
        with trio.move_on_after(2.0):
            async with trio.open_nursery() as n:
                for hs in todo:
                    n.start_soon(self._close_one, hs.hop.peer)

    async def _close_one(self, peer: str) -> None:
        msg = {"v": WIRE_VERSION, "op": "close", "model": self.llm.model_hash, "session": self.id}
        try:
            await self.llm._request(peer, msg, timeout=2.0)
        except _HopFailed:
            pass

    def rollback(self, length: int) -> None:
        """Forget positions ``[length, self.length)``: the next step continues
        at ``length`` and every peer rolls its KV cache back to it."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back a session of {self.length} positions to {length}")
        if length == self.length:
            return
        self.length = length
        del self.tokens[length:]
        for inputs in self.hist.values():
            inputs.truncate(length)
        self.chain.rollback(length)

    async def step(self, ids: Sequence[int]) -> torch.Tensor:
        """Run ``ids`` (the next positions) through the chain; return the last
        block's hidden states for them, shape ``(len(ids), hidden_size)``.

        The walk along the chain (what to send where, resyncs, detours around
        a failed or lying hop) is ``StepPlan``'s; this performs its actions."""
        llm = self.llm
        n, t = self.length, len(ids)
        if n + t > self.max_length:
            raise ValueError(f"session length {self.max_length} exceeded")
        emb = llm.head.embed(torch.tensor([list(ids)], dtype=torch.long))[0]
        first = self.hist.setdefault(0, _Inputs())
        first.write(n, emb)
        first.keep(n + t)
        plan = StepPlan(self.chain, llm.book, llm.hops, n, n + t, max_chunk=llm.max_chunk)
        outs: list[torch.Tensor] = []  # the current hop's outputs since its run started
        # a forwarded step's outputs (or the first hop's failure), per hop:
        # the answers the plan's sends of [n, n+t) would get; dropped from the
        # first hop that deviates (no output, a resync, a failure, a lie)
        pre = await self._forwarded(n, t)
        try:
            while True:
                act = plan.next()
                if isinstance(act, Done):
                    break
                if isinstance(act, NeedRoute):
                    self.chain.set_tail(act.start, await llm.wait_route(act.start, llm.num_layers))
                    continue
                if isinstance(act, Send):
                    hs = act.hop
                    got = pre.pop(hs, None) if (act.lo, act.hi) == (n, n + t) else None
                    if got is None:
                        pre.clear()
                    try:
                        if isinstance(got, _HopFailed):
                            raise got
                        outs.append(got if got is not None
                                    else await self._forward(hs, self.hist[hs.hop.start].upto(act.hi)[act.lo :]))
                        plan.sent(hs, act.hi - act.lo)
                    except _Resync as rs:
                        outs = []
                        pre.clear()
                        plan.resync(hs, rs.length, len(self.hist.get(hs.hop.end, ())), time.monotonic())
                    except _HopFailed as exc:
                        outs = []
                        pre.clear()
                        llm.stats["failures"] += 1
                        before = len(plan.recoveries)
                        plan.failed(hs, exc.reason, time.monotonic(), moved=exc.moved)
                        llm.stats["recoveries"] += len(plan.recoveries) - before
                    continue
                assert isinstance(act, HopOutput)
                hs, e = act.hop, act.hop.hop.end
                out = torch.cat(outs) if len(outs) > 1 else outs[0]
                outs = []
                inputs = self.hist.setdefault(e, _Inputs())
                full = inputs.write(act.lo, out)
                if await self._spot_check(hs, n + t, full):
                    pre.clear()
                    plan.lied(hs, time.monotonic())  # banned by the check: recompute from a replacement
                    continue
                inputs.keep(len(full))
                plan.accept(hs)
        except GiveUp as exc:
            raise NoRoute(str(exc)) from None
        finally:
            self.recoveries.extend(plan.recoveries)
        self.length = n + t
        self.tokens.extend(int(i) for i in ids)
        self.prefilled += t
        if plan.attempts:
            done = time.monotonic()
            for r in self.recoveries:
                r.setdefault("recovered_s", round(done - r["t"], 4))
        # a copy: the buffer's rows past a later rollback are written again
        return self.hist[llm.num_layers].upto(n + t)[n:].clone()

    async def _forwarded(self, n: int, t: int) -> dict[HopState, "torch.Tensor | _HopFailed"]:
        """Send decode position ``n`` down the chain peer to peer (when this
        session may: forwarding on, one position, the chain whole and every
        hop's cache at ``n``, no other session decoding, no recent refusal).
        Returns each hop's output, in chain order up to the first that did
        not come; or ``{first hop: failure}`` when the first hop failed."""
        llm = self.llm
        hops = self.chain.hops
        if (llm._inbox is None or t != 1 or n == 0 or len(hops) < 2 or len(llm.active) > 1
                or time.monotonic() < self._forward_off_until or hops[0].hop.start != 0
                or hops[-1].hop.end != llm.num_layers or any(hs.pos != n for hs in hops)
                or any(a.hop.end != b.hop.start for a, b in zip(hops, hops[1:]))):
            return {}
        route = tuple((hs.hop.peer, hs.hop.start, hs.hop.end) for hs in hops)
        d = self._delegation
        if d is None or d.route != route or d.expires - time.time() < llm.delegation_ttl / 4:
            assert llm.identity is not None
            d = self._delegation = sign_delegation(llm.identity, self.id, llm.model_hash, route,
                                                   time.time() + llm.delegation_ttl)
        for peer, _, _ in route[1:]:
            if peer not in llm._dialed:  # so that they can reach us too
                await llm._dial(peer)
        llm.forward_stats["steps"] += 1
        first = hops[0]
        exp = _Expect(n, route, llm.head.config.hidden_size)
        llm._inbox.expects[self.id] = exp
        try:
            msg = {
                "v": WIRE_VERSION, "op": "forward", "model": llm.model_hash, "span": [0, first.hop.end],
                "session": self.id, "pos": n, "max_length": self.max_length,
                "hidden": pack_tensor(self.hist[0].upto(n + 1)[n:]), "route": d.wire(), **llm.tenant_fields,
            }
            t0 = time.perf_counter()
            try:
                resp = await llm._request(first.hop.peer, msg)
            except _HopFailed as exc:
                llm.forward_stats["fallbacks"] += 1
                return {first: exc}
            t_first = time.perf_counter() - t0
            try:
                out = unpack_tensor(resp.get("hidden"), max_ndim=2) if resp.get("ok") is True else None
            except WireError:
                out = None
            if out is None or tuple(out.shape) != (1, llm.head.config.hidden_size) or resp.get("length") != n + 1:
                # refused (its view lacks a hop, a resync, ...): the plan asks it
                # again the usual way; no forwarding for a while
                llm.forward_stats["refused"] += 1
                self._forward_off_until = time.monotonic() + 5.0
                return {}
            pre: dict[HopState, torch.Tensor | _HopFailed] = {first: out}
            with trio.move_on_after(llm.request_timeout):
                await exp.ev.wait()
            for hs in hops[1:]:
                h = exp.got.get((hs.hop.start, hs.hop.end))
                if h is None:
                    break
                pre[hs] = h
            complete = len(pre) == len(hops) and exp.error is None
            llm.forward_stats["complete" if complete else "fallbacks"] += 1
            if complete:  # the chain's output covers every hop: their round trips learn from it
                llm.book.observe_chain([hs.hop for hs in hops], exp.at - t0, first=t_first)
            return pre
        finally:
            llm._inbox.expects.pop(self.id, None)

    async def _spot_check(self, hs: HopState, upto: int, full: torch.Tensor) -> bool:
        """Maybe recompute a hop's outputs ``[0, upto)`` on another peer that
        serves the same span, and compare. Returns True if the hop is judged
        to have lied (and bans it).

        Who is believed: a trusted peer (federation member) over an untrusted
        one; between two untrusted peers, a third one with the span decides;
        with no third, both are banned from routing for ``ban_s`` and the
        step is recomputed elsewhere (or fails if nobody else serves it).
        """
        llm = self.llm
        peer = hs.hop.peer
        if llm.spot_check_rate <= 0 or llm.trusted(peer) or llm.rng.random() >= llm.spot_check_rate:
            return False
        others = [h for h in llm.hops() if h.start == hs.hop.start and h.end == hs.hop.end
                  and h.peer != peer and h.peer not in llm.excluded()]
        if not others:
            return False
        others.sort(key=lambda h: (not llm.trusted(h.peer), h.peer))
        llm.stats["spot_checks"] += 1
        x = self.hist[hs.hop.start].upto(upto)
        verdicts: list[tuple[str, bool]] = []  # (checker, agrees)
        for other in others[:2]:
            try:
                ref = await self._replay_on(other, x)
            except _HopFailed:
                continue
            agrees = self._close(full, ref)
            verdicts.append((other.peer, agrees))
            if agrees or llm.trusted(other.peer):
                break
        if not verdicts or verdicts[0][1]:
            return False
        llm.stats["spot_mismatches"] += 1
        checker, _ = verdicts[0]
        if llm.trusted(checker) or (len(verdicts) > 1 and not verdicts[1][1]):
            llm.ban(peer, seconds=10 * llm.ban_s)  # outvoted: the hop lied
            llm.stats["spot_banned"] += 1
            return True
        if len(verdicts) > 1:  # the second checker agreed with the hop
            llm.ban(checker, seconds=10 * llm.ban_s)
            llm.stats["spot_banned"] += 1
            return False
        llm.ban(peer)  # undecidable: trust neither
        llm.ban(checker)
        return True

    def _close(self, a: torch.Tensor, b: torch.Tensor) -> bool:
        if a.shape != b.shape:
            return False
        scale = max(float(a.abs().max()), 1e-6)
        return float((a.float() - b.float()).abs().max()) <= self.llm.spot_check_tol * scale

    async def _replay_on(self, hop: Hop, x: torch.Tensor) -> torch.Tensor:
        """Run ``x`` through ``hop`` in a throwaway session; return its outputs."""
        llm = self.llm
        probe = InferenceSession(llm, self.max_length)
        hs = HopState(hop)
        try:
            outs = []
            while hs.pos < len(x):
                chunk = x[hs.pos : min(len(x), hs.pos + llm.max_chunk)]
                outs.append(await probe._forward(hs, chunk))
                hs.pos += len(chunk)
            return torch.cat(outs) if len(outs) > 1 else outs[0]
        except _Resync as rs:
            raise _HopFailed(hop.peer, f"spot check out of sync ({rs})") from None
        finally:
            with trio.move_on_after(2):
                try:
                    await llm._request(hop.peer, {"v": WIRE_VERSION, "op": "close", "model": llm.model_hash,
                                                  "session": probe.id}, 2.0)
                except _HopFailed:
                    pass

    async def _forward(self, hs: HopState, chunk: torch.Tensor) -> torch.Tensor:
        """Send inputs ``chunk`` for positions ``hs.pos ..`` to the hop; return
        its outputs. Moving ``hs.pos`` is the caller's (``StepPlan.sent``)."""
        llm = self.llm
        peer = hs.hop.peer
        # a lone session has nobody to share a step request with: it skips the
        # step queue (and its scheduler ticks: ~0.17 ms of client CPU per hop)
        if len(chunk) == 1 and hs.pos > 0 and llm.max_step_batch > 1 and len(llm.active) > 1:
            out = await llm._step_together(self, hs, chunk)
            if out is not None:
                return out
        msg = {
            "v": WIRE_VERSION, "op": "forward", "model": llm.model_hash, "span": [hs.hop.start, hs.hop.end],
            "session": self.id, "pos": hs.pos, "max_length": self.max_length, "hidden": pack_tensor(chunk),
            **llm.tenant_fields,
        }
        t0 = time.perf_counter()
        resp = await llm._request(peer, msg, timeout=llm.request_timeout * max(1, len(chunk) // 64 + 1))
        dt = time.perf_counter() - t0
        if resp.get("ok") is not True:
            err = resp.get("error")
            if err == "pos-mismatch" and type(resp.get("length")) is int:
                raise _Resync(resp["length"])
            if err == "unknown-session":
                raise _Resync(0)
            raise _HopFailed(peer, f"{err}: {resp.get('detail', '')}", moved=err == "wrong-span")
        try:
            out = unpack_tensor(resp.get("hidden"), max_ndim=2)
        except WireError as exc:
            raise _HopFailed(peer, f"bad hidden: {exc}") from None
        if tuple(out.shape) != tuple(chunk.shape) or resp.get("length") != hs.pos + len(chunk):
            raise _HopFailed(peer, "answer does not match the request")
        if len(chunk) == 1:
            llm.book.observe(peer, dt)
        return out


async def _settle(count: Callable[[], int], max_ticks: int = 8) -> None:
    """Yield to the scheduler until a tick passes in which ``count()`` does
    not grow (at least two ticks, at most ``max_ticks``).

    Tasks woken together by one answer run in the next scheduler batch in a
    random order; one tick is not enough for all of them to reach the queue
    before the one that leads reads it."""
    n = count()
    for i in range(max_ticks):
        await trio.sleep(0)
        m = count()
        if m == n and i >= 1:
            return
        n = m


@dataclass(eq=False)
class _StepItem:
    sess: "InferenceSession"
    hs: "HopState"
    x: torch.Tensor  # (1, hidden)
    out: torch.Tensor | None = None
    failed: "_HopFailed | None" = None
    done: bool = False


@dataclass(eq=False)
class _StepQueue:
    items: list[_StepItem] = field(default_factory=list)
    busy: bool = False
    changed: trio.Event = field(default_factory=trio.Event)


class _Resync(Exception):
    def __init__(self, length: int) -> None:
        super().__init__(f"peer holds {length} positions")
        self.length = length


@dataclass(eq=False)
class _Expect:
    """The outputs a forwarded step of one session waits for."""

    pos: int
    route: tuple[tuple[str, int, int], ...]
    hidden_size: int
    got: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # span -> its output
    error: str | None = None
    at: float = 0.0  # time.perf_counter() when the out message came
    ev: trio.Event = field(default_factory=trio.Event)


class _Inbox:
    """Receives serving peers' ``out`` messages on one client transport
    (shared by the ``SwarmLLM``s on it): each must be about a step one of our
    sessions waits for, from the hop its route says (the last hop, or the hop
    before the one that failed), with one output per hop before that span."""

    def __init__(self, transport: Any) -> None:
        self.expects: dict[bytes, _Expect] = {}
        self.refused = 0
        transport.set_request_handler(OUT_PROTOCOL, self.handle)

    async def handle(self, sender: str, data: bytes) -> bytes:
        try:
            self._take(sender, decode(data))
            return encode({"ok": True})
        except WireError as exc:
            self.refused += 1
            return encode({"ok": False, "error": exc.code, "detail": exc.detail[:300]})

    def _take(self, sender: str, msg: dict[str, Any]) -> None:
        keys = set(msg)
        if (msg.get("v") != WIRE_VERSION or msg.get("op") != "out" or not OP_KEYS["out"] <= keys
                or keys - OP_KEYS["out"] - OPTIONAL_KEYS["out"] or ("hidden" in msg) == ("error" in msg)):
            raise WireError("bad-request", "not an out message")
        sid, span, pos, outs = msg["session"], msg["span"], msg["pos"], msg.get("outs", [])
        e = self.expects.get(sid) if type(sid) is bytes else None
        if e is None:
            raise WireError("unknown-session", "no step of this session is waiting")
        spans = [(a, b) for _, a, b in e.route]
        k = spans.index((span[0], span[1])) if (type(span) is list and len(span) == 2
                                                 and (span[0], span[1]) in spans) else -1
        if k < 1 or type(pos) is not int or pos != e.pos or type(outs) is not list or len(outs) != k:
            raise WireError("bad-request", "not a step this session waits for")
        failed = "error" in msg
        if sender != e.route[k - 1 if failed else k][0] or (not failed and k != len(spans) - 1):
            raise WireError("bad-request", "not from the route's hop for this span")
        packed = [*outs[1:], *([] if failed else [msg["hidden"]])]
        hs = [unpack_tensor(o, max_ndim=2) for o in packed]
        if any(tuple(h.shape) != (1, e.hidden_size) or not finite(o) for h, o in zip(hs, packed)):
            raise WireError("bad-request", f"outputs must be (1, {e.hidden_size}), finite")
        for sp, h in zip(spans[1:], hs):
            e.got[sp] = h
        if failed:
            e.error = f"{msg.get('error')}: {msg.get('detail')}"[:300]
        e.at = time.perf_counter()
        e.ev.set()


_INBOXES: "weakref.WeakKeyDictionary[Any, _Inbox]" = weakref.WeakKeyDictionary()


def _inbox_of(transport: Any) -> _Inbox:
    box = _INBOXES.get(transport)
    if box is None:
        box = _INBOXES[transport] = _Inbox(transport)
    return box
