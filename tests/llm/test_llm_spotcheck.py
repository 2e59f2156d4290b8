"""Spot checks of LLM spans: a peer whose outputs are wrong is caught by
recomputing its span on other peers, and generation stays exact."""

from __future__ import annotations

import pytest
import torch
import trio

from fedswarm.tasks.checkpoint import load_block_span, load_client_head
from fedswarm.tasks.llama import generate_greedy
from fedswarm.tasks.tokenizer import ByteTokenizer
from llm_swarm_helpers import memory_swarm

N_NEW = 12
PROMPT = ByteTokenizer().encode("Spot check me")


def make_liar(server) -> None:
    """Perturb every output this server computes (a lying or broken peer)."""
    honest = server._compute

    def lying(*args):  # (span, batch): the batch's items are the last argument
        honest(*args)
        for it in args[-1]:
            if it.result is not None:
                t = torch.frombuffer(bytearray(it.result), dtype=torch.float32)
                it.result = (t + 0.5).numpy().tobytes()

    server._compute = lying


@pytest.mark.parametrize("role", ["on-route", "checker"])
def test_lying_span_is_outvoted_and_tokens_stay_exact(tiny_dir, role):
    ref = generate_greedy(load_client_head(tiny_dir), [load_block_span(tiny_dir, 0, 4)], PROMPT, N_NEW)

    async def main():
        async with memory_swarm(tiny_dir, ["0:2", "2:4", "2:4", "2:4"], spot_check_rate=1.0, seed=3) as s:
            with trio.fail_after(60):
                while len(s.llm.hops()) < 4:
                    await trio.sleep(0.01)
            second = sorted(s.peer_ids[1:])
            # steer the route with round-trip estimates: the cheapest 2:4 peer is used
            routed = second[0] if role == "on-route" else second[2]
            for p in second:
                s.llm.rtt[p] = 1e-9 if p == routed else 1.0
            # checkers are tried in peer id order (none is trusted here)
            liar = routed if role == "on-route" else second[0]
            make_liar(s.server_of(liar))
            res = await s.llm.generate(PROMPT, N_NEW, greedy=True)
            assert res.token_ids == ref
            assert s.llm.stats["spot_mismatches"] >= 1 and s.llm.stats["spot_banned"] == 1
            assert liar in s.llm.excluded()
            assert all(h["peer"] != liar for h in res.route)

    trio.run(main)


def test_no_spot_checks_when_disabled(tiny_dir):
    async def main():
        async with memory_swarm(tiny_dir, ["0:2", "2:4", "2:4"], spot_check_rate=0.0) as s:
            with trio.fail_after(60):
                while len(s.llm.hops()) < 3:
                    await trio.sleep(0.01)
            await s.llm.generate(PROMPT, 4, greedy=True)
            assert s.llm.stats["spot_checks"] == 0

    trio.run(main)
