"""Chat: one session's KV cache is kept across turns, so a turn prefills only
the tokens the conversation gained; ``peer chat`` driven through a pipe."""

from __future__ import annotations

import re

import pytest
import trio

from fedswarm.llm_cli import load_client_model
from fedswarm.llm_client import common_prefix
from fedswarm.tasks.sampling import SamplingParams
from llm_swarm_helpers import memory_swarm


def test_session_reuse_prefills_only_the_new_suffix(gqa_dir):
    cm = load_client_model("tiny-llama-gqa")
    params = SamplingParams(max_new_tokens=10, temperature=0)

    async def main():
        async with memory_swarm(gqa_dir, ["0:2", "2:4"]) as s:
            async with s.llm.session(400) as sess:
                msgs = [{"role": "user", "content": "Hello!"}]
                r1 = cm.render_chat(msgs)
                a = await s.llm.generate(r1, params=params, tokenizer=cm.tokenizer, session=sess)
                assert a.prefill_tokens == len(r1) and a.reused_tokens == 0
                assert sess.tokens == r1 + a.token_ids[:-1]
                msgs += [{"role": "assistant", "content": a.text}, {"role": "user", "content": "And again?"}]
                r2 = cm.render_chat(msgs)
                sent_before = sess.prefilled
                b = await s.llm.generate(r2, params=params, tokenizer=cm.tokenizer, session=sess)
                keep = common_prefix(r1 + a.token_ids[:-1], r2)
                assert keep >= len(r1)
                assert b.reused_tokens == keep and b.prefill_tokens == len(r2) - keep
                # positions sent through the chain this turn: the new suffix, then one per decode step
                assert sess.prefilled - sent_before == len(r2) - keep + len(b.token_ids) - 1
                # the continued session gives what a fresh one gives
                fresh = await s.llm.generate(r2, params=params, tokenizer=cm.tokenizer)
                assert fresh.token_ids == b.token_ids and fresh.prefill_tokens == len(r2)
                # a rollback: an edited earlier turn keeps only the common prefix
                r3 = cm.render_chat([{"role": "user", "content": "Hello?"}])
                c = await s.llm.generate(r3, params=params, tokenizer=cm.tokenizer, session=sess)
                assert c.reused_tokens == common_prefix(r2, r3) < len(r1)
                assert c.token_ids == (await s.llm.generate(r3, params=params, tokenizer=cm.tokenizer)).token_ids

    trio.run(main)


@pytest.mark.slow
def test_peer_chat_through_a_pipe_two_turns(smol_swarm):
    from llm_proc_helpers import REAL_MODEL, peer_cli

    q1, q2 = "What is the capital of France?", "And of Germany?"
    r = peer_cli("chat", "--bootstrap", smol_swarm.bootstrap, "--model", REAL_MODEL, "--greedy",
                 "--max-new-tokens", "24", "--torch-threads", "1", input=f"{q1}\n{q2}\n")
    assert r.returncode == 0, r.stderr[-3000:]
    answers = r.stdout.strip().split("\n")
    assert len(answers) == 2 and "Paris" in answers[0] and "Berlin" in answers[1], r.stdout
    turns = [tuple(map(int, m)) for m in re.findall(r"turn \d+: prefilled (\d+) new tokens, reused (\d+)", r.stderr)]
    assert len(turns) == 2, r.stderr
    cm = load_client_model(REAL_MODEL)
    r1 = cm.render_chat([{"role": "user", "content": q1}])
    r2 = cm.render_chat([{"role": "user", "content": q1}, {"role": "assistant", "content": answers[0]},
                         {"role": "user", "content": q2}])
    assert turns[0] == (len(r1), 0)
    prefilled, reused = turns[1]
    assert prefilled + reused == len(r2)
    # everything of turn 1 (prompt and answer) was kept: only the new user turn was prefilled
    n1 = len(cm.tokenizer.encode(answers[0], add_special_tokens=False))
    assert reused == len(r1) + n1, (turns, len(r1), n1)
