"""PNG figures of netsim results (matplotlib, Agg backend: no display needed).

``plot_run(results, stem)`` (``netsim run --plot``) and
``plot_compare(cmp, stem)`` (``netsim compare``) write, next to the JSON:

* ``STEM.cdf.png``: CDFs of job completion time and of rho (finish-time
  fairness), one line per policy;
* ``STEM.energy.png``: energy split into running shards (busy) and idle peers;
* ``STEM.shares.png``: each tenant's share of busy GPU-seconds over time;
* ``STEM.messages.png``: messages per peer per second, by message kind;
* ``STEM.tokens.png``: tokens/s per tenant, only when the jobs carry token
  counts (LLM workloads that report them);
* ``STEM.png``: an overview of the first four on one page.

Each function returns the paths it wrote.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["plot_run", "plot_compare", "stem_of"]

#: message kinds that are membership traffic rather than scheduling
BACKGROUND = ("Gossip", "PeerState")
#: one colour per policy in every figure, whatever order the JSON lists them in
POLICY_ORDER = ("fedswarm", "fedswarm-race", "fedswarm-rerun", "centralized", "centralized-instant", "fifo", "fifo-instant",
                "random", "random-instant", "sparrow", "sparrow-instant")
_TAB10 = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
POLICY_COLORS = {p: c for p, c in zip(("fedswarm", "centralized", "fifo", "random", "sparrow", "fedswarm-race",
                                        "centralized-instant", "fifo-instant", "random-instant", "sparrow-instant"),
                                       _TAB10)}
POLICY_COLORS["fedswarm-rerun"] = "#000000"


def _ordered(runs: dict[str, Any]) -> dict[str, Any]:
    rank = {p: i for i, p in enumerate(POLICY_ORDER)}
    return {p: runs[p] for p in sorted(runs, key=lambda p: (rank.get(p, len(rank)), p))}


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _ticker() -> Any:
    import matplotlib.ticker as ticker

    return ticker


def stem_of(path: str | Path) -> Path:
    """``out/c.json`` or ``out/c.png`` -> ``out/c``."""
    p = Path(path)
    return p.with_suffix("") if p.suffix in (".json", ".png") else p


def _cdf(ax: Any, values: list[float], label: str) -> None:
    xs = sorted(max(v, 1e-3) for v in values)
    if xs:
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=label,
                color=POLICY_COLORS.get(label))


def _draw_cdfs(axes: Any, runs: dict[str, dict[str, Any]]) -> None:
    for ax, metric, label in ((axes[0], "jct_s", "job completion time (s)"), (axes[1], "rho", "finish-time fairness rho")):
        xs = []
        for pol, d in runs.items():
            vals = [j[metric] for j in d["jobs"] if j.get(metric) is not None]
            xs.extend(vals)
            _cdf(ax, vals, pol)
        ax.set_xscale("log")  # heavy tails: a linear axis hides all but the worst policy
        plain = _ticker().FuncFormatter(lambda v, _pos: f"{v:g}")
        lo, hi = (max(min(xs), 1e-3), max(max(xs), 1e-3)) if xs else (1.0, 10.0)
        # 1-2-5 ticks over a few decades; powers of ten only over more
        subs = (1.0, 2.0, 5.0) if hi / lo < 10 ** 2.5 else (1.0,)
        ax.xaxis.set_major_locator(_ticker().LogLocator(base=10, subs=subs))
        ax.xaxis.set_major_formatter(plain)
        ax.xaxis.set_minor_formatter(_ticker().NullFormatter())
        ax.set_xlabel(label + ", log scale")
        ax.set_ylabel("fraction of jobs")
        ax.grid(True, which="major", alpha=0.3)
    if metric == "rho":
        axes[1].axvline(1.0, color="grey", lw=0.8, ls="--")
    axes[0].legend(loc="lower right", fontsize="small")


def _draw_energy(ax: Any, runs: dict[str, dict[str, Any]]) -> None:
    pols = list(runs)
    busy = [runs[p]["summary"]["energy_busy_j"] / 1e6 for p in pols]
    idle = [runs[p]["summary"]["energy_idle_j"] / 1e6 for p in pols]
    ax.bar(pols, busy, label="busy: running shards", color="#d95f02")
    ax.bar(pols, idle, bottom=busy, label="idle peers", color="#7570b3")
    ax.set_ylabel("energy (MJ)")
    ax.legend(loc="upper left", fontsize="small")
    ax.tick_params(axis="x", labelrotation=20)
    ax.set_title("energy, busy and idle", fontsize="medium")


def _draw_shares(ax: Any, name: str, sot: dict[str, Any]) -> None:
    for t, ys in sorted(sot["tenants"].items()):
        ax.plot(sot["t_s"], ys, label=t, lw=1.2)
    ax.set_title(f"{name}: tenants' shares of busy GPU-seconds", fontsize="medium")
    ax.set_xlabel("time since the first arrival (s)")
    ax.set_ylabel("share")
    ax.set_ylim(0, 1.02)
    if sot["tenants"]:
        ax.legend(fontsize="small", ncol=2)


def _msgs_per_peer_s(d: dict[str, Any]) -> dict[str, float]:
    """Messages per peer per second by kind: the summary's rate split in
    proportion to the message counts by kind."""
    by_kind = d["by_kind"]
    total = sum(by_kind.values())
    rate = d["summary"].get("msgs_per_peer_s") or 0.0
    if not total or not rate:
        return {}
    return {k: rate * v / total for k, v in sorted(by_kind.items())}


def _draw_messages(ax: Any, runs: dict[str, dict[str, Any]]) -> None:
    pols = list(runs)
    rates = {p: _msgs_per_peer_s(runs[p]) for p in pols}
    kinds = sorted({k for r in rates.values() for k in r}, key=lambda k: (k in BACKGROUND, k))
    bottom = [0.0] * len(pols)
    import matplotlib

    cmap = matplotlib.colormaps["tab20"]
    for i, k in enumerate(kinds):
        ys = [rates[p].get(k, 0.0) for p in pols]
        ax.bar(pols, ys, bottom=bottom, label=k, color=cmap(i % 20), hatch="//" if k in BACKGROUND else None)
        bottom = [b + y for b, y in zip(bottom, ys)]
    ax.set_ylabel("messages per peer per second")
    ax.set_title("messages by kind (hatched: membership gossip)", fontsize="medium")
    ax.tick_params(axis="x", labelrotation=20)
    if kinds:
        ax.legend(fontsize="x-small", ncol=2)


def _tokens_per_tenant(d: dict[str, Any]) -> dict[str, float]:
    tok: dict[str, float] = {}
    span = d["summary"].get("makespan_s") or d["summary"].get("sim_time_s") or 0.0
    for j in d["jobs"]:
        if j.get("tokens") is not None:
            tok[j["tenant"]] = tok.get(j["tenant"], 0.0) + float(j["tokens"])
    return {t: v / span for t, v in sorted(tok.items())} if span > 0 else {}


def _save(fig: Any, path: Path, written: list[str]) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)
    written.append(str(path))


def _write_all(runs: dict[str, dict[str, Any]], shares: tuple[str, dict[str, Any]], stem: Path, title: str) -> list[str]:
    plt = _plt()
    runs = _ordered(runs)
    stem.parent.mkdir(parents=True, exist_ok=True)
    written: list[str] = []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    _draw_cdfs(axes, runs)
    fig.suptitle(title, fontsize="medium")
    _save(fig, Path(f"{stem}.cdf.png"), written)
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    _draw_energy(ax, runs)
    _save(fig, Path(f"{stem}.energy.png"), written)
    fig, ax = plt.subplots(figsize=(8, 4.2))
    _draw_shares(ax, *shares)
    _save(fig, Path(f"{stem}.shares.png"), written)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    _draw_messages(ax, runs)
    _save(fig, Path(f"{stem}.messages.png"), written)
    toks = {p: _tokens_per_tenant(d) for p, d in runs.items()}
    if any(toks.values()):
        fig, ax = plt.subplots(figsize=(7, 4.2))
        tenants = sorted({t for v in toks.values() for t in v})
        width = 0.8 / max(len(runs), 1)
        for i, (p, v) in enumerate(toks.items()):
            ax.bar([k + i * width for k in range(len(tenants))], [v.get(t, 0.0) for t in tenants], width, label=p)
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(tenants))], tenants, rotation=20)
        ax.set_ylabel("tokens per second")
        ax.set_title("LLM tokens/s per tenant", fontsize="medium")
        ax.legend(fontsize="small")
        _save(fig, Path(f"{stem}.tokens.png"), written)
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    _draw_cdfs(axes[0], runs)
    _draw_energy(axes[1][0], runs)
    _draw_shares(axes[1][1], *shares)
    fig.suptitle(title, fontsize="medium")
    _save(fig, Path(f"{stem}.png"), written)
    return written


def plot_run(results: dict[str, Any], stem: str | Path) -> list[str]:
    """Figures of one ``netsim run`` result."""
    name = results.get("policy", "fedswarm")
    runs = {name: {"summary": results["summary"], "jobs": results["jobs"], "by_kind": results["network"]["by_kind"]}}
    title = f"{results['scenario']} seed={results['seed']} peers={results['peers']['initial']}"
    return _write_all(runs, (name, results["shares_over_time"]), stem_of(stem), title)


def plot_compare(cmp: dict[str, Any], stem: str | Path) -> list[str]:
    """Figures of a ``netsim compare`` result (every policy on each)."""
    runs = {p: {"summary": d["summary"], "jobs": d["jobs"], "by_kind": d["network_by_kind"]} for p, d in cmp["policies"].items()}
    who = "fedswarm" if "fedswarm" in cmp["policies"] else next(iter(cmp["policies"]))
    title = f"{cmp['scenario']} seed={cmp['seed']} peers={cmp['peers']}"
    return _write_all(runs, (who, cmp["policies"][who]["shares_over_time"]), stem_of(stem), title)
