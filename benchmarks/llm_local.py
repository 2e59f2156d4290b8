#!/usr/bin/env python3
"""Local LLM decode benchmark: tokens/s of batched greedy decoding on a shipped
tiny model (or an operator model by name), single process, no network.

    .venv/bin/python benchmarks/llm_local.py [--model tiny-llama-gqa] [--batch 8]
        [--new 64] [--device cpu|cuda] [--dtype float32|bfloat16|float16] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch

from fedswarm.tasks.checkpoint import load_block_span, load_client_head, model_hash, resolve_model
from fedswarm.tasks.llama import generate
from fedswarm.tasks.tokenizer import ByteTokenizer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-llama-gqa")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    d = resolve_model(a.model)
    head = load_client_head(d, device=a.device, dtype=a.dtype)
    cfg = head.config
    span = load_block_span(d, 0, cfg.num_hidden_layers, device=a.device, dtype=a.dtype)
    tok = ByteTokenizer()
    prompts = [tok.encode(f"prompt number {i}: " + "x" * (i % 7)) for i in range(a.batch)]
    generate(head, [span], prompts[:1], 2)  # warm-up
    if a.device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = generate(head, [span], prompts, a.new)
    if a.device.startswith("cuda"):
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    n = sum(len(o) for o in outs)
    print(f"model {a.model} ({model_hash(d)[:12]}), {cfg.param_count()} params, {a.device}/{a.dtype}")
    print(f"batch {a.batch} x {a.new} new tokens: {n} tokens in {dt:.3f}s = {n / dt:.1f} tok/s")


if __name__ == "__main__":
    main()
