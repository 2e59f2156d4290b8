import netsim_helpers  # noqa: F401  (must come first: fixes sys.path)
import json
import os
import subprocess
import sys
from collections import Counter

import msgspec

import pytest

from fedswarm.core import wire
from netsim import Simulator, dumps_results, load_scenario, run_scenario

from netsim_helpers import SCENARIOS, make_scenario

WORK = {
    "tenants": [
        {"name": "t1", "jobs": 6, "rate_per_h": 600, "shards": {"dist": "lognormal", "median": 6, "sigma": 0.8, "max": 20},
         "duration_s": {"dist": "lognormal", "median": 15, "sigma": 0.5, "min": 3, "max": 60}, "chain_fraction": 0.3,
         "chain_max_shards": 4},
        {"name": "t2", "jobs": 6, "rate_per_h": 600, "shards": {"dist": "pareto", "xm": 3, "alpha": 1.5, "max": 20},
         "duration_s": {"dist": "uniform", "lo": 5, "hi": 25}, "chain_fraction": 0.3, "chain_max_shards": 4},
        {"name": "t3", "jobs": 4, "rate_per_h": 600, "shards": 8, "duration_s": 10, "gpus": 2},
    ]
}
SWARM = [
    {"profile": "datacenter-a100", "count": 3},
    {"profile": "workstation-rtx4090", "count": 12},
    {"profile": "volunteer-gaming", "count": 15},
]


def assert_exactly_once(res):
    s = res["summary"]
    assert s["jobs_completed"] == s["jobs_submitted"] > 0
    assert s["shards_completed"] == s["shards_submitted"]
    assert s["shards_lost"] == 0
    assert s["shards_duplicated"] == 0
    assert all(j["finished"] and j["jct_s"] > 0 and j["rho"] > 0 for j in res["jobs"])


def smoke():
    return load_scenario(SCENARIOS / "smoke-20.toml")


def test_smoke_deterministic_bytes():
    a = dumps_results(run_scenario(smoke(), seed=3))
    b = dumps_results(run_scenario(smoke(), seed=3))
    c = dumps_results(run_scenario(smoke(), seed=4))
    assert a == b
    assert a != c
    res = json.loads(a)
    assert_exactly_once(res)
    for k in ("jobs_completed", "shards_completed", "shards_lost", "shards_duplicated", "jain_index", "max_rho",
              "mean_jct_s", "makespan_s", "energy_j", "carbon_g", "msgs_per_peer_s", "bytes_per_peer_s"):
        assert k in res["summary"]
    assert {"job_id", "tenant", "jct_s", "rho"} <= set(res["jobs"][0])
    assert res["jobs"][0]["job_id"].startswith(("alice-", "bob-"))  # the trace's ids
    # the message cost split by class adds up to the total, and each class was paid
    for total, split in (("msgs_per_peer_s", "msgs_per_peer_s_split"), ("bytes_per_peer_s", "bytes_per_peer_s_split")):
        parts = res["summary"][split]
        assert set(parts) == {"gossip", "leases", "scheduling"}
        assert all(v > 0 for v in parts.values()), parts
        assert abs(sum(parts.values()) - res["summary"][total]) <= 1e-4 * res["summary"][total]


def test_caches_do_not_change_results(monkeypatch):
    # count the message bodies decoded and checked, by kind
    checked: Counter[str] = Counter()
    check_body = wire._check_body

    def counting(cls, body):
        checked[cls.__name__] += 1
        return check_body(cls, body)

    monkeypatch.setattr(wire, "_check_body", counting)
    fast = Simulator(smoke(), 5)
    fast.run()
    fast_checked = dict(checked)
    checked.clear()
    plain = Simulator(smoke(), 5, fast=False)
    plain.run()
    assert dumps_results(fast.results()) == dumps_results(plain.results())
    # fast mode: the receivers took every signed message from the cache, as
    # its sender entered it, and the senders checked nothing either; only the
    # unsigned gossip envelopes were checked (as sent and as received, in
    # both modes). The plain run checked every kind as it sent it and as it
    # received it
    assert set(fast_checked) == {"Gossip"}
    assert {"PeerState", "CallForBids", "Bid", "Award", "ShardResult"} <= set(checked)
    assert checked["Gossip"] == fast_checked["Gossip"] > 100

    # fast mode signed with placeholders that nobody checked; the plain run
    # made real signatures, and checked them as it received
    def signatures(sim: Simulator) -> set[bytes]:
        return {msgspec.msgpack.decode(raw)[0] for raw, _ in sim.cache._seen}

    assert signatures(fast) == {bytes(64)}
    assert len(signatures(plain)) == len(plain.cache._seen) > 100


def replayed_once(sc, seed):
    """Run ``sc()`` three times (twice with the caches, once without): the
    same bytes each time, every shard delivered once. Returns the results."""
    runs = []
    for fast in (True, True, False):
        sim = Simulator(sc(), seed, fast=fast)
        sim.run()
        runs.append(dumps_results(sim.results()))
    assert runs[0] == runs[1] == runs[2]
    res = json.loads(runs[0])
    assert_exactly_once(res)
    return res


def test_sampled_ranking_and_batched_renewals_replay_exactly_and_deliver_once():
    # rank_max = 8 of 30 peers: every round ranks a seeded sample; renew_batch:
    # one renewal message per (peer, client); the same seed gives the same
    # bytes, with or without the caches, and every shard is delivered once
    def sc():
        return make_scenario(swarm=SWARM, workload=WORK, max_time_s=5000, network={"loss": 0.01},
                             client={"rank_max": 8}, peer={"renew_batch": True})

    res = replayed_once(sc, 7)
    assert res["network"]["by_kind"]["LeaseRenewBatch"] > 0
    assert res["network"]["by_kind"]["LeaseAckBatch"] > 0


def test_slot_offers_move_queued_shards_replay_exactly_and_deliver_once():
    # offers on, under loss and crashes: idle peers offer their slots, busy
    # ones hand queued shards back naming them ("moved"), and their clients
    # place them again; the same seed gives the same bytes with or without
    # the caches, and every shard is delivered once
    def sc():
        return make_scenario(swarm=SWARM, workload=WORK, max_time_s=5000, network={"loss": 0.02},
                             churn={"crash_fraction": 0.1, "crash_window_s": [20, 120]},
                             peer={"offer_interval_s": 2.0, "gossip_interval_s": 2.0})

    res = replayed_once(sc, 7)
    assert res["peers"]["crashed"] == 3
    assert res["network"]["by_kind"]["SlotOffer"] > 0
    moved = res["core_stats"]["shards_moved"]
    assert moved > 0 and res["core_stats"]["declines_moved"] == moved


def test_auction_under_loss_duplication_reorder_and_crashes():
    sc = make_scenario(
        swarm=SWARM,
        network={"loss": 0.05, "duplicate": 0.05, "reorder": 0.1, "reorder_ms": 200, "jitter_ms": 10,
                 "regions": {"us": 1, "eu": 1}},
        churn={"crash_fraction": 0.2, "crash_window_s": [20, 120]},
        workload=WORK,
        max_time_s=5000,
    )
    res = run_scenario(sc, seed=11)
    assert_exactly_once(res)
    assert res["peers"]["crashed"] == 6
    assert res["network"]["lost"] > 0 and res["network"]["duplicated"] > 0


def test_churn_small_with_joins_and_leaves():
    sc = make_scenario(
        swarm=SWARM,
        network={"loss": 0.01, "regions": {"us": 0.5, "eu": 0.3, "asia": 0.2}},
        churn={"crash_fraction": 0.1, "crash_window_s": [20, 100], "leave_fraction": 0.1,
               "leave_window_s": [20, 100], "leave_grace_s": 20, "join_count": 5, "join_window_s": [10, 80]},
        workload=WORK,
        max_time_s=5000,
    )
    res = run_scenario(sc, seed=2)
    assert_exactly_once(res)
    p = res["peers"]
    assert (p["crashed"], p["left"], p["joined"]) == (3, 3, 5)
    s = res["summary"]
    assert 0 < s["utilization"] < 1 and s["energy_j"] > s["energy_busy_j"] > 0 and s["carbon_g"] > 0
    assert 0 < s["jain_index"] <= 1


@pytest.mark.slow
def test_churn_200_scenario():
    sc = load_scenario(SCENARIOS / "churn-200.toml")
    a = dumps_results(run_scenario(sc, seed=1))
    res = json.loads(a)
    assert_exactly_once(res)
    assert res["peers"]["initial"] == 200 and res["peers"]["crashed"] == 20
    # (byte-identical reruns are covered on smoke-20 to keep the suite fast)


@pytest.mark.parametrize("name", ["partition-20", "dup-reorder-20", "leave-20"])
def test_fault_scenarios_complete_exactly_once(name):
    res = run_scenario(load_scenario(SCENARIOS / f"{name}.toml"), seed=1)
    assert_exactly_once(res)


def test_scaled_keeps_mix():
    sc = load_scenario(SCENARIOS / "churn-200.toml").scaled(50)
    assert sc.n_peers == 50
    assert [g.count for g in sc.swarm] == [4, 6, 15, 25]


# -- views ---------------------------------------------------------------------

def view_sim(**kw):
    kw.setdefault("swarm", [{"profile": "workstation-rtx4090", "count": 50}])
    sc = make_scenario(max_time_s=1000,
                       network={"regions": {"us": 1, "eu": 1}, **kw.pop("network", {})}, **kw)
    return Simulator(sc, seed=9)


def all_know_each_other(sim):
    live = sorted(r.id for r in sim.live_peers())
    for r in sim.live_peers():
        known = {e.peer for e in r.core.view.live(sim.now)}
        if not set(live) <= known:
            return False
    return True


def test_views_converge():
    sim = view_sim()
    sim.run_until(30.0)
    assert all_know_each_other(sim)


@pytest.mark.parametrize("peer", [{"gossip_quiet_max": 1}, {}], ids=["quiet-off", "default"])
def test_partition_heals(peer):
    # quiet gossip off, and on (the default, gossip_quiet_max = 8): the peers
    # are idle, so their states advertise state_ttl_s * 8 (240 s here) and
    # are re-signed every state_refresh_s * 8 (80 s); no view loses anyone
    # in a 20 s split, and a quiet peer cannot tell that a split it never
    # saw has healed, so what crosses the healed split is its next
    # stretched refresh (docs/netsim.md)
    sim = view_sim(network={"partitions": [{"start_s": 20, "end_s": 40, "fraction": 0.5}]}, peer=peer)
    sim.run_until(39.9)
    assert sim.net_stats["partitioned"] > 0
    side_b = sim.part_b[0]
    a_peer = next(r for r in sim.live_peers() if r.id not in side_b)
    # during the split, nothing a-side knows of b-side was issued after the split began
    for e in a_peer.core.view.live(sim.now):
        if e.peer in side_b:
            assert e.issued_at < 20.0 + 1e-9
    sim.run_until(80.0)
    assert all_know_each_other(sim)
    b_peer = next(r for r in sim.live_peers() if r.id in side_b)
    cfg = b_peer.core.config
    refresh = cfg.state_refresh_s * cfg.gossip_quiet_max
    # one stretched refresh after the heal (plus one stretched push round
    # for the re-sign and one to spread it), the a-side peer holds a state
    # of the b-side peer no older than its stretched refresh: one issued
    # after the heal (quiet off: at 80 s, as before)
    sim.run_until(max(80.0, 40.0 + refresh + 2 * cfg.gossip_interval_s * cfg.gossip_quiet_max))
    issued = a_peer.core.view.get(b_peer.id).issued_at
    assert issued >= sim.now - refresh and issued > 40.0


def test_crashed_peer_leaves_every_view_within_ttl():
    # quiet gossip off: within state_ttl_s (on, the default, an idle peer's
    # bound is state_ttl_s * gossip_quiet_max: the test below)
    sim = view_sim(peer={"gossip_quiet_max": 1})
    sim.run_until(25.0)
    victim = sim.live_peers()[7]
    cfg = victim.core.config
    sim.schedule(30.0, "crash", victim.id)
    sim.run_until(30.0 + cfg.state_ttl_s + cfg.gossip_interval_s + 0.01)
    assert not victim.alive
    for r in sim.live_peers():
        assert victim.id not in r.core.view, r.id
    assert all_know_each_other(sim)


def test_graceful_leave_is_seen_at_once():
    sim = view_sim()
    sim.run_until(25.0)
    leaver = sim.live_peers()[3]
    sim.schedule(26.0, "leave", leaver.id)
    sim.run_until(28.0)
    assert not leaver.alive and leaver.fate == "left"
    for r in sim.live_peers():
        assert leaver.id not in {e.peer for e in r.core.view.live(sim.now)}


def test_long_partition_heals():
    sim = view_sim(network={"partitions": [{"start_s": 20, "end_s": 120, "fraction": 0.5}]})
    sim.run_until(300.0)
    assert all_know_each_other(sim)


def test_a_swarm_that_starts_at_once_pays_a_constant_number_of_messages_per_peer():
    per_peer = {}
    for n in (25, 100):
        sim = view_sim(swarm=[{"profile": "workstation-rtx4090", "count": n}])
        sim.run_until(6.0)  # the peers start in [0, warmup_s / 2] = [0, 5]
        assert "PeerState" not in sim.msg_kinds  # a join is not published
        per_peer[n] = sum(sim.msg_kinds.values()) / n
        sim.run_until(30.0)  # rumour gossip still spreads every join
        views = [{e.peer for e in r.core.view.live(sim.now)} for r in sim.live_peers()]
        for r in sim.live_peers():
            assert sum(r.id in v for v in views) >= 0.9 * len(views)
    # publishing each join to every peer up cost ~n/2 messages per peer
    assert per_peer[100] < 1.25 * per_peer[25], per_peer


@pytest.mark.parametrize("crash_at", [30.0, 201.0])
def test_quiet_gossip_still_forgets_a_crashed_peer_within_its_bound(crash_at):
    # gossip_quiet_max = 8 (issue 23, the default): idle peers with unchanged
    # states push up to 8x less often, and advertise TTLs and refresh 8x
    # longer (from their start: the TTL follows idleness, not the push
    # rate); a crashed peer still leaves every view within
    # state_ttl_s * gossip_quiet_max of its crash, whether it crashed in the
    # loud start (30 s) or quiet (201 s), and the live peers still know each
    # other then
    sim = view_sim()
    sim.run_until(crash_at - 1.0)
    victim = sim.live_peers()[7]
    cfg = victim.core.config
    assert cfg.gossip_quiet_max == 8
    if crash_at > 200.0:
        assert victim.core._quiet > 1  # it has gone quiet
    bound = cfg.state_ttl_s * cfg.gossip_quiet_max
    sim.schedule(crash_at, "crash", victim.id)
    sim.run_until(crash_at + bound + 0.01)
    assert not victim.alive
    views = [{e.peer for e in r.core.view.live(sim.now)} for r in sim.live_peers()]
    assert all(victim.id not in v for v in views)
    # the live peers still know each other: every one is in nearly every view
    # (a quiet state may expire from one view for a while before its refresh
    # comes round: at most a pair or two of the 2,450 here, also before the
    # gossip sample was drawn exactly)
    live = [r.id for r in sim.live_peers()]
    assert min(sum(p in v for v in views) for p in live) >= 0.95 * len(views)
    assert sum(len(set(live) - v - {p}) for p, v in zip(live, views)) <= 0.01 * len(live) ** 2


def test_quiet_gossip_sends_fewer_messages_on_an_idle_swarm():
    # quiet gossip is the default (8); loud is quiet gossip off
    loud, quiet = view_sim(peer={"gossip_quiet_max": 1}), view_sim()
    for sim in (loud, quiet):
        sim.run_until(600.0)
    assert {r.core.config.gossip_quiet_max for r in quiet.live_peers()} == {8}
    assert quiet.msgs * 4 < loud.msgs


def test_a_run_gives_the_same_bytes_under_any_hash_seed(tmp_path):
    # str hashes differ from process to process: nothing in a run may follow
    # the iteration order of a set of peer ids (a client's round once did)
    outs = []
    for hs in ("1", "2"):
        out = tmp_path / f"h{hs}.json"
        env = {**os.environ, "PYTHONHASHSEED": hs}
        subprocess.run([sys.executable, "-m", "netsim", "run", str(SCENARIOS / "smoke-20.toml"), "--seed", "3",
                        "--out", str(out), "-q"], check=True, env=env, capture_output=True)
        outs.append(out.read_bytes())
    assert outs[0] == outs[1] and json.loads(outs[0])["summary"]["jobs_completed"] > 0
