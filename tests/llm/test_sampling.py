"""Sampling: parameter validation, the seeded sampler's properties, stop
strings, and seeded generation through an in-process swarm equal to the same
sampler run locally."""

from __future__ import annotations

import pytest
import torch
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from fedswarm.errors import InputError
from fedswarm.tasks.checkpoint import load_block_span, load_client_head
from fedswarm.tasks.sampling import Sampler, SamplingParams, StopMatcher
from fedswarm.tasks.tokenizer import load_tokenizer
from llm_swarm_helpers import memory_swarm

logit_lists = st.lists(st.floats(min_value=-20, max_value=20, allow_nan=False), min_size=2, max_size=40)


@pytest.mark.parametrize("kw", [
    {"max_new_tokens": 0}, {"max_new_tokens": -3}, {"max_new_tokens": 2.5}, {"temperature": -0.1},
    {"temperature": float("nan")}, {"top_p": 0.0}, {"top_p": 1.01}, {"top_p": -1}, {"top_k": -1},
    {"repetition_penalty": 0}, {"seed": "x"}, {"seed": 2**70}, {"stop": [""]}, {"stop": [1]},
    {"stop": ["a"] * 9}, {"temperature": True},
])
def test_bad_params_are_input_errors(kw):
    with pytest.raises(InputError):
        SamplingParams(**kw)


def test_temperature_zero_is_greedy_and_draws_nothing():
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    for p in (SamplingParams(temperature=0.0), SamplingParams(greedy=True, temperature=5.0)):
        s = Sampler(p)
        state = s._gen.get_state().clone()
        assert [s.pick(logits) for _ in range(5)] == [1] * 5
        assert torch.equal(s._gen.get_state(), state)


@settings(max_examples=60)
@given(logits=logit_lists, seed=st.integers(0, 2**40), temp=st.floats(0.1, 3.0))
def test_same_seed_same_tokens(logits, seed, temp):
    x = torch.tensor(logits)
    p = SamplingParams(temperature=temp, seed=seed)
    a, b = Sampler(p), Sampler(p)
    assert [a.pick(x) for _ in range(20)] == [b.pick(x) for _ in range(20)]


def test_different_seeds_differ():
    x = torch.zeros(50)
    runs = {tuple(Sampler(SamplingParams(seed=s)).pick(x) for _ in range(10)) for s in range(5)}
    assert len(runs) == 5


@settings(max_examples=60)
@given(logits=logit_lists, k=st.integers(1, 6), seed=st.integers(0, 1000))
def test_top_k_restricts_support(logits, k, seed):
    x = torch.tensor(logits)
    logits = x.tolist()
    s = Sampler(SamplingParams(top_k=k, seed=seed))
    order = sorted(range(len(logits)), key=lambda i: (-logits[i], i))
    allowed = set(order[:k])
    assert {s.pick(x) for _ in range(30)} <= allowed


@settings(max_examples=60)
@given(logits=logit_lists, top_p=st.floats(0.05, 1.0), seed=st.integers(0, 1000))
def test_top_p_keeps_the_smallest_nucleus(logits, top_p, seed):
    x = torch.tensor(logits).double()  # the sampler sees float32 logits
    logits = x.tolist()
    probs = torch.softmax(x, 0).tolist()
    order = sorted(range(len(logits)), key=lambda i: (-logits[i], i))
    nucleus, mass = [], 0.0  # the most likely tokens until their mass reaches top_p
    for i in order:
        if mass >= top_p and top_p < 1:
            break
        nucleus.append(i)
        mass += probs[i]
    s = Sampler(SamplingParams(top_p=top_p, seed=seed))
    ids, p = s.distribution(x.float())
    assert set(ids.tolist()) <= set(nucleus) and len(ids) >= len(nucleus) - 1  # float rounding: one token
    assert abs(float(p.sum()) - 1) < 1e-9
    assert {s.pick(x.float()) for _ in range(30)} <= set(nucleus)


def test_top_p_tiny_is_greedy_support():
    x = torch.tensor([1.0, 4.0, 2.0])
    s = Sampler(SamplingParams(top_p=1e-6, seed=0))
    assert {s.pick(x) for _ in range(20)} == {1}


def test_repetition_penalty_demotes_seen_tokens():
    x = torch.tensor([2.0, 1.9, -1.0, -1.1])
    greedy = SamplingParams(temperature=0)
    assert Sampler(greedy).pick(x, history=[0]) == 0
    pen = Sampler(greedy.with_(repetition_penalty=1.5))
    assert pen.pick(x, history=[0]) == 1  # 2.0 / 1.5 < 1.9
    # negative logits get more negative
    assert pen.penalize(x, [2]).tolist()[2] == pytest.approx(-1.5)
    # sampling: a huge penalty on everything but one token leaves mostly that token
    s = Sampler(SamplingParams(repetition_penalty=50.0, seed=1))
    picks = [s.pick(torch.tensor([3.0, 3.0, 3.0, 3.0]), history=[0, 1, 2]) for _ in range(20)]
    assert picks.count(3) >= 18


@settings(max_examples=200)
@given(text=st.text(alphabet="ab\u00e9c\u4e2d", max_size=30), stops=st.lists(st.text(alphabet="ab\u00e9c", min_size=1,
       max_size=3), max_size=3), cuts=st.lists(st.integers(0, 30), max_size=10))
def test_stop_matcher_shows_text_before_the_first_stop(text, stops, cuts):
    bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    m = StopMatcher(stops)
    shown = []
    for a, b in zip(bounds, bounds[1:]):
        shown.append(m.push(text[a:b]))
        assert "".join(shown) == m.output
        assert not any(s in m.output for s in stops)  # never shows a stop string
    shown.append(m.finish())
    got = "".join(shown)
    assert text.startswith(got)
    assert not any(s in got for s in stops)
    if any(s in text for s in stops):
        assert m.stopped in stops and text[len(got):].startswith(m.stopped)
        # nothing was cut before the first place a stop string ends
        first_end = min(i + len(s) for s in stops for i in range(len(text)) if text.startswith(s, i))
        assert len(got) + len(m.stopped) <= first_end + max(map(len, stops))
    else:
        assert got == text and m.stopped is None


async def _local_sample(d, prompt, params):
    head = load_client_head(d)
    span = load_block_span(d, 0, 4)
    cache = span.new_cache(len(prompt) + params.max_new_tokens)
    s = Sampler(params)
    ids, out, hist = prompt, [], list(prompt)
    with torch.no_grad():
        for _ in range(params.max_new_tokens):
            h = span(head.embed(torch.tensor([ids])), cache)
            tok = s.pick(head.logits(h[:, -1:])[0, -1], hist)
            out.append(tok)
            hist.append(tok)
            ids = [tok]
    return out


def test_seeded_swarm_sampling_equals_local_and_stop_strings(gqa_dir):
    tok = load_tokenizer(gqa_dir)
    prompt = tok.encode("Hello, swarm!")
    params = SamplingParams(max_new_tokens=24, temperature=0.9, top_k=40, top_p=0.95, repetition_penalty=1.1,
                            seed=1234, stop_at_eos=False)

    async def main():
        ref = await _local_sample(gqa_dir, prompt, params)
        async with memory_swarm(gqa_dir, ["0:2", "2:4"]) as s:
            a = await s.llm.generate(prompt, params=params)
            b = await s.llm.generate(prompt, params=params)
            assert a.token_ids == b.token_ids == ref
            assert a.seed == 1234
            other = await s.llm.generate(prompt, params=params.with_(seed=99))
            assert other.token_ids != ref
            # text with the stream decoder; then a stop string cut from it
            pieces = []
            full = await s.llm.generate(prompt, params=params, tokenizer=tok, on_text=pieces.append)
            assert full.text == "".join(pieces) == tok.decode(ref)
            printable = [i for i, ch in enumerate(full.text) if ch.isprintable() and ch != "\ufffd"]
            assert len(printable) >= 3, full.text
            at = printable[len(printable) // 2]
            stop = full.text[at]
            cut = await s.llm.generate(prompt, params=params.with_(stop=(stop,)), tokenizer=tok)
            assert cut.finish_reason == "stop"
            assert cut.text == full.text[: full.text.index(stop)]
            assert stop not in cut.text
            assert cut.token_ids == ref[: len(cut.token_ids)]

    trio.run(main)
