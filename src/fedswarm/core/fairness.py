"""Finish-time fairness (Themis) estimates and queue priorities.

Themis's rho for a job is ``T_shared / T_alone`` where ``T_alone`` is the
finish time the job would get on a private 1/N share of the cluster (N active
tenants). A peer estimates both from what it knows:

* ``T_alone``: the job's total work spread over its 1/N share of the swarm's
  slots (from the view), but never shorter than one shard (bag jobs) or all
  shards back to back (chain jobs);
* ``T_shared``: time since the job was submitted, plus the wait and run time
  still ahead of this shard here.

Queue priority under policy ``rho`` is ``knob * log(rho / weight) -
(1 - knob) * log(remaining)``: knob = 1 is pure finish-time fairness, knob = 0
is shortest-remaining-first (efficiency). ``share`` orders by the tenant's
ledger share over its weight (lowest first), ``fifo`` by arrival.

Deadlines come first, under every policy: a shard whose slack (time left to
its deadline minus its run time) is down to ``URGENT_SLACK`` run times is
*urgent*; urgent shards run before all others, earliest deadline first. A
shard that can no longer meet its deadline keeps its place (its deadline is
the earliest): dropping it back among the rest let a stream of urgent
shards starve it, e.g. a 2.2 s job waiting 270 s on a busy 8-GPU peer.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .wire import JobSpec

__all__ = ["alone_time", "deadline_left", "estimate_rho", "priority", "run_time", "URGENT_SLACK"]

URGENT_SLACK = 2.0  # run times of slack below which a shard with a deadline jumps the queue


def alone_time(work_s: float, shards: int, gpus: int, chain: bool, swarm_slots: float, tenants: int) -> float:
    """Finish time of a job alone on a 1/``tenants`` share of ``swarm_slots``."""
    share = max(swarm_slots / max(tenants, 1), 1e-9)
    floor = work_s * shards if chain else work_s
    fluid = work_s * shards * max(gpus, 1) / share
    # float(): an int work (a trace's whole seconds) where the floor wins
    # would come back an int from Python and a float compiled
    return float(max(floor, fluid, 1e-9))


def run_time(job: "JobSpec", throughput: dict[str, float]) -> float:
    """Seconds one shard of ``job`` runs at full clock on a peer of this
    ``throughput`` (per task kind, ``"*"`` for the rest); clients and peers
    both count it so."""
    return job.work_s / max(throughput.get(job.task, throughput.get("*", 1.0)), 1e-6)


def deadline_left(job: "JobSpec", shard: int, now: float) -> float | None:
    """Seconds left to the deadline of ``shard`` (None: no deadline). A
    chain's deadline is shared by the shards still to come, this one
    included; clients and peers both count it so."""
    if job.deadline_s is None:
        return None
    left = job.submitted_at + job.deadline_s - now
    if job.chain:
        left /= max(job.shards - shard, 1)
    return left


def estimate_rho(elapsed_s: float, ahead_s: float, t_alone: float) -> float:
    return max(elapsed_s + ahead_s, 1e-9) / t_alone


def priority(
    policy: str,
    *,
    rho: float,
    weight: float,
    share: float,
    remaining_s: float,
    arrival: float,
    knob: float,
    deadline_left_s: float | None = None,
    run_s: float = 0.0,
) -> tuple[float, float, float]:
    """Sort key: smaller runs first.

    ``deadline_left_s``: seconds left to this shard's deadline (None: none);
    ``run_s``: its run time here.
    """
    if deadline_left_s is not None and deadline_left_s <= (1.0 + URGENT_SLACK) * run_s:
        return (0.0, deadline_left_s, arrival)
    if policy == "fifo":
        return (1.0, arrival, 0.0)
    if policy == "share":
        return (1.0, share / weight, arrival)
    score = knob * math.log(max(rho / weight, 1e-12)) - (1.0 - knob) * math.log(max(remaining_s, 1e-9))
    return (1.0, -score, arrival)
