#!/usr/bin/env python3
"""Span recovery: how long a swarm of ``peer start --blocks auto`` peers
takes to serve every block again after ``kill -9`` of one of them.

    .venv/bin/python benchmarks/span_recovery.py [--model tiny-llama-gqa] [--peers 4] [--repeats 3] [--json OUT]

Each repeat starts ``--peers`` processes on 127.0.0.1 one after another
(LocalSwarm, ``--torch-threads 1``), waits until they serve every block,
then kills two of them in turn:

1. a peer chosen without looking (the second one started): with N peers of
   half the model each, every block usually keeps a holder;
2. then a peer that alone holds some block (there is one: 3 x 2 blocks on 4),
   so a gap opens and a survivor has to move into it.

For each kill: ``gap`` (whether some block lost its last holder), ``served``
(seconds from the kill until the survivors' own ``/status`` spans cover
every block), ``seen`` (until every survivor's view, counting live
survivors only, covers every block: what a client that asks them sees), and
the span changes of the survivors since the swarm first covered the model.
Polls every 50 ms; the kill time is taken right after ``kill -9`` returns.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fedswarm.llm_serving import served_gaps
from fedswarm.testing.localswarm import LocalSwarm, PeerProcess
from fedswarm.tasks.checkpoint import load_config, resolve_model


def view_gaps(p: PeerProcess, live: set[str], layers: int) -> list[int]:
    st = p.status()
    rows = [{"spans": [{**s, "state": "serving"} for s in r["spans"]]} for r in st["peers"] if r["peer"] in live]
    return served_gaps(rows, layers)


def until(pred: Any, timeout: float) -> float:
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            return float("nan")
        time.sleep(0.05)
    return time.monotonic() - t0


def one_run(model: str, n: int, layers: int, workdir: Path, timeout: float) -> dict[str, Any]:
    auto = ["--serve-model", model, "--blocks", "auto"]
    swarm = LocalSwarm(n, workdir)
    try:
        t0 = time.monotonic()
        swarm.peers.append(swarm.start_peer(0, extra=auto))
        for i in range(1, n):
            swarm.peers.append(swarm.start_peer(i, bootstrap=[swarm.bootstrap], extra=auto))
        alive = list(swarm.peers)
        until(lambda: not served_gaps([p.status() for p in alive], layers), timeout)
        out: dict[str, Any] = {"start_to_covered_s": round(time.monotonic() - t0, 2), "kills": []}
        base = {p.peer_id: p.status()["span_changes"] for p in alive}
        for pick in ("second started", "lone holder"):
            if pick == "lone holder":
                victim = next((p for p in alive if served_gaps([q.status() for q in alive if q is not p], layers)),
                              alive[0])
            else:
                victim = alive[1]
            alive = [p for p in alive if p is not victim]
            gap = bool(served_gaps([p.status() for p in alive], layers))
            victim.kill()
            t_kill = time.monotonic()
            live = {p.peer_id for p in alive}
            served = until(lambda: not served_gaps([p.status() for p in alive], layers), timeout)
            seen = until(lambda: all(not view_gaps(p, live, layers) for p in alive),
                         max(timeout - (time.monotonic() - t_kill), 0.1))
            seen = time.monotonic() - t_kill if seen == seen else float("nan")
            ch = [p.status()["span_changes"] - base[p.peer_id] for p in alive]
            out["kills"].append({"victim": pick, "gap": gap, "served_s": round(served, 2), "seen_s": round(seen, 2),
                                 "max_changes": max(ch), "changes": ch})
        return out
    finally:
        swarm.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-llama-gqa")
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--json")
    args = ap.parse_args()
    layers = load_config(resolve_model(args.model)).num_hidden_layers
    runs = []
    with tempfile.TemporaryDirectory() as td:
        for r in range(args.repeats):
            runs.append(one_run(args.model, args.peers, layers, Path(td) / f"run{r}", args.timeout))
            print(f"run {r}: {json.dumps(runs[-1])}", file=sys.stderr, flush=True)
    print(f"\n{args.peers} x peer start --serve-model {args.model} --blocks auto ({layers} blocks), "
          f"{args.repeats} runs, kill -9")
    print(f"{'kill':<16} {'gap':>5} {'served_s (median, max)':>24} {'seen_s (median, max)':>22} {'max span changes':>17}")
    for k, pick in enumerate(("second started", "lone holder")):
        rows = [run["kills"][k] for run in runs]
        sv = [x["served_s"] for x in rows]
        se = [x["seen_s"] for x in rows]
        gaps = sum(x["gap"] for x in rows)
        print(f"{pick:<16} {gaps:>2}/{len(rows):<2} {statistics.median(sv):>11.2f}, {max(sv):>10.2f} "
              f"{statistics.median(se):>10.2f}, {max(se):>9.2f} {max(x['max_changes'] for x in rows):>17}")
    print(f"start -> every block served: median {statistics.median(r['start_to_covered_s'] for r in runs):.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "peers": args.peers, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
