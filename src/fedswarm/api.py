"""``peer api``: an OpenAI-compatible HTTP API in front of the swarm.

    peer api --bootstrap MADDR --listen 127.0.0.1:8000 [--model NAME]...

A swarm client (it serves no blocks itself) that holds, for each model it
offers, the embeddings, final norm, LM head and tokenizer, and answers

* ``GET /v1/models`` (and ``/v1/models/{id}``),
* ``POST /v1/chat/completions`` -- the messages are rendered with the model's
  chat template,
* ``POST /v1/completions`` -- the prompt is tokenized as ``peer generate
  --prompt`` does,

with ``stream: true`` as server-sent events in OpenAI's chunk format ending
with ``data: [DONE]`` (``stream_options.include_usage`` adds a usage chunk),
``usage`` counts, ``max_tokens`` / ``max_completion_tokens``, ``temperature``,
``top_p``, ``seed``, ``stop`` and, as extensions, ``top_k`` and
``repetition_penalty``. The same prompt, seed and settings give the same text
as ``peer generate`` (same tokenizer, :class:`~fedswarm.tasks.sampling.Sampler`
and route choice).

Every request is its own generation session, so concurrent requests run as
concurrent sessions and the serving peers batch their decode steps. Errors
use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: a bad
body is 400, an unknown model 404, a model no chain of peers serves 503 (with
the reason), an error after a stream started is sent as an ``error`` event.
A bad request never stops the server.

The app is Starlette, served by :func:`fedswarm.net.http.serve_asgi` on
hypercorn's trio worker, in the same trio run as the swarm client.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import trio

from .errors import FederationError, InputError

__all__ = ["add_api", "ApiModel", "build_app", "run_api", "ApiError"]

MAX_BODY = 4 * 1024 * 1024
DEFAULT_MAX_TOKENS = 512
MAX_MESSAGES = 1024
ROLES = ("system", "user", "assistant")


def add_api(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "api", help="serve an OpenAI-compatible HTTP API backed by the swarm's LLM peers",
        description="A swarm client answering /v1/models, /v1/chat/completions and /v1/completions (streaming "
                    "with stream: true). Example: peer api --bootstrap MADDR --listen 127.0.0.1:8000 "
                    "--model smollm2-135m-instruct")
    p.add_argument("--bootstrap", action="append", required=True, help="multiaddr of a swarm peer (repeatable)")
    p.add_argument("--listen", default="127.0.0.1:8000", help="HOST:PORT to serve on; port 0 picks a free port "
                   "(default: 127.0.0.1:8000)")
    p.add_argument("--model", action="append", default=[],
                   help="model to offer: a name (e.g. smollm2-135m-instruct), directory or .gguf file (repeatable; "
                        "default: the shipped models and the model store's)")
    p.add_argument("--key", help="client key file (default: a fresh key)")
    p.add_argument("--request-timeout", type=float, default=10.0,
                   help="per-hop request limit in seconds (default: 10)")
    p.add_argument("--connect-timeout", type=float, default=15.0,
                   help="seconds to reach the swarm at start (default: 15)")
    p.add_argument("--route-timeout", type=float, default=3.0,
                   help="seconds a request waits for a chain of peers before a 503 (default: 3)")
    p.add_argument("--torch-threads", type=int, help="torch intra-op threads (default: torch's)")
    from .llm_cli import add_forward_option, add_tenant_options

    add_tenant_options(p)
    add_forward_option(p)
    p.set_defaults(func=_cmd_api)


# ----------------------------------------------------------------- errors

class ApiError(Exception):
    """An error answer: HTTP status + OpenAI error object."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _bad(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


# ----------------------------------------------------------------- models

@dataclass
class ApiModel:
    """One model the API offers; loaded on first use."""

    name: str
    ref: str
    client: Any = None  # llm_cli.ClientModel
    llm: Any = None  # SwarmLLM
    lock: trio.Lock = field(default_factory=trio.Lock)
    error: str | None = None


class _State:
    def __init__(self, models: dict[str, ApiModel], make_llm: Any, route_timeout: float) -> None:
        self.models = models
        self.make_llm = make_llm  # ClientModel -> SwarmLLM
        self.route_timeout = route_timeout
        self.nursery: trio.Nursery | None = None
        self.requests = 0
        self.active = 0

    async def model(self, name: Any) -> ApiModel:
        if not isinstance(name, str) or not name:
            raise _bad("'model' must be a non-empty string", "model", "missing_required_parameter"
                       if name is None else "invalid_type")
        m = self.models.get(name)
        if m is None:
            raise ApiError(404, f"The model '{name}' does not exist; offered: {', '.join(sorted(self.models))}",
                           param="model", code="model_not_found")
        async with m.lock:
            if m.client is None and m.error is None:
                from .llm_cli import load_client_model

                try:
                    m.client = await trio.to_thread.run_sync(load_client_model, m.ref)
                except (InputError, OSError, ValueError) as exc:
                    m.error = str(exc)
            if m.error is not None:
                raise ApiError(503, f"model '{name}' cannot be loaded here: {m.error}", type="server_error",
                               code="model_unavailable")
            if m.llm is None:
                m.llm = self.make_llm(m.client)
        return m


# ----------------------------------------------------------------- request parsing

def _get(body: dict[str, Any], key: str, kinds: tuple[type, ...], default: Any = None) -> Any:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in kinds:
        raise _bad(f"'{key}' must be {' or '.join(k.__name__ for k in kinds)}", key, "invalid_type")
    if not isinstance(v, kinds):
        raise _bad(f"'{key}' must be {' or '.join(k.__name__ for k in kinds)}", key, "invalid_type")
    if isinstance(v, float) and not math.isfinite(v):
        raise _bad(f"'{key}' must be finite", key)
    return v


def sampling_from_body(body: dict[str, Any], room: int) -> Any:
    """SamplingParams from an OpenAI request body; ``room``: positions left
    after the prompt."""
    from .tasks.sampling import SamplingParams

    mt = _get(body, "max_completion_tokens", (int,))
    if mt is None:
        mt = _get(body, "max_tokens", (int,))
        param = "max_tokens"
    else:
        param = "max_completion_tokens"
    if mt is not None and mt <= 0:
        raise _bad(f"'{param}' must be at least 1, got {mt}", param)
    if mt is not None and mt > room:
        raise ApiError(400, f"this model's context allows {room} more tokens after the prompt, but {mt} were "
                       f"asked for", param=param, code="context_length_exceeded")
    if room < 1:
        raise ApiError(400, "the prompt fills the model's context", param="messages" if "messages" in body
                       else "prompt", code="context_length_exceeded")
    n = _get(body, "n", (int,), 1)
    if n != 1:
        raise _bad("only n = 1 is supported", "n")
    for k in ("frequency_penalty", "presence_penalty"):
        if _get(body, k, (int, float), 0) != 0:
            raise _bad(f"'{k}' is not supported (use repetition_penalty)", k, "unsupported_parameter")
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stop = tuple(stop)
    else:
        raise _bad("'stop' must be a string or a list of strings", "stop", "invalid_type")
    fields = {
        "max_new_tokens": mt if mt is not None else min(DEFAULT_MAX_TOKENS, room),
        "temperature": _get(body, "temperature", (int, float), 1.0),
        "top_p": _get(body, "top_p", (int, float), 1.0),
        "top_k": _get(body, "top_k", (int,), 0),
        "repetition_penalty": _get(body, "repetition_penalty", (int, float), 1.0),
        "seed": _get(body, "seed", (int,)),
        "stop": stop,
        "stop_at_eos": not _get(body, "ignore_eos", (bool,), False),
    }
    try:
        return SamplingParams(**fields)
    except InputError as exc:
        bad: str | None = next((k for k in ("temperature", "top_p", "top_k", "repetition_penalty", "seed", "stop")
                                if str(exc.what).startswith(k)), None)
        if str(exc.what).startswith("max_tokens"):
            bad = "max_tokens"
        raise _bad(exc.what, bad) from None


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    msgs = body.get("messages")
    if msgs is None:
        raise _bad("'messages' is required", "messages", "missing_required_parameter")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("'messages' must be a non-empty list", "messages", "invalid_type")
    if len(msgs) > MAX_MESSAGES:
        raise _bad(f"at most {MAX_MESSAGES} messages", "messages")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(f"{where} must be an object", where, "invalid_type")
        role = m.get("role")
        if role == "developer":
            role = "system"
        if role not in ROLES:
            raise _bad(f"{where}.role must be one of {', '.join(ROLES)}", f"{where}.role")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            parts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise _bad(f"{where}.content: only text parts are supported", f"{where}.content")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise _bad(f"{where}.content must be a string", f"{where}.content", "invalid_type")
        out.append({"role": role, "content": content})
    return out


def _prompt(body: dict[str, Any], vocab: int) -> str | list[int]:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        if not p:
            raise _bad("'prompt' is empty", "prompt")
        return p
    if isinstance(p, list) and p and all(isinstance(i, int) and not isinstance(i, bool) for i in p):
        if any(not 0 <= i < vocab for i in p):
            raise _bad(f"prompt token ids must be in [0, {vocab})", "prompt")
        return list(p)
    if p is None:
        raise _bad("'prompt' is required", "prompt", "missing_required_parameter")
    raise _bad("'prompt' must be a string, a list of token ids, or a list of one of those", "prompt", "invalid_type")


# ----------------------------------------------------------------- the app

def build_app(state: _State) -> Any:
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    def err(e: ApiError) -> Response:
        return JSONResponse(e.body(), status_code=e.status)

    async def read_json(request: Request) -> dict[str, Any]:
        size = 0
        chunks = []
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY:
                raise ApiError(413, f"request body over {MAX_BODY} bytes", code="request_too_large")
            chunks.append(chunk)
        raw = b"".join(chunks)
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise _bad(f"the request body is not valid JSON: {exc}", None, "invalid_json") from None
        if not isinstance(body, dict):
            raise _bad("the request body must be a JSON object", None, "invalid_json")
        return body

    def model_card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": 0, "owned_by": "fedswarm"}

    async def list_models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [model_card(n) for n in sorted(state.models)]})

    async def get_model(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in state.models:
            return err(ApiError(404, f"The model '{name}' does not exist", param="model", code="model_not_found"))
        return JSONResponse(model_card(name))

    async def completion(request: Request, chat: bool) -> Response:
        try:
            body = await read_json(request)
            m = await state.model(body.get("model"))
            cm = m.client
            from .llm_cli import context_limit

            ctx = context_limit(cm)
            if chat:
                msgs = _messages(body)
                try:
                    prompt = cm.render_chat(msgs)
                except Exception as exc:  # a template that rejects these messages (e.g. role order)
                    raise _bad(f"the chat template rejected the messages: {exc}", "messages") from None
            else:
                p = _prompt(body, cm.config.vocab_size)
                prompt = cm.encode(p) if isinstance(p, str) else p
            if len(prompt) >= ctx:
                raise ApiError(400, f"the prompt has {len(prompt)} tokens; this model's context is {ctx}",
                               param="messages" if chat else "prompt", code="context_length_exceeded")
            params = sampling_from_body(body, ctx - len(prompt))
            stream = _get(body, "stream", (bool,), False)
            so = body.get("stream_options")
            include_usage = isinstance(so, dict) and so.get("include_usage") is True
            try:
                await m.llm.wait_route(timeout=state.route_timeout)
            except FederationError as exc:
                raise ApiError(503, f"no chain of peers serves model '{m.name}' now: {exc}", type="server_error",
                               code="no_route") from None
        except ApiError as e:
            return err(e)
        state.requests += 1
        rid = ("chatcmpl-" if chat else "cmpl-") + os.urandom(12).hex()
        created = int(time.time())
        fp = "fedswarm-" + cm.hash[:12]
        if stream:
            return StreamingResponse(_sse(state, m, prompt, params, chat, rid, created, fp, include_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            state.active += 1
            res = await m.llm.generate(prompt, params=params, tokenizer=cm.tokenizer)
        except InputError as exc:
            return err(_bad(str(exc)))
        except FederationError as exc:
            return err(ApiError(503, f"generation failed in the swarm: {exc}", type="server_error",
                                code="swarm_error"))
        finally:
            state.active -= 1
        usage = {"prompt_tokens": len(prompt), "completion_tokens": len(res.token_ids),
                 "total_tokens": len(prompt) + len(res.token_ids)}
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": res.text, "refusal": None},
                      "logprobs": None, "finish_reason": res.finish_reason}
        else:
            choice = {"index": 0, "text": res.text, "logprobs": None, "finish_reason": res.finish_reason}
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                             "created": created, "model": m.name, "system_fingerprint": fp,
                             "choices": [choice], "usage": usage})

    async def chat_completions(request: Request) -> Response:
        return await completion(request, True)

    async def completions(request: Request) -> Response:
        return await completion(request, False)

    async def http_error(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 500)
        code = {404: "not_found", 405: "method_not_allowed"}.get(status, "http_error")
        return err(ApiError(status, f"{request.method} {request.url.path}: {getattr(exc, 'detail', exc)}",
                            code=code))

    async def server_error(request: Request, exc: Exception) -> Response:
        return err(ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error",
                            code="internal_error"))

    routes = [
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{name:path}", get_model, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: server_error})


async def _sse(state: _State, m: ApiModel, prompt: list[int], params: Any, chat: bool, rid: str, created: int,
               fp: str, include_usage: bool) -> Any:
    """The SSE body: the generation runs in the server's nursery and feeds a
    channel; leaving early (client gone) cancels it."""
    send, recv = trio.open_memory_channel[tuple[str, Any]](math.inf)
    scope = trio.CancelScope()
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(delta: dict[str, Any] | str | None, finish: str | None = None, usage: Any = None) -> str:
        if chat:
            choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None,
                                                 "finish_reason": finish}]
        else:
            choices = [] if delta is None else [{"index": 0, "text": delta, "logprobs": None,
                                                 "finish_reason": finish}]
        d = {"id": rid, "object": obj, "created": created, "model": m.name, "system_fingerprint": fp,
             "choices": choices}
        if include_usage:
            d["usage"] = usage
        return f"data: {json.dumps(d)}\n\n"

    async def produce() -> None:
        state.active += 1
        try:
            with scope:
                try:
                    res = await m.llm.generate(prompt, params=params, tokenizer=m.client.tokenizer,
                                               on_text=lambda s: send.send_nowait(("text", s)))
                    send.send_nowait(("done", res))
                except FederationError as exc:
                    send.send_nowait(("error", ApiError(503, f"generation failed in the swarm: {exc}",
                                                        type="server_error", code="swarm_error")))
                except Exception as exc:  # noqa: BLE001 - reported to this client; the server keeps serving
                    send.send_nowait(("error", ApiError(500, f"internal error: {type(exc).__name__}: {exc}",
                                                        type="server_error", code="internal_error")))
        finally:
            state.active -= 1
            send.close()

    assert state.nursery is not None
    state.nursery.start_soon(produce)
    try:
        yield chunk({"role": "assistant", "content": ""} if chat else "")
        async for kind, val in recv:
            if kind == "text":
                yield chunk({"content": val} if chat else val)
            elif kind == "done":
                yield chunk({} if chat else "", val.finish_reason)
                if include_usage:
                    n = len(val.token_ids)
                    yield chunk(None, usage={"prompt_tokens": len(prompt), "completion_tokens": n,
                                             "total_tokens": len(prompt) + n})
            else:
                yield f"data: {json.dumps(val.body())}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        scope.cancel()


# ----------------------------------------------------------------- running it

def default_models() -> list[str]:
    from .tasks.checkpoint import shipped_models

    names = list(shipped_models())
    try:
        from . import models as store

        lister = getattr(store, "list_models", None)
        if lister is not None:
            for entry in lister():
                n = entry.get("name") if isinstance(entry, dict) else getattr(entry, "name", None)
                if isinstance(n, str) and n not in names:
                    names.append(n)
    except Exception:  # noqa: BLE001 - a broken store must not stop the API; the shipped models remain
        pass
    return names


async def run_api(a: argparse.Namespace, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    from .client import open_swarm_client
    from .core.identity import Identity, load_or_create_key
    from .net.http import bind_tcp, parse_listen, serve_asgi
    from .llm_cli import load_client_model
    from .llm_client import SwarmLLM

    host, port = parse_listen(a.listen)
    refs = a.model or default_models()
    models: dict[str, ApiModel] = {}
    for ref in refs:
        models[ref] = ApiModel(ref, ref)
    # the models named on the command line must load now (a typo is an error at start)
    for ref in a.model:
        models[ref].client = load_client_model(ref)
    sock = bind_tcp(host, port)
    identity = load_or_create_key(a.key) if a.key else Identity.generate()
    async with open_swarm_client(a.bootstrap, identity=identity, connect_timeout=a.connect_timeout) as client:
        def make_llm(cm: Any) -> Any:
            return SwarmLLM(client.agent.transport, lambda: client.core.view.live(client.agent.now()), cm.head,
                            cm.hash, request_timeout=a.request_timeout, route_timeout=a.route_timeout,
                            tenant=a.tenant, weight=a.weight, identity=identity,
                            forward=not getattr(a, "no_forward", False))

        state = _State(models, make_llm, a.route_timeout)
        app = build_app(state)
        async with trio.open_nursery() as nursery:
            state.nursery = nursery
            for m in models.values():
                if m.client is not None:
                    m.llm = make_llm(m.client)
                    nursery.start_soon(_warm, m.llm)
            bound = await nursery.start(serve_asgi, app, sock)
            task_status.started(bound)
            print(f"peer api: serving {', '.join(models)} on http://{bound[0]}:{bound[1]}/v1", flush=True)


async def _warm(llm: Any) -> None:
    """Dial the peers of a first chain now, not in the first request."""
    try:
        await llm.warm_up()
    except FederationError:
        pass


def _cmd_api(a: argparse.Namespace) -> int:
    if a.torch_threads:
        import torch

        torch.set_num_threads(a.torch_threads)
    try:
        from .net.quiet import quiet_libraries

        quiet_libraries()
    except ImportError:
        pass
    try:
        trio.run(run_api, a)
    except KeyboardInterrupt:
        print("peer api: stopped", file=sys.stderr)
    return 0
