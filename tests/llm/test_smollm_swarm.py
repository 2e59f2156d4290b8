"""Greedy generation through 2 and 3 peers (in-process MemoryNetwork swarm)
equals transformers' model loaded from the same GGUF, token for token: the
pulled SmolLM2 (tied embeddings, Q4_1/Q8_0) and a small GGUF with untied
embeddings (F16/Q8_0) that the test writes."""

from __future__ import annotations

import pytest
import trio

from fedswarm.tasks.tokenizer import load_tokenizer
from gguf_testing import hf_greedy, hf_margins, smollm_path, tiny_files
from llm_swarm_helpers import memory_swarm

N_NEW = 12
#: a bfloat16 rounding step of a logit of 16 to 32 (SmolLM2's top logits here)
BF16_STEP = 0.125
CHAINS = {
    "smollm": (["0:15", "15:30"], ["0:7", "7:19", "19:30"]),
    "tiny": (["0:2", "2:4"], ["0:1", "1:3", "3:4"]),
}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return {"smollm": smollm_path(), "tiny": tiny_files(str(tmp_path_factory.mktemp("swarm")))[0]}


@pytest.mark.parametrize("which", ["smollm", "tiny"])
def test_swarm_greedy_equals_transformers_on_gguf(which, paths):
    path = paths[which]
    tok = load_tokenizer(path)
    chat = [{"role": "user", "content": "Write a long story about a dragon who learns to bake bread."}]
    prompt = tok.encode(tok.apply_chat_template(chat), add_special_tokens=False)
    ref = hf_greedy(str(path), tuple(prompt), N_NEW)
    assert len(ref) == N_NEW and len(set(ref)) > 3
    got = {}

    async def main():
        for blocks in CHAINS[which]:
            async with memory_swarm(path, blocks) as s:
                res = await s.llm.generate(prompt, N_NEW, greedy=True)
                got[tuple(blocks)] = res.token_ids
                assert [h["blocks"] for h in res.route] == [[int(x) for x in b.split(":")] for b in blocks]

    trio.run(main)
    for blocks, toks in got.items():
        assert toks == ref, (blocks, tok.decode(toks), tok.decode(ref))
    if which == "smollm":
        assert tok.decode(ref).strip()  # readable text, not ids


def test_bf16_peers_decode_as_transformers_bf16(paths):
    """Two peers serving SmolLM2's halves in bfloat16 (``--serve-dtype
    bfloat16``, what ``auto`` picks on a GPU) pick, at every step, a token
    that transformers' model loaded in bfloat16 from the same GGUF ranks
    first, or within one bfloat16 rounding step of first, read teacher-forced
    over the swarm's continuation.

    Greedy tokens alone are not compared: this prompt's first new token is
    an exact tie of bfloat16 logits, which the two implementations' CPU
    kernels break differently from one CPU to another (on a CPU with
    AVX512-BF16 transformers' own cached greedy run picks a third token).
    That the peers really compute in bfloat16 is their ``dtype_name`` here,
    and ``test_llm_processes.py::test_peers_serve_in_the_dtype_asked_for``
    compares them with the same spans run in one process."""
    path = paths["smollm"]
    tok = load_tokenizer(path)
    chat = [{"role": "user", "content": "List three prime numbers and explain why."}]
    prompt = tok.encode(tok.apply_chat_template(chat), add_special_tokens=False)

    async def main():
        async with memory_swarm(path, ["0:15", "15:30"], dtype="bfloat16") as s:
            assert [sv.dtype_name for sv in s.servers] == ["bfloat16", "bfloat16"]
            return (await s.llm.generate(prompt, N_NEW, greedy=True)).token_ids

    toks = trio.run(main)
    assert len(toks) == N_NEW
    margins = hf_margins(str(path), prompt, toks, "bfloat16")
    assert max(margins) <= BF16_STEP, (tok.decode(toks), margins)
    # the check has teeth: a continuation with one token swapped for another
    # that transformers ranks far down is caught
    worse = list(toks)
    worse[N_NEW // 2] = (worse[N_NEW // 2] + 1) % 49152
    assert max(hf_margins(str(path), prompt, worse, "bfloat16")) > 4 * BF16_STEP
