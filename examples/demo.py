"""The demo: start 3 real peers on 127.0.0.1, each serving a third of
SmolLM2-135M-Instruct's decoder blocks; submit a batch job, show who ran
what, check the results against a local run; then ask SmolLM2 a question
through the three peers, Petals-style (the hidden states travel on
direct lanes), stream the answer, and check the
greedy tokens against the same model run in one process; stop the peers.

Run it with ``./scripts/demo.sh`` (which installs what it needs), or
``.venv/bin/python examples/demo.py``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fedswarm.testing.localswarm import LocalSwarm

MODEL = "smollm2-135m-instruct"  # SmolLM2-135M-Instruct, pulled by scripts/setup.sh (`peer models pull`)
SPANS = [(0, 10), (10, 20), (20, 30)]  # its 30 decoder blocks, one span per peer


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--peers", type=int, default=len(SPANS), help="peers to start; the first three serve SmolLM2")
    ap.add_argument("--shards", type=int, default=12)
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--iters", type=int, default=8)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fedswarm-demo-"))
    print(f"starting {a.peers} peers on 127.0.0.1 (logs in {work})")
    t0 = time.monotonic()
    serve = [["--serve-model", MODEL, "--blocks", f"{lo}:{hi}", "--torch-threads", "1"] for lo, hi in SPANS]
    with LocalSwarm(a.peers, work, per_peer_args=serve) as swarm:
        for p in swarm.peers:
            print(f"  peer {p.peer_id}  {p.addr}")
        print(f"swarm up in {time.monotonic() - t0:.1f}s; submitting a tensor-map job of {a.shards} shards")
        out = work / "results.jsonl"
        job = [sys.executable, "-m", "fedswarm.cli", "submit", "--kind", "tensor-map", "--shards", str(a.shards),
               "--seed", "42", "--size", str(a.size), "--iters", str(a.iters), "--out"]
        r = subprocess.run(job + [str(out), "--bootstrap", swarm.bootstrap, "--min-peers", str(a.peers)], text=True)
        if r.returncode != 0:
            print("job failed", file=sys.stderr)
            return 1
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        names = {p.peer_id: f"peer{i}" for i, p in enumerate(swarm.peers)}
        print(f"\n{'shard':>5}  {'ran on':<8} {'attempt':>7}  {'checksum':>14}  digest")
        for row in rows:
            res = row["result"]
            print(f"{row['shard']:>5}  {names.get(row['peer'], row['peer'][:8]):<8} {row['attempt']:>7}  {res['checksum']:>14}  {res['digest'][:16]}")
        per_peer: dict[str, int] = {}
        for row in rows:
            per_peer[names[row["peer"]]] = per_peer.get(names[row["peer"]], 0) + 1
        print("\nshards per peer:", ", ".join(f"{k}={v}" for k, v in sorted(per_peer.items())))
        local = work / "local.jsonl"
        subprocess.run(job + [str(local), "--local", "--progress", "off"], check=True, capture_output=True)
        same = [json.loads(x)["result"] for x in local.read_text().splitlines()] == [row["result"] for row in rows]
        print(f"results equal a local single-process run: {same}")
        st = swarm.peers[0].status()
        print(f"peer0 sees {len(st['peers'])} live peers; tenant shares {st['tenant_shares']}")

        question, n_new = "What is the capital of France? Answer in one sentence.", 48
        print(f"\nasking {MODEL} through three peers, blocks {SPANS[0][0]}:{SPANS[0][1]}, "
              f"{SPANS[1][0]}:{SPANS[1][1]} and {SPANS[2][0]}:{SPANS[2][1]} (greedy, streamed as it arrives):")
        print(f"  you: {question}")
        print("  SmolLM2: ", end="", flush=True)
        gen_out = work / "generate.json"
        # the answer streams to our stdout token by token; timings go to stderr
        r = subprocess.run([sys.executable, "-m", "fedswarm.cli", "generate", "--bootstrap", swarm.bootstrap,
                            "--model", MODEL, "--chat", "--prompt", question, "--max-new-tokens", str(n_new),
                            "--greedy", "--torch-threads", "1", "--out", str(gen_out)], text=True)
        print()
        if r.returncode != 0:
            print("generation failed", file=sys.stderr)
            return 1
        gen = json.loads(gen_out.read_text())
        route = " -> ".join(f"{names.get(h['peer'], h['peer'][:8])}[{h['blocks'][0]}:{h['blocks'][1]}]"
                            for h in gen.get("route", []))
        print(f"route: {route}")
        lanes = [q.status().get("transport", {}) for q in swarm.peers[:len(SPANS)]]
        print("requests the serving peers took on direct lanes (sealed TCP, keyed over libp2p): "
              + ", ".join(f"{names[q.peer_id]}={t.get('lane_requests_in', 0)}" for q, t in zip(swarm.peers, lanes)))
        local_ids = _local_generate(gen["prompt_ids"], len(gen["token_ids"]))
        same_tokens = local_ids == gen["token_ids"]
        print(f"{len(local_ids)} tokens equal the same model run greedily in one process: {same_tokens}")
        print("stopping peers (SIGTERM, graceful leave)")
    print(f"done in {time.monotonic() - t0:.1f}s")
    return 0 if same and same_tokens else 1


def _local_generate(prompt_ids: list[int], n: int) -> list[int]:
    """The same model in this process: every block on one span, greedy, no swarm."""
    import torch

    from fedswarm.tasks.checkpoint import load_block_span, load_client_head, load_config, resolve_model
    from fedswarm.tasks.llama import generate_greedy

    torch.set_num_threads(1)
    path = resolve_model(MODEL)
    layers = load_config(path).num_hidden_layers
    return list(generate_greedy(load_client_head(path), [load_block_span(path, 0, layers)], prompt_ids, n))


if __name__ == "__main__":
    sys.exit(main())
