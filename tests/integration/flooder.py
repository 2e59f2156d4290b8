"""A hostile process: floods one daemon with malformed traffic over libp2p.

Usage: python flooder.py MULTIADDR SECONDS
Sends, in a bounded loop: random bytes, truncated msgpack, well-formed but
unsigned or forged envelopes, oversize frames, garbage pubsub messages and
garbage requests. Prints how many of each it sent, as JSON, and exits 0.
"""

from __future__ import annotations

import json
import random
import sys

import msgpack
import trio

from fedswarm.core.identity import Identity
from fedswarm.core.wire import Bid, encode
from fedswarm.errors import FederationError
from fedswarm.net.libp2p import Libp2pConfig, open_libp2p_transport


async def main(addr: str, seconds: float) -> None:
    rng = random.Random(1)
    me = Identity.generate()
    other = Identity.generate()
    counts = {"random": 0, "truncated": 0, "forged": 0, "replayed": 0, "oversize": 0, "pubsub": 0, "request": 0, "errors": 0}
    async with open_libp2p_transport(me, config=Libp2pConfig(max_frame=8 << 20)) as t:
        target = await t.connect(addr)
        await t.subscribe("fedswarm/peers/1")
        good = encode(Bid("j", 0, (0,), 0.0, 1.0, 1, 1.0, 1.0, 0.0, "volunteer"), me, issued_at=0.0, nonce=1)
        with trio.move_on_after(seconds):
            while True:
                kind = rng.choice(list(counts)[:-1])
                try:
                    if kind == "random":
                        await t.send(target, rng.randbytes(rng.randrange(1, 2000)))
                    elif kind == "truncated":
                        await t.send(target, good[: rng.randrange(1, len(good))])
                    elif kind == "forged":
                        sig, payload = msgpack.unpackb(good)
                        fields = msgpack.unpackb(payload)
                        fields[2] = other.peer_id
                        await t.send(target, msgpack.packb([sig, msgpack.packb(fields)]))
                    elif kind == "replayed":
                        await t.send(target, good)
                    elif kind == "oversize":
                        await t.send(target, b"\x00" * (5 << 20))
                    elif kind == "pubsub":
                        await t.publish("fedswarm/peers/1", rng.randbytes(300))
                    else:
                        with trio.move_on_after(0.5):
                            await t.request(target, "/fedswarm/llm/1.0.0", rng.randbytes(200), timeout=0.5)
                    counts[kind] += 1
                except FederationError:
                    counts["errors"] += 1
                await trio.sleep(0)
    print(json.dumps(counts), flush=True)


if __name__ == "__main__":
    trio.run(main, sys.argv[1], float(sys.argv[2]))
