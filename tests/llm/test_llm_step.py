"""The ``step`` op: decode positions of several sessions in one request.

It must compute exactly what one ``forward`` per session computes, check
every session before any cache moves, and leave the server serving after a
refusal."""

from __future__ import annotations

import pytest
import torch
import trio

from fedswarm.llm_protocol import decode, encode, pack_tensor, unpack_tensor
from fedswarm.llm_serving import BlockServer, ServerLimits
from fedswarm.tasks.checkpoint import load_block_span, model_hash

SIDS = [bytes([65 + i]) * 16 for i in range(4)]


@pytest.fixture(scope="module")
def span(tiny_dir):
    return load_block_span(tiny_dir, 0, 2)


def call(srv, msg, sender="client-a"):
    return decode(trio.run(srv.handle, sender, encode(msg)))


def fwd(srv, sid, pos, x, max_length=32):
    return {"v": 1, "op": "forward", "model": srv.model_hash, "span": [0, 2], "session": sid, "pos": pos,
            "max_length": max_length, "hidden": pack_tensor(x)}


def step(srv, sids, pos, x, max_length=None):
    return {"v": 1, "op": "step", "model": srv.model_hash, "span": [0, 2], "sessions": list(sids), "pos": list(pos),
            "max_length": list(max_length or [32] * len(sids)), "hidden": pack_tensor(x)}


def opened(span, tiny_dir, prompts):
    """A server with one session per prompt (of different lengths)."""
    srv = BlockServer(span, model_hash(tiny_dir), limits=ServerLimits(max_batch=8))
    for sid, p in zip(SIDS, prompts):
        assert call(srv, fwd(srv, sid, 0, p))["ok"]
    return srv


def test_step_equals_one_forward_per_session(span, tiny_dir):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randn(n, 64, generator=g) for n in (3, 5, 2, 7)]
    nxt = torch.randn(4, 64, generator=g)
    a = opened(span, tiny_dir, prompts)
    b = opened(span, tiny_dir, prompts)
    r = call(a, step(a, SIDS, [len(p) for p in prompts], nxt))
    assert r["ok"] is True and r["length"] == [len(p) + 1 for p in prompts]
    got = unpack_tensor(r["hidden"])
    want = torch.cat([unpack_tensor(call(b, fwd(b, sid, len(p), nxt[i : i + 1]))["hidden"])
                      for i, (sid, p) in enumerate(zip(SIDS, prompts))])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert a.stats.step_requests == 1 and a.stats.max_batch == 4
    # a retried step (same positions again) rolls each cache back first
    again = unpack_tensor(call(a, step(a, SIDS, [len(p) for p in prompts], nxt))["hidden"])
    torch.testing.assert_close(again, want, rtol=1e-5, atol=1e-5)


def test_step_is_all_or_nothing(span, tiny_dir):
    prompts = [torch.randn(n, 64) for n in (3, 4)]
    srv = opened(span, tiny_dir, prompts)
    x = torch.randn(2, 64)
    refusals = {
        # the second session is unknown, is ahead of the server, or belongs to someone else
        "unknown-session": (step(srv, [SIDS[0], SIDS[2]], [3, 0], x), "client-a"),
        "pos-mismatch": (step(srv, SIDS[:2], [3, 9], x), "client-a"),
    }
    for code, (msg, sender) in refusals.items():
        r = call(srv, msg, sender)
        assert r["ok"] is False and r["error"] == code and r["index"] == 1, r
    assert call(srv, step(srv, SIDS[:2], [3, 4], x), "client-b")["error"] == "unknown-session"
    bad = {
        "bad-request": [step(srv, [SIDS[0], SIDS[0]], [3, 3], x),  # one session twice
                        step(srv, SIDS[:2], [3, 4], torch.randn(3, 64)),  # rows != sessions
                        step(srv, SIDS[:2], [3], x),
                        {**step(srv, SIDS[:2], [3, 4], x), "pos": [3, "4"]},
                        step(srv, [SIDS[0], b"short"], [3, 4], x)],
        "too-large": [step(srv, [bytes([i]) * 16 for i in range(9)], [0] * 9, torch.randn(9, 64))],
        "wrong-span": [{**step(srv, SIDS[:2], [3, 4], x), "span": [0, 1]}],
    }
    for code, msgs in bad.items():
        for m in msgs:
            assert call(srv, m)["error"] == code, (code, m)
    # no cache moved: both sessions still hold their prompts, and a good step works
    assert [s.cache.length for s in srv.sessions.values()] == [3, 4]
    r = call(srv, step(srv, SIDS[:2], [3, 4], x))
    assert r["ok"] is True and r["length"] == [4, 5]
