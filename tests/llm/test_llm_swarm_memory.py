"""Generation through an in-process swarm (MemoryNetwork): parity with
transformers, recovery from a dead chain peer, batching of concurrent
sessions, replay after a server lost a session."""

from __future__ import annotations

import pytest
import trio

from fedswarm.tasks.checkpoint import load_block_span, load_client_head
from fedswarm.tasks.llama import generate_greedy
from fedswarm.tasks.tokenizer import ByteTokenizer
from llm_swarm_helpers import hf_greedy, memory_swarm


N_NEW = 20
PROMPT = ByteTokenizer().encode("Hello, swarm!")


def local_greedy(d, prompt, n):
    return generate_greedy(load_client_head(d), [load_block_span(d, 0, 4)], prompt, n)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-llama-gqa"])
def test_swarm_greedy_equals_transformers(name, tiny_dir, gqa_dir):
    pytest.importorskip("transformers")  # the reference; the other tests compare with a local run
    d = tiny_dir if name == "tiny-llama" else gqa_dir
    ref = hf_greedy(d, PROMPT, N_NEW)
    assert len(set(ref)) > 3
    got = {}

    async def main():
        # two chains: 2 hops, and 3 hops of uneven spans
        for blocks in (["0:2", "2:4"], ["0:1", "1:3", "3:4"]):
            async with memory_swarm(d, blocks) as s:
                res = await s.llm.generate(PROMPT, N_NEW, greedy=True)
                got[tuple(blocks)] = res.token_ids
                assert [h["blocks"] for h in res.route] == [[int(x) for x in b.split(":")] for b in blocks]
                assert res.recoveries == []
                # the client closed its sessions
                with trio.fail_after(5):
                    while any(srv.sessions for srv in s.servers):
                        await trio.sleep(0.01)

    trio.run(main)
    for blocks, toks in got.items():
        assert toks == ref, blocks


def test_chain_peer_dies_mid_generation_same_tokens(tiny_dir):
    """A serves 0:2, B and C both 2:4; the chain's 2:4 peer goes down after 6
    tokens: the client replays into the other one and the tokens don't change."""
    n_new = 24
    ref = local_greedy(tiny_dir, PROMPT, n_new)

    async def main():
        async with memory_swarm(tiny_dir, ["0:2", "2:4", "2:4"]) as s:
            await s.llm.wait_route()
            # wait until both 2:4 peers are in the client's view
            with trio.fail_after(10):
                while len([h for h in s.llm.hops() if h.start == 2]) < 2:
                    await trio.sleep(0.01)
            killed = []

            def on_token(i, tok):
                if i == 5:
                    (sess,) = s.llm.active
                    victim = next(hs.hop.peer for hs in sess.hops if hs.hop.start == 2)
                    s.net.set_down(victim)
                    killed.append(victim)

            res = await s.llm.generate(PROMPT, n_new, greedy=True, on_token=on_token)
            assert res.token_ids == ref
            assert len(res.recoveries) == 1
            rec = res.recoveries[0]
            assert rec["failed"] == killed[0] and rec["blocks"] == [2, 4]
            assert rec["recovered_s"] < 2.0
            survivor = next(p for p in s.peer_ids[1:] if p != killed[0])
            assert res.route[1]["peer"] == survivor
            # the survivor rebuilt the cache from the replayed prefix
            assert s.server_of(survivor).stats.tokens >= len(PROMPT) + 6

    trio.run(main)


def test_concurrent_sessions_are_batched_and_exact(gqa_dir):
    prompts = [ByteTokenizer().encode(t) for t in ("one", "two prompts", "a third, longer prompt", "4")]
    n_new = 16
    head = load_client_head(gqa_dir)
    span = [load_block_span(gqa_dir, 0, 4)]
    refs = [generate_greedy(head, span, p, n_new) for p in prompts]

    async def main():
        async with memory_swarm(gqa_dir, ["0:2", "2:4"]) as s:
            await s.llm.wait_route()
            one_at_a_time = [(await s.llm.generate(p, n_new)).token_ids for p in prompts]
            assert all(srv.stats.max_batch == 1 for srv in s.servers)
            results = [None] * len(prompts)

            async def run(i):
                results[i] = (await s.llm.generate(prompts[i], n_new)).token_ids

            async with trio.open_nursery() as n:
                for i in range(len(prompts)):
                    n.start_soon(run, i)
            assert results == one_at_a_time == refs
            assert max(srv.stats.max_batch for srv in s.servers) >= 2
            assert sum(srv.stats.batched_steps for srv in s.servers) >= 2
            # the decode steps travelled together: multi-session step requests to both peers
            assert all(srv.stats.step_requests >= 1 for srv in s.servers)
            assert s.llm.step_batches["requests"] >= 2 and s.llm.step_batches["fallbacks"] == 0
            # the sessions' prefills differ in length, yet they decoded as one cohort
            assert s.llm.step_batches["max_batch"] == len(prompts), s.llm.step_batches
            info = await s.llm.info(s.peer_ids[0])
            assert info["stats"]["max_batch"] == s.servers[0].stats.max_batch

    trio.run(main)


def test_refused_step_batch_falls_back_and_stays_exact(tiny_dir):
    """A peer that lost the sessions of a step batch refuses it; each session
    then resyncs on its own (replaying its cache) and the tokens are exact."""
    prompts = [PROMPT, PROMPT[:5], PROMPT[2:]]
    refs = [local_greedy(tiny_dir, p, N_NEW) for p in prompts]

    async def main():
        async with memory_swarm(tiny_dir, ["0:2", "2:4"]) as s:
            await s.llm.wait_route()
            results = [None] * len(prompts)

            def on_token(i, tok):
                if i == 4:  # the second peer forgets everyone's session
                    for k in list(s.servers[1].sessions):
                        s.servers[1]._free(k)

            async def run(i):
                results[i] = (await s.llm.generate(prompts[i], N_NEW, on_token=on_token if i == 0 else None)).token_ids

            async with trio.open_nursery() as n:
                for i in range(len(prompts)):
                    n.start_soon(run, i)
            assert results == refs
            assert s.llm.step_batches["fallbacks"] >= 2
            assert s.servers[1].stats.by_error.get("unknown-session", 0) >= 1

    trio.run(main)


def test_lost_server_session_is_replayed(tiny_dir):
    """A peer that forgot a session (expired, restarted) answers
    unknown-session; the client replays its inputs and the tokens are exact."""
    ref = local_greedy(tiny_dir, PROMPT, N_NEW)

    async def main():
        async with memory_swarm(tiny_dir, ["0:2", "2:4"]) as s:
            def on_token(i, tok):
                if i in (3, 9):
                    for srv in s.servers[i // 9 :]:
                        for k in list(srv.sessions):
                            srv._free(k)

            res = await s.llm.generate(PROMPT, N_NEW, on_token=on_token)
            assert res.token_ids == ref
            assert res.recoveries == []  # same peers, resynced
            assert s.servers[1].stats.by_error.get("unknown-session") == 2

    trio.run(main)


def test_sampling_is_reproducible_with_a_seed(tiny_dir):
    async def main():
        async with memory_swarm(tiny_dir, ["0:4"]) as s:
            a = await s.llm.generate(PROMPT, 12, greedy=False, temperature=1.0, seed=7)
            b = await s.llm.generate(PROMPT, 12, greedy=False, temperature=1.0, seed=7)
            assert a.token_ids == b.token_ids and len(a.token_ids) == 12

    trio.run(main)


def test_a_cancelled_session_does_not_hold_up_its_cohort(tiny_dir):
    """A stream that goes away mid-generation (an API client that hung up)
    leaves the cohort; the others finish with exact tokens and no wait runs
    out for it."""
    prompts = [PROMPT, PROMPT[:5], PROMPT[2:]]
    refs = [local_greedy(tiny_dir, p, N_NEW) for p in prompts]

    async def main():
        async with memory_swarm(tiny_dir, ["0:2", "2:4"]) as s:
            await s.llm.wait_route()
            # a long bound: a cancelled member still waited for would stall each step for 30 s
            s.llm.cohort_wait = 30.0
            results = [None] * len(prompts)
            gone = trio.CancelScope()

            def on_token(i, tok):
                if i == 3:
                    gone.cancel()

            async def run(i):
                if i == 0:
                    with gone:
                        await s.llm.generate(prompts[i], N_NEW, on_token=on_token)
                    return
                results[i] = (await s.llm.generate(prompts[i], N_NEW)).token_ids

            async with trio.open_nursery() as n:
                for i in range(len(prompts)):
                    n.start_soon(run, i)
            assert gone.cancelled_caught
            assert results[1:] == refs[1:]
            assert s.llm.step_batches["cohort_timeouts"] == 0, s.llm.step_batches
            assert not s.llm._decoding  # nobody is left in a decode loop

    trio.run(main)
