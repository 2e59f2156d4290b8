import netsim_helpers  # noqa: F401  (must come first: fixes sys.path)

from netsim.convergence import main, measure


def test_a_changed_state_reaches_every_peer_and_replays_exactly():
    kw = dict(warmup_s=20.0, horizon_s=4.0, step_s=0.1)
    r = measure(40, **kw)
    assert r["view_coverage"] > 0.95  # the views had filled before the change
    reached = r["reached_s"]
    assert reached["0.5"] is not None and reached["0.999"] is not None
    assert reached["0.5"] <= reached["0.9"] <= reached["0.99"] <= reached["0.999"] <= 4.0
    fracs = [f for _, f, _, _ in r["curve"]]
    assert fracs == sorted(fracs) and fracs[-1] == 1.0  # nobody forgets it again
    assert measure(40, **kw) == r


def test_a_change_spreads_through_views_smaller_than_the_swarm():
    # 300 peers whose views hold 48: a full view takes a newcomer in place of
    # an entry drawn at random, and a newcomer whose state is old is not a
    # rumour. With the soonest expiry dropped instead, and every newcomer a
    # rumour, 83% of the peers had seen a change 8 s after it, after a 30 s
    # warm-up (every view held the same newest states; docs/netsim.md,
    # "Gossip convergence")
    r = measure(300, max_view=48, warmup_s=10.0, horizon_s=4.0)
    assert r["view_coverage"] > 0.95
    reached = r["reached_s"]
    assert reached["0.99"] is not None and reached["0.99"] <= 2.0, reached
    # and no view that holds the changed peer still holds its old state
    _, seen, held_new, holders = r["curve"][-1]
    assert seen >= 0.99 and held_new == 1.0 and holders > 0


def test_the_command_prints_a_table_and_writes_the_curves(tmp_path, capsys):
    import json

    out = tmp_path / "c.json"
    assert main(["--peers", "30", "--warmup", "15", "--horizon", "4", "--step", "0.1", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert table.startswith("| peers | 50% s |") and "| 30 |" in table
    [r] = json.loads(out.read_text())
    assert r["peers"] == 30 and r["reached_s"]["0.99"] is not None and r["curve"]
