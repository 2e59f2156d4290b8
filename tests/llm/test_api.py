"""``peer api``'s app against an in-process swarm (MemoryNetwork peers), served
by hypercorn's trio worker on 127.0.0.1 and driven by the official ``openai``
client: models, chat and text completions streamed and not, usage, seeds,
stop strings, every bad input's status and error shape (the server keeps
serving), 503 for a model no peer serves, concurrent streams batched."""

from __future__ import annotations

import json
import functools
import queue
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import trio

from fedswarm.api import ApiModel, _State, build_app
from fedswarm.net.http import bind_tcp, serve_asgi
from fedswarm.llm_cli import load_client_model
from fedswarm.llm_client import SwarmLLM
from fedswarm.tasks.sampling import SamplingParams
from llm_swarm_helpers import memory_swarm


MODEL = "tiny-llama-gqa"
MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, swarm!"}]


class Api:
    def __init__(self, url, token, swarm, cm):
        self.url, self.token, self.swarm, self.cm = url, token, swarm, cm

    @functools.cached_property
    def client(self):
        """The official ``openai`` client (a test that uses it is skipped
        without the package; the raw-HTTP tests run anyway)."""
        openai = pytest.importorskip("openai")
        return openai.OpenAI(base_url=self.url, api_key="unused", max_retries=0, timeout=60)

    def run(self, afn, *args):
        """Run ``afn`` in the server's trio loop (e.g. a reference generation)."""
        return trio.from_thread.run(afn, *args, trio_token=self.token)


@pytest.fixture(scope="module")
def api(gqa_dir):
    ready: queue.Queue = queue.Queue()
    stop = threading.Event()

    async def main():
        cm = load_client_model(MODEL)
        other = load_client_model("tiny-llama")  # offered, but no peer serves it
        async with memory_swarm(gqa_dir, ["0:2", "2:4"]) as s:
            def make_llm(c):
                return SwarmLLM(s.client.agent.transport, lambda: s.client.core.view.live(s.client.agent.now()),
                                c.head, c.hash, route_timeout=0.5)

            models = {MODEL: ApiModel(MODEL, MODEL, client=cm, llm=s.llm),
                      "tiny-llama": ApiModel("tiny-llama", "tiny-llama", client=other)}
            state = _State(models, make_llm, route_timeout=0.5)
            await s.llm.wait_route()
            async with trio.open_nursery() as n:
                state.nursery = n
                host, port = await n.start(serve_asgi, build_app(state), bind_tcp("127.0.0.1", 0))
                ready.put((f"http://{host}:{port}/v1", trio.lowlevel.current_trio_token(), s, cm))
                while not stop.is_set():
                    await trio.sleep(0.05)
                n.cancel_scope.cancel()

    t = threading.Thread(target=lambda: trio.run(main), daemon=True)
    t.start()
    a = Api(*ready.get(timeout=120))
    yield a
    stop.set()
    t.join(30)


def chat_text(api, stream=False, **kw):
    kw = {"model": MODEL, "messages": MSGS, "max_tokens": 10, "seed": 7, "temperature": 0.8, **kw}
    if not stream:
        r = api.client.chat.completions.create(**kw)
        return r.choices[0].message.content, r
    chunks = list(api.client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks


def test_models_listed(api):
    ids = [m.id for m in api.client.models.list()]
    assert ids == sorted([MODEL, "tiny-llama"])
    assert api.client.models.retrieve(MODEL).id == MODEL


def test_chat_stream_equals_non_stream_and_generate(api):
    text, r = chat_text(api)
    streamed, chunks = chat_text(api, stream=True)
    assert streamed == text and len(text) > 0
    assert r.object == "chat.completion" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 10 and r.usage.prompt_tokens == len(api.cm.render_chat(MSGS))
    assert r.usage.total_tokens == r.usage.prompt_tokens + 10
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].choices == []
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    # the same as SwarmLLM.generate (what peer generate --chat runs) with the same settings
    params = SamplingParams(max_new_tokens=10, seed=7, temperature=0.8)

    async def ref():
        return await api.swarm.llm.generate(api.cm.render_chat(MSGS), params=params, tokenizer=api.cm.tokenizer)

    assert api.run(ref).text == text
    # another seed, another text; greedy ignores the seed
    assert chat_text(api, seed=8)[0] != text
    assert chat_text(api, temperature=0, seed=1)[0] == chat_text(api, temperature=0, seed=2)[0]


def test_completions_stream_and_stop(api):
    kw = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 14, "temperature": 0}
    r = api.client.completions.create(**kw)
    text = r.choices[0].text
    assert r.object == "text_completion" and r.usage.completion_tokens == 14
    streamed = "".join(c.choices[0].text for c in api.client.completions.create(stream=True, **kw) if c.choices)
    assert streamed == text
    ch = next(c for c in text[3:] if c.isprintable() and c != "\ufffd")
    cut = api.client.completions.create(stop=[ch], **kw)
    assert cut.choices[0].text == text[: text.index(ch)] and cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens < 14
    # token ids as the prompt
    ids = api.cm.encode("Once upon a time")
    assert api.client.completions.create(**{**kw, "prompt": ids}).choices[0].text == text


def err_of(exc):
    body = exc.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return exc.status_code, body["error"]


@pytest.mark.parametrize("kw,status,param", [
    ({"model": "no-such-model"}, 404, "model"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"max_completion_tokens": -1}, 400, "max_completion_tokens"),
    ({"temperature": -0.5}, 400, "temperature"),
    ({"top_p": 0}, 400, "top_p"),
    ({"top_p": 1.5}, 400, "top_p"),
    ({"max_tokens": 100000}, 400, "max_tokens"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x" * 2000}]}, 400, "messages"),
    ({"stop": 5}, 400, "stop"),
    ({"n": 2}, 400, "n"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_requests_get_openai_errors(api, kw, status, param, stream):
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.APIStatusError) as ei:
        api.client.chat.completions.create(**{"model": MODEL, "messages": MSGS, "max_tokens": 4, **kw},
                                           stream=stream)
    st, e = err_of(ei.value)
    assert st == status and e["param"] == param, e
    assert e["type"] == "invalid_request_error" and e["message"]


@pytest.mark.parametrize("body,code", [
    (b"{not json", "invalid_json"),
    (b"[1, 2]", "invalid_json"),
    (json.dumps({"model": MODEL}).encode(), "missing_required_parameter"),
    (json.dumps({"messages": MSGS}).encode(), "missing_required_parameter"),
])
def test_bad_bodies_are_400_and_the_server_keeps_serving(api, body, code):
    r = httpx.post(api.url + "/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == code
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert chat_text(api, max_tokens=2)[1].usage.completion_tokens == 2


def test_completions_bad_prompt_and_unknown_path(api):
    for prompt in (None, "", [1, "a"], [10**6]):
        r = httpx.post(api.url + "/completions", json={"model": MODEL, "prompt": prompt})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.get(api.url + "/nothing-here")
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(api.url + "/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_model_without_peers_is_503_with_the_reason(api):
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.APIStatusError) as ei:
        api.client.chat.completions.create(model="tiny-llama", messages=MSGS, max_tokens=4)
    st, e = err_of(ei.value)
    assert st == 503 and e["code"] == "no_route" and "no live chain" in e["message"]
    assert chat_text(api, max_tokens=2)[1].usage.completion_tokens == 2


def test_concurrent_streams_are_concurrent_sessions(api):
    seeds = list(range(6))
    solo = {s: chat_text(api, seed=s, max_tokens=12)[0] for s in seeds[:2]}
    before = [srv.stats.max_batch for srv in api.swarm.servers]
    with ThreadPoolExecutor(len(seeds)) as ex:
        texts = list(ex.map(lambda s: chat_text(api, stream=True, seed=s, max_tokens=12)[0], seeds))
    assert texts[:2] == [solo[0], solo[1]]
    assert len(set(texts)) > 1
    # the serving peers ran several sessions' steps in one batch
    assert max(srv.stats.max_batch for srv in api.swarm.servers) >= 2, before
    # and the client's LM head ran concurrent sessions' positions in one matmul
    assert api.swarm.llm.head_batches["max_batch"] >= 2, api.swarm.llm.head_batches
