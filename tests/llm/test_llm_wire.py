"""The block server's wire rules: strict msgpack, limits, model identity,
sessions; every bad request gets an error answer and the server keeps serving."""

from __future__ import annotations

import msgpack
import pytest
import torch
import trio

from hypothesis import given, settings
from hypothesis import strategies as st

from fedswarm.llm_client import Hop, find_route
from fedswarm.llm_protocol import check_tensor, finite, tensor_of
from fedswarm.llm_serving import (
    BlockServer,
    ServerLimits,
    WireError,
    choose_span,
    decode,
    encode,
    pack_tensor,
    parse_blocks,
    unpack_tensor,
)
from fedswarm.tasks.checkpoint import load_block_span, model_hash

SID = b"s" * 16


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture(scope="module")
def span(tiny_dir):
    return load_block_span(tiny_dir, 0, 2)


def make(span, tiny_dir, **limits):
    clock = FakeClock()
    return BlockServer(span, model_hash(tiny_dir), limits=ServerLimits(**limits), clock=clock), clock


def fwd(srv, *, pos=0, t=1, sid=SID, max_length=32, **over):
    msg = {"v": 1, "op": "forward", "model": srv.model_hash, "span": [0, 2], "session": sid, "pos": pos,
           "max_length": max_length, "hidden": pack_tensor(torch.randn(t, 64))}
    msg.update(over)
    return msg


def call(srv, msg, sender="client-a"):
    raw = msg if isinstance(msg, bytes) else encode(msg)
    return decode(trio.run(srv.handle, sender, raw))


def test_tensor_codec_roundtrip_and_validation():
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.randn(3, 5).to(dt)
        y = unpack_tensor(decode(encode({"t": pack_tensor(x)}))["t"])
        assert y.dtype == dt and torch.equal(x, y)
    good = pack_tensor(torch.zeros(2, 3))
    for bad in (
        {**good, "dtype": "float64"},
        {**good, "shape": [2, 4]},
        {**good, "shape": [-1, 3]},
        {**good, "shape": "2x3"},
        {**good, "data": "text"},
        {**good, "extra": 1},
        [1, 2],
    ):
        with pytest.raises(WireError):
            unpack_tensor(bad)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       st.lists(st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32),
                          st.sampled_from([0.0, -0.0, 1e-45, -1e-45, 65504.0, 65520.0, 3.4e38, -3.4e38])),
                min_size=1, max_size=40))
def test_finite_on_the_bytes_agrees_with_torch(dt, values):
    """``finite`` reads each value's exponent bits off the wire bytes; it
    must say what ``torch.isfinite`` says of the unpacked tensor, for every
    wire dtype, subnormals, signed zeros and values that overflow the
    narrower dtypes to inf included."""
    x = torch.tensor(values, dtype=torch.float32).to(dt).reshape(1, -1)
    v = pack_tensor(x)
    assert finite(v) == bool(torch.isfinite(unpack_tensor(v)).all())


@pytest.mark.parametrize("n", [8191, 8192, 8193, 20000])
@pytest.mark.parametrize("bad", [None, float("inf"), float("-inf"), float("nan")])
def test_finite_float32_on_either_side_of_the_python_sum(n, bad):
    """A float32 tensor of up to 8,192 values is summed in Python, a larger
    one goes through numpy: both must find one inf or NaN anywhere, and
    accept the largest finite values (their sum does not overflow)."""
    x = torch.full((1, n), 3.4e38)
    if bad is not None:
        x[0, n // 3] = bad
    v = pack_tensor(x)
    assert finite(v) is (bad is None)
    assert finite(v) == bool(torch.isfinite(unpack_tensor(v, max_bytes=1 << 20)).all())


def test_check_tensor_is_unpack_tensor_without_the_tensor():
    x = torch.randn(3, 5).to(torch.bfloat16)
    v = pack_tensor(x)
    assert check_tensor(v) == ("bfloat16", [3, 5])
    assert torch.equal(tensor_of(*check_tensor(v), v["data"]), x)
    with pytest.raises(WireError):
        check_tensor({**v, "shape": [5, 5]})


def test_decode_is_strict():
    for raw in (b"\xc1", b"\x92\x01\x02", msgpack.packb({1: 2}), msgpack.packb(msgpack.ExtType(1, b"x")),
                msgpack.packb(list(range(100)))):
        with pytest.raises(WireError):
            decode(raw)
    with pytest.raises(WireError):
        decode(b"\x80" * 10, max_bytes=5)


def test_bad_requests_get_error_answers(span, tiny_dir):
    srv, _ = make(span, tiny_dir, max_tokens_per_request=8)
    cases = {
        "bad-request": [b"garbage", encode([1, 2]), {**fwd(srv), "v": 2}, {**fwd(srv), "op": "explode"},
                        {**fwd(srv), "extra": 1}, {k: v for k, v in fwd(srv).items() if k != "pos"},
                        fwd(srv, pos=-1), fwd(srv, pos="0"), fwd(srv, sid=b"short"),
                        fwd(srv, hidden=pack_tensor(torch.randn(1, 63))),
                        fwd(srv, hidden=pack_tensor(torch.full((1, 64), float("nan")))),
                        fwd(srv, hidden=pack_tensor(torch.randn(1, 1, 64)))],
        "wrong-model": [fwd(srv, model="0" * 64)],
        "wrong-span": [fwd(srv, span=[0, 4]), fwd(srv, span=[2, 4])],
        "too-large": [fwd(srv, t=9), fwd(srv, max_length=10_000), fwd(srv, t=4, max_length=3)],
    }
    for code, msgs in cases.items():
        for m in msgs:
            r = call(srv, m)
            assert r["ok"] is False and r["error"] == code, (code, m if isinstance(m, bytes) else list(m))
    # still serving after all that
    r = call(srv, fwd(srv, t=3))
    assert r["ok"] and r["length"] == 3 and unpack_tensor(r["hidden"]).shape == (3, 64)
    assert srv.stats.errors == sum(len(v) for v in cases.values())


def test_forward_matches_local_span_and_positions(span, tiny_dir):
    srv, _ = make(span, tiny_dir)
    x = torch.randn(6, 64)
    ref = span(x[None])[0]
    a = call(srv, fwd(srv, hidden=pack_tensor(x[:4])))
    b = call(srv, fwd(srv, pos=4, hidden=pack_tensor(x[4:])))
    got = torch.cat([unpack_tensor(a["hidden"]), unpack_tensor(b["hidden"])])
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # ahead of the server: pos-mismatch with the server's length
    r = call(srv, fwd(srv, pos=9))
    assert r == {"ok": False, "error": "pos-mismatch", "detail": "server is behind", "length": 6}
    # a retry of an earlier step rolls the cache back
    c = call(srv, fwd(srv, pos=4, hidden=pack_tensor(x[4:])))
    torch.testing.assert_close(unpack_tensor(c["hidden"]), ref[4:], rtol=1e-5, atol=1e-5)
    # unknown session with pos > 0
    assert call(srv, fwd(srv, pos=3, sid=b"x" * 16))["error"] == "unknown-session"
    # sessions are per sender: another client cannot continue ours
    assert call(srv, fwd(srv, pos=6), sender="client-b")["error"] == "unknown-session"


def test_session_limits_memory_close_and_expiry(span, tiny_dir):
    srv, clock = make(span, tiny_dir, max_sessions=2, idle_timeout_s=10.0)
    assert call(srv, fwd(srv, sid=b"a" * 16))["ok"]
    assert call(srv, fwd(srv, sid=b"b" * 16))["ok"]
    assert call(srv, fwd(srv, sid=b"c" * 16))["error"] == "full"
    close = {"v": 1, "op": "close", "model": srv.model_hash, "session": b"a" * 16}
    assert call(srv, close) == {"ok": True, "closed": True}
    assert call(srv, close) == {"ok": True, "closed": False}
    assert call(srv, fwd(srv, sid=b"c" * 16))["ok"]
    clock.t += 11
    info = call(srv, {"v": 1, "op": "info"})
    assert info["sessions"] == 0 and info["stats"]["sessions_expired"] == 2 and info["cache_bytes"] == 0
    # memory: each cache of 32 positions costs 2 layers * 4 heads * 16 * 2 * 4 bytes * 32
    per = 2 * 4 * 16 * 2 * 4 * 32
    srv2, _ = make(span, tiny_dir, max_cache_bytes=per + 1)
    assert call(srv2, fwd(srv2, sid=b"a" * 16))["ok"]
    assert call(srv2, fwd(srv2, sid=b"b" * 16))["error"] == "full"
    assert srv2.cache_bytes == per


def test_batched_forward_equals_single(span, tiny_dir):
    """Steps of sessions at different positions computed in one batch."""
    srv, _ = make(span, tiny_dir)
    xs = [torch.randn(n, 64) for n in (3, 5, 1)]
    refs = [span(x[None])[0] for x in xs]

    async def main():
        sids = [bytes([65 + i]) * 16 for i in range(3)]
        for sid, x in zip(sids, xs):  # prefills of all but the last position
            r = decode(await srv.handle("c", encode(fwd(srv, sid=sid, hidden=pack_tensor(x[:-1]))))) if len(x) > 1 else None
            assert r is None or r["ok"]
        outs = {}

        async def step(i):
            x = xs[i]
            r = decode(await srv.handle("c", encode(fwd(srv, sid=sids[i], pos=len(x) - 1, hidden=pack_tensor(x[-1:])))))
            outs[i] = unpack_tensor(r["hidden"])

        async with trio.open_nursery() as n:
            for i in range(3):
                n.start_soon(step, i)
        for i in range(3):
            torch.testing.assert_close(outs[i], refs[i][-1:], rtol=1e-5, atol=1e-5)

    trio.run(main)
    assert srv.stats.max_batch >= 2


def test_parse_blocks():
    assert parse_blocks("0:2", 4) == (0, 2)
    assert parse_blocks(None, 4) == (0, 4)
    for bad in ("2:2", "0:5", "-1:2", "x", "1:2:3"):
        with pytest.raises(ValueError):
            parse_blocks(bad, 4)


def test_find_route_prefers_fast_and_avoids_excluded():
    hops = [Hop("a", 0, 2, 100.0), Hop("b", 2, 4, 100.0), Hop("c", 2, 4, 1000.0), Hop("d", 0, 4, 10.0),
            Hop("e", 1, 3, 1000.0)]
    assert [h.peer for h in find_route(hops, 0, 4)] == ["a", "c"]
    assert [h.peer for h in find_route(hops, 0, 4, exclude={"c"})] == ["a", "b"]
    assert [h.peer for h in find_route(hops, 0, 4, exclude={"a"})] == ["d"]
    assert find_route(hops, 0, 4, exclude={"a", "d"}) is None
    assert [h.peer for h in find_route(hops, 2, 4)] == ["c"]


def test_choose_span_fills_the_gap_without_flapping():
    spans = [("p1", 0, 2, 100.0), ("p2", 0, 2, 100.0), ("p3", 2, 3, 50.0)]
    assert choose_span(spans, 4, 1, self_id="me") == (3, 4)  # block 3 is unserved
    assert choose_span(spans, 4, 2, self_id="me") == (2, 4)
    # keep the current span unless the best one is much worse served
    spans2 = [("p1", 0, 4, 100.0), ("me", 2, 4, 90.0), ("p3", 0, 2, 80.0)]
    assert choose_span(spans2, 4, 2, self_id="me", current=(2, 4)) == (2, 4)
    assert choose_span([("p1", 0, 2, 120.0), ("p2", 2, 4, 100.0)], 4, 2, self_id="me", current=(0, 2)) == (0, 2)
    assert choose_span([("p1", 0, 2, 100.0)], 4, 2, self_id="me", current=(0, 2)) == (2, 4)
