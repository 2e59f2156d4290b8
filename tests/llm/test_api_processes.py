"""``peer api`` as a process in front of two ``peer start`` processes serving
SmolLM2 (blocks 0:15 and 15:30), with the official ``openai`` client: the
streamed text equals ``peer generate``'s for the same prompt, seed and
settings; bad requests get OpenAI errors and the server keeps serving."""

from __future__ import annotations

import json

import pytest

from llm_proc_helpers import REAL_MODEL, peer_cli

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"


def client(api):
    openai = pytest.importorskip("openai")  # test_peer_generate_bad_input_is_one_line runs without it
    return openai.OpenAI(base_url=api.url, api_key="unused", max_retries=0, timeout=120)


def generate(swarm, *args):
    r = peer_cli("generate", "--bootstrap", swarm.bootstrap, "--model", REAL_MODEL, "--torch-threads", "1",
                 "--json", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def test_openai_stream_equals_peer_generate(smol_swarm, smol_api):
    c = client(smol_api)
    assert [m.id for m in c.models.list()] == [REAL_MODEL]
    settings = {"max_tokens": 24, "seed": 11, "temperature": 0.7, "top_p": 0.9}
    stream = c.chat.completions.create(model=REAL_MODEL, messages=[{"role": "user", "content": QUESTION}],
                                       stream=True, **settings)
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    ref = generate(smol_swarm, "--chat", "--prompt", QUESTION, "--max-new-tokens", "24", "--seed", "11",
                   "--temperature", "0.7", "--top-p", "0.9")
    assert text == ref["text"] and text.strip()
    assert "Paris" in text, text
    assert [h["blocks"] for h in ref["route"]] == [[0, 15], [15, 30]]
    assert ref["seed"] == 11 and ref["finish_reason"] in ("stop", "length")


def test_bad_requests_and_the_server_keeps_serving(smol_api):
    openai = pytest.importorskip("openai")
    c = client(smol_api)
    for kw, status in [({"model": "nope"}, 404), ({"max_tokens": 0}, 400), ({"temperature": -1}, 400),
                       ({"top_p": 2}, 400), ({"messages": [{"role": "user", "content": "hi " * 3000}]}, 400)]:
        args = {"model": REAL_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kw}
        with pytest.raises(openai.APIStatusError) as ei:
            c.chat.completions.create(**args)
        assert ei.value.status_code == status
        assert set(ei.value.response.json()["error"]) == {"message", "type", "param", "code"}
    r = c.chat.completions.create(model=REAL_MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=12,
                                  temperature=0)
    assert "Paris" in r.choices[0].message.content
    assert smol_api.proc.poll() is None


def test_peer_generate_bad_input_is_one_line(smol_swarm):
    # (every bad sampling value is an InputError: test_sampling.py; here the command line's handling)
    for args in (["--prompt", "hi", "--top-p", "0"], ["--prompt", "hi " * 3000]):
        r = peer_cli("generate", "--bootstrap", smol_swarm.bootstrap, "--model", REAL_MODEL, *args)
        assert r.returncode == 2, (args, r.stderr[-2000:])
        assert "Traceback" not in r.stderr
    r = peer_cli("generate", "--bootstrap", smol_swarm.bootstrap, "--model", "no-such-model", "--prompt", "hi")
    assert r.returncode == 2 and "no-such-model" in r.stderr
