"""Fair sessions: when a serving peer's forwards are full, the tenants with
the least usage in its ledger (over weight) go first; nobody is refused."""

from __future__ import annotations

import pytest
import torch
import trio

from fedswarm.core.ledger import Ledger
from fedswarm.core.spans import ServingCore
from fedswarm.llm_protocol import decode, encode, pack_tensor
from fedswarm.llm_serving import BlockServer, ServerLimits
from fedswarm.tasks.checkpoint import load_block_span, model_hash


def test_queued_steps_go_lowest_share_over_weight_first():
    core = ServingCore("me", max_length=64, max_tokens=64)
    usage = {"heavy": 0.9, "light": 0.1, "weighted": 0.9}
    for i, (tenant, weight) in enumerate([("heavy", 1.0), ("heavy", 1.0), ("light", 1.0), ("weighted", 10.0)]):
        core.enqueue(f"step{i}", ("c", bytes([i]) * 16, 0, 2), 1, tenant=tenant, weight=weight)
    core.limits = ServerLimits(max_batch=1)
    core.share = None
    assert core.take_batch() == ["step0"]  # no ledger: first come, first served
    core.batch_done()
    core.share = lambda t: usage[t]
    order = []
    while core.queued:
        order += core.take_batch()
        core.batch_done()
    # weighted: 0.9 / 10 = 0.09 < light's 0.1 < heavy's 0.9
    assert order == ["step3", "step2", "step1"]


@pytest.fixture(scope="module")
def span(tiny_dir):
    return load_block_span(tiny_dir, 0, 2)


def run_tenants(span, tiny_dir, *, fair: bool, steps: int = 10) -> tuple[int, int]:
    """Tenant "many" decodes 4 sessions, tenant "one" a single session, on a
    server that computes one step per forward. Returns (forwards before
    "one" finished, total forwards)."""
    srv = BlockServer(span, model_hash(tiny_dir), limits=ServerLimits(max_batch=1))
    ledger = Ledger()
    clock = [0.0]
    if fair:
        srv.use_ledger(ledger, "me", lambda: clock[0])
    done_at: dict[str, int] = {}

    async def session(tenant: str, sid: bytes) -> None:
        for pos in range(steps):
            msg = {"v": 1, "op": "forward", "model": srv.model_hash, "span": [0, 2], "session": sid, "pos": pos,
                   "max_length": 32, "hidden": pack_tensor(torch.randn(1, 64)), "tenant": tenant}
            r = decode(await srv.handle("client-" + tenant, encode(msg)))
            assert r["ok"] is True, r  # a tenant over its share waits; it is not refused
        done_at[sid.hex()] = srv.stats.forwards

    async def main() -> None:
        async with trio.open_nursery() as n:
            for i in range(4):
                n.start_soon(session, "many", bytes([i]) * 16)
            n.start_soon(session, "one", b"\xff" * 16)

    trio.run(main)
    return done_at[(b"\xff" * 16).hex()], srv.stats.forwards


def test_a_light_tenant_is_not_starved_by_a_heavy_one(span, tiny_dir):
    fair_one, total = run_tenants(span, tiny_dir, fair=True)
    fcfs_one, total2 = run_tenants(span, tiny_dir, fair=False)
    assert total == total2 == 50
    # fair: "one" gets about half the forwards while it waits, so its 10 steps
    # are done within ~20 forwards; first come, first served gives it ~1/5
    assert fair_one <= 25, (fair_one, fcfs_one)
    assert fcfs_one >= 35, (fair_one, fcfs_one)


def test_bad_tenant_fields_are_refused(span, tiny_dir):
    srv = BlockServer(span, model_hash(tiny_dir))
    base = {"v": 1, "op": "forward", "model": srv.model_hash, "span": [0, 2], "session": b"s" * 16, "pos": 0,
            "max_length": 32, "hidden": pack_tensor(torch.randn(1, 64))}
    for bad in ({"tenant": ""}, {"tenant": "x" * 65}, {"tenant": 3}, {"weight": 0}, {"weight": "1"},
                {"weight": 1e9}):
        r = decode(trio.run(srv.handle, "c", encode({**base, **bad})))
        assert r["ok"] is False and r["error"] == "bad-request", (bad, r)
    assert decode(trio.run(srv.handle, "c", encode({**base, "tenant": "t", "weight": 2})))["ok"] is True
