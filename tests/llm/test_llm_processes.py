"""LLM serving across real ``peer start`` processes on 127.0.0.1 (py-libp2p).

Readiness is the printed multiaddr; the client waits (bounded) until the
view holds a chain; nothing sleeps a fixed time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from fedswarm.testing.localswarm import LocalSwarm
from fedswarm.tasks.checkpoint import load_block_span, load_client_head, model_hash
from fedswarm.tasks.llama import generate_greedy
from fedswarm.tasks.tokenizer import ByteTokenizer
from llm_swarm_helpers import hf_greedy

pytestmark = pytest.mark.slow

PROMPT = "Hello, swarm!"


def start(swarm: LocalSwarm, d: Path, blocks: list[str]) -> None:
    first = swarm.start_peer(0, extra=["--serve-model", str(d), "--blocks", blocks[0]])
    swarm.peers.append(first)
    rest = [swarm.spawn_peer(i, bootstrap=[first.addr], extra=["--serve-model", str(d), "--blocks", b])
            for i, b in enumerate(blocks[1:], 1)]
    swarm.peers.extend(rest)
    for p in rest:
        p.wait_ready()


def test_peer_generate_through_two_processes_equals_transformers(tmp_path, gqa_dir):
    pytest.importorskip("transformers")
    ref = hf_greedy(gqa_dir, ByteTokenizer().encode(PROMPT), 20)
    swarm = LocalSwarm(2, tmp_path / "swarm")
    try:
        start(swarm, gqa_dir, ["0:2", "2:4"])
        out = tmp_path / "gen.json"
        r = subprocess.run(
            [sys.executable, "-m", "fedswarm.cli", "generate", "--bootstrap", swarm.bootstrap, "--model", str(gqa_dir),
             "--prompt", PROMPT, "--max-new-tokens", "20", "--greedy", "--out", str(out)],
            capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
        got = json.loads(out.read_text())
        assert got["token_ids"] == ref
        assert got["text"] == ByteTokenizer().decode(ref)
        assert [h["blocks"] for h in got["route"]] == [[0, 2], [2, 4]]
        assert {h["peer"] for h in got["route"]} == {p.peer_id for p in swarm.peers}
        assert "time to first token" in r.stderr and "tokens/s" in r.stderr
    finally:
        swarm.close()


def test_kill_chain_peer_process_mid_generation(tmp_path, tiny_dir):
    """A serves 0:2, B and C serve 2:4; kill -9 the chain's 2:4 peer after 8
    tokens: generation completes with the undisturbed tokens."""
    from fedswarm.client import open_swarm_client
    from fedswarm.llm_client import SwarmLLM

    n_new = 32
    prompt = ByteTokenizer().encode(PROMPT)
    ref = generate_greedy(load_client_head(tiny_dir), [load_block_span(tiny_dir, 0, 4)], prompt, n_new)
    swarm = LocalSwarm(3, tmp_path / "swarm")
    try:
        start(swarm, tiny_dir, ["0:2", "2:4", "2:4"])
        by_id = {p.peer_id: p for p in swarm.peers}

        async def main():
            async with open_swarm_client([swarm.bootstrap], min_peers=3) as client:
                llm = SwarmLLM(client.agent.transport, lambda: client.core.view.live(client.agent.now()),
                               load_client_head(tiny_dir), model_hash(tiny_dir), request_timeout=5.0)
                with trio.fail_after(15):
                    while len([h for h in llm.hops() if h.start == 2]) < 2:
                        await trio.sleep(0.02)
                killed = []

                def on_token(i, tok):
                    if i == 7:
                        (sess,) = llm.active
                        victim = next(hs.hop.peer for hs in sess.hops if hs.hop.start == 2)
                        by_id[victim].kill()
                        killed.append(victim)

                res = await llm.generate(prompt, n_new, on_token=on_token)
                return res, killed, client.agent.transport.statistics()

        res, killed, st = trio.run(main)
        assert res.token_ids == ref
        # the steps travelled on direct lanes (fedswarm.net.lane), and the
        # killed peer's lane broke without costing a token
        assert st.lanes_opened >= 2 and st.lane_requests_out >= n_new, st
        assert len(res.recoveries) == 1 and res.recoveries[0]["failed"] == killed[0]
        assert res.recoveries[0]["recovered_s"] < 2.0, res.recoveries
        assert res.route[1]["peer"] not in killed
    finally:
        swarm.close()


def test_peers_serve_in_the_dtype_asked_for(tmp_path, gqa_dir):
    """``peer start --serve-dtype bfloat16``: both peers compute in bfloat16
    (``/status`` says so, with the device), and ``peer generate`` through them
    gives the tokens of the same bf16 spans run in one process, which are not
    the float32 model's."""
    prompt, n_new, eos = ByteTokenizer().encode(PROMPT), 24, ByteTokenizer.eos_id
    head = load_client_head(gqa_dir)
    ref = generate_greedy(head, [load_block_span(gqa_dir, 0, 2, dtype="bfloat16"),
                                 load_block_span(gqa_dir, 2, 4, dtype="bfloat16")], prompt, n_new, eos_id=eos)
    assert len(ref) > 8 and ref != generate_greedy(head, [load_block_span(gqa_dir, 0, 4)], prompt, n_new, eos_id=eos)
    swarm = LocalSwarm(2, tmp_path / "swarm", extra_args=["--serve-dtype", "bfloat16", "--serve-device", "cpu"])
    try:
        start(swarm, gqa_dir, ["0:2", "2:4"])
        assert [(sp["start"], sp["end"], sp["device"], sp["dtype"]) for p in swarm.peers
                for sp in p.status()["spans"]] == [(0, 2, "cpu", "bfloat16"), (2, 4, "cpu", "bfloat16")]
        # and a person starting it reads where its blocks compute
        assert "fedswarm serving blocks 0:2 of" in (swarm.peers[0].data_dir / "peer.log").read_text()
        assert "on cpu, bfloat16" in (swarm.peers[0].data_dir / "peer.log").read_text()
        out = tmp_path / "gen.json"
        r = subprocess.run(
            [sys.executable, "-m", "fedswarm.cli", "generate", "--bootstrap", swarm.bootstrap, "--model", str(gqa_dir),
             "--prompt", PROMPT, "--max-new-tokens", str(n_new), "--greedy", "--out", str(out)],
            capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
        assert json.loads(out.read_text())["token_ids"] == ref
    finally:
        swarm.close()
