"""Coverage-guided fuzzing of the wire decoder and every protocol handler.

    .venv/bin/pip install atheris
    .venv/bin/python fuzz/fuzz_protocol.py -runs=200000            # libFuzzer flags
    .venv/bin/python fuzz/fuzz_protocol.py -max_total_time=120

Each input is turned into one of three things (first byte chooses):
  0: raw bytes fed to the decoder and to a peer's and a client's ``handle``;
  1: a well-signed message of a fuzz-chosen kind with fuzz-chosen fields
     (so the handlers behind signature checks are reached), fed to both;
  2: a valid envelope with fuzz-chosen byte flips.
The peer and client are mid-job (the client has shards out, the peer holds a
lease), so awards, results, renewals, cancels and accusations hit live state.
Any exception escaping ``handle`` is a crash: the contract is "a bad message
gets a typed error and a counter".
"""

from __future__ import annotations

import atexit
import random
import sys

import atheris

with atheris.instrument_imports():
    from fedswarm.core.client_core import ClientCore, JobRequest
    from fedswarm.core.config import ClientConfig, PeerConfig
    from fedswarm.core.events import MessageReceived, Send
    from fedswarm.core.identity import Identity
    from fedswarm.core.peer import PeerCore
    from fedswarm.core.wire import KINDS, decode, encode
    from fedswarm.errors import LocalProtocolError, RemoteProtocolError

NOW = 1_000_000.0
FUZZER = Identity.from_seed(b"z" * 32)
PEER = Identity.from_seed(b"p" * 32)
CLIENT = Identity.from_seed(b"c" * 32)


def _setup() -> tuple[PeerCore, ClientCore, list[bytes]]:
    # the rate limiter is tested on its own; here it would only hide the handlers
    peer = PeerCore(PEER, PeerConfig(rate_per_s=1e12, rate_burst=1e12), random.Random(1))
    client = ClientCore(CLIENT, ClientConfig(rate_per_s=1e12, rate_burst=1e12), random.Random(2))
    peer.start(NOW)
    client.start(NOW)
    # introduce them and run one auction so both hold live state
    own = peer._refresh_state(NOW)
    client.handle(NOW, MessageReceived(PEER.peer_id, own))
    _, effects = client.submit(NOW, JobRequest("sim", 3, work_s=5.0, job_id="job"))
    seeds = []
    for _ in range(4):
        nxt = []
        for e in effects:
            if isinstance(e, Send):
                seeds.append(e.data)
                target = peer if e.to == PEER.peer_id else client
                src = CLIENT.peer_id if target is peer else PEER.peer_id
                nxt.extend(target.handle(NOW, MessageReceived(src, e.data)))
        effects = nxt + client.poll(NOW + 1)
    return peer, client, seeds


PEER_CORE, CLIENT_CORE, SEEDS = _setup()


def _value(fdp: atheris.FuzzedDataProvider, depth: int = 0):
    choice = fdp.ConsumeIntInRange(0, 8 if depth < 2 else 5)
    if choice == 0:
        return fdp.ConsumeInt(8)
    if choice == 1:
        return fdp.ConsumeFloat()
    if choice == 2:
        return fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 64))
    if choice == 3:
        return fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 128))
    if choice == 4:
        return fdp.ConsumeBool()
    if choice == 5:
        return None
    if choice == 6:
        return [_value(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 6))]
    if choice == 7:
        return {fdp.ConsumeUnicodeNoSurrogates(8): _value(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 4))}
    return SEEDS[fdp.ConsumeIntInRange(0, len(SEEDS) - 1)] if SEEDS else b""


COUNTS = {"inputs": 0, "fed": 0, "signed_fed": 0, "accepted": 0}


def _feed(data: bytes, signed: bool = False) -> None:
    COUNTS["fed"] += 1
    COUNTS["signed_fed"] += signed
    for core in (PEER_CORE, CLIENT_CORE):
        before = sum(core.rejected.values())
        core.handle(NOW + 2, MessageReceived(FUZZER.peer_id, data))
        COUNTS["accepted"] += sum(core.rejected.values()) == before


def TestOneInput(buf: bytes) -> None:
    COUNTS["inputs"] += 1
    if COUNTS["inputs"] % 250_000 == 0:
        _report()
    fdp = atheris.FuzzedDataProvider(buf)
    mode = fdp.ConsumeIntInRange(0, 2)
    if mode == 0:
        data = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 4096))
        try:
            decode(data)
        except RemoteProtocolError:
            pass
        _feed(data)
        return
    if mode == 1:
        cls = KINDS[fdp.ConsumeIntInRange(1, len(KINDS))]
        body = [_value(fdp) for _ in range(fdp.ConsumeIntInRange(0, 18))]
        try:
            msg = cls.from_body(body)
        except RemoteProtocolError:
            return
        try:
            data = encode(msg, FUZZER, issued_at=NOW + fdp.ConsumeFloatInRange(-100, 100), nonce=fdp.ConsumeIntInRange(0, 2**63))
        except LocalProtocolError:
            return
        _feed(data, signed=True)
        return
    base = bytearray(SEEDS[fdp.ConsumeIntInRange(0, len(SEEDS) - 1)])
    for _ in range(fdp.ConsumeIntInRange(1, 8)):
        if base:
            base[fdp.ConsumeIntInRange(0, len(base) - 1)] = fdp.ConsumeIntInRange(0, 255)
    _feed(bytes(base))


def _report() -> None:
    rejected = {**PEER_CORE.rejected}
    for k, v in CLIENT_CORE.rejected.items():
        rejected[k] = rejected.get(k, 0) + v
    print(f"fedswarm fuzz: {COUNTS}; rejections by reason: {dict(sorted(rejected.items()))}", file=sys.stderr)


def main() -> None:
    atexit.register(_report)
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
