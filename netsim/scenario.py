"""Scenario files (TOML): swarm, network model, churn and workload.

See docs/netsim.md for the full schema. Unknown keys are errors.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from fedswarm.core.config import ClientConfig, PeerConfig
from fedswarm.profiles import Profile, load_profile

from .network import NetworkModel, Partition
from .workload import TraceError, TraceJob, check_dist, generate, read_trace

__all__ = ["Scenario", "SwarmGroup", "Churn", "Fault", "FAULT_KINDS", "TENANT_TASKS", "ScenarioError", "load_scenario",
           "find_profiles_dir"]


class ScenarioError(ValueError):
    pass


@dataclass(frozen=True)
class SwarmGroup:
    profile: str
    count: int
    region: str = ""  # overrides the profile's region; "" keeps it ("" there too: drawn)


@dataclass(frozen=True)
class Churn:
    crash_fraction: float = 0.0
    crash_window_s: tuple[float, float] = (0.0, 0.0)
    leave_fraction: float = 0.0
    leave_window_s: tuple[float, float] = (0.0, 0.0)
    leave_grace_s: float = 60.0
    join_count: int = 0
    join_window_s: tuple[float, float] = (0.0, 0.0)


FAULT_KINDS = ("crash", "hang", "slow", "partition", "delay", "client-disconnect")
#: task kinds a generator tenant may name (``task = ...``): "sim" is the plain
#: batch shard; "llm-batch" stands for the built-in batch LLM inference task
#: (netsim runs no model: a shard is a timed slot like any other)
TENANT_TASKS = ("sim", "tensor-map", "llm-batch")


@dataclass(frozen=True)
class Fault:
    """One ``[[faults]]`` entry; see docs/netsim.md ("Faults").

    Peer faults (crash, hang, slow) hit ``count`` or ``fraction`` of the
    initial peers (disjoint across entries); ``partition`` splits off
    ``fraction`` of them (or ``regions``); ``delay`` adds ``delay_s`` to the
    messages of ``fraction`` of the links; ``client-disconnect`` cuts the
    client of ``tenant`` (or ``count``/``fraction`` of the tenants) off the
    network. All act in ``[start_s, end_s)``; ``end_s = inf``: for good.
    """

    kind: str
    start_s: float = 0.0
    end_s: float = math.inf
    fraction: float | None = None
    count: int | None = None
    factor: float = 10.0  # slow: run time multiplier
    delay_s: float = 0.0  # delay: extra one-way latency
    regions: tuple[str, ...] = ()  # partition: side B by region
    tenant: str = ""  # client-disconnect

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "start_s": self.start_s,
                               "end_s": None if math.isinf(self.end_s) else self.end_s}
        if self.fraction is not None:
            out["fraction"] = self.fraction
        if self.count is not None:
            out["count"] = self.count
        if self.kind == "slow":
            out["factor"] = self.factor
        if self.kind == "delay":
            out["delay_s"] = self.delay_s
        if self.regions:
            out["regions"] = list(self.regions)
        if self.tenant:
            out["tenant"] = self.tenant
        return out


@dataclass
class Scenario:
    name: str
    swarm: list[SwarmGroup]
    network: NetworkModel = field(default_factory=NetworkModel)
    regions: dict[str, float] = field(default_factory=lambda: {"us": 1.0})
    churn: Churn = field(default_factory=Churn)
    tenants: list[dict[str, Any]] = field(default_factory=list)
    trace: list[TraceJob] | None = None
    task: str = "sim"
    peer_overrides: dict[str, Any] = field(default_factory=dict)
    client_overrides: dict[str, Any] = field(default_factory=dict)
    max_time_s: float = 86400.0
    warmup_s: float = 10.0
    settle_s: float = 10.0
    sample_s: float = 0.0  # shares-over-time bucket; 0: makespan / 50
    bootstrap_peers: int = 3
    pubsub_fanout: int = 0  # 0: a Publish reaches every live node; k: k random ones
    forget_after_s: float = 120.0
    base_dir: Path = Path(".")
    profiles_dir: Path | None = None
    profiles: dict[str, Profile] = field(default_factory=dict)
    faults: tuple[Fault, ...] = ()
    tenant_tasks: dict[str, str] = field(default_factory=dict)  # tenant -> task (default: ``task``)
    #: tenant -> the region its client sits in (default: drawn from ``regions``)
    tenant_regions: dict[str, str] = field(default_factory=dict)
    #: ``[parallel]``: the run split into ``parts`` (netsim.parallel), the
    #: clients and ``first_share`` of the peers in the first part
    parts: int = 1
    first_share: float = 0.5
    #: or the parts by region: part i runs the nodes of the regions in
    #: ``part_regions[i]`` (every message between parts then crosses regions)
    part_regions: tuple[tuple[str, ...], ...] = ()
    #: ``workload.checkpoint_s``: every running shard's task saves its
    #: progress this often (``ShardProgress``), so that a re-run after a
    #: crash goes on from there; 0: no task saves progress
    checkpoint_s: float = 0.0
    llm: Any = None  # an ``[llm]`` table: netsim.llm.LLMConfig (LLM serving sessions; ``netsim run`` runs netsim.llm)

    def task_of(self, tenant: str) -> str:
        return self.tenant_tasks.get(tenant, self.task)

    @property
    def n_peers(self) -> int:
        return sum(g.count for g in self.swarm)

    def scaled(self, n: int) -> "Scenario":
        """The same scenario with ``n`` initial peers, keeping the profile mix
        (largest-remainder rounding); joins scale proportionally."""
        total = self.n_peers
        if n < 1 or total < 1:
            raise ScenarioError("--peers must be >= 1")
        exact = [g.count * n / total for g in self.swarm]
        base = [int(math.floor(x)) for x in exact]
        left = n - sum(base)
        order = sorted(range(len(exact)), key=lambda i: (-(exact[i] - base[i]), i))
        for i in order[:left]:
            base[i] += 1
        swarm = [replace(g, count=c) for g, c in zip(self.swarm, base) if c > 0]
        churn = replace(self.churn, join_count=int(round(self.churn.join_count * n / total)))
        out = replace(self, swarm=swarm, churn=churn)
        return out

    def jobs(self, rng: Any) -> list[TraceJob]:
        if self.trace is not None:
            return list(self.trace)
        return generate(self.tenants, rng)


_TOP = {
    "name", "description", "max_time_s", "warmup_s", "settle_s", "sample_s", "bootstrap_peers",
    "pubsub_fanout", "forget_after_s", "profiles_dir", "swarm", "network", "churn", "workload", "peer", "client",
    "faults", "llm", "parallel",
}
_PARALLEL = {"parts", "first_share", "regions"}
_NET = {"regions", "intra_ms", "inter_ms", "jitter_ms", "bandwidth_mbps", "loss", "duplicate", "reorder",
        "reorder_ms", "partitions"}
_PART = {"start_s", "end_s", "fraction", "regions"}
_CHURN = {"crash_fraction", "crash_window_s", "leave_fraction", "leave_window_s", "leave_grace_s",
          "join_count", "join_window_s"}
_WORK = {"trace", "task", "tenants", "checkpoint_s"}
_GROUP = {"profile", "count", "region"}
_FAULT_KEYS = {
    "crash": {"kind", "fraction", "count", "start_s", "end_s"},
    "hang": {"kind", "fraction", "count", "start_s", "end_s"},
    "slow": {"kind", "fraction", "count", "start_s", "end_s", "factor"},
    "partition": {"kind", "fraction", "regions", "start_s", "end_s"},
    "delay": {"kind", "fraction", "start_s", "end_s", "delay_s"},
    "client-disconnect": {"kind", "tenant", "fraction", "count", "start_s", "end_s"},
}


def _num(v: Any, where: str, *, lo: float = 0.0, inf_ok: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or v < lo \
            or (math.isinf(v) and not inf_ok):
        raise ScenarioError(f"{where}: must be a {'' if inf_ok else 'finite '}number >= {lo:g}, got {v!r}")
    return float(v)


def parse_faults(raw: Any, src: str, tenant_names: set[str] | None) -> tuple[Fault, ...]:
    """Validate the ``[[faults]]`` array strictly (unknown keys, ranges, windows)."""
    if not isinstance(raw, list):
        raise ScenarioError(f"{src}: faults: must be an array of tables ([[faults]])")
    out = []
    for i, f in enumerate(raw):
        where = f"{src}: faults[{i}]"
        if not isinstance(f, dict):
            raise ScenarioError(f"{where}: must be a table")
        kind = f.get("kind")
        if kind not in _FAULT_KEYS:
            raise ScenarioError(f"{where}: kind must be one of {list(FAULT_KINDS)}, got {kind!r}")
        _table(f, where, _FAULT_KEYS[kind])
        start = _num(f.get("start_s", 0.0), f"{where}.start_s")
        needs_end = kind in ("partition", "delay", "client-disconnect")
        if needs_end and "end_s" not in f:
            raise ScenarioError(f"{where}: {kind} needs end_s")
        default_end = start if kind == "crash" else math.inf
        end = _num(f.get("end_s", default_end), f"{where}.end_s", inf_ok=not needs_end)
        if end < start:
            raise ScenarioError(f"{where}: end_s ({end:g}) < start_s ({start:g})")
        if end == start and kind != "crash":
            raise ScenarioError(f"{where}: empty window (end_s == start_s)")
        fraction = _prob(f["fraction"], f"{where}.fraction") if "fraction" in f else None
        count = None
        if "count" in f:
            if isinstance(f["count"], bool) or not isinstance(f["count"], int) or f["count"] < 0:
                raise ScenarioError(f"{where}.count: must be a non-negative integer")
            count = f["count"]
        if fraction is not None and count is not None:
            raise ScenarioError(f"{where}: give fraction or count, not both")
        kw: dict[str, Any] = {}
        if kind in ("crash", "hang", "slow") and fraction is None and count is None:
            raise ScenarioError(f"{where}: {kind} needs fraction or count (of the initial peers)")
        if kind == "slow":
            kw["factor"] = _num(f.get("factor", 10.0), f"{where}.factor", lo=1.0)
        if kind == "partition":
            regs = f.get("regions", [])
            if not isinstance(regs, list) or not all(isinstance(r, str) for r in regs):
                raise ScenarioError(f"{where}.regions: a list of region names")
            if regs and fraction is not None:
                raise ScenarioError(f"{where}: give fraction or regions, not both")
            if not regs and fraction is None:
                fraction = 0.5
            kw["regions"] = tuple(regs)
        if kind == "delay":
            if "delay_s" not in f:
                raise ScenarioError(f"{where}: delay needs delay_s")
            kw["delay_s"] = _num(f["delay_s"], f"{where}.delay_s")
            if kw["delay_s"] <= 0:
                raise ScenarioError(f"{where}.delay_s: must be > 0")
            if fraction is None:
                fraction = 1.0
        if kind == "client-disconnect":
            if "tenant" in f:
                if fraction is not None or count is not None:
                    raise ScenarioError(f"{where}: give tenant, fraction or count, only one")
                if not isinstance(f["tenant"], str) or not f["tenant"]:
                    raise ScenarioError(f"{where}.tenant: a tenant name")
                if tenant_names is not None and f["tenant"] not in tenant_names:
                    raise ScenarioError(f"{where}.tenant: no tenant {f['tenant']!r} (have {sorted(tenant_names)})")
                kw["tenant"] = f["tenant"]
            elif fraction is None and count is None:
                raise ScenarioError(f"{where}: client-disconnect needs tenant, fraction or count")
        out.append(Fault(kind, start, end, fraction, count, **kw))
    return tuple(out)


def _table(v: Any, where: str, allowed: set[str]) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise ScenarioError(f"{where}: must be a table")
    bad = sorted(set(v) - allowed)
    if bad:
        raise ScenarioError(f"{where}: unknown key(s) {bad}; allowed: {sorted(allowed)}")
    return v


def _pair(v: Any, where: str) -> tuple[float, float]:
    if not (isinstance(v, list) and len(v) == 2 and all(isinstance(x, (int, float)) for x in v) and v[0] <= v[1]):
        raise ScenarioError(f"{where}: must be [lo, hi] with lo <= hi")
    return float(v[0]), float(v[1])


def _prob(v: Any, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
        raise ScenarioError(f"{where}: must be a probability in [0, 1], got {v!r}")
    return float(v)


_KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _overrides(v: Any, where: str, cls: type) -> dict[str, Any]:
    """A ``[peer]`` or ``[client]`` table as ``cls`` fields. A field whose
    default is a plain bool, int, float or str takes only a value of that
    kind (an integer for a float), so a mistyped value is named here, not
    met later as a comparison of a string with a number."""
    defaults = {f.name: f.default for f in fields(cls)}
    t = _table(v, where, set(defaults))
    out = {}
    for k, x in t.items():
        want = type(defaults[k])
        if want in _KINDS:
            ok = (isinstance(x, bool) if want is bool
                  else isinstance(x, str) if want is str
                  else not isinstance(x, bool) and isinstance(x, (int, float) if want is float else int))
            if not ok:
                raise ScenarioError(f"{where}.{k}: must be {_KINDS[want]}, got {x!r}")
        if isinstance(x, list):
            x = tuple(x)
        out[k] = x
    return out


def find_profiles_dir(start: Path) -> Path | None:
    """The nearest ``peers/`` directory at or above ``start``, else ./peers."""
    for d in [start, *start.parents]:
        if (d / "peers").is_dir():
            return d / "peers"
    cwd = Path.cwd() / "peers"
    return cwd if cwd.is_dir() else None


def resolve_profile(name: str, profiles_dir: Path | None, base: Path) -> Path:
    p = Path(name)
    cands = []
    if p.suffix == ".toml":
        cands += [base / p, p]
    if profiles_dir is not None:
        cands.append(profiles_dir / (name if name.endswith(".toml") else f"{name}.toml"))
    for c in cands:
        if c.is_file():
            return c
    raise ScenarioError(f"profile {name!r} not found (looked in {[str(c) for c in cands]}); use --profiles DIR")


def checkpoint_interval(value: Any, where: str) -> float:
    """``workload.checkpoint_s`` (or ``--checkpoint-s``, ``where`` names
    which) checked: seconds from 0 (off) to a day."""
    if type(value) not in (int, float) or not 0.0 <= value <= 86400.0:
        raise ScenarioError(f"{where}: seconds from 0 (off) to 86400, got {value!r}")
    return float(value)


def parse_scenario(data: dict[str, Any], *, src: str = "<scenario>", base_dir: Path = Path("."),
                   profiles_dir: Path | None = None) -> Scenario:
    _table(data, src, _TOP)
    name = str(data.get("name", Path(src).stem))
    if profiles_dir is None:
        if "profiles_dir" in data:
            profiles_dir = (base_dir / data["profiles_dir"]).resolve()
        else:
            profiles_dir = find_profiles_dir(base_dir.resolve())
    groups_raw = data.get("swarm")
    if not isinstance(groups_raw, list) or not groups_raw:
        raise ScenarioError(f"{src}: swarm: needs at least one [[swarm]] entry (profile, count)")
    swarm, profiles = [], {}
    for i, g in enumerate(groups_raw):
        where = f"{src}: swarm[{i}]"
        _table(g, where, _GROUP)
        if "profile" not in g or "count" not in g:
            raise ScenarioError(f"{where}: needs profile and count")
        if not isinstance(g["count"], int) or g["count"] < 0:
            raise ScenarioError(f"{where}: count must be a non-negative integer")
        pname = str(g["profile"])
        if pname not in profiles:
            profiles[pname] = load_profile(resolve_profile(pname, profiles_dir, base_dir))
        swarm.append(SwarmGroup(pname, g["count"], str(g.get("region", ""))))

    net = _table(data.get("network", {}), f"{src}: network", _NET)
    regions = net.get("regions", {"us": 1.0})
    if not isinstance(regions, dict) or not regions or not all(isinstance(w, (int, float)) and w >= 0 for w in regions.values()):
        raise ScenarioError(f"{src}: network.regions: a table region -> weight")
    parts = []
    for i, p in enumerate(net.get("partitions", [])):
        where = f"{src}: network.partitions[{i}]"
        _table(p, where, _PART)
        if "start_s" not in p or "end_s" not in p:
            raise ScenarioError(f"{where}: needs start_s and end_s")
        parts.append(Partition(float(p["start_s"]), float(p["end_s"]), _prob(p.get("fraction", 0.5), where + ".fraction"),
                               tuple(str(r) for r in p.get("regions", ()))))
    model = NetworkModel(
        intra_ms=_pair(net.get("intra_ms", [5, 20]), f"{src}: network.intra_ms"),
        inter_ms=_pair(net.get("inter_ms", [50, 150]), f"{src}: network.inter_ms"),
        jitter_ms=float(net.get("jitter_ms", 2.0)),
        bandwidth_mbps=float(net.get("bandwidth_mbps", 1000.0)),
        loss=_prob(net.get("loss", 0.0), f"{src}: network.loss"),
        duplicate=_prob(net.get("duplicate", 0.0), f"{src}: network.duplicate"),
        reorder=_prob(net.get("reorder", 0.0), f"{src}: network.reorder"),
        reorder_ms=float(net.get("reorder_ms", 50.0)),
        partitions=tuple(parts),
    )
    if model.bandwidth_mbps <= 0:
        raise ScenarioError(f"{src}: network.bandwidth_mbps must be > 0")

    ch = _table(data.get("churn", {}), f"{src}: churn", _CHURN)
    churn = Churn(
        crash_fraction=_prob(ch.get("crash_fraction", 0.0), f"{src}: churn.crash_fraction"),
        crash_window_s=_pair(ch.get("crash_window_s", [0, 0]), f"{src}: churn.crash_window_s"),
        leave_fraction=_prob(ch.get("leave_fraction", 0.0), f"{src}: churn.leave_fraction"),
        leave_window_s=_pair(ch.get("leave_window_s", [0, 0]), f"{src}: churn.leave_window_s"),
        leave_grace_s=float(ch.get("leave_grace_s", 60.0)),
        join_count=int(ch.get("join_count", 0)),
        join_window_s=_pair(ch.get("join_window_s", [0, 0]), f"{src}: churn.join_window_s"),
    )
    if churn.crash_fraction + churn.leave_fraction > 0.9:
        raise ScenarioError(f"{src}: churn: crash_fraction + leave_fraction must stay <= 0.9")

    wl = _table(data.get("workload", {}), f"{src}: workload", _WORK)
    trace = None
    tenants = wl.get("tenants", [])
    try:
        if "trace" in wl:
            trace = read_trace(base_dir / wl["trace"])
        elif not isinstance(tenants, list):
            raise ScenarioError(f"{src}: workload.tenants must be an array of tables")
        else:
            for i, t in enumerate(tenants):
                for k in ("shards", "duration_s", "gpus"):
                    if isinstance(t, dict) and k in t:
                        check_dist(t[k], f"{src}: workload.tenants[{i}].{k}")
    except TraceError as exc:
        raise ScenarioError(str(exc)) from None
    # per-tenant task kind and client region: taken out here, the generator never sees them
    tenant_tasks: dict[str, str] = {}
    tenant_regions: dict[str, str] = {}
    if trace is None:
        clean = []
        for i, t in enumerate(tenants):
            if isinstance(t, dict) and ("task" in t or "region" in t):
                t = dict(t)
                if "task" in t:
                    task = t.pop("task")
                    if task not in TENANT_TASKS:
                        raise ScenarioError(
                            f"{src}: workload.tenants[{i}].task: one of {list(TENANT_TASKS)}, got {task!r}")
                    tenant_tasks[str(t.get("name", ""))] = task
                if "region" in t:
                    reg = t.pop("region")
                    if not isinstance(reg, str) or not reg:
                        raise ScenarioError(f"{src}: workload.tenants[{i}].region: a region name, got {reg!r}")
                    tenant_regions[str(t.get("name", ""))] = reg
            clean.append(t)
        tenants = clean
    if trace is not None:
        tenant_names: set[str] | None = {j.tenant for j in trace}
    else:
        tenant_names = {str(t["name"]) for t in tenants if isinstance(t, dict) and "name" in t}
    faults = parse_faults(data.get("faults", []), src, tenant_names)

    sc = Scenario(
        name=name,
        swarm=swarm,
        network=model,
        regions={str(k): float(v) for k, v in sorted(regions.items())},
        churn=churn,
        tenants=list(tenants),
        trace=trace,
        task=str(wl.get("task", "sim")),
        peer_overrides=_overrides(data.get("peer", {}), f"{src}: peer", PeerConfig),
        client_overrides=_overrides(data.get("client", {}), f"{src}: client", ClientConfig),
        max_time_s=float(data.get("max_time_s", 86400.0)),
        warmup_s=float(data.get("warmup_s", 10.0)),
        settle_s=float(data.get("settle_s", 10.0)),
        sample_s=float(data.get("sample_s", 0.0)),
        bootstrap_peers=int(data.get("bootstrap_peers", 3)),
        pubsub_fanout=int(data.get("pubsub_fanout", 0)),
        forget_after_s=float(data.get("forget_after_s", 120.0)),
        base_dir=base_dir,
        profiles_dir=profiles_dir,
        profiles=profiles,
        faults=faults,
        tenant_tasks=tenant_tasks,
        tenant_regions=tenant_regions,
    )
    sc.checkpoint_s = checkpoint_interval(wl.get("checkpoint_s", 0.0), f"{src}: workload.checkpoint_s")
    par = data.get("parallel", {})
    _table(par, f"{src}: parallel", _PARALLEL)
    parts, first = par.get("parts", 1), par.get("first_share", 0.5)
    if type(parts) is not int or not 1 <= parts <= 64:
        raise ScenarioError(f"{src}: parallel.parts: an integer from 1 to 64, got {parts!r}")
    if type(first) not in (int, float) or not 0.0 <= first <= 1.0:
        raise ScenarioError(f"{src}: parallel.first_share: a number from 0 to 1, got {first!r}")
    sc.parts, sc.first_share = parts, float(first)
    if "regions" in par:
        groups = par["regions"]
        if (not isinstance(groups, list) or len(groups) < 1
                or not all(isinstance(g, list) and g and all(isinstance(r, str) for r in g) for g in groups)):
            raise ScenarioError(f"{src}: parallel.regions: a list of lists of region names, one per part")
        named = [r for g in groups for r in g]
        if len(set(named)) != len(named):
            raise ScenarioError(f"{src}: parallel.regions: a region in two parts")
        if "parts" in par and parts != len(groups):
            raise ScenarioError(f"{src}: parallel.parts = {parts} but parallel.regions names {len(groups)} parts")
        if "first_share" in par:
            raise ScenarioError(f"{src}: parallel.first_share: not with parallel.regions (the regions place the peers)")
        sc.part_regions = tuple(tuple(g) for g in groups)
        sc.parts = len(groups)
    if "llm" in data:
        from .llm import LLMError, parse_llm

        try:
            sc.llm = parse_llm(data["llm"], src)
        except LLMError as exc:
            raise ScenarioError(str(exc)) from None
    for k in ("bootstrap", "devices", "power", "throughput"):
        if k in sc.peer_overrides:
            raise ScenarioError(f"{src}: peer.{k}: set hardware in the profile, not the scenario")
    try:
        for p in profiles.values():
            p.peer_config(**sc.peer_overrides)
        ClientConfig(**sc.client_overrides)
    except (TypeError, ValueError) as exc:
        raise ScenarioError(f"{src}: {exc}") from None
    return sc


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` on top of ``base``: tables merge key by key, anything else
    (numbers, strings, arrays such as ``[[swarm]]``) is replaced whole."""
    out = dict(base)
    for k, v in over.items():
        b = out.get(k)
        out[k] = _merge(b, v) if isinstance(b, dict) and isinstance(v, dict) else v
    return out


def _read(p: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A scenario file's tables, with ``extends = "other.toml"`` resolved:
    the other file (in the same directory, so that the paths both hold, a
    trace's and the profiles', mean the same) is read first and this one's
    keys go on top of it (``_merge``)."""
    try:
        with p.open("rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ScenarioError(f"{p}: no such scenario file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(f"{p}: invalid TOML: {exc}") from None
    if "extends" not in data:
        return data
    base = data.pop("extends")
    if not isinstance(base, str) or not base or Path(base).name != base:
        raise ScenarioError(f"{p}: extends: must name a scenario file in the same directory, e.g. \"eval-philly.toml\"")
    bp = p.parent / base
    seen = (*seen, p.resolve())
    if bp.resolve() in seen:
        raise ScenarioError(f"{p}: extends: {base} extends this file again (a cycle)")
    return _merge(_read(bp, seen), data)


def load_scenario(path: str | Path, *, profiles_dir: str | Path | None = None) -> Scenario:
    p = Path(path)
    data = _read(p)
    return parse_scenario(data, src=str(p), base_dir=p.parent,
                          profiles_dir=Path(profiles_dir) if profiles_dir is not None else None)
