#!/usr/bin/env python3
"""What the client's per-boundary history costs a decode step, by context length.

    .venv/bin/python benchmarks/llm_client_history.py [--width 576] [--boundaries 3] [--steps 200]

A generation through a chain keeps, at every block boundary of the chain, the
hidden states that entered it at every position so far: what a replacement
peer needs replayed if a hop fails (``fedswarm.llm_client``). Each decode
step adds a row to each boundary: 3 boundaries through 2 peers. This times
one step's bookkeeping two ways, in turns, at several context lengths:

* ``cat``: the history rebuilt with ``torch.cat`` (the client before
  ``llm_client._Inputs``), a copy of every row so far;
* ``buffer``: ``_Inputs.write`` and ``keep``, a buffer that doubles as it
  fills.

Width 576 is SmolLM2-135M's hidden size. Prints microseconds per step (all
boundaries), medians of ``--repeats`` runs of ``--steps`` steps, and the
ratio. One thread, as the client runs its tensor work.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fedswarm.llm_client import _Inputs


def per_step_cat(hist: list[torch.Tensor], row: torch.Tensor, steps: int) -> float:
    n = len(hist[0])
    t0 = time.perf_counter()
    for i in range(steps):
        for b in range(len(hist)):
            hist[b] = torch.cat([hist[b][: n + i], row])
    return (time.perf_counter() - t0) / steps


def per_step_buffer(hist: list[_Inputs], row: torch.Tensor, steps: int) -> float:
    n = len(hist[0])
    t0 = time.perf_counter()
    for i in range(steps):
        for h in hist:
            h.write(n + i, row)
            h.keep(n + i + 1)
    return (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int, default=576)
    ap.add_argument("--boundaries", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 512, 2048, 4096, 8192])
    a = ap.parse_args()
    if min(a.width, a.boundaries, a.steps, a.repeats, *a.lengths) < 1:
        ap.error("--width, --boundaries, --steps, --repeats and --lengths must be at least 1")
    torch.set_num_threads(1)
    row = torch.randn(1, a.width)
    print(f"width {a.width}, {a.boundaries} boundaries, {a.steps} steps a run, median of {a.repeats} runs\n")
    print("| positions so far | cat, us a step | buffer, us a step | cat / buffer |")
    print("|---|---|---|---|")
    for n in a.lengths:
        cat_s, buf_s = [], []
        for _ in range(a.repeats):
            start = torch.randn(n, a.width)
            cat_s.append(per_step_cat([start.clone() for _ in range(a.boundaries)], row, a.steps))
            hist = []
            for _ in range(a.boundaries):
                h = _Inputs()
                h.write(0, start)
                h.keep(n)
                hist.append(h)
            buf_s.append(per_step_buffer(hist, row, a.steps))
        c, b = statistics.median(cat_s) * 1e6, statistics.median(buf_s) * 1e6
        print(f"| {n:,} | {c:,.1f} | {b:,.1f} | {c / b:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
