#!/usr/bin/env python3
"""Attention without copies of the KV cache, side by side with the copies it
replaced: grouped-query heads read in place, and each row of a batch of
decode steps on its own cache.

    .venv/bin/python benchmarks/llm_attention_gqa.py [--model smollm2-135m-instruct] [--threads 1]

SmolLM2-135M has 9 query heads and 3 key/value heads. ``LlamaAttention``
repeated each key/value head 3 times (``repeat_interleave``) before
``scaled_dot_product_attention``: a copy of the layer's whole cache, every
layer, every step. It now passes ``enable_gqa=True``. This script runs both
ways in turns:

1. one layer's attention for a one-token step at several cache lengths
   (the model's head counts, float32), checking that both give the same bits;
2. the whole model (one sequence, greedy): the median ms of a decode step
   after prompts of several lengths, with the old way put back
   by a wrapper around ``scaled_dot_product_attention`` that repeats the heads
   and drops ``enable_gqa``; the tokens must match;
3. one layer's attention for a batch of decode steps of sessions at
   different lengths (a serving peer's batched forward): every cache copied
   into one padded tensor with a mask, one call (before), against one call
   per row on its own cache (``_StepKV.rows``, now). These agree to float
   rounding, not bit for bit (the padded call runs another kernel).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import fedswarm.tasks.llama as llama
from fedswarm.errors import InputError
from fedswarm.tasks.checkpoint import load_block_span, load_client_head, resolve_model

_sdpa = F.scaled_dot_product_attention


def _repeating(q, k, v, *args, enable_gqa=False, **kw):  # type: ignore[no-untyped-def]
    """The attention before: key/value heads repeated, then plain SDPA."""
    if enable_gqa:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return _sdpa(q, k, v, *args, **kw)


def _timed(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def attention_alone(heads: int, kv_heads: int, dim: int, lengths: list[int]) -> None:
    print(f"one layer's attention, one-token step, {heads} query heads / {kv_heads} key-value heads of {dim}, "
          "median of 5 runs of 50 calls\n")
    print("| cached positions | repeated heads, us | in place (enable_gqa), us | ratio | same bits |")
    print("|---|---|---|---|---|")
    for n in lengths:
        q = torch.randn(1, heads, 1, dim)
        k, v = torch.randn(1, kv_heads, n, dim), torch.randn(1, kv_heads, n, dim)
        same = torch.equal(_repeating(q, k, v, scale=dim**-0.5, enable_gqa=True),
                           _sdpa(q, k, v, scale=dim**-0.5, enable_gqa=True))
        old, new = [], []
        for _ in range(5):
            old.append(_timed(lambda: _repeating(q, k, v, scale=dim**-0.5, enable_gqa=True), 50))
            new.append(_timed(lambda: _sdpa(q, k, v, scale=dim**-0.5, enable_gqa=True), 50))
        o, w = statistics.median(old) * 1e6, statistics.median(new) * 1e6
        print(f"| {n:,} | {o:,.1f} | {w:,.1f} | {o / w:.1f}x | {'yes' if same else 'NO'} |", flush=True)


def _step(head, span, cache, tok: int, sdpa) -> tuple[float, int]:  # type: ignore[no-untyped-def]
    """One greedy decode step (embed, every block, LM head) with ``sdpa``."""
    llama.F.scaled_dot_product_attention = sdpa  # type: ignore[attr-defined]
    try:
        t0 = time.perf_counter()
        h = span(head.embed(torch.tensor([[tok]], dtype=torch.long)), [cache])
        nxt = int(head.logits(h[:, -1]).argmax(-1))
        return time.perf_counter() - t0, nxt
    finally:
        llama.F.scaled_dot_product_attention = _sdpa  # type: ignore[attr-defined]


def whole_model(model: str, prompts: list[int], new: int) -> None:
    d = resolve_model(model)
    head = load_client_head(d)
    cfg = head.config
    span = load_block_span(d, 0, cfg.num_hidden_layers)
    print(f"\n{model}: whole-model greedy decode, one sequence, median ms of a decode step over "
          f"{new} steps after the prompt's prefill, the two ways in turns, step by step\n")
    print("| prompt positions | repeated heads, ms a token | in place, ms a token | ratio | same tokens |")
    print("|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for p in prompts:
        prompt = torch.randint(0, cfg.vocab_size, (p,), generator=g).tolist()
        with torch.inference_mode():
            caches, toks = [], []
            for sdpa in (_repeating, _sdpa):  # each way prefills its own cache
                llama.F.scaled_dot_product_attention = sdpa  # type: ignore[attr-defined]
                try:
                    c = span.new_cache(p + new + 1)
                    h = span(head.embed(torch.tensor([prompt], dtype=torch.long)), c)
                finally:
                    llama.F.scaled_dot_product_attention = _sdpa  # type: ignore[attr-defined]
                caches.append(c)
                toks.append([int(head.logits(h[:, -1]).argmax(-1))])
            times: list[list[float]] = [[], []]
            for _ in range(new):
                for i, sdpa in enumerate((_repeating, _sdpa)):
                    dt, nxt = _step(head, span, caches[i], toks[i][-1], sdpa)
                    times[i].append(dt)
                    toks[i].append(nxt)
        o, w = statistics.median(times[0]) * 1e3, statistics.median(times[1]) * 1e3
        print(f"| {p:,} | {o:.1f} | {w:.1f} | {o / w:.2f}x | {'yes' if toks[0] == toks[1] else 'NO'} |", flush=True)


def batched_rows(heads: int, kv_heads: int, dim: int, batches: list[tuple[int, int]]) -> None:
    print(f"\none layer's attention for a batch of decode steps, {heads}/{kv_heads} heads of {dim}; "
          "row i of B has L - i positions; median of 5 runs of 20 calls\n")
    print("| B | L | padded copy and mask, us | each row in place, us | ratio | largest difference |")
    print("|---|---|---|---|---|---|")
    scale = dim**-0.5
    for bsz, n in batches:
        lens = [n - i for i in range(bsz)]
        q = torch.randn(bsz, heads, 1, dim)
        ks = [torch.randn(1, kv_heads, m, dim) for m in lens]
        vs = [torch.randn(1, kv_heads, m, dim) for m in lens]

        def padded() -> torch.Tensor:
            total = max(lens)
            keys, values = q.new_zeros(bsz, kv_heads, total, dim), q.new_zeros(bsz, kv_heads, total, dim)
            for b, m in enumerate(lens):
                keys[b, :, :m] = ks[b][0]
                values[b, :, :m] = vs[b][0]
            mask = (torch.arange(total)[None, :] < torch.tensor(lens)[:, None])[:, None, None, :]
            return _sdpa(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)

        def rows() -> torch.Tensor:
            return torch.cat([_sdpa(q[b : b + 1], ks[b], vs[b], scale=scale, enable_gqa=True) for b in range(bsz)])

        diff = float((padded() - rows()).abs().max())
        old, new = [], []
        for _ in range(5):
            old.append(_timed(padded, 20))
            new.append(_timed(rows, 20))
        o, w = statistics.median(old) * 1e6, statistics.median(new) * 1e6
        print(f"| {bsz} | {n:,} | {o:,.1f} | {w:,.1f} | {o / w:.1f}x | {diff:.1e} |", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 512, 2048, 8192])
    ap.add_argument("--prompts", type=int, nargs="+", default=[16, 512, 2048])
    ap.add_argument("--new", type=int, default=32)
    a = ap.parse_args()
    if a.threads < 1 or a.new < 1 or min(a.lengths) < 1 or min(a.prompts) < 1:
        ap.error("--threads, --new, --lengths and --prompts must be at least 1")
    torch.set_num_threads(a.threads)
    try:
        cfg = load_client_head(resolve_model(a.model)).config
    except InputError as exc:
        print(f"llm_attention_gqa: {exc}", file=sys.stderr)
        return 2
    attention_alone(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, a.lengths)
    batched_rows(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                 [(4, 64), (4, 512), (4, 2048), (8, 512)])
    whole_model(a.model, a.prompts, a.new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
