"""netsim progress: a sliced run gives the same results as one go; off a
terminal it prints periodic lines, on one a rich bar; -q prints nothing."""

import netsim_helpers  # noqa: F401  (must come first: fixes sys.path)
import io

from netsim import dumps_results
from netsim.cli import main
from netsim.progress import Progress, run_sim
from netsim.scenario import load_scenario
from netsim.sim import Simulator
from netsim_helpers import SCENARIOS


def test_sliced_run_is_the_same_run_and_reports_lines() -> None:
    sc = load_scenario(SCENARIOS / "smoke-20.toml")
    whole = Simulator(sc, 5)
    whole.run()
    sliced = Simulator(sc, 5)
    out = io.StringIO()
    with Progress(stream=out, interval_s=0.0) as prog:
        run_sim(sliced, prog.task("smoke"), slice_wall_s=0.001)
    assert dumps_results(sliced.results()) == dumps_results(whole.results())
    lines = out.getvalue().splitlines()
    assert len(lines) >= 3 and all(line.startswith("netsim: smoke") for line in lines)
    assert "events=" in lines[0] and "sim=" in lines[0]
    assert lines[-1].startswith("netsim: smoke 100%") and "done in" in lines[-1]


def test_rich_bar_on_a_terminal_and_quiet() -> None:
    sc = load_scenario(SCENARIOS / "smoke-20.toml")
    out = io.StringIO()
    with Progress(stream=out, force_terminal=True) as prog:
        run_sim(Simulator(sc, 1), prog.task("smoke"))
    text = out.getvalue()
    assert "\x1b[" in text and "smoke" in text and "ev/s" in text
    quiet = io.StringIO()
    with Progress(stream=quiet, quiet=True, interval_s=0.0) as prog:
        run_sim(Simulator(sc, 1), prog.task("smoke"))
    assert quiet.getvalue() == ""


def test_cli_quiet_flag(tmp_path, capsys) -> None:
    assert main(["run", str(SCENARIOS / "smoke-20.toml")]) == 0
    assert "100% sim=" in capsys.readouterr().err  # pytest's capture is no terminal: plain lines
    assert main(["run", str(SCENARIOS / "smoke-20.toml"), "-q"]) == 0
    err = capsys.readouterr().err
    assert "100%" not in err and "wall=" in err  # the run's one-line summary stays
    assert main(["run", str(SCENARIOS / "smoke-20.toml"), "--plot"]) == 2
    assert "needs --out" in capsys.readouterr().err
    assert main(["run", str(SCENARIOS / "smoke-20.toml"), "-q", "--out", str(tmp_path / "r.json"), "--plot"]) == 0
    assert (tmp_path / "r.cdf.png").exists() and (tmp_path / "r.png").exists()


def test_progress_counts_shards_delivered_not_only_jobs_finished() -> None:
    # at 10,000 peers no job finishes for minutes of simulated time: the
    # share done follows the shards delivered too (each counted once), so
    # the bar moves and its time left is not estimated from 0%
    from netsim.progress import _done

    sim = Simulator(load_scenario(SCENARIOS / "smoke-20.toml"), 1)
    total = sum(j.shards for j in sim.trace)
    led = 0
    while sim.q and sim.now < sim.stop_at:
        sim.run_until(sim.now + 1.0)
        shards = sum(len(j.delivered) for j in sim.jobs.values())
        jobs = sum(j.finish_t is not None for j in sim.jobs.values()) / len(sim.trace)
        assert sim.shards_delivered == shards
        assert _done(sim) == 1000.0 * min(max(jobs, shards / total, sim.now / sim.stop_at), 1.0)
        led += shards / total > max(jobs, sim.now / sim.stop_at)
    assert led >= 10  # seconds in which the shards were ahead of jobs and time
    assert sim.shards_delivered == total  # duplicates not counted twice
