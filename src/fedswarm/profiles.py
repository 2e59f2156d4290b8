"""Peer profiles: hardware, power curve and policy of a peer, as TOML.

A profile (``peers/*.toml``) is read by both the daemon and netsim::

    prof = load_profile("peers/datacenter-a100.toml")
    cfg = prof.peer_config(bootstrap=(...,))   # -> fedswarm.core.config.PeerConfig

Schema (every table optional except ``devices``; unknown keys are errors)::

    name = "datacenter-a100"          # defaults to the file stem
    description = "..."
    trust = "datacenter"              # or "volunteer"
    region = "us-east"
    slots = 8                         # devices usable side by side (default: GPU count)
    energy_price = 0.08               # per kWh
    carbon_g_kwh = 120.0
    tasks = ["llama"]                 # task kinds served (default: any)

    [[devices]]
    kind = "cuda"                     # cuda | rocm | mps | cpu
    name = "NVIDIA A100-SXM4-80GB"
    count = 8
    mem_gb = 80                       # per device

    [throughput]                      # task kind -> speed relative to the reference
    "*" = 1.0                         # device (NVIDIA A100 SXM4 = 1.0)

    [power]                           # per device (core.energy.PowerModel)
    idle_w = 60.0
    max_w = 400.0
    alpha = 2.5
    cap_w = 0.0                       # 0 = no cap
    levels = [0.6, 0.8, 1.0]

    [policy]
    queue_policy = "rho"              # rho | share | fifo
    fairness_knob = 1.0
    race_to_idle = false
    rerun_room = false                # true: slow down only with room for a re-run
    offer_interval_s = 0.0            # > 0: offer free slots to queued peers (slot offers)
    offer_backoff_max = 16            # an idle peer's offers slow down to 1 per this many intervals
    offer_max_ratio = 0.0             # > 0: no offers to peers more than this many times faster
    max_backlog_s = inf               # optional
    tenant_cap_s = inf                # optional

    [gossip]
    interval_s = 1.0
    fanout = 2
    entries = 8
    state_ttl_s = 30.0
    state_refresh_s = 10.0
    max_view = 1024
    join_pull = 255
    quiet_max = 8                     # quiet gossip when idle, up to 8x (1 = off)

    [lease]
    renew_interval_s = 2.0
    lease_grace_s = 12.0
    result_retry_s = 1.0
    result_retries = 60
    checkpoint_min_s = 10.0           # a running shard's checkpoints go out at most this often

Reference device: throughput 1.0 is one NVIDIA A100 SXM4 at full clock, so
a job's ``work_s`` is its per-shard run time on ``gpus`` A100s.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from .core.config import QUEUE_POLICIES, PeerConfig
from .core.energy import PowerModel
from .core.wire import Device
from .errors import InputError

__all__ = ["Profile", "ProfileError", "load_profile", "parse_profile", "REFERENCE_DEVICE"]

REFERENCE_DEVICE = "NVIDIA A100-SXM4 (throughput 1.0)"
DEVICE_KINDS = ("cuda", "rocm", "mps", "cpu")
TRUST_LEVELS = ("datacenter", "volunteer")
GIB = 1 << 30


class ProfileError(InputError):
    """A profile file is malformed; the message names the file and key.

    An ``InputError`` (so a ``ValueError`` too): ``peer`` exits 2 on it."""


@dataclass(frozen=True)
class Profile:
    name: str
    devices: tuple[Device, ...]
    slots: int
    throughput: dict[str, float]
    power: PowerModel
    energy_price: float = 0.2
    carbon_g_kwh: float = 300.0
    trust: str = "volunteer"
    region: str = ""
    description: str = ""
    tasks: frozenset[str] | None = None
    policy: dict[str, Any] = field(default_factory=dict)  # PeerConfig field -> value
    path: str = ""

    @property
    def gpus(self) -> int:
        return self.slots

    def speed(self, kind: str = "*") -> float:
        return self.throughput.get(kind, self.throughput.get("*", 1.0))

    def peer_config(self, **overrides: Any) -> PeerConfig:
        """The core's ``PeerConfig``; ``overrides`` are PeerConfig fields."""
        names = {f.name for f in fields(PeerConfig)}
        bad = sorted(set(overrides) - names)
        if bad:
            raise ProfileError(f"{self.name}: unknown PeerConfig override(s) {bad}")
        kw: dict[str, Any] = dict(
            devices=self.devices,
            slots=self.slots,
            throughput=dict(self.throughput),
            power=self.power,
            energy_price=self.energy_price,
            carbon_g_kwh=self.carbon_g_kwh,
            tasks=self.tasks,
            trust=self.trust,
            region=self.region,
        )
        kw.update(self.policy)
        kw.update(overrides)
        return PeerConfig(**kw)

    def with_region(self, region: str) -> "Profile":
        return replace(self, region=region)


# -- validation helpers ---------------------------------------------------------

_TOP = {
    "name", "description", "trust", "region", "slots", "energy_price", "carbon_g_kwh", "tasks",
    "devices", "throughput", "power", "policy", "gossip", "lease",
}
_DEVICE = {"kind", "name", "count", "mem_gb"}
_POWER = {"idle_w", "max_w", "alpha", "cap_w", "levels"}
# table -> {toml key: PeerConfig field}
_MAPPED = {
    "policy": {
        "queue_policy": "queue_policy",
        "fairness_knob": "fairness_knob",
        "race_to_idle": "race_to_idle",
        "rerun_room": "rerun_room",
        "offer_interval_s": "offer_interval_s",
        "offer_backoff_max": "offer_backoff_max",
        "offer_max_ratio": "offer_max_ratio",
        "max_backlog_s": "max_backlog_s",
        "tenant_cap_s": "tenant_cap_s",
        "ledger_tau_s": "ledger_tau_s",
    },
    "gossip": {
        "interval_s": "gossip_interval_s",
        "fanout": "gossip_fanout",
        "entries": "gossip_entries",
        "state_ttl_s": "state_ttl_s",
        "state_refresh_s": "state_refresh_s",
        "max_view": "max_view",
        "join_pull": "join_pull",
        "quiet_max": "gossip_quiet_max",
    },
    "lease": {
        "renew_interval_s": "renew_interval_s",
        "lease_grace_s": "lease_grace_s",
        "result_retry_s": "result_retry_s",
        "result_retries": "result_retries",
        "checkpoint_min_s": "checkpoint_min_s",
    },
}
_INT_FIELDS = {"gossip_fanout", "gossip_entries", "max_view", "join_pull", "gossip_quiet_max", "result_retries",
               "offer_backoff_max"}
_BOOL_FIELDS = {"race_to_idle", "rerun_room"}
_STR_FIELDS = {"queue_policy"}


class _Ctx:
    def __init__(self, src: str) -> None:
        self.src = src

    def err(self, key: str, msg: str) -> ProfileError:
        return ProfileError(f"{self.src}: {key}: {msg}")

    def table(self, v: Any, key: str, allowed: set[str]) -> dict[str, Any]:
        if not isinstance(v, dict):
            raise self.err(key, "must be a table")
        unknown = sorted(set(v) - allowed)
        if unknown:
            raise self.err(key, f"unknown key(s) {unknown}; allowed: {sorted(allowed)}")
        return v

    def num(self, v: Any, key: str, lo: float = -math.inf, hi: float = math.inf, *, lo_open: bool = False) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise self.err(key, f"must be a number, got {v!r}")
        x = float(v)
        if math.isnan(x) or x < lo or x > hi or (lo_open and x <= lo):
            rng = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
            raise self.err(key, f"{x} out of range {rng}")
        return x

    def int_(self, v: Any, key: str, lo: int = 0, hi: int = 1 << 31) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.err(key, f"must be an integer, got {v!r}")
        if not lo <= v <= hi:
            raise self.err(key, f"{v} out of range [{lo}, {hi}]")
        return v

    def str_(self, v: Any, key: str, choices: tuple[str, ...] | None = None) -> str:
        if not isinstance(v, str):
            raise self.err(key, f"must be a string, got {v!r}")
        if choices is not None and v not in choices:
            raise self.err(key, f"{v!r} is not one of {list(choices)}")
        return v


def parse_profile(data: dict[str, Any], *, name: str = "", src: str = "<profile>") -> Profile:
    """Validate a parsed TOML document and build a ``Profile``."""
    c = _Ctx(src)
    c.table(data, "(top level)", _TOP)
    pname = c.str_(data.get("name", name), "name") or name
    if not pname:
        raise c.err("name", "missing")
    if "devices" not in data:
        raise c.err("devices", "missing: at least one [[devices]] entry is required")
    devs_raw = data["devices"]
    if not isinstance(devs_raw, list) or not devs_raw:
        raise c.err("devices", "must be a non-empty array of tables ([[devices]])")
    devices = []
    for i, d in enumerate(devs_raw):
        k = f"devices[{i}]"
        c.table(d, k, _DEVICE)
        for req in ("kind", "count"):
            if req not in d:
                raise c.err(f"{k}.{req}", "missing")
        kind = c.str_(d["kind"], f"{k}.kind", DEVICE_KINDS)
        count = c.int_(d["count"], f"{k}.count", 1, 4096)
        mem = int(c.num(d.get("mem_gb", 8), f"{k}.mem_gb", 0, 1 << 20, lo_open=True) * GIB)
        devices.append(Device(kind, c.str_(d.get("name", kind), f"{k}.name"), count, mem, mem))
    n_acc = sum(d.count for d in devices if d.kind != "cpu")
    default_slots = n_acc if n_acc > 0 else 1
    slots = c.int_(data.get("slots", default_slots), "slots", 1, 4096)
    total = sum(d.count for d in devices)
    if slots > total:
        raise c.err("slots", f"{slots} exceeds the {total} devices declared")

    thr_raw = c.table(data.get("throughput", {"*": 1.0}), "throughput", set(data.get("throughput", {"*": 1.0})))
    throughput = {str(k): c.num(v, f"throughput.{k}", 0, 1e6, lo_open=True) for k, v in sorted(thr_raw.items())}
    if not throughput:
        raise c.err("throughput", "must name at least one kind (use \"*\" for the default)")

    p = c.table(data.get("power", {}), "power", _POWER)
    if "idle_w" not in p or "max_w" not in p:
        raise c.err("power", "idle_w and max_w are required")
    idle = c.num(p["idle_w"], "power.idle_w", 0, 1e5)
    mx = c.num(p["max_w"], "power.max_w", 0, 1e5, lo_open=True)
    if mx < idle:
        raise c.err("power.max_w", f"{mx} is below idle_w {idle}")
    levels_raw = p.get("levels", [1.0])
    if not isinstance(levels_raw, list) or not levels_raw:
        raise c.err("power.levels", "must be a non-empty array of numbers in (0, 1]")
    levels = tuple(sorted({c.num(f, "power.levels[]", 0, 1, lo_open=True) for f in levels_raw}))
    power = PowerModel(
        idle_w=idle,
        max_w=mx,
        alpha=c.num(p.get("alpha", 2.5), "power.alpha", 0, 10, lo_open=True),
        cap_w=c.num(p.get("cap_w", 0.0), "power.cap_w", 0, 1e5),
        levels=levels,
    )

    policy: dict[str, Any] = {}
    for tname, mapping in _MAPPED.items():
        t = c.table(data.get(tname, {}), tname, set(mapping))
        for key, fname in mapping.items():
            if key not in t:
                continue
            v = t[key]
            full = f"{tname}.{key}"
            if fname in _BOOL_FIELDS:
                if not isinstance(v, bool):
                    raise c.err(full, f"must be true or false, got {v!r}")
                policy[fname] = v
            elif fname in _STR_FIELDS:
                policy[fname] = c.str_(v, full, QUEUE_POLICIES)
            elif fname in _INT_FIELDS:
                policy[fname] = c.int_(v, full, 1 if fname in ("max_view", "offer_backoff_max") else 0)
            else:
                policy[fname] = c.num(v, full, 0, math.inf, lo_open=fname not in ("fairness_knob", "checkpoint_min_s",
                                                                                "offer_interval_s", "offer_max_ratio"))
    if "fairness_knob" in policy and policy["fairness_knob"] > 1:
        raise c.err("policy.fairness_knob", "must be in [0, 1]")

    tasks = None
    if "tasks" in data:
        if not isinstance(data["tasks"], list) or not all(isinstance(x, str) for x in data["tasks"]):
            raise c.err("tasks", "must be an array of strings")
        tasks = frozenset(data["tasks"])

    prof = Profile(
        name=pname,
        devices=tuple(devices),
        slots=slots,
        throughput=throughput,
        power=power,
        energy_price=c.num(data.get("energy_price", 0.2), "energy_price", 0, 1e3),
        carbon_g_kwh=c.num(data.get("carbon_g_kwh", 300.0), "carbon_g_kwh", 0, 1e4),
        trust=c.str_(data.get("trust", "volunteer"), "trust", TRUST_LEVELS),
        region=c.str_(data.get("region", ""), "region"),
        description=c.str_(data.get("description", ""), "description"),
        tasks=tasks,
        policy=policy,
        path=src,
    )
    try:
        prof.peer_config()  # let PeerConfig's own checks run now
    except ValueError as exc:
        raise ProfileError(f"{src}: {exc}") from None
    return prof


def load_profile(path: str | Path) -> Profile:
    """Read and validate a peer profile TOML file."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ProfileError(f"{p}: no such profile file", "see peers/*.toml, or omit --profile to detect this machine") from None
    except IsADirectoryError:
        raise ProfileError(f"{p}: is a directory, not a profile file") from None
    except PermissionError:
        raise ProfileError(f"{p}: permission denied") from None
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{p}: invalid TOML: {exc}") from None
    return parse_profile(data, name=p.stem, src=str(p))
