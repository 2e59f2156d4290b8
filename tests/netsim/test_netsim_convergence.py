import netsim_helpers  # noqa: F401  (must come first: fixes sys.path)

from netsim.convergence import main, measure


def test_a_changed_state_reaches_every_peer_and_replays_exactly():
    kw = dict(warmup_s=20.0, horizon_s=4.0, step_s=0.1)
    r = measure(40, **kw)
    assert r["view_coverage"] > 0.95  # the views had filled before the change
    reached = r["reached_s"]
    assert reached["0.5"] is not None and reached["0.999"] is not None
    assert reached["0.5"] <= reached["0.9"] <= reached["0.99"] <= reached["0.999"] <= 4.0
    fracs = [f for _, f in r["curve"]]
    assert fracs == sorted(fracs) and fracs[-1] == 1.0  # nobody forgets it again
    assert measure(40, **kw) == r


def test_the_command_prints_a_table_and_writes_the_curves(tmp_path, capsys):
    import json

    out = tmp_path / "c.json"
    assert main(["--peers", "30", "--warmup", "15", "--horizon", "4", "--step", "0.1", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert table.startswith("| peers | 50% s |") and "| 30 |" in table
    [r] = json.loads(out.read_text())
    assert r["peers"] == 30 and r["reached_s"]["0.99"] is not None and r["curve"]
