"""Detection of lying peers, and what verification costs.

One untrusted peer among N returns a wrong result for a fraction r of the
shards it runs (r from 1% to 100%); two peers are trusted (federation
members). A tenant submits jobs until S shards have been delivered, with
verification on (``verify="auto"``: every result of a new peer is re-run,
the check rate falls with agreeing results to ``verify_min_rate``) and off.
For each r it prints: lies told, lies caught (the lie did not reach the
tenant), detection rate, wrong results delivered, whether and after how many
of its results the liar was banned, and the compute overhead (shard runs per
delivered shard, minus one). Deterministic (seeded), in virtual time.

    .venv/bin/python benchmarks/verification.py [--shards 600] [--peers 12]
"""

from __future__ import annotations

import argparse

from fedswarm.core.client_core import JobRequest
from fedswarm.testing import MiniSwarm


def run(rate: float, shards: int, peers: int, verify: str, seed: int) -> dict[str, float]:
    s = MiniSwarm(peers, seed=seed, liars={peers - 1: rate} if rate > 0 else {}, trusted=(0, 1))
    s.step_until(s.now + 10)
    c = s.add_client(verify=verify)
    s.step_until(s.now + 5)
    per_job = 20
    for j in range(shards // per_job):
        jid = s.submit(c, JobRequest("sim", per_job, work_s=2.0))
        s.step_until(s.now + 10_000, stop=lambda: jid in s.finished)
    wrong = sum(1 for d in s.delivered if d.result != b"r%d" % d.shard)
    liar = [p for p in s.peers if s.liar_ids.get(p)]
    banned = bool(liar) and liar[0] in c.banned
    return {
        "lies": s.lies,
        "wrong_delivered": wrong,
        "caught": s.lies - wrong,
        "detection": (s.lies - wrong) / s.lies if s.lies else float("nan"),
        "banned": banned,
        "overhead": s.executions / max(len(s.delivered), 1) - 1.0,
        "delivered": len(s.delivered),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shards", type=int, default=600)
    ap.add_argument("--peers", type=int, default=12)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    print(f"{a.peers} peers (2 trusted, 1 liar), {a.shards} shards delivered per run, seed {a.seed}\n")
    print(f"{'lie rate':>8} {'verify':>6} {'lies':>5} {'caught':>6} {'detect':>7} {'wrong out':>9} {'banned':>6} {'overhead':>8}")
    for rate in (0.0, 0.01, 0.05, 0.1, 0.5, 1.0):
        for verify in ("always", "auto", "none"):
            r = run(rate, a.shards, a.peers, verify, a.seed)
            det = "-" if r["lies"] == 0 else f"{r['detection']:.0%}"
            print(f"{rate:>8.0%} {verify:>6} {r['lies']:>5} {r['caught']:>6} {det:>7} {r['wrong_delivered']:>9} "
                  f"{str(r['banned']):>6} {r['overhead']:>7.0%}")


if __name__ == "__main__":
    main()
