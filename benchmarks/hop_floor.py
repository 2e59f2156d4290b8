#!/usr/bin/env python3
"""The floor of a hop on this machine: a model split over processes with nothing between them.

    .venv/bin/python benchmarks/hop_floor.py [--model smollm2-135m-instruct] [--peers 2] [--new 64] [--rounds 10]

Issue #21 asks for at most 1 ms of added latency per hop. Part of any hop's
cost belongs to the machine, not to the code that carries it: the processes
of a chain sleep while the others compute, and each wakes to a cold cache
after every step. This script measures that part alone. It splits the model
over ``--peers`` processes that keep only what a hop must do: one blocking,
unencrypted TCP connection per leg (``TCP_NODELAY``), a length header, the
hidden state's raw bytes, the span's forward, the next send. No trio, no
threads, no checks, no signatures, no sessions beyond one KV cache. The
chain forwards server to server: the client sends the embedding to the first
process, the last one sends its output back to the client, which runs the
head.

Each round runs one greedy generation in this process (the whole model, as
``llm_pipeline.py``'s local run) and one through the chain, in turns, and
takes that round's added latency per hop: (chain step time - local step
time) / peers. A second chain, beside it in the same rounds, differs in one
thing: each process hands the step to a worker thread for the forward and
the onward send, as fedswarm's serving peer does (issue #21 keeps tensor
work off the event loop); its difference from the first is the thread hop's
cost. Medians over the rounds after a warm-up; every round checks that each
chain gave the local tokens. ``llm_pipeline.py --lanes N --floor``
runs the same chain beside fedswarm's in its rounds.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import struct
import subprocess
import sys
import queue
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from fedswarm.errors import InputError

_HDR = struct.Struct(">IIB")  # payload bytes, tokens in this step, kind
_NEW, _STEP = 0, 1  # a new session (the KV cache starts over), a hidden state


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise EOFError("the chain's previous process closed its connection")
        got += k
    return buf


def _recv(sock: socket.socket) -> tuple[int, int, bytearray]:
    n, t, kind = _HDR.unpack(_recv_exact(sock, _HDR.size))
    return kind, t, _recv_exact(sock, n)


def _send(sock: socket.socket, kind: int, t: int, payload: bytes = b"") -> None:
    sock.sendall(_HDR.pack(len(payload), t, kind) + payload)


def _nodelay(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _tensor_bytes(h: torch.Tensor) -> bytes:
    return h.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def serve(model_dir: str, blocks: str, next_port: int, max_len: int, threaded: bool = False) -> None:
    """One process of the chain: ``blocks`` ("A:B", as ``peer start --blocks``
    takes them), its output to ``next_port``.
    ``threaded``: the forward and the onward send run in a second thread, as in
    fedswarm's serving peer (the receiving thread hands each step over and
    waits for the next frame)."""
    from fedswarm.llm_serving import parse_blocks
    from fedswarm.tasks.checkpoint import load_block_span, load_config

    torch.set_num_threads(1)
    start, end = parse_blocks(blocks, load_config(model_dir).num_hidden_layers)
    span = load_block_span(model_dir, start, end)
    hidden = span.config.hidden_size
    listener = socket.create_server(("127.0.0.1", 0))
    down = _nodelay(socket.create_connection(("127.0.0.1", next_port)))
    print(listener.getsockname()[1], flush=True)  # the port, once the next leg is connected
    up = _nodelay(listener.accept()[0])
    cache = span.new_cache(max_len)

    def step(t: int, payload: bytearray) -> None:
        out = span(torch.frombuffer(payload, dtype=span.dtype).view(1, t, hidden), cache)
        _send(down, _STEP, t, _tensor_bytes(out))

    jobs: queue.SimpleQueue[tuple[int, bytearray] | None] = queue.SimpleQueue()

    def worker() -> None:
        while (job := jobs.get()) is not None:
            step(*job)

    th = threading.Thread(target=worker, daemon=True) if threaded else None
    if th is not None:
        th.start()
    while True:
        try:
            kind, t, payload = _recv(up)
        except EOFError:
            jobs.put(None)
            if th is not None:
                th.join()  # leaving with the worker inside torch aborts the process
            return
        if kind == _NEW:  # the previous step has been answered: the worker is idle
            cache = span.new_cache(max_len)
            _send(down, _NEW, 0)
        elif th is not None:
            jobs.put((t, payload))
        else:
            step(t, payload)


class RawChain:
    """``len(blocks)`` processes, each serving one span, forwarding to the next."""

    def __init__(self, model_dir: Path, blocks: list[str], max_len: int = 1024,
                 threaded: bool = False) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        port = self._listener.getsockname()[1]
        self.procs: list[subprocess.Popen[bytes]] = []
        try:
            for b in reversed(blocks):  # each connects to the one after it, the last to us
                p = subprocess.Popen([sys.executable, __file__, "--serve", str(model_dir), b,
                                      str(port), str(max_len)] + (["--threaded"] if threaded else []),
                                     stdout=subprocess.PIPE)
                self.procs.append(p)
                assert p.stdout is not None
                line = p.stdout.readline()
                if not line.strip().isdigit():
                    raise RuntimeError(f"chain process for blocks {b} did not start (exit {p.wait()})")
                port = int(line)
            self._up = _nodelay(self._listener.accept()[0])
            self._down = _nodelay(socket.create_connection(("127.0.0.1", port)))
        except BaseException:
            self.close()
            raise

    def generate(self, head: Any, prompt: list[int], n_new: int) -> tuple[float, list[int]]:
        """One greedy generation: (decode tok/s, tokens), timed as ``local_generate``."""
        _send(self._down, _NEW, 0)
        self._recv_check(_NEW)
        hidden, dtype = head.config.hidden_size, head.embed_tokens.weight.dtype

        def step(ids: list[int]) -> int:
            h = head.embed(torch.tensor([ids]))
            _send(self._down, _STEP, len(ids), _tensor_bytes(h))
            t, payload = self._recv_check(_STEP)
            out = torch.frombuffer(payload, dtype=dtype).view(1, t, hidden)[:, -1:]
            return int(head.logits(out)[0, -1].argmax())

        tok = step(prompt)
        toks, steps = [tok], []
        for _ in range(n_new - 1):
            ts = time.perf_counter()
            tok = step([tok])
            steps.append(time.perf_counter() - ts)
            toks.append(tok)
        return len(steps) / sum(steps), toks

    def _recv_check(self, want: int) -> tuple[int, bytearray]:
        kind, t, payload = _recv(self._up)
        if kind != want:
            raise RuntimeError(f"chain answered kind {kind}, expected {want}")
        return t, payload

    def close(self) -> None:
        for s in ("_down", "_up", "_listener"):
            sock = getattr(self, s, None)
            if sock is not None:
                sock.close()
        for p in self.procs:
            try:
                p.wait(timeout=10)  # the closed connections end each process in turn
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def __enter__(self) -> "RawChain":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import llm_pipeline as lp

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="model name, directory or .gguf")
    ap.add_argument("--peers", type=int, default=2, help="processes in the chain")
    ap.add_argument("--new", type=int, default=64, help="tokens per generation")
    ap.add_argument("--rounds", type=int, default=10, help="rounds after the warm-up")
    a = ap.parse_args()
    if a.peers < 1 or a.new < 2 or a.rounds < 1:
        ap.error("--peers >= 1, --new >= 2 and --rounds >= 1")
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp())
    try:
        d = lp.build_model(a.model, tmp)
    except InputError as exc:
        print(f"hop_floor: {exc}", file=sys.stderr)
        return 2
    model = lp.local_model(d)
    head = model[0]
    if a.peers > head.config.num_hidden_layers:
        ap.error(f"{a.peers} processes for {head.config.num_hidden_layers} blocks")
    prompt = list(range(100, 142))
    load = os.getloadavg()[0]
    blocks = lp.splits(head.config.num_hidden_layers, a.peers)
    names = ("raw chain (the floor)", "raw chain, forward in a thread")
    rows: list[tuple[float, ...]] = []  # per round: local tok/s, then each chain's
    with RawChain(d, blocks, max_len=len(prompt) + a.new) as plain, \
            RawChain(d, blocks, max_len=len(prompt) + a.new, threaded=True) as threaded:
        for r in range(a.rounds + 1):
            _, lt, ltoks = lp.local_generate(model, prompt, a.new)
            row = [lt]
            for name, chain in zip(names, (plain, threaded)):
                ct, ctoks = chain.generate(head, prompt, a.new)
                if ctoks != ltoks:
                    print(f"hop_floor: round {r}: {name}: tokens differ from the local run's", file=sys.stderr)
                    return 1
                row.append(ct)
            if r:  # the first round is a warm-up
                rows.append(tuple(row))

    def per_hop(i: int, ref: int = 0) -> list[float]:  # column i's ms per hop over column ref, round by round
        return [(1.0 / x[i] - 1.0 / x[ref]) / a.peers * 1e3 for x in rows]

    print(f"{a.model}, {a.peers} processes, {a.new} tokens, {a.rounds} rounds after a warm-up, "
          f"torch threads 1, 1-minute load {load:.2f} at start")
    print(f"{'setup':<32} {'tok/s':>7} {'x local':>8} {'+ms/hop median':>15} {'[lowest, highest]':>18}")
    print(f"{'local (one process)':<32} {statistics.median(x[0] for x in rows):7.2f} {1.0:8.3f}")
    for i, name in enumerate(names, 1):
        h = per_hop(i)
        print(f"{name:<32} {statistics.median(x[i] for x in rows):7.2f} "
              f"{statistics.median(x[i] / x[0] for x in rows):8.3f} {statistics.median(h):+15.3f} "
              f"  [{min(h):+.3f}, {max(h):+.3f}]")
    h = per_hop(2, 1)
    print(f"the thread hop, ms per hop (threaded minus plain, round by round): median {statistics.median(h):+.3f} "
          f"[{min(h):+.3f}, {max(h):+.3f}]")
    print("every round gave the local tokens")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        serve(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), threaded="--threaded" in sys.argv[6:])
    else:
        sys.exit(main())
