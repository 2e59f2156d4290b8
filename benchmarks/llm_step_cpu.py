#!/usr/bin/env python3
"""Where a decode step's time goes through a chain of real peers: per step,
the CPU of the client (this process) and of each ``peer start`` process
(psutil), the span's own forward time as each peer counts it
(``stats.compute_s``), and the wall time, next to the same model run in
this process. Forwarding on and off alternate in one swarm.

    .venv/bin/python benchmarks/llm_step_cpu.py [MODEL] [PEERS] [NEW_TOKENS] [--no-lane]

Defaults: smollm2-135m-instruct, 2 peers, 64 new tokens; one torch thread
per process, greedy, a 42-token prompt.
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import psutil  # noqa: E402
import torch  # noqa: E402
import trio  # noqa: E402

import llm_pipeline as lp  # noqa: E402
from fedswarm.errors import InputError  # noqa: E402
from fedswarm.tasks.checkpoint import load_client_head, model_hash  # noqa: E402


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise ValueError(text)
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="smollm2-135m-instruct", help="model name, directory or .gguf")
    ap.add_argument("peers", nargs="?", type=_positive, default=2, help="serving peers in the chain")
    ap.add_argument("new_tokens", nargs="?", type=_positive, default=64, help="tokens to decode per run")
    ap.add_argument("--no-lane", action="store_true",
                    help="peers and client without direct lanes: every request over py-libp2p")
    a = ap.parse_args()
    model, peers, n_new = a.model, a.peers, a.new_tokens
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp())
    try:
        d = lp.build_model(model, tmp)
        head = load_client_head(d)
    except InputError as exc:
        print(f"llm_step_cpu: {exc}", file=sys.stderr)
        return 2
    if peers > head.config.num_hidden_layers:
        print(f"llm_step_cpu: {peers} peers for {head.config.num_hidden_layers} blocks", file=sys.stderr)
        return 2
    prompt = list(range(100, 142))
    loc = lp.local_run(d, prompt, n_new, 3)
    print(f"local: {loc['tok_s']:.2f} tok/s, {1e3 / loc['tok_s']:.2f} ms per token")
    sw = lp.start_swarm(tmp / "sw", d, lp.splits(head.config.num_hidden_layers, peers), lane=not a.no_lane)

    def cpu() -> list[float]:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return [r.ru_utime + r.ru_stime] + [sum(psutil.Process(p.proc.pid).cpu_times()[:2]) for p in sw.peers]

    async def body(llm, connect, plain) -> None:  # noqa: ANN001
        route = (await llm.generate(prompt, 4)).route
        print("forward  tok/s  x local  tokens  | CPU ms per step: client, peers... | span forward ms per step | wall ms")
        for fw in [False, True] * 4:
            before = [(await llm.info(h["peer"]))["stats"] for h in route]
            c0, t0 = cpu(), time.perf_counter()
            r = await (llm if fw else plain).generate(prompt, n_new)
            wall, c1 = time.perf_counter() - t0, cpu()
            after = [(await llm.info(h["peer"]))["stats"] for h in route]
            fwd = [(b["compute_s"] - a["compute_s"]) / max(b["steps"] - a["steps"], 1) * 1e3 for a, b in zip(before, after)]
            print(f"{fw!s:<7} {r.decode_tokens_per_s:6.2f} {r.decode_tokens_per_s / loc['tok_s']:8.3f}  "
                  f"{'same' if r.token_ids == loc['tokens'] else 'DIFF'}    | "
                  + " ".join(f"{(b - a) / n_new * 1e3:6.2f}" for a, b in zip(c0, c1))
                  + " | " + " ".join(f"{x:6.2f}" for x in fwd) + f" | {wall / n_new * 1e3:6.2f}")

    try:
        trio.run(lp.swarm_client, sw, d, head, model_hash(d), body, not a.no_lane)
    finally:
        sw.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
