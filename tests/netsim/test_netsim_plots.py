"""netsim.plots: the figures of a run and of a comparison are real PNGs;
tokens/s per tenant only when the jobs carry token counts."""

import netsim_helpers  # noqa: F401  (must come first: fixes sys.path)

from netsim import run_scenario
from netsim.compare import compare
from netsim.plots import plot_compare, plot_run, stem_of
from netsim.scenario import load_scenario
from netsim_helpers import SCENARIOS

PNG = b"\x89PNG\r\n\x1a\n"


def test_run_figures_and_tokens_only_when_present(tmp_path) -> None:
    res = run_scenario(load_scenario(SCENARIOS / "smoke-20.toml"), 1)
    written = plot_run(res, tmp_path / "r.json")
    names = sorted(p.rsplit("/", 1)[-1] for p in written)
    assert names == ["r.cdf.png", "r.energy.png", "r.messages.png", "r.png", "r.shares.png"]
    assert all(open(p, "rb").read(8) == PNG for p in written)
    for j in res["jobs"]:
        j["tokens"] = 1000
    written = plot_run(res, tmp_path / "t.png")
    assert str(tmp_path / "t.tokens.png") in written
    assert (tmp_path / "t.tokens.png").read_bytes()[:8] == PNG


def test_compare_figures(tmp_path) -> None:
    cmp = compare(load_scenario(SCENARIOS / "smoke-20.toml"), 1, ["centralized", "fedswarm"])
    written = plot_compare(cmp, tmp_path / "c.json")
    assert {p.rsplit("/", 1)[-1] for p in written} == {"c.png", "c.cdf.png", "c.energy.png", "c.shares.png",
                                                        "c.messages.png"}
    assert stem_of("a/b.json") == stem_of("a/b.png") == stem_of("a/b")
