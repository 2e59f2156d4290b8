"""A serving peer's clock level for its spans, wired as ``peer start`` wires
it: ``start_block_server(on_level=...)`` hands the level the sans-IO
``ServingCore`` picks from the profile's power model (``span_level``) to the
runner, and ``/status`` shows it under ``llm.energy``. An idle span waits at
the cheapest level; steps that wait for a batch bring it to full clock."""

from __future__ import annotations

import random

import torch
import trio

from fedswarm.core.config import PeerConfig
from fedswarm.core.energy import PowerModel
from fedswarm.core.peer import PeerCore
from fedswarm.llm_protocol import decode, encode, pack_tensor
from fedswarm.llm_serving import ServerLimits, start_block_server
from fedswarm.net.memory import MemoryNetwork
from fedswarm.testing import ident
from helpers import until

POWER = PowerModel(idle_w=40.0, max_w=250.0, alpha=2.5, levels=(0.5, 0.75, 1.0))


def test_span_level_follows_demand_through_the_server(tiny_dir):
    levels: list[float] = []

    async def main() -> None:
        idn = ident(0)
        core = PeerCore(idn, PeerConfig(power=POWER), random.Random(0))
        async with trio.open_nursery() as n:
            srv = await start_block_server(MemoryNetwork().add(idn), core, tiny_dir, "0:2", return_server=True,
                                           nursery=n, on_level=levels.append,
                                           limits=ServerLimits(max_batch=1))
            srv.core.level_every_s = 0.05
            await until(lambda: levels, 20.0)  # a first level
            assert levels == [0.5]  # nothing to serve: the level a unit of work is cheapest at
            assert srv.info()["energy"] == {"level": 0.5, "demand": 0.0, "level_changes": 1, "power_model": True}

            async def session(i: int) -> None:
                for pos in range(6):
                    msg = {"v": 1, "op": "forward", "model": srv.model_hash, "span": [0, 2],
                           "session": bytes([i]) * 16, "pos": pos, "max_length": 32,
                           "hidden": pack_tensor(torch.randn(1, 64))}
                    assert decode(await srv.handle(f"c{i}", encode(msg)))["ok"] is True

            async with trio.open_nursery() as clients:  # 4 sessions, batches of 1: steps wait
                for i in range(4):
                    clients.start_soon(session, i)
            assert srv.info()["energy"]["demand"] > 0  # the forwards were recorded
            await until(lambda: levels[-1] == 1.0, 20.0)  # full clock for waiting steps
            n.cancel_scope.cancel()

    trio.run(main)
    assert levels[0] == 0.5 and levels[-1] == 1.0


def test_without_on_level_the_server_keeps_no_power_model(tiny_dir):
    async def main() -> None:
        idn = ident(1)
        core = PeerCore(idn, PeerConfig(power=POWER), random.Random(1))
        srv = await start_block_server(MemoryNetwork().add(idn), core, tiny_dir, "0:2", return_server=True)
        assert srv.core.power is None and srv.on_level is None
        assert srv.info()["energy"]["power_model"] is False

    trio.run(main)
