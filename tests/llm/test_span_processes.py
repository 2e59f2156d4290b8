"""Span placement across real ``peer start --blocks auto`` processes on
127.0.0.1: four peers started one after another cover every block; after
``kill -9`` of one, and of a second one whose blocks nobody else holds, the
others cover every block again within 30 s, each changing span at most
twice, and a generation under way when the second peer dies finishes with
the undisturbed tokens.

Every wait is bounded and ends on a real signal: a printed multiaddr, the
peers' ``/status``, the client's view."""

from __future__ import annotations

import time

import pytest
import trio

from fedswarm.llm_serving import served_gaps
from fedswarm.testing.localswarm import LocalSwarm, PeerProcess
from fedswarm.tasks.checkpoint import load_block_span, load_client_head, model_hash
from fedswarm.tasks.llama import generate_greedy
from fedswarm.tasks.tokenizer import ByteTokenizer

pytestmark = pytest.mark.slow

MODEL = "tiny-llama-gqa"
LAYERS = 4
AUTO = ["--serve-model", MODEL, "--blocks", "auto"]


def served(p: PeerProcess) -> list[tuple[int, int]]:
    return [(s["start"], s["end"]) for s in p.status()["spans"] if s.get("state", "serving") == "serving"]


def gaps(peers: list[PeerProcess]) -> list[int]:
    """Blocks none of ``peers`` serves now (from their ``/status``)."""
    return served_gaps([p.status() for p in peers], LAYERS)


def wait_covered(peers: list[PeerProcess], timeout: float) -> float:
    """Seconds until ``peers`` together serve every block (bounded)."""
    t0 = time.monotonic()
    while gaps(peers):
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"blocks {gaps(peers)} not served after {timeout}s: "
                                 f"{ {p.peer_id[-6:]: served(p) for p in peers} }")
        time.sleep(0.1)  # polling /status, not waiting for readiness
    return time.monotonic() - t0


def changes(peers: list[PeerProcess]) -> dict[str, int]:
    return {p.peer_id: p.status()["span_changes"] for p in peers}


def lone_holder(peers: list[PeerProcess]) -> PeerProcess:
    """A peer that holds a block nobody else serves."""
    for p in peers:
        if gaps([q for q in peers if q is not p]):
            return p
    raise AssertionError(f"every block has two holders: { {p.peer_id[-6:]: served(p) for p in peers} }")


def test_auto_peers_cover_and_recover_after_kills(tmp_path, gqa_dir):
    from fedswarm.client import open_swarm_client
    from fedswarm.llm_client import SwarmLLM

    n_new = 24
    prompt = ByteTokenizer().encode("Hello, swarm!")
    ref = generate_greedy(load_client_head(gqa_dir), [load_block_span(gqa_dir, 0, LAYERS)], prompt, n_new)
    swarm = LocalSwarm(4, tmp_path / "swarm")
    try:
        swarm.peers.append(swarm.start_peer(0, extra=AUTO))
        for i in range(1, 4):  # one after another: each joins a swarm it can see
            swarm.peers.append(swarm.start_peer(i, bootstrap=[swarm.bootstrap], extra=AUTO))
        peers = list(swarm.peers)
        wait_covered(peers, 60.0)
        before = changes(peers)

        # kill -9 of one of them: the others cover every block within 30 s
        first = peers[1]
        first.kill()
        alive = [p for p in peers if p is not first]
        wait_covered(alive, 30.0)

        # a second kill, of the only holder of some block, while a generation
        # runs through it: someone moves into the gap, the tokens are the same
        victim = lone_holder(alive)
        alive = [p for p in alive if p is not victim]
        boot = [alive[0].addr]
        killed_at: list[float] = []

        async def main():
            async with open_swarm_client(boot, min_peers=3) as client:
                llm = SwarmLLM(client.agent.transport, lambda: client.core.view.live(client.agent.now()),
                               load_client_head(gqa_dir), model_hash(gqa_dir), request_timeout=5.0,
                               route_timeout=30.0)
                await llm.wait_route(timeout=30.0)

                def on_token(i, tok):
                    if i == 7:
                        (sess,) = llm.active
                        assert victim.peer_id in {hs.hop.peer for hs in sess.hops}
                        victim.kill()
                        killed_at.append(time.monotonic())

                return await llm.generate(prompt, n_new, on_token=on_token)

        res = trio.run(main)
        assert killed_at, "the generation ended before the kill"
        assert res.token_ids == ref
        assert any(r["failed"] == victim.peer_id for r in res.recoveries)
        wait_covered(alive, max(30.0 - (time.monotonic() - killed_at[0]), 0.1))
        after = changes(alive)
        assert all(after[p.peer_id] - before[p.peer_id] <= 2 for p in alive), (before, after)
        assert sum(after[p.peer_id] - before[p.peer_id] for p in alive) >= 1  # the gap was closed by a move
        # the steps reached the serving peers on direct lanes (/status "transport")
        lanes = {p.peer_id: p.status()["transport"] for p in alive}
        assert all(t["lane_port"] > 0 for t in lanes.values()), lanes
        assert sum(t["lane_requests_in"] for t in lanes.values()) >= n_new, lanes
    finally:
        swarm.close()
