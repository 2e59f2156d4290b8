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


def run_tenants(span, tiny_dir, *, fair: bool, steps: int = 10) -> tuple[list[int], int]:
    """Tenant "many" decodes 4 sessions, tenant "one" a single session, on a
    server that computes one step per forward. With ``fair``, the server
    takes steps by the tenants' shares of its ledger, where "many" has
    already used 100 s. Returns, for each of "one"'s steps, how many of
    "many"'s forwards were charged between the moment the step was sent and
    the step's own forward, and the total number of forwards.

    The count starts when the step is queued, not when the previous one
    came back: how soon a client sends its next step depends on when trio
    runs its task, which the server does not decide."""
    srv = BlockServer(span, model_hash(tiny_dir), limits=ServerLimits(max_batch=1))
    order: list[str] = []  # "sent" (one's step queued), then each forward's tenant as it is charged
    if fair:
        ledger = Ledger()
        ledger.add("me", "many", 100.0, 0.0)
        srv.use_ledger(ledger, "me", lambda: 0.0)
        charge = srv.charge
        assert charge is not None
    else:
        charge = None

    def charged(tenant: str, seconds: float) -> None:
        order.append(tenant)
        if charge is not None:
            charge(tenant, seconds)

    srv.charge = charged

    async def session(tenant: str, sid: bytes) -> None:
        for pos in range(steps):
            msg = {"v": 1, "op": "forward", "model": srv.model_hash, "span": [0, 2], "session": sid, "pos": pos,
                   "max_length": 32, "hidden": pack_tensor(torch.randn(1, 64)), "tenant": tenant}
            if tenant == "one":
                order.append("sent")
            r = decode(await srv.handle("client-" + tenant, encode(msg)))
            assert r["ok"] is True, r  # a tenant over its share waits; it is not refused

    async def main() -> None:
        async with trio.open_nursery() as n:
            for i in range(4):
                n.start_soon(session, "many", bytes([i]) * 16)
            n.start_soon(session, "one", b"\xff" * 16)

    trio.run(main)
    waits = []
    for i, what in enumerate(order):
        if what == "sent":
            served = order.index("one", i)
            waits.append(order[i:served].count("many"))
    assert order.count("one") == steps and order.count("many") == 4 * steps
    return waits, srv.stats.forwards


def test_a_light_tenant_is_not_starved_by_a_heavy_one(span, tiny_dir):
    fair, total = run_tenants(span, tiny_dir, fair=True)
    fcfs, total2 = run_tenants(span, tiny_dir, fair=False)
    assert total == total2 == 50
    assert len(fair) == len(fcfs) == 10
    # fair: a step of "one" waits at most for the forward already running
    # when it was sent; first come, first served queues it behind "many"'s
    # waiting steps (3 or 4 of them, as the 5 sessions take turns)
    assert max(fair) <= 1, (fair, fcfs)
    assert sum(fcfs) >= 20, (fair, fcfs)


def test_bad_tenant_fields_are_refused(span, tiny_dir):
    srv = BlockServer(span, model_hash(tiny_dir))
    base = {"v": 1, "op": "forward", "model": srv.model_hash, "span": [0, 2], "session": b"s" * 16, "pos": 0,
            "max_length": 32, "hidden": pack_tensor(torch.randn(1, 64))}
    for bad in ({"tenant": ""}, {"tenant": "x" * 65}, {"tenant": 3}, {"weight": 0}, {"weight": "1"},
                {"weight": 1e9}):
        r = decode(trio.run(srv.handle, "c", encode({**base, **bad})))
        assert r["ok"] is False and r["error"] == "bad-request", (bad, r)
    assert decode(trio.run(srv.handle, "c", encode({**base, "tenant": "t", "weight": 2})))["ok"] is True
