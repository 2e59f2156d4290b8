#!/usr/bin/env python3
"""LLM pipeline benchmark: generation through 1, 2 and 3 serving peers (real
``peer start`` processes on loopback via LocalSwarm, ``--torch-threads 1``)
next to the same model in one local process, in one run.

    .venv/bin/python benchmarks/llm_pipeline.py [--model random58m|smollm2-135m-instruct|tiny-llama|DIR|FILE.gguf]
        [--prompt-len 16] [--new 32] [--concurrent 8] [--repeats 3] [--no-recovery] [--json OUT]

``random58m`` (default) builds the issue's reference model on the fly --
hidden 512, 8 layers, 8 heads, FFN 1376, vocab 32000, random weights --
saved with ``checkpoint.save_checkpoint`` into a temp dir. Greedy decoding.
A model with a real tokenizer (``smollm2-135m-instruct``) gets a chat-rendered
question as its prompt; the others ``--prompt-len`` random byte ids.

Reported: time to first token (TTFT) and decode tokens/s per setup with the
ratio to local, added latency per hop ((per-token time through the chain -
the local per-token time) / hops) with server-to-server forwarding and with
the client driving every hop (``--no-forward`` runs; the two alternate in
the same swarm, so their ratio is measured side by side), connect time (client start -> a
chain is known), serving peers' RSS/PSS, aggregate tokens/s of N concurrent
sessions through the 2-peer chain, and the recovery time when the chain's
second peer is killed mid-generation (3 peers, two of them serving the same
blocks). Every swarm run checks its tokens against the local run.

``--lanes 2,3`` adds a side-by-side table: the same chain twice at once
(direct lanes and py-libp2p, or this tree's peers and ``--baseline-tree
DIR``'s, both driven by this tree's client),
with a local generation in this process taking its turn in every round.
Its added latency per hop is the median over rounds of (the setup's step
time - the same round's local step time) / hops, so the machine's speed
drifting between the local run at the start and the swarms' minutes later
(1-2 ms per token here) does not enter it. ``--floor`` adds a fifth setup to
those rounds: the same split over processes with nothing between them
(``hop_floor.RawChain``: blocking raw TCP, no checks), the part of a hop's
cost that belongs to this machine rather than to fedswarm's code.

With ``--concurrent N`` (default 8) a ``peer api`` process is started in
front of the longest chain and N streams (the ``openai`` client, one thread
each, greedy, ``ignore_eos`` so each yields ``--new`` tokens) run at once;
their aggregate tokens/s is shown next to one stream alone. The start-up
costs are measured in fresh processes: ``python -c 'import torch, libp2p,
trio'``, building the client's head (from the head cache and without it),
and ``peer generate``'s model load + connect + time to first token.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import trio

import fedswarm.net.libp2p  # noqa: F401 - imported up front: import time is not connect time
from fedswarm.testing.localswarm import LocalSwarm
from fedswarm.tasks.checkpoint import load_block_span, load_client_head, load_config, model_hash, resolve_model, save_checkpoint
from fedswarm.tasks.llama import LlamaConfig, random_state_dict

REF_CONFIG = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu",
    "hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 8, "num_attention_heads": 8,
    "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 32000, "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float32",
    "fedswarm_tokenizer": "bytes", "bos_token_id": 256, "eos_token_id": 257,
}


def build_model(name: str, tmp: Path) -> Path:
    if name == "random58m":
        d = tmp / "random58m"
        cfg = LlamaConfig.from_hf_dict(REF_CONFIG)
        save_checkpoint(d, REF_CONFIG, random_state_dict(cfg, seed=0, std=0.02))
        return d
    p = Path(name)
    return p if (p / "config.json").is_file() else resolve_model(name)


def splits(layers: int, n: int) -> list[str]:
    cuts = [round(i * layers / n) for i in range(n + 1)]
    return [f"{a}:{b}" for a, b in zip(cuts, cuts[1:])]


# ----------------------------------------------------------------- local

def local_model(d: Path) -> tuple[Any, Any]:
    """The whole model in this process: (client head, span of every block)."""
    head = load_client_head(d)
    return head, load_block_span(d, 0, head.config.num_hidden_layers)


def local_generate(model: tuple[Any, Any], prompt: list[int], n_new: int) -> tuple[float, float, list[int]]:
    """One greedy generation in this process: (TTFT s, decode tok/s, tokens)."""
    head, span = model
    cache = span.new_cache(len(prompt) + n_new)
    t0 = time.perf_counter()
    h = span(head.embed(torch.tensor([prompt])), cache)
    tok = int(head.logits(h[:, -1:])[0, -1].argmax())
    ttft = time.perf_counter() - t0
    toks, steps = [tok], []
    for _ in range(n_new - 1):
        ts = time.perf_counter()
        h = span(head.embed(torch.tensor([[tok]])), cache)
        tok = int(head.logits(h)[0, -1].argmax())
        steps.append(time.perf_counter() - ts)
        toks.append(tok)
    return ttft, len(steps) / sum(steps), toks


def local_run(model: tuple[Any, Any], prompt: list[int], n_new: int, repeats: int) -> dict[str, Any]:
    runs = [local_generate(model, prompt, n_new) for _ in range(repeats + 1)][1:]  # the first is a warm-up
    return {"ttft_s": statistics.median(r[0] for r in runs), "tok_s": statistics.median(r[1] for r in runs),
            "tokens": runs[0][2]}


# ----------------------------------------------------------------- swarm

def start_swarm(workdir: Path, d: Path, blocks: list[str], lane: bool = True, tree: Path | None = None) -> LocalSwarm:
    """Peers serving ``blocks`` (one span each); ``lane=False``: ``peer start --no-lane``;
    ``tree``: peers run another checkout's ``src`` (``--baseline-tree``)."""
    sw = LocalSwarm(len(blocks), workdir, torch_threads=1, extra_args=[] if lane else ["--no-lane"],
                    env={"PYTHONPATH": str(tree / "src")} if tree is not None else None)
    first = sw.start_peer(0, extra=["--serve-model", str(d), "--blocks", blocks[0]])
    sw.peers.append(first)
    rest = [sw.spawn_peer(i, bootstrap=[first.addr], extra=["--serve-model", str(d), "--blocks", b])
            for i, b in enumerate(blocks[1:], 1)]
    sw.peers.extend(rest)
    for p in rest:
        p.wait_ready()
    return sw


async def swarm_client(sw: LocalSwarm, d: Path, head: Any, mhash: str, body: Any, lane: bool = True) -> Any:
    """``body(llm, connect_s, plain)``: ``llm`` forwards decode steps server
    to server (the default), ``plain`` (same client) drives every hop;
    ``lane=False``: a client transport without direct lanes."""
    from fedswarm.client import open_swarm_client
    from fedswarm.core.identity import Identity
    from fedswarm.llm_client import SwarmLLM
    from fedswarm.net.libp2p import Libp2pConfig

    t0 = time.perf_counter()
    identity = Identity.generate()
    async with open_swarm_client([sw.bootstrap], identity=identity,
                                 transport_config=Libp2pConfig(lane=lane)) as client:
        def make(forward: bool) -> Any:
            return SwarmLLM(client.agent.transport, lambda: client.core.view.live(client.agent.now()), head, mhash,
                            request_timeout=10.0, route_timeout=30.0, identity=identity, forward=forward)

        llm, plain = make(True), make(False)
        await llm.wait_route()
        connect = time.perf_counter() - t0
        return await body(llm, connect, plain)


def memory(sw: LocalSwarm) -> list[dict[str, float]]:
    import psutil

    out = []
    for p in sw.peers:
        mi = psutil.Process(p.proc.pid).memory_full_info()
        out.append({"rss_mb": mi.rss / 2**20, "pss_mb": getattr(mi, "pss", float("nan")) / 2**20})
    return out


def bench_chain(tmp: Path, d: Path, head: Any, mhash: str, blocks: list[str], prompt: list[int], n_new: int,
                repeats: int, concurrent: int, extra: Any = None) -> dict[str, Any]:
    sw = start_swarm(tmp / f"swarm{len(blocks)}", d, blocks)
    try:
        async def body(llm: Any, connect: float, plain: Any) -> dict[str, Any]:
            # forwarding on and off alternate (after a warm-up of each) in this swarm
            both: dict[bool, list[Any]] = {True: [], False: []}
            for fw in [False, True] * (repeats + 1):
                both[fw].append(await (llm if fw else plain).generate(prompt, n_new))
            runs, off = both[True][1:], both[False][1:]
            res = {"connect_s": connect, "ttft_s": statistics.median(r.ttft_s for r in runs),
                   "tok_s": statistics.median(r.decode_tokens_per_s for r in runs), "tokens": runs[0].token_ids,
                   "route": runs[0].route, "forward_stats": dict(llm.forward_stats),
                   "noforward": {"ttft_s": statistics.median(r.ttft_s for r in off),
                                 "tok_s": statistics.median(r.decode_tokens_per_s for r in off),
                                 "same_tokens": all(r.token_ids == runs[0].token_ids for r in off + runs)}}
            if concurrent:
                # N sessions of one SwarmLLM at once, with their decode steps
                # sent together (the default) and one request per session
                # step (max_step_batch=1), alternating, in the same swarm
                single = n_new / statistics.median(r.total_s for r in runs)
                res["concurrent"] = {"sessions": concurrent, "single_tok_s": single, "together": [], "apart": []}
                for mode in ("apart", "together", "apart", "together"):
                    llm.max_step_batch = 32 if mode == "together" else 1
                    before = [(await llm.info(h["peer"]))["stats"] for h in res["route"]]
                    outs: list[Any] = [None] * concurrent

                    async def one(i: int) -> None:
                        outs[i] = await llm.generate(prompt, n_new)

                    t0 = time.perf_counter()
                    async with trio.open_nursery() as n:
                        for i in range(concurrent):
                            n.start_soon(one, i)
                    wall = time.perf_counter() - t0
                    after = [(await llm.info(h["peer"]))["stats"] for h in res["route"]]
                    res["concurrent"][mode].append({
                        "agg_tok_s": concurrent * n_new / wall, "wall_s": wall,
                        "same_tokens": all(o.token_ids == res["tokens"] for o in outs),
                        "forwards": [a["forwards"] - b["forwards"] for a, b in zip(after, before)],
                        "steps": [a["steps"] - b["steps"] for a, b in zip(after, before)]})
                llm.max_step_batch = 32
            return res

        res = trio.run(swarm_client, sw, d, head, mhash, body)
        res["memory"] = memory(sw)
        if extra is not None:
            extra(sw)
        return res
    finally:
        sw.close()


def bench_lanes(tmp: Path, d: Path, head: Any, mhash: str, blocks: list[str], prompt: list[int], n_new: int,
                repeats: int, model: tuple[Any, Any], baseline: Path | None = None,
                floor: bool = False) -> dict[str, Any]:
    """The same chain twice at once: peers and client with direct lanes
    (``fedswarm.net.lane``) and with every request on py-libp2p
    (``--no-lane``). Generations take turns between the four setups (lanes
    or not, forwarding or not) after a warm-up of each, so a load spike hits
    all of them alike. Medians of decode tok/s; tokens checked.
    ``baseline``: the second swarm has lanes too, but its peers run that
    checkout's code (the "libp2p" keys then hold the baseline's figures).
    A generation in this process (the whole model, ``local_generate``)
    takes its turn in each round too: ``local`` holds its median, and each
    setup's ``paired_ms_per_hop`` the median over rounds of (its step time
    - that round's local step time) / hops, which a drift of the machine's
    speed between the local run and the swarms' cannot bias. ``model``:
    ``local_model(d)``, loaded once for every table. ``floor``: a
    ``hop_floor.RawChain`` of the same split takes its turn in each round too
    (``floor`` holds its figures, and each setup's ``over_floor_ms_per_hop``
    the median over rounds of its step time minus the chain's, per hop)."""
    from hop_floor import RawChain

    chain = RawChain(d, blocks, max_len=len(prompt) + n_new) if floor else None
    swarms: dict[bool, LocalSwarm] = {}
    try:
        for lane in (False, True):
            swarms[lane] = start_swarm(tmp / f"lanes{len(blocks)}-{int(lane)}", d, blocks, lane or baseline is not None,
                                       tree=baseline if not lane else None)

        async def main() -> dict[str, Any]:
            out: dict[str, Any] = {}
            llms: dict[bool, Any] = {}
            transports: dict[bool, Any] = {}

            async def hold(lane: bool, ready: trio.Event, done: trio.Event) -> None:
                async def body(llm: Any, connect: float, plain: Any) -> None:
                    llms[lane] = (llm, plain)
                    transports[lane] = llm.transport
                    ready.set()
                    await done.wait()

                await swarm_client(swarms[lane], d, head, mhash, body, lane=lane or baseline is not None)

            done = trio.Event()
            async with trio.open_nursery() as n:
                ready = {lane: trio.Event() for lane in (False, True)}
                for lane in (False, True):
                    n.start_soon(hold, lane, ready[lane], done)
                for ev in ready.values():
                    await ev.wait()
                setups = [(lane, fw) for fw in (True, False) for lane in (False, True)]
                runs: dict[tuple[bool, bool], list[Any]] = {s: [] for s in setups}
                local_tok_s: list[float] = []
                local_tokens: list[list[int]] = []
                floor_runs: list[tuple[float, list[int]]] = []
                for _ in range(repeats + 1):
                    _, t, toks = local_generate(model, prompt, n_new)
                    local_tok_s.append(t)
                    local_tokens.append(toks)
                    if chain is not None:  # blocks this loop for its turn, as the local generation does
                        floor_runs.append(chain.generate(model[0], prompt, n_new))
                    for lane, fw in setups:
                        llm, plain = llms[lane]
                        runs[(lane, fw)].append(await (llm if fw else plain).generate(prompt, n_new))
                ref = runs[setups[0]][1].token_ids
                hops = len(blocks)
                out["local"] = {"tok_s": statistics.median(local_tok_s[1:]),
                                "same_tokens": all(t == ref for t in local_tokens[1:])}
                for (lane, fw), rs in runs.items():
                    rs = rs[1:]
                    out[f"{'lanes' if lane else 'libp2p'}-{'forward' if fw else 'client'}"] = {
                        "tok_s": statistics.median(r.decode_tokens_per_s for r in rs),
                        "same_tokens": all(r.token_ids == ref for r in rs),
                        "paired_ms_per_hop": statistics.median(
                            (1.0 / r.decode_tokens_per_s - 1.0 / lt) / hops * 1e3
                            for r, lt in zip(rs, local_tok_s[1:]))}
                if floor_runs:
                    fl = floor_runs[1:]
                    out["floor"] = {"tok_s": statistics.median(t for t, _ in fl),
                                    "same_tokens": all(toks == ref for _, toks in fl),
                                    "paired_ms_per_hop": statistics.median(
                                        (1.0 / t - 1.0 / lt) / hops * 1e3 for (t, _), lt in zip(fl, local_tok_s[1:]))}
                    for (lane, fw), rs in runs.items():
                        out[f"{'lanes' if lane else 'libp2p'}-{'forward' if fw else 'client'}"][
                            "over_floor_ms_per_hop"] = statistics.median(
                            (1.0 / r.decode_tokens_per_s - 1.0 / t) / hops * 1e3 for r, (t, _) in zip(rs[1:], fl))
                for fw in (True, False):  # ms per hop of the first swarm over the second, round by round
                    pairs = zip(runs[(True, fw)][1:], runs[(False, fw)][1:])
                    out[f"diff-{'forward' if fw else 'client'}"] = statistics.median(
                        (1.0 / a.decode_tokens_per_s - 1.0 / b.decode_tokens_per_s) / hops * 1e3 for a, b in pairs)
                st = transports[True].statistics()
                out["lane_requests_out"] = st.lane_requests_out
                out["requests_out"] = st.requests_out
                out["tokens"] = ref
                done.set()
            return out

        return trio.run(main)
    finally:
        for sw in swarms.values():
            sw.close()
        if chain is not None:
            chain.close()


QUESTION = "What is the capital of France? Answer in one sentence."


def _wall(cmd: list[str], env: dict[str, str] | None = None) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, env=env)
    return time.perf_counter() - t0


def measure_startup(model: str, repeats: int = 3) -> dict[str, Any]:
    """Fresh processes: the import of torch+libp2p+trio, and building the
    client's head (cached / parsed from the file) after those imports."""
    imp = statistics.median(_wall([sys.executable, "-c", "import torch, libp2p, trio"]) for _ in range(repeats))
    code = ("import sys, time, json, torch, libp2p, trio; torch.set_num_threads(1)\n"
            "from fedswarm.llm_cli import load_client_model\n"
            "t = time.perf_counter(); load_client_model(sys.argv[1], cache=sys.argv[2] == '1')\n"
            "print(json.dumps(time.perf_counter() - t))")

    def build(cache: bool) -> float:
        r = subprocess.run([sys.executable, "-c", code, model, "1" if cache else "0"], check=True,
                           capture_output=True, text=True)
        return float(r.stdout.strip().splitlines()[-1])

    build(True)  # fills the head cache
    return {"import_s": imp, "head_cached_s": statistics.median(build(True) for _ in range(repeats)),
            "head_uncached_s": build(False)}


def bench_api(sw: LocalSwarm, model: str, prompt: list[int], n_new: int, streams: int,
              real_tok: bool) -> dict[str, Any]:
    """``peer generate`` once (start-up to first token), then a ``peer api``
    process: one stream alone, then ``streams`` at once."""
    import openai

    out: dict[str, Any] = {}
    g = subprocess.run([sys.executable, "-m", "fedswarm.cli", "generate", "--bootstrap", sw.bootstrap,
                        "--model", model, "--prompt-ids", ",".join(map(str, prompt)), "--greedy",
                        "--max-new-tokens", str(n_new), "--torch-threads", "1", "--json", "-q"],
                       capture_output=True, text=True, check=True)
    gj = json.loads(g.stdout)
    out["generate"] = {k: gj[k] for k in ("load_s", "connect_s", "ttft_s", "tokens_per_s")}
    out["generate"]["first_token_after_imports_s"] = gj["load_s"] + gj["connect_s"] + gj["ttft_s"]
    proc = subprocess.Popen([sys.executable, "-m", "fedswarm.cli", "api", "--bootstrap", sw.bootstrap,
                             "--listen", "127.0.0.1:0", "--model", model, "--torch-threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        url = ""
        for line in proc.stdout:  # type: ignore[union-attr]
            if "http://" in line:
                url = "http://" + line.split("http://", 1)[1].split()[0]
                break
        if not url:
            raise RuntimeError("peer api did not start")
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
        body = {"model": model, "prompt": prompt, "max_tokens": n_new, "temperature": 0, "stream": True,
                "extra_body": {"ignore_eos": True}}

        def one(_: int = 0) -> tuple[int, float, float]:
            t0 = time.perf_counter()
            first = 0.0
            for ch in client.completions.create(**body):
                if ch.choices and ch.choices[0].text and not first:
                    first = time.perf_counter() - t0
            return 0, first, time.perf_counter() - t0

        one()  # warm-up
        singles = [one() for _ in range(2)]
        single_wall = statistics.median(w for _, _, w in singles)
        out["single"] = {"tok_s": n_new / single_wall, "ttft_s": statistics.median(f for _, f, _ in singles)}
        with ThreadPoolExecutor(streams) as ex:
            t0 = time.perf_counter()
            res = list(ex.map(one, range(streams)))
            wall = time.perf_counter() - t0
        out["concurrent"] = {"streams": streams, "agg_tok_s": streams * n_new / wall, "wall_s": wall,
                             "ttft_s": statistics.median(f for _, f, _ in res)}
        return out
    finally:
        proc.terminate()
        proc.wait(20)


def bench_recovery(tmp: Path, d: Path, head: Any, mhash: str, layers: int, prompt: list[int], n_new: int) -> dict[str, Any]:
    half = layers // 2
    blocks = [f"0:{half}", f"{half}:{layers}", f"{half}:{layers}"]
    sw = start_swarm(tmp / "swarm_kill", d, blocks)
    by_id = {p.peer_id: p for p in sw.peers}
    try:
        async def body(llm: Any, connect: float, plain: Any) -> Any:
            with trio.fail_after(30):
                while len([h for h in llm.hops() if h.start == half]) < 2:
                    await trio.sleep(0.02)
            await llm.generate(prompt, 4)  # warm streams, as in the other runs

            def on_token(i: int, tok: int) -> None:
                if i == 8:
                    (sess,) = llm.active
                    by_id[next(hs.hop.peer for hs in sess.hops if hs.hop.start == half)].kill()

            return await llm.generate(prompt, n_new, on_token=on_token)

        r = trio.run(swarm_client, sw, d, head, mhash, body)
        normal = statistics.median(r.step_times) if r.step_times else 0.0
        rec = r.recoveries[0] if r.recoveries else {}
        return {"recoveries": len(r.recoveries), "recovered_s": rec.get("recovered_s"), "normal_step_s": normal,
                "tokens": r.token_ids, "slowest_step_s": max(r.step_times, default=0.0)}
    finally:
        sw.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="random58m")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--concurrent", type=int, default=8, help="API streams at once through the longest chain (0: none)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--peers", default="1,2,3", help="chain lengths to run")
    ap.add_argument("--no-recovery", action="store_true")
    ap.add_argument("--no-startup", action="store_true", help="skip the fresh-process start-up timings")
    ap.add_argument("--lanes", default="1,2,3", metavar="N,..",
                    help="chain lengths to run with direct lanes and without them side by side ('' : none)")
    ap.add_argument("--baseline-tree", type=Path, metavar="DIR",
                    help="in the side-by-side runs, compare with peers running this checkout's code (both with "
                         "lanes) instead of with py-libp2p alone, e.g. a `git worktree` of the previous commit; "
                         "the client (in this process) runs this tree's code for both, so this compares "
                         "serving-side changes only")
    ap.add_argument("--floor", action="store_true",
                    help="in the side-by-side runs, add the same split with nothing between the processes "
                         "(benchmarks/hop_floor.py): this machine's own share of a hop")
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args()
    if a.baseline_tree is not None and not (a.baseline_tree / "src" / "fedswarm").is_dir():
        ap.error(f"--baseline-tree {a.baseline_tree}: no src/fedswarm there (give a checkout of this project)")
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="llm-bench-") as tmps:
        tmp = Path(tmps)
        d = build_model(a.model, tmp)
        cfg = load_config(d)
        layers = cfg.num_hidden_layers
        mhash = model_hash(d)
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, min(cfg.vocab_size, 256), (a.prompt_len,), generator=g).tolist()
        real_tok = cfg.tokenizer != "bytes" and a.model != "random58m"
        if real_tok:
            from fedswarm.llm_cli import load_client_model

            prompt = load_client_model(a.model).render_chat([{"role": "user", "content": QUESTION}])
        startup = None if a.no_startup else measure_startup(a.model if a.model != "random58m" else str(d))
        head = load_client_head(d)
        print(f"model {a.model}: {cfg.param_count() / 1e6:.1f}M params, {layers} layers, hidden {cfg.hidden_size}, "
              f"vocab {cfg.vocab_size}; prompt {len(prompt)} tokens, {a.new} new, greedy, torch threads 1",
              file=sys.stderr)
        model = local_model(d)
        local = local_run(model, prompt, a.new, a.repeats)
        rows: dict[str, Any] = {}
        chains = [int(x) for x in a.peers.split(",") if int(x) <= layers]
        api_res: dict[str, Any] | None = None
        for n in chains:
            def extra(sw: LocalSwarm) -> None:
                nonlocal api_res
                api_res = bench_api(sw, a.model if a.model != "random58m" else str(d), prompt, a.new, a.concurrent,
                                    real_tok)

            last_chain = a.concurrent and n == chains[-1]
            rows[str(n)] = bench_chain(tmp, d, head, mhash, splits(layers, n), prompt, a.new, a.repeats,
                                       a.concurrent if last_chain else 0, extra if last_chain else None)
            print(f"  {n} peer(s) done ({time.perf_counter() - t_start:.0f}s)", file=sys.stderr)
        lanes: dict[str, Any] = {}
        for n in [int(x) for x in a.lanes.split(",") if x and int(x) <= layers]:
            lanes[str(n)] = bench_lanes(tmp, d, head, mhash, splits(layers, n), prompt, a.new, a.repeats,
                                        model, a.baseline_tree, a.floor)
            print(f"  lanes against libp2p, {n} peer(s) done ({time.perf_counter() - t_start:.0f}s)", file=sys.stderr)
        rec = None if a.no_recovery else bench_recovery(tmp, d, head, mhash, layers, prompt, a.new)
    elapsed = time.perf_counter() - t_start

    lt = 1.0 / local["tok_s"]
    print(f"\n{'setup':<16} {'TTFT ms':>8} {'x local':>8} {'decode tok/s':>13} {'x local':>8} {'+ms/hop':>8} "
          f"{'connect s':>9}  tokens   | --no-forward: {'tok/s':>6} {'x local':>8} {'+ms/hop':>8}")
    print(f"{'local 1 process':<16} {local['ttft_s'] * 1e3:>8.1f} {1:>8.2f} {local['tok_s']:>13.1f} {1:>8.2f} "
          f"{'':>8} {'':>9}  reference")
    for n, r in rows.items():
        per_hop = (1.0 / r["tok_s"] - lt) / int(n) * 1e3
        nf = r["noforward"]
        nf["added_ms_per_hop"] = (1.0 / nf["tok_s"] - lt) / int(n) * 1e3
        r["added_ms_per_hop"] = per_hop
        same = r["tokens"] == local["tokens"] and nf["same_tokens"]
        print(f"{'swarm ' + n + ' peer' + ('s' if n != '1' else ''):<16} {r['ttft_s'] * 1e3:>8.1f} "
              f"{r['ttft_s'] / local['ttft_s']:>8.2f} {r['tok_s']:>13.1f} {r['tok_s'] / local['tok_s']:>8.2f} "
              f"{per_hop:>8.2f} {r['connect_s']:>9.3f}  {'same' if same else 'DIFFERENT':<8} | "
              f"{'':>13} {nf['tok_s']:>6.1f} {nf['tok_s'] / local['tok_s']:>8.2f} {nf['added_ms_per_hop']:>8.2f}")
    print("(the first column group forwards decode steps server to server; --no-forward runs alternate with them "
          "in the same swarm)")
    for n, r in rows.items():
        fs = r["forward_stats"]
        print(f"  {n} peer(s): forwarded steps {fs['complete']} complete, {fs['fallbacks']} fell back, "
              f"{fs['refused']} refused; forwarding saves "
              f"{r['noforward']['added_ms_per_hop'] - r['added_ms_per_hop']:.2f} ms per hop")
    if lanes:
        other = "baseline" if a.baseline_tree else "libp2p"
        mine = "this tree" if a.baseline_tree else "lanes"
        print(f"\n{'this tree against ' + str(a.baseline_tree) + ', both with lanes' if a.baseline_tree else 'direct lanes against py-libp2p'}"
              f", side by side (two swarms at once and a local process, generations taking turns; decode tok/s, "
              f"x local, +ms/hop, each against the local generation of the same round)")
        print(f"{'chain':<9} {'local':>6} {other + ', forwarding':>24} {mine + ', forwarding':>24} "
              f"{other + ', client hops':>24} {mine + ', client hops':>24}  tokens  lane requests")
        for n, r in lanes.items():
            cells = []
            lr = r["local"]["tok_s"]
            for k in ("libp2p-forward", "lanes-forward", "libp2p-client", "lanes-client"):
                t = r[k]["tok_s"]
                r[k]["added_ms_per_hop"] = hop = r[k]["paired_ms_per_hop"]
                cells.append(f"{t:>8.1f} {t / lr:>6.3f} {hop:>+7.2f}")
            same = all(r[k]["same_tokens"] for k in r if isinstance(r[k], dict)) and r["tokens"] == local["tokens"]
            print(f"{n + ' peer' + ('s' if n != '1' else ''):<9} {lr:>6.1f} " + " ".join(f"{c:>24}" for c in cells)
                  + f"  {'same' if same else 'DIFFERENT':<7} {r['lane_requests_out']}/{r['requests_out']}")
        print(f"{mine} minus {other}, ms per hop, median over rounds of the same round's difference: "
              + "; ".join(f"{n} peers {r['diff-forward']:+.2f} forwarding, {r['diff-client']:+.2f} client hops"
                          for n, r in lanes.items()))
        floors = {n: r for n, r in lanes.items() if "floor" in r}
        if floors:
            print("the floor (hop_floor.RawChain, the same split with nothing between the processes, in the same "
                  "rounds): decode tok/s, x local, +ms/hop; then each setup's ms per hop over the floor, median "
                  "over rounds of the same round's difference")
            for n, r in floors.items():
                f = r["floor"]
                print(f"  {n} peer{'s' if n != '1' else ''}: floor {f['tok_s']:.1f} {f['tok_s'] / r['local']['tok_s']:.3f} "
                      f"{f['paired_ms_per_hop']:+.2f} (tokens {'same' if f['same_tokens'] else 'DIFFERENT'}); over it: "
                      + ", ".join(f"{k} {r[k]['over_floor_ms_per_hop']:+.2f}"
                                  for k in ("libp2p-forward", "lanes-forward", "libp2p-client", "lanes-client")))
    print()
    targets = []
    last = str(chains[-1]) if chains else None
    for n, r in rows.items():
        for i, m in enumerate(r["memory"]):
            print(f"serving peer {i} of {n} ({splits(layers, int(n))[i]}): RSS {m['rss_mb']:.0f} MB, "
                  f"PSS {m['pss_mb']:.0f} MB")
    if api_res:
        s1, c = api_res["single"], api_res["concurrent"]
        print(f"\nAPI (peer api, {last} peers, /v1/completions streamed, greedy, {a.new} tokens each):")
        print(f"  1 stream: {s1['tok_s']:.1f} tok/s, first token {s1['ttft_s'] * 1e3:.0f} ms")
        print(f"  {c['sessions'] if 'sessions' in c else c['streams']} concurrent streams: {c['agg_tok_s']:.1f} tok/s "
              f"aggregate = x{c['agg_tok_s'] / s1['tok_s']:.2f} one stream (median first token "
              f"{c['ttft_s'] * 1e3:.0f} ms, wall {c['wall_s']:.1f}s)")
        targets.append((f"{c['streams']} concurrent API streams >= 3x one stream", c["agg_tok_s"] >= 3 * s1["tok_s"]))
        gq = api_res["generate"]
        print(f"peer generate ({last} peers, fresh process): model {gq['load_s'] * 1e3:.0f} ms + connect "
              f"{gq['connect_s'] * 1e3:.0f} ms + first token {gq['ttft_s'] * 1e3:.0f} ms = "
              f"{gq['first_token_after_imports_s']:.2f} s after its imports")
        targets.append(("peer generate: first token <= 1 s after imports", gq["first_token_after_imports_s"] <= 1.0))
    direct = rows[last]["concurrent"] if last is not None and "concurrent" in rows[last] else None
    if direct:
        def fmt(runs: list[dict[str, Any]]) -> str:
            return ", ".join(f"x{r['agg_tok_s'] / direct['single_tok_s']:.2f} ({sum(r['forwards'])} forwards for "
                             f"{sum(r['steps'])} steps, tokens {'same' if r['same_tokens'] else 'DIFFERENT'})"
                             for r in runs)
        print(f"direct SwarmLLM, {direct['sessions']} sessions at once through {last} peers, aggregate tok/s over "
              f"one session's {direct['single_tok_s']:.1f}:\n  steps sent together:     {fmt(direct['together'])}"
              f"\n  one request per step:    {fmt(direct['apart'])}")
    if startup:
        print(f"start-up (fresh processes, median of 3): python -c 'import torch, libp2p, trio' "
              f"{startup['import_s']:.2f} s; client head build after those imports {startup['head_cached_s']:.3f} s "
              f"(head cache), {startup['head_uncached_s']:.2f} s (parsed from the model file)")
    if last is not None:
        r3 = rows[last]
        targets += [
            (f"added latency <= 1 ms per hop, forwarding ({last} peers)", r3["added_ms_per_hop"] <= 1.0),
            (f"decode tok/s >= 0.9x local ({last} peers)", r3["tok_s"] >= 0.9 * local["tok_s"]),
            (f"TTFT <= 1.2x local ({last} peers)", r3["ttft_s"] <= 1.2 * local["ttft_s"]),
            (f"connect <= 0.3 s ({last} peers)", r3["connect_s"] <= 0.3),
        ]
    if "2" in rows:
        targets.append(("decode tok/s >= 0.9x local (2 peers, forwarding)", rows["2"]["tok_s"] >= 0.9 * local["tok_s"]))
    for n, r in lanes.items():
        targets.append((f"added latency <= 1 ms per hop, lanes and forwarding ({n} peers, side by side)",
                        r["lanes-forward"]["added_ms_per_hop"] <= 1.0))
    if "2" in lanes:
        targets.append(("decode tok/s >= 0.9x local (2 peers, lanes and forwarding, side by side)",
                        lanes["2"]["lanes-forward"]["tok_s"] >= 0.9 * lanes["2"]["local"]["tok_s"]))
    if rec is not None:
        print(f"kill of the chain's 2nd peer after 8 tokens (forwarding on): {rec['recoveries']} recovery in "
              f"{rec['recovered_s']}s (normal step {rec['normal_step_s'] * 1e3:.1f} ms, slowest "
              f"{rec['slowest_step_s'] * 1e3:.0f} ms), tokens "
              f"{'same' if rec['tokens'] == local['tokens'] else 'DIFFERENT'}")
        targets.append(("recovery after a kill <= 2 s", rec["recovered_s"] is not None and rec["recovered_s"] <= 2.0))
    print("\ntargets:")
    for name, ok in targets:
        print(f"  {'MET    ' if ok else 'NOT MET'}  {name}")
    print(f"\n(benchmark ran {elapsed:.0f}s on {os.cpu_count()} CPUs; 1-min load average {load0:.2f} at start, "
          f"{os.getloadavg()[0]:.2f} at end: other processes compete for the same cores)")
    if a.json:
        Path(a.json).write_text(json.dumps({"model": a.model, "local": local, "swarm": rows, "lanes": lanes, "recovery": rec,
                                            "api": api_res, "startup": startup, "targets": dict(targets)},
                                           indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
