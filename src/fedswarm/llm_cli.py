"""``peer generate``, ``peer chat`` and ``peer api``: use an LLM whose decoder
blocks are served by swarm peers.

    peer generate --bootstrap MADDR --model NAME (--prompt TEXT | --prompt-ids IDS) [--chat]
        [--max-new-tokens N] [--greedy | --temperature T --top-k K --top-p P --seed S]
        [--stop STR]... [--json | --out FILE] [-q]
    peer chat --bootstrap MADDR --model NAME [--system TEXT] [sampling options]
    peer api --bootstrap MADDR --listen 127.0.0.1:8000 [--model NAME]...

The client loads only the embeddings, final norm and LM head of the model (a
name such as ``smollm2-135m-instruct`` or ``tiny-llama-gqa``, a checkpoint
directory or a ``.gguf`` file, see ``resolve_model``) plus its tokenizer; the
blocks run on peers started with ``peer start --serve-model M --blocks A:B``.

``peer generate`` prints the new text as the tokens arrive (flushed per
token) and the timings (connect, time to first token, tokens/s, route) on
stderr; ``--json`` prints one JSON object instead; ``--out`` also writes it
to a file. ``peer chat`` reads one user message per line from stdin (a pipe
works), applies the model's chat template and keeps one session's KV cache
across turns, so a turn prefills only the tokens the conversation gained.
``peer api`` is in :mod:`fedswarm.api`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from .errors import InputError

__all__ = ["add_generate", "parse_ids", "ClientModel", "load_client_model", "add_sampling_options",
           "sampling_from_args", "context_limit"]

# what one serving peer accepts per session by default (ServerLimits.max_session_length)
SERVER_SESSION_LIMIT = 2048


def add_generate(sub: argparse._SubParsersAction) -> None:
    """Register ``generate``, ``chat`` and ``api`` (one call from ``cli.main``)."""
    p = sub.add_parser(
        "generate", help="generate text with an LLM whose blocks are served by swarm peers",
        description="Generate text through the swarm's serving peers, printed as it arrives. Example: "
                    "peer generate --bootstrap MADDR --model smollm2-135m-instruct --chat "
                    "--prompt 'What is the capital of France?' --greedy")
    _add_common(p)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt", help="prompt text, tokenized with the model's tokenizer")
    g.add_argument("--prompt-ids", help="prompt token ids, comma or space separated")
    p.add_argument("--chat", action="store_true",
                   help="render --prompt as one user message with the model's chat template (what the API's "
                        "/v1/chat/completions does); default: off, the prompt is used as is")
    p.add_argument("--system", help="system message for --chat (default: none)")
    add_sampling_options(p)
    p.add_argument("--json", action="store_true", help="print one JSON object (text, token ids, timings, route) "
                   "on stdout instead of streaming the text (default: off)")
    p.add_argument("-q", "--quiet", action="store_true", help="no timings on stderr (default: off)")
    p.add_argument("--out", help="also write the JSON result to this file (default: none)")
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser(
        "chat", help="interactive multi-turn chat with a swarm-served LLM",
        description="Chat on stdin/stdout: one user message per line, the answer streams back. /reset starts "
                    "over, /quit or EOF (Ctrl-D) ends. The session's KV cache is kept across turns. Example: "
                    "peer chat --bootstrap MADDR --model smollm2-135m-instruct")
    _add_common(p)
    p.add_argument("--system", help="system message (default: none)")
    p.add_argument("--context", type=int, default=SERVER_SESSION_LIMIT,
                   help=f"positions the conversation may use, at most the model's context "
                        f"(default: {SERVER_SESSION_LIMIT})")
    add_sampling_options(p, default_max=256)
    p.add_argument("-q", "--quiet", action="store_true", help="no per-turn statistics on stderr (default: off)")
    p.set_defaults(func=_cmd_chat)

    from .api import add_api

    add_api(sub)


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bootstrap", action="append", required=True, help="multiaddr of a swarm peer (repeatable)")
    p.add_argument("--model", required=True,
                   help="model name (e.g. smollm2-135m-instruct, tiny-llama-gqa), checkpoint directory or .gguf "
                        "file; only the embeddings, final norm and LM head are loaded")
    p.add_argument("--key", help="client key file (default: a fresh key)")
    p.add_argument("--timeout", type=float, default=300.0, help="overall limit in seconds (default: 300)")
    p.add_argument("--request-timeout", type=float, default=10.0,
                   help="per-hop request limit in seconds (default: 10)")
    p.add_argument("--connect-timeout", type=float, default=15.0,
                   help="seconds to reach the swarm and find a chain of peers (default: 15)")
    p.add_argument("--torch-threads", type=int, help="torch intra-op threads of the client (default: torch's)")
    add_tenant_options(p)
    add_forward_option(p)


def tenant_name(text: str) -> str:
    from .core.spans import tenant_problem  # torch-free: a mistake fails before the heavy imports

    problem = tenant_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def tenant_weight(text: str) -> float:
    from .core.spans import weight_problem

    try:
        w = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    problem = weight_problem(w)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return w


def add_tenant_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tenant", type=tenant_name,
                   help="tenant the sessions are served for: when a serving peer's forwards are full, the tenants "
                        "with the least usage over weight go first (default: this client's peer id)")
    p.add_argument("--weight", type=tenant_weight, help="the tenant's weight, in (0, 1000] (default: 1)")


def add_forward_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-forward", action="store_true",
                   help="drive every hop from this client instead of letting the serving peers pass a decode step "
                        "straight to the next one (server-to-server forwarding, on by default)")


def add_sampling_options(p: argparse.ArgumentParser, *, default_max: int = 64) -> None:
    p.add_argument("--max-new-tokens", "--max-tokens", dest="max_new_tokens", type=int, default=default_max,
                   help=f"most tokens to generate (default: {default_max})")
    p.add_argument("--greedy", action="store_true", help="greedy decoding, same as --temperature 0 (default: off)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature, 0 = greedy (default: 1)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens, 0 = all (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default: 1)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="penalty > 0 on tokens already seen, 1 = off (default: 1)")
    p.add_argument("--seed", type=int, help="sampling seed; same seed and route give the same text "
                   "(default: random, printed)")
    p.add_argument("--stop", action="append", default=[], help="stop string, not printed (repeatable; default: none)")
    p.add_argument("--ignore-eos", action="store_true", help="keep going after the end-of-sequence token "
                   "(default: stop there)")
    p.add_argument("--stop-at-eos", action="store_true", help=argparse.SUPPRESS)  # the default now; kept for scripts


def sampling_from_args(a: argparse.Namespace) -> Any:
    from .tasks.sampling import SamplingParams

    return SamplingParams(max_new_tokens=a.max_new_tokens, temperature=a.temperature, greedy=a.greedy,
                          top_k=a.top_k, top_p=a.top_p, repetition_penalty=a.repetition_penalty, seed=a.seed,
                          stop=tuple(a.stop), stop_at_eos=not a.ignore_eos)


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise InputError(f"--prompt-ids must be integers, got {text!r}") from None
    if not ids:
        raise InputError("--prompt-ids is empty")
    return ids


# ----------------------------------------------------------------- the client's part of a model

@dataclass
class ClientModel:
    """What a client holds of a model: head, hash, tokenizer."""

    name: str
    path: Path
    head: Any
    hash: str
    tokenizer: Any

    @property
    def config(self) -> Any:
        return self.head.config

    def render_chat(self, messages: list[dict[str, str]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True)


def resolve(ref: str) -> Path:
    """A model name, directory or .gguf file -> its path (InputError if unknown)."""
    from .tasks.checkpoint import resolve_model

    try:
        return Path(resolve_model(ref, allow_paths=True))
    except InputError:
        raise
    except (OSError, ValueError) as exc:
        raise InputError(str(exc)) from None


def load_client_model(ref: str, *, cache: bool = True) -> ClientModel:
    """The client's part of model ``ref``: LM head, hash and tokenizer.

    For a GGUF file this is kept in a per-user cache (see :func:`head_cache_dir`):
    opening a GGUF file with ``gguf.GGUFReader`` parses every metadata field,
    the 49,152-token vocabulary and its merges included (about 4 s for
    SmolLM2 here, before any token could be generated). The cache holds the
    head's tensors (safetensors), the parsed config, the model hash and the
    tokenizer (``tokenizer.json``), keyed by the file's path, size, mtime and
    inode, so it is rebuilt whenever the file changes.
    """
    from .tasks.checkpoint import load_client_head, model_hash
    from .tasks.tokenizer import load_tokenizer

    path = resolve(ref)
    if cache and path.suffix == ".gguf":
        hit = _cache_load(path)
        if hit is not None:
            return ClientModel(ref, path, *hit)
    try:
        head = load_client_head(path)
        mhash = model_hash(path)
        tok = load_tokenizer(path)
    except InputError:
        raise
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot load model {ref!r}: {exc}") from None
    if cache and path.suffix == ".gguf":
        _cache_store(path, head, mhash, tok)
    return ClientModel(ref, path, head, mhash, tok)


HEAD_CACHE_VERSION = 1


def head_cache_dir() -> Path:
    """``$FEDSWARM_CACHE_DIR`` or the platform's user cache dir, + ``client-heads``."""
    import os

    root = os.environ.get("FEDSWARM_CACHE_DIR")
    if not root:
        import platformdirs

        root = platformdirs.user_cache_dir("fedswarm")
    return Path(root) / "client-heads"


def _cache_key(path: Path) -> Path:
    import hashlib

    p = path.resolve()
    st = p.stat()
    key = f"v{HEAD_CACHE_VERSION}\0{p}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}"
    return head_cache_dir() / hashlib.sha256(key.encode()).hexdigest()[:32]


def _cache_load(path: Path) -> tuple[Any, str, Any] | None:
    import torch
    from safetensors.torch import load_file

    from .tasks.llama import LlamaClientHead, LlamaConfig
    from .tasks.tokenizer import HFTokenizer

    try:
        d = _cache_key(path)
        meta = json.loads((d / "meta.json").read_text())
        if meta.get("version") != HEAD_CACHE_VERSION:
            return None
        cfg = LlamaConfig(**meta["config"])
        tensors = load_file(str(d / "head.safetensors"))
        with torch.device("meta"):
            head = LlamaClientHead(cfg)
        head.load_state_dict(tensors, strict=True, assign=True)
        t = meta["tokenizer"]
        from tokenizers import Tokenizer

        tok = HFTokenizer(Tokenizer.from_str((d / "tokenizer.json").read_text()), name=t["name"],
                          chat_template=t["chat_template"], bos_token=t["bos_token"], eos_token=t["eos_token"],
                          extra_special=t["extra_special"], eos_ids=t["eos_ids"], add_bos=t["add_bos"])
        return head.eval(), str(meta["hash"]), tok
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, Exception):  # noqa: BLE001 - a bad cache is rebuilt
        return None


def _cache_store(path: Path, head: Any, mhash: str, tok: Any) -> None:
    import dataclasses
    import os
    import shutil
    import tempfile

    from safetensors.torch import save_file

    from .tasks.tokenizer import HFTokenizer

    if not isinstance(tok, HFTokenizer):
        return
    try:
        d = _cache_key(path)
        d.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=d.parent))
        try:
            save_file({k: v.contiguous() for k, v in head.state_dict().items()}, str(tmp / "head.safetensors"))
            (tmp / "tokenizer.json").write_text(tok.backend.to_str())
            special = {k: v for k, v in tok._special.items() if k not in ("bos_token", "eos_token")}
            meta = {"version": HEAD_CACHE_VERSION, "source": str(path.resolve()), "hash": mhash,
                    "config": dataclasses.asdict(head.config),
                    "tokenizer": {"name": tok.name, "chat_template": tok.chat_template, "bos_token": tok.bos_token,
                                  "eos_token": tok.eos_token, "extra_special": special,
                                  "eos_ids": sorted(tok.eos_ids), "add_bos": bool(tok._add_bos)}}
            (tmp / "meta.json").write_text(json.dumps(meta))
            if d.exists():
                shutil.rmtree(d, ignore_errors=True)
            os.replace(tmp, d)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError:
        pass  # no cache: the next start parses the file again


def context_limit(model: ClientModel, want: int | None = None) -> int:
    """Positions a session may use: the model's context, what a serving peer
    holds per session by default, and ``want``."""
    n = min(model.config.max_position_embeddings, SERVER_SESSION_LIMIT)
    return min(n, want) if want else n


def _set_threads(a: argparse.Namespace) -> None:
    if a.torch_threads:
        import torch

        torch.set_num_threads(a.torch_threads)
    try:
        from .net.quiet import quiet_libraries
    except ImportError:
        return
    quiet_libraries()


def _import_runtime() -> None:
    import torch  # noqa: F401

    from . import client, llm_client  # noqa: F401
    from .net import libp2p  # noqa: F401
    from .tasks import checkpoint, tokenizer  # noqa: F401


def _route_text(route: list[dict[str, Any]]) -> str:
    return " -> ".join(f"{h['peer'][-8:]}[{h['blocks'][0]}:{h['blocks'][1]}]" for h in route)


def open_llm(a: argparse.Namespace, model: ClientModel) -> Any:
    """``async with open_llm(a, model) as (llm, connect_s)``: a swarm client with
    a chain for ``model``."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def cm() -> Any:
        from .client import open_swarm_client
        from .core.identity import Identity, load_or_create_key
        from .llm_client import SwarmLLM

        identity = load_or_create_key(a.key) if a.key else Identity.generate()
        t0 = time.perf_counter()
        async with open_swarm_client(a.bootstrap, identity=identity, connect_timeout=a.connect_timeout) as client:
            llm = SwarmLLM(client.agent.transport, lambda: client.core.view.live(client.agent.now()), model.head,
                           model.hash, request_timeout=a.request_timeout, route_timeout=a.connect_timeout,
                           tenant=a.tenant, weight=a.weight, identity=identity,
                           forward=not getattr(a, "no_forward", False))
            await llm.warm_up()
            yield llm, time.perf_counter() - t0

    return cm()


# ----------------------------------------------------------------- peer generate

def _cmd_generate(a: argparse.Namespace) -> int:
    params = sampling_from_args(a)  # a bad option fails before torch and libp2p load
    _set_threads(a)
    _import_runtime()  # imports first: load_s and connect_s time the work, not the imports
    t_load = time.perf_counter()
    model = load_client_model(a.model)
    load_s = time.perf_counter() - t_load
    if a.prompt is not None:
        if a.chat:
            msgs = ([{"role": "system", "content": a.system}] if a.system else []) + [
                {"role": "user", "content": a.prompt}]
            prompt = model.render_chat(msgs)
        else:
            prompt = model.encode(a.prompt)
    else:
        if a.chat:
            raise InputError("--chat needs --prompt")
        prompt = parse_ids(a.prompt_ids)
    vocab = model.config.vocab_size
    if any(not 0 <= i < vocab for i in prompt):
        raise InputError(f"prompt ids must be in [0, {vocab})")
    ctx = context_limit(model)
    if not prompt:
        raise InputError("the prompt is empty")
    if len(prompt) + params.max_new_tokens > ctx:
        raise InputError(f"prompt of {len(prompt)} tokens + {params.max_new_tokens} new tokens exceeds the "
                         f"context of {ctx} tokens", "shorten the prompt or lower --max-new-tokens")
    stream = not a.json

    def on_text(piece: str) -> None:
        if stream:
            sys.stdout.write(piece)
            sys.stdout.flush()

    async def run() -> tuple[Any, float]:
        with trio.fail_after(a.timeout):
            async with open_llm(a, model) as (llm, connect_s):
                res = await llm.generate(prompt, params=params, tokenizer=model.tokenizer, on_text=on_text)
                return res, connect_s

    try:
        res, connect_s = trio.run(run)
    except trio.TooSlowError:
        from .errors import FederationError

        raise FederationError(f"generation did not finish within --timeout {a.timeout}s") from None
    if stream:
        sys.stdout.write("\n")
        sys.stdout.flush()
    out = {
        "text": res.text,
        "token_ids": res.token_ids,
        "prompt_ids": prompt,
        "finish_reason": res.finish_reason,
        "seed": res.seed,
        "model": a.model,
        "model_hash": model.hash,
        "load_s": round(load_s, 4),
        "connect_s": round(connect_s, 4),
        "ttft_s": round(res.ttft_s, 4),
        "tokens_per_s": round(res.decode_tokens_per_s, 2),
        "total_s": round(res.total_s, 4),
        "route": res.route,
        "recoveries": [{k: v for k, v in r.items() if k != "t"} for r in res.recoveries],
    }
    if a.json:
        print(json.dumps(out))
    if not a.quiet:
        print(f"model {load_s:.3f}s, connect {connect_s:.3f}s, time to first token {res.ttft_s:.3f}s, "
              f"{res.decode_tokens_per_s:.1f} tokens/s ({len(res.token_ids)} tokens in {res.total_s:.3f}s, "
              f"{res.finish_reason}, seed {res.seed}) via {_route_text(res.route)}"
              + (f", {len(res.recoveries)} recoveries" if res.recoveries else ""), file=sys.stderr)
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


# ----------------------------------------------------------------- peer chat

def _cmd_chat(a: argparse.Namespace) -> int:
    params = sampling_from_args(a)
    _set_threads(a)
    model = load_client_model(a.model)
    ctx = context_limit(model, a.context)
    if ctx < 2:
        raise InputError(f"--context {a.context} is too small")
    interactive = sys.stdin.isatty()
    trio.run(_chat, a, model, params, ctx, interactive)
    return 0


async def _chat(a: argparse.Namespace, model: ClientModel, params: Any, ctx: int, interactive: bool) -> None:
    def say(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    def note(text: str) -> None:
        if not a.quiet:
            print(text, file=sys.stderr, flush=True)

    async with open_llm(a, model) as (llm, connect_s):
        note(f"[connected in {connect_s:.2f}s; {model.name}; /reset starts over, /quit or Ctrl-D ends]")
        system = [{"role": "system", "content": a.system}] if a.system else []
        messages = list(system)
        sess = await llm.session(ctx).__aenter__()
        turn = 0
        try:
            while True:
                if interactive:
                    say("> ")
                line = await trio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True)
                if not line:
                    break
                text = line.rstrip("\r\n")
                if not text.strip():
                    continue
                if text.strip() in ("/quit", "/exit"):
                    break
                if text.strip() == "/reset":
                    await sess.close()
                    sess = await llm.session(ctx).__aenter__()
                    messages = list(system)
                    note("[conversation reset]")
                    continue
                turn += 1
                trial = messages + [{"role": "user", "content": text}]
                ids = model.render_chat(trial)
                room = ctx - len(ids)
                if room < 1:
                    note(f"[error: the conversation needs {len(ids)} of {ctx} positions; /reset to start over]")
                    continue
                p = params.with_(max_new_tokens=min(params.max_new_tokens, room),
                                 seed=None if params.seed is None else params.seed + turn - 1)
                res = await llm.generate(ids, params=p, tokenizer=model.tokenizer, on_text=say, session=sess)
                say("\n")
                messages = trial + [{"role": "assistant", "content": res.text or ""}]
                note(f"[turn {turn}: prefilled {res.prefill_tokens} new tokens, reused {res.reused_tokens}; "
                     f"{len(res.token_ids)} tokens, ttft {res.ttft_s:.3f}s, {res.decode_tokens_per_s:.1f} tokens/s, "
                     f"{res.finish_reason}; session {sess.length}/{ctx} positions]")
        finally:
            await sess.close()
