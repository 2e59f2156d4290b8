"""Shared helpers of the LLM serving tests: an in-process swarm on MemoryNetwork
and the Hugging Face reference."""

from __future__ import annotations

import random
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator

import torch
import trio

from fedswarm.client import open_client
from fedswarm.core.config import PeerConfig
from fedswarm.core.identity import Identity
from fedswarm.core.peer import PeerCore
from fedswarm.llm_client import SwarmLLM
from fedswarm.llm_serving import BlockServer, ServerLimits, start_block_server
from fedswarm.net.libp2p import open_libp2p_transport
from fedswarm.net.memory import MemoryNetwork
from fedswarm.runtime.agent import Agent
from fedswarm.tasks.checkpoint import load_client_head, model_hash


def ident(i: int) -> Identity:
    return Identity.from_seed(random.Random(i * 7919 + 4242).randbytes(32))


@dataclass
class MemSwarm:
    net: MemoryNetwork | None
    servers: list[BlockServer]
    peer_ids: list[str]
    llm: SwarmLLM
    client: Any

    def server_of(self, peer: str) -> BlockServer:
        return self.servers[self.peer_ids.index(peer)]


@asynccontextmanager
async def memory_swarm(model_dir: Any, blocks: list[str], *, limits: ServerLimits | None = None,
                       forwarding: bool = False, libp2p: bool = False, dtype: str | None = None,
                       **llm_kw: Any) -> AsyncIterator[MemSwarm]:
    """Peers serving ``blocks`` (e.g. ["0:2", "2:4"]) and a client, in one trio run.

    ``forwarding``: the peers pass forwarded steps on from their nursery (as
    ``peer start`` does) and the client's ``SwarmLLM`` has its key (forwarding on).
    ``libp2p``: real py-libp2p transports on 127.0.0.1, with direct lanes,
    instead of the in-memory network (``net`` is then None). ``dtype``: the
    peers' (``peer start --serve-dtype``; None: the checkpoint's)."""
    net = MemoryNetwork()
    ids = [ident(i) for i in range(len(blocks))]
    servers = []
    async with trio.open_nursery() as nursery, AsyncExitStack() as stack:
        first: list[str] = []

        async def transport(idn: Identity) -> Any:
            if not libp2p:
                return net.add(idn)
            t = await stack.enter_async_context(open_libp2p_transport(idn, bootstrap=first))
            if not first:  # the others dial the first peer
                first.extend(t.listen_addrs())
            return t

        for i, (idn, b) in enumerate(zip(ids, blocks)):
            t = await transport(idn)
            core = PeerCore(idn, PeerConfig(bootstrap=(ids[0].peer_id,)), random.Random(i))
            servers.append(await start_block_server(t, core, model_dir, b, limits=limits, dtype=dtype, return_server=True,
                                                    nursery=nursery if forwarding else None))
            await nursery.start(Agent(core, t).run)
        cid = ident(1000)
        async with open_client(await transport(cid), cid, bootstrap=[ids[0].peer_id], seed=1) as client:
            llm = SwarmLLM(client.agent.transport, lambda: client.core.view.live(client.agent.now()),
                           load_client_head(model_dir), model_hash(model_dir),
                           **({"identity": cid} if forwarding else {}), **llm_kw)
            yield MemSwarm(None if libp2p else net, servers, [i.peer_id for i in ids], llm, client)
        nursery.cancel_scope.cancel()


def hf_greedy(model_dir: Any, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding with transformers' LlamaForCausalLM built from the local dir."""
    import transformers

    hf = transformers.LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                       local_files_only=True).eval()
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]
