#!/usr/bin/env python3
"""The batch wire's codec (``fedswarm.core.wire``), timed for one or more
checkouts side by side: microseconds per message to encode (with the
sender's check, without the signature) and to decode and validate (without
the signature check), for the messages a swarm sends most.

    .venv/bin/python benchmarks/wire_codec.py [--rounds 5] [--src DIR ...]

Each ``--src`` is a checkout's ``src`` directory (default: this one's). Each
checkout runs in its own child process; the checkouts take turns, and a row
is the median of ``--rounds`` rounds. The last column of each further
checkout is its time over the first one's. The encoded bytes' SHA-256 is
printed per checkout: equal digests mean the two encode byte for byte alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import hashlib, json, sys, time
from fedswarm.core.identity import Identity
from fedswarm.core.wire import (Bid, CallForBids, Device, Gossip, LeaseAck, LeaseRenew, LeaseRenewBatch, PeerState,
                                PowerInfo, ShardResult, Span, decode_unverified, encode)

me = Identity.from_seed(bytes(range(32)))
state = PeerState(41, 30.0, (Device("cuda", "NVIDIA A100-SXM4-80GB", 8, 85899345920, 80000000000),), 8,
                  {"*": 1.0, "llm": 1.7}, 12.5, PowerInfo(310.5, 60.0, 400.0, 400.0, 2.5, (0.6, 0.8, 1.0)), 0.12, 420.0,
                  (Span("9f" * 16, 0, 15, 18.7),), "volunteer", b"", ("/ip4/127.0.0.1/tcp/4001",), "eu", False,
                  {"alice": 3.5, "bob": -1.25}, (4.0, 9.5, 30.0))
st_raw = encode(state, me, issued_at=1000.0, nonce=7)
msgs = {
    "PeerState": state,
    "Gossip (8 states)": Gossip((st_raw,) * 8, True, 64),
    "CallForBids": CallForBids(b"\x00" * 300, (0, 1, 2, 3), 2),
    "Bid": Bid("job-17", 2, (0, 1, 2, 3), 3.5, 60.0, 8, 1.0, 1.2e4, 1.4, "volunteer", (3.5, 9.0, 12.0)),
    "LeaseRenew": LeaseRenew("job-17", 3, 0, True, 41.5),
    "LeaseRenewBatch (64)": LeaseRenewBatch(tuple(LeaseRenew("job-17", i, 0, i % 2 == 0, 41.5) for i in range(64))),
    "LeaseAck": LeaseAck("job-17", 3, 0, True, 30.0),
    "ShardResult": ShardResult("job-17", 3, 0, True, b"\x81\xa1y\xcb" + bytes(8), "", 60.0, 1.2e4, 1.4),
}
n = int(sys.argv[1])
out = {}
digest = hashlib.sha256()
for name, m in msgs.items():
    author = me if m.SIGNED else None
    raw = encode(m, author, issued_at=1000.0, nonce=7)
    digest.update(raw)
    t = time.perf_counter()
    for i in range(n):
        encode(m, author, issued_at=1000.0, nonce=i)
    enc = (time.perf_counter() - t) / n
    if m.SIGNED:
        # the codec's own cost: the Ed25519 signature is the same call in every checkout
        t = time.perf_counter()
        for i in range(n):
            me.sign(raw)
        enc -= (time.perf_counter() - t) / n
    t = time.perf_counter()
    for _ in range(n):
        decode_unverified(raw)
    dec = (time.perf_counter() - t) / n
    out[name] = [enc * 1e6, dec * 1e6, len(raw)]
print(json.dumps({"rows": out, "sha": digest.hexdigest()[:12]}))
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", action="append", help="a checkout's src directory (repeatable)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--n", type=int, default=2000, help="messages per timing loop")
    a = ap.parse_args(argv)
    if a.rounds < 1 or a.n < 1:
        ap.error("--rounds and --n must be at least 1")
    srcs = [str(Path(s).resolve()) for s in (a.src or [str(Path(__file__).resolve().parents[1] / "src")])]
    for s in srcs:
        # else the child would import the installed fedswarm and label it with this path
        if not (Path(s) / "fedswarm" / "core" / "wire.py").is_file():
            ap.error(f"{s} is not a checkout's src directory (no fedswarm/core/wire.py)")
    runs: dict[str, list[dict]] = {s: [] for s in srcs}
    for _ in range(a.rounds):
        for s in srcs:
            env = {**os.environ, "PYTHONPATH": s}
            got = subprocess.run([sys.executable, "-c", CHILD, str(a.n)], env=env, capture_output=True, text=True)
            if got.returncode != 0:
                print(f"wire_codec: {s}: the timing child failed:\n{got.stderr[-2000:]}", file=sys.stderr)
                return 1
            runs[s].append(json.loads(got.stdout))
    names = list(runs[srcs[0]][0]["rows"])
    print(f"median of {a.rounds} rounds, {a.n} messages per loop; us per message (encode: the check and msgpack, signature excluded;")
    print("decode: unpack and validate, signature check excluded)")
    head = f"{'message':22} {'bytes':>6}"
    for k, s in enumerate(srcs):
        tag = f"[{k}]"
        head += f" {tag + ' enc':>9} {tag + ' dec':>9}"
        if k:
            head += f" {'enc x':>6} {'dec x':>6}"
    print(head)
    for name in names:
        line = f"{name:22} {runs[srcs[0]][0]['rows'][name][2]:>6}"
        base = None
        for k, s in enumerate(srcs):
            enc = statistics.median(r["rows"][name][0] for r in runs[s])
            dec = statistics.median(r["rows"][name][1] for r in runs[s])
            line += f" {enc:>9.2f} {dec:>9.2f}"
            if base is None:
                base = (enc, dec)
            else:
                line += f" {enc / base[0]:>6.2f} {dec / base[1]:>6.2f}"
        print(line)
    for k, s in enumerate(srcs):
        print(f"[{k}] {s}: encoded bytes sha256 {runs[s][0]['sha']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
