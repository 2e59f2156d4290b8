"""``peer generate``: generate text through the swarm's LLM block servers.

    peer generate --bootstrap MADDR --model DIR (--prompt TEXT | --prompt-ids IDS)
        --max-new-tokens N [--greedy] [--temperature T] [--seed S] [--out FILE]

The client loads only the embeddings, final norm and LM head from DIR (a
checkpoint directory, or the name of a shipped model); the decoder blocks run
on peers started with ``peer start --serve-model DIR --blocks A:B``. The new
tokens go to stdout (text for byte-tokenizer models, else ids); timings to
stderr; ``--out`` writes JSON with ``token_ids`` and ``text``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import trio

__all__ = ["add_generate", "parse_ids"]


def add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate with an LLM whose blocks are served by swarm peers")
    p.add_argument("--bootstrap", action="append", required=True, help="multiaddr of a swarm peer (repeatable)")
    p.add_argument("--model", required=True, help="checkpoint directory (or shipped model name); only the "
                   "embeddings and the LM head are loaded")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt", help="prompt text (byte-tokenizer models)")
    g.add_argument("--prompt-ids", help="prompt token ids, comma or space separated")
    p.add_argument("--max-new-tokens", type=int, required=True)
    p.add_argument("--greedy", action="store_true", help="greedy decoding (default: sampling)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, help="sampling seed")
    p.add_argument("--stop-at-eos", action="store_true", help="stop after the model's eos token")
    p.add_argument("--out", help="write {token_ids, text, ...} as JSON here")
    p.add_argument("--key", help="client key file (default: a fresh key)")
    p.add_argument("--timeout", type=float, default=300.0, help="overall limit in seconds")
    p.add_argument("--request-timeout", type=float, default=10.0, help="per-hop request limit in seconds")
    p.add_argument("--connect-timeout", type=float, default=15.0)
    p.add_argument("--torch-threads", type=int, help="torch intra-op threads of the client")
    p.set_defaults(func=_cmd_generate)


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise ValueError(f"--prompt-ids must be integers, got {text!r}") from None
    if not ids:
        raise ValueError("--prompt-ids is empty")
    return ids


def _cmd_generate(a: argparse.Namespace) -> int:
    from .tasks.checkpoint import load_client_head, model_hash, resolve_model
    from .tasks.tokenizer import ByteTokenizer

    if a.torch_threads:
        import torch

        torch.set_num_threads(a.torch_threads)
    d = Path(a.model)
    try:
        if not (d / "config.json").is_file():
            d = resolve_model(a.model)
        head = load_client_head(d)
        mhash = model_hash(d)
        cfg = head.config
        if a.prompt is not None:
            if cfg.tokenizer != "bytes":
                raise ValueError("--prompt needs a byte-tokenizer model; use --prompt-ids")
            prompt = ByteTokenizer().encode(a.prompt)
        else:
            prompt = parse_ids(a.prompt_ids)
        if any(not 0 <= i < cfg.vocab_size for i in prompt):
            raise ValueError(f"prompt ids must be in [0, {cfg.vocab_size})")
        if a.max_new_tokens < 1 or len(prompt) + a.max_new_tokens > cfg.max_position_embeddings:
            raise ValueError(f"need 1 <= max-new-tokens and prompt + new <= {cfg.max_position_embeddings}")
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    eos = cfg.extra.get("eos_token_id") if a.stop_at_eos else None
    try:
        res, connect_s = trio.run(_generate, a, head, mhash, prompt, eos)
    except trio.TooSlowError:
        print(f"timeout after {a.timeout}s", file=sys.stderr)
        return 2
    except Exception as exc:  # FederationError and friends: one line, no traceback
        print(f"generation failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    text = ByteTokenizer().decode(res.token_ids) if cfg.tokenizer == "bytes" else None
    print(text if text is not None else " ".join(map(str, res.token_ids)))
    hops = " -> ".join(f"{h['peer'][-8:]}[{h['blocks'][0]}:{h['blocks'][1]}]" for h in res.route)
    print(f"connect {connect_s:.3f}s, time to first token {res.ttft_s:.3f}s, "
          f"{res.decode_tokens_per_s:.1f} tokens/s ({len(res.token_ids)} tokens in {res.total_s:.3f}s) "
          f"via {hops}" + (f", {len(res.recoveries)} recoveries" if res.recoveries else ""), file=sys.stderr)
    if a.out:
        out = {
            "token_ids": res.token_ids,
            "text": text,
            "prompt_ids": prompt,
            "model_hash": mhash,
            "connect_s": round(connect_s, 4),
            "ttft_s": round(res.ttft_s, 4),
            "tokens_per_s": round(res.decode_tokens_per_s, 2),
            "total_s": round(res.total_s, 4),
            "route": res.route,
            "recoveries": [{k: v for k, v in r.items() if k != "t"} for r in res.recoveries],
        }
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


async def _generate(a: argparse.Namespace, head: Any, mhash: str, prompt: list[int], eos: int | None) -> Any:
    from .client import open_swarm_client
    from .core.identity import Identity, load_or_create_key
    from .llm_client import SwarmLLM

    from .net import libp2p as _libp2p  # noqa: F401 - import cost is not connect time

    identity = load_or_create_key(a.key) if a.key else Identity.generate()
    with trio.fail_after(a.timeout):
        t0 = time.perf_counter()
        async with open_swarm_client(a.bootstrap, identity=identity, connect_timeout=a.connect_timeout) as client:
            llm = SwarmLLM(client.agent.transport, lambda: client.core.view.live(client.agent.now()), head, mhash,
                           request_timeout=a.request_timeout, route_timeout=a.connect_timeout)
            await llm.wait_route()
            connect_s = time.perf_counter() - t0
            res = await llm.generate(prompt, a.max_new_tokens, greedy=a.greedy, temperature=a.temperature,
                                     seed=a.seed, eos_id=eos)
            return res, connect_s
