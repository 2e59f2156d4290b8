"""``peer start --engine ray``: a peer that fronts an existing Ray cluster.

The peer joins the swarm on the cluster's behalf (like an HTCondor glidein
joins a pool): it gossips the cluster's spare capacity, bids with the
cluster's slots and power model through the ordinary ``PeerCore`` (so its
bids use the same fairness priority and energy choice as every other peer),
and runs the shards it wins as Ray tasks. Nothing of the swarm's reaches Ray
but a task kind's *name*, its msgpack-decoded parameter dict and a shard
index: the Ray task function is fedswarm's own (:func:`run_shard_on_worker`),
which looks the kind up in fedswarm's task registry on the worker. So every
Ray node needs the same fedswarm (and task plugins) installed as the peer.

Pieces
------
:func:`connect_cluster` (at start, before the peer touches the network)
    connects as a Ray driver and checks the cluster; every problem is an
    ``InputError`` (one line, exit 2, nothing left running): Ray not
    installed, no cluster at the address (a bounded TCP check, then a bounded
    ``ray.init``), a cluster with no CPUs and no GPUs, a reserve larger than
    the cluster.

:class:`RayCluster` reads capacity. The *slot resource* is ``GPU`` when the
    cluster has GPUs, else ``CPU`` (fixed at start). Advertised slots::

        min(total - reserve, free + held - reserve)

    where ``total``/``free`` are Ray's ``cluster_resources()`` /
    ``available_resources()`` of the slot resource and ``held`` is what this
    peer's own Ray tasks hold (the core already counts those as its busy
    slots, so they must not also shrink its slot count). Other users of the
    cluster therefore shrink what the swarm is offered; nodes joining or
    leaving change it at the next read. Devices are grouped per node kind
    (``ray.nodes()``); GPU names, memory and power come from NVML on the
    GPU nodes (a tiny probe task per new node, where ``pynvml`` is
    importable), else from the profile.

:class:`RayRunner` is the ``ShardRunner`` the agent drives (like the
    daemon's ``ExecutorRunner``): ``watch()`` re-reads capacity every
    ``refresh_s`` and writes slots/devices into ``core.config`` (the core
    re-signs its gossiped state when they change); ``run_shard`` runs one
    shard as a Ray task asking ``num_cpus`` (CPU cluster) or ``num_gpus``
    (GPU cluster) for the shard's slots, a gang (``gpus > 1``) in one
    placement group of that many one-slot bundles; shards of a chain job held
    here run in shard order. Cancelling (a ``CancelShard`` from a revoked
    lease, a tenant's cancel, a hand-back on leave) cancels the Ray task
    (``ray.cancel(force=True)``: its worker process ends, so no half-run
    shard leaves state behind in a worker Ray would reuse) and removes its
    placement group. A shard awarded with a checkpoint (``RunShard.resume``)
    resumes from it on the worker; a Ray task itself never checkpoints.

Failures: a Ray task that fails because its worker or node died
(``WorkerCrashedError``, ``NodeDiedError``, ``ObjectLostError``,
``OutOfMemoryError``, ...) is submitted once more, within the same lease
(the core keeps renewing it meanwhile); a second such failure returns a
failed ``ShardFinished``, which the client treats as a hand-back and
auctions again. Ray's own retries are off (``max_retries=0``), so a shard
runs at most twice here and reports one result: nothing lost, nothing
duplicated. The task's own exception (bad params, ...) fails the shard at
once, as on any peer.

Energy: the worker measures NVML energy on the GPUs Ray gave it, where it
can; otherwise the runner charges the profile's power curve at the shard's
clock level for its run time (clock levels are modelled: Ray workers cannot
lock GPU clocks).

No call here blocks the trio loop: every Ray call runs in a worker thread
(``trio.to_thread.run_sync``); a shard's ``ray.get`` runs in its own,
abandoned on cancel.
"""

from __future__ import annotations

import logging
import itertools
import math
import re
import socket
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import msgpack
import trio

from ..core.events import Input, RunShard, SetLevel, SetPower, SetThroughput, ShardFinished
from ..core.runs import Runs, run_key
from ..core.wire import Device, unpack_params
from ..errors import InputError

__all__ = [
    "RAY_HINT",
    "Capacity",
    "RayCluster",
    "RayRunner",
    "connect_cluster",
    "import_ray",
    "parse_reserve",
    "run_shard_on_worker",
    "probe_node_gpus",
    "task_name",
    "RaySpan",
    "SpanWorker",
    "span_loader",
]

log = logging.getLogger("fedswarm.ray")

RAY_HINT = "pip install 'fedswarm[ray]'"
#: the Ray task name prefix (Ray's state API and dashboard show it)
TASK_PREFIX = "fedswarm"
_JOB_CHARS = re.compile(r"[^A-Za-z0-9._:-]")


def task_name(kind: str, shard: int, job_id: str) -> str:
    """The Ray task name of one shard: ``fedswarm KIND#SHARD JOB`` (the job id
    as the client chose it, cut to 64 safe characters)."""
    return f"{TASK_PREFIX} {kind}#{shard} {_JOB_CHARS.sub('_', job_id)[:64]}"
_SIZE_SUFFIX = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def import_ray() -> Any:
    """``ray``, or an ``InputError`` that names the extra to install."""
    try:
        import ray
    except ImportError:
        raise InputError("--engine ray needs Ray, which is not installed", RAY_HINT) from None
    return ray


# ------------------------------------------------------------------ reserve

def parse_reserve(text: str | None) -> dict[str, float]:
    """``--ray-reserve``: ``N`` (slots: GPUs on a GPU cluster, else CPUs) or
    ``RES=N[,RES=N...]`` with Ray resource names (``CPU=4,GPU=1,memory=16G``;
    ``memory`` takes k/M/G/T suffixes). Returns ``{resource: amount}``, the
    slot resource under the key ``"slots"``."""
    if text is None or not text.strip():
        return {}
    out: dict[str, float] = {}
    bad = InputError(f"--ray-reserve {text!r} is not a reserve",
                     "give N slots (GPUs, or CPUs on a CPU-only cluster) or RES=N,... e.g. CPU=4,GPU=1,memory=16G")
    for part in text.split(","):
        part = part.strip()
        name, sep, value = part.partition("=")
        if not sep:
            name, value = "slots", part
        name = name.strip()
        value = value.strip()
        if not name or not value or name in out:
            raise bad
        mult = 1
        if name == "memory" and value[-1:].lower() in _SIZE_SUFFIX and not value[-1:].isdigit():
            mult = _SIZE_SUFFIX[value[-1].lower()]
            value = value[:-1]
        try:
            x = float(value) * mult
        except ValueError:
            raise bad from None
        if not math.isfinite(x) or x < 0:
            raise bad
        out[name] = x
    return out


# ---------------------------------------------------------------- the worker

def run_shard_on_worker(kind: str, params: dict, shard: int, resume: bytes = b"") -> dict:
    """The one Ray task function fedswarm runs: look ``kind`` up in this
    worker's fedswarm registry, run shard ``shard`` of it on the devices Ray
    gave this task, and return plain data (the result msgpack-encoded).

    ``resume``: a checkpoint to go on from (``RunShard.resume``), for a
    resumable task; ``resumed`` in the answer says whether it did. A Ray
    task never checkpoints: its progress has no way back to the peer while
    it runs, so a shard lost with this peer starts over (or from an earlier
    peer's checkpoint) elsewhere."""
    import ray

    from ..tasks.registry import default_registry, is_resumable, run_task

    task = default_registry().get(kind)
    est = task.estimate(params)
    gpu_ids = [int(g) for g in ray.get_gpu_ids() if str(g).isdigit()]
    device = "cpu"
    torch = None
    if gpu_ids:
        import torch as _torch

        if _torch.cuda.is_available():
            torch, device = _torch, "cuda:0"  # Ray set CUDA_VISIBLE_DEVICES to this task's GPUs
    handles = _nvml_handles(gpu_ids)
    e0 = _nvml_energy(handles)
    t0 = time.perf_counter()
    result = run_task(task, params, shard, device=device, resume=resume)
    if torch is not None:
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    e1 = _nvml_energy(handles)
    if not isinstance(result, dict):
        raise TypeError(f"task {kind!r} returned {type(result).__name__}, not a dict")
    packed = msgpack.packb(result, use_bin_type=True)  # TypeError for anything but plain data
    energy = (e1 - e0) / 1000.0 if e0 is not None and e1 is not None else None
    return {
        "result": packed,
        "wall_s": wall,
        "energy_j": energy,
        "ref_seconds": float(est.ref_seconds),
        "resumed": bool(resume) and is_resumable(task),
        "node": ray.get_runtime_context().get_node_id(),
        "device": device,
    }


def _nvml_handles(gpu_ids: list[int]) -> list[Any]:
    if not gpu_ids:
        return []
    try:
        import pynvml

        pynvml.nvmlInit()
        return [pynvml.nvmlDeviceGetHandleByIndex(i) for i in gpu_ids]
    except Exception:  # no pynvml, no driver: energy comes from the power model
        return []


def _nvml_energy(handles: list[Any]) -> float | None:
    """Total energy counter (mJ) summed over ``handles``; None if unreadable."""
    if not handles:
        return None
    try:
        import pynvml

        return float(sum(pynvml.nvmlDeviceGetTotalEnergyConsumption(h) for h in handles))
    except Exception:
        return None


def probe_node_gpus() -> list[dict]:
    """On one Ray node: each GPU's name, memory and power from NVML ([] if
    NVML is not there). Runs as a zero-resource Ray task pinned to the node."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return []
    out = []
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            row = {"name": name.decode() if isinstance(name, bytes) else str(name),
                   "mem_total": int(mem.total), "mem_free": int(mem.free)}
            for key, fn in (("limit_w", "nvmlDeviceGetPowerManagementDefaultLimit"),
                            ("cap_w", "nvmlDeviceGetEnforcedPowerLimit"), ("power_w", "nvmlDeviceGetPowerUsage")):
                try:
                    row[key] = float(getattr(pynvml, fn)(h)) / 1000.0
                except Exception:
                    pass
            out.append(row)
    except Exception:
        log.debug("NVML probe failed", exc_info=True)
    return out


# ----------------------------------------------------------------- capacity

@dataclass(frozen=True)
class Capacity:
    """One reading of the cluster, and what the swarm is offered of it."""

    slot_resource: str  # "GPU" or "CPU"
    total: float  # the cluster's slot resource
    free: float  # Ray's available_resources() of it
    held: float  # held by this peer's own Ray tasks
    reserve: float  # --ray-reserve of it
    slots: int  # advertised: min(total - reserve, free + held - reserve), >= 0
    nodes: int  # alive nodes
    devices: tuple[Device, ...]
    now_w: float | None = None  # NVML power draw per GPU (mean), where probed


class RayCluster:
    """A driver connection to one Ray cluster (the blocking calls; run them
    in a thread). Build it with :func:`connect_cluster`."""

    def __init__(self, ray: Any, address: str, reserve: dict[str, float], slot_resource: str,
                 fallback_gpu: Device | None = None) -> None:
        self.ray = ray
        self.address = address
        self.reserve = reserve
        self.slot_resource = slot_resource
        self.fallback_gpu = fallback_gpu
        self.remote = ray.remote(run_shard_on_worker)
        self._probe = ray.remote(probe_node_gpus)
        self._gpu_info: dict[str, list[dict]] = {}  # node id -> NVML rows
        #: the reading taken when connecting (so the runner starts without a blocking call)
        self.initial: Capacity | None = None

    @property
    def reserve_slots(self) -> float:
        return self.reserve.get("slots", 0.0) + self.reserve.get(self.slot_resource, 0.0)

    def _probe_new_gpu_nodes(self, nodes: list[dict]) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        new = [n["NodeID"] for n in nodes if n["Resources"].get("GPU", 0) > 0 and n["NodeID"] not in self._gpu_info]
        if not new:
            return
        refs = {nid: self._probe.options(num_cpus=0, max_retries=0, name=f"{TASK_PREFIX} nvml probe",
                                         scheduling_strategy=NodeAffinitySchedulingStrategy(nid, soft=False)).remote()
                for nid in new}
        for nid, ref in refs.items():
            try:
                self._gpu_info[nid] = list(self.ray.get(ref, timeout=10.0))
            except Exception as exc:  # a node that cannot run it: the profile's figures
                log.info("NVML probe on Ray node %s failed: %r", nid[:12], exc)
                self._gpu_info[nid] = []

    def read(self, held: float = 0.0) -> Capacity:
        """Read the cluster now (blocking: a few GCS calls)."""
        ray = self.ray
        total_r = ray.cluster_resources()
        free_r = ray.available_resources()
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        res = self.slot_resource
        total = float(total_r.get(res, 0.0))
        free = float(free_r.get(res, 0.0))
        reserve = self.reserve_slots
        slots = int(math.floor(min(total - reserve, free + held - reserve) + 1e-9))
        if res == "GPU":
            self._probe_new_gpu_nodes(nodes)
        mem_reserve = self.reserve.get("memory", 0.0)
        groups: dict[tuple[str, str, int], list[int]] = {}
        draws: list[float] = []
        for n in nodes:
            r = n.get("Resources", {})
            if res == "GPU":
                count = int(r.get("GPU", 0))
                if count <= 0:
                    continue
                rows = self._gpu_info.get(n["NodeID"], [])
                if rows:
                    name, mem = rows[0]["name"], int(rows[0]["mem_total"])
                    free_mem = int(min(x["mem_free"] for x in rows))
                    draws += [x["power_w"] for x in rows if "power_w" in x]
                else:
                    acc = [k.split(":", 1)[1] for k in r if k.startswith("accelerator_type:")]
                    fb = self.fallback_gpu
                    name = acc[0] if acc else (fb.name if fb else "GPU")
                    mem = fb.mem_total if fb else 0
                    free_mem = mem
                kind = "cuda"
            else:
                count = int(r.get("CPU", 0))
                if count <= 0:
                    continue
                name, kind = "ray node CPU", "cpu"
                mem = int(max(float(r.get("memory", 0.0)) - mem_reserve, 0.0))
                free_mem = mem
            g = groups.setdefault((kind, name[:128], mem), [0, free_mem])
            g[0] += count
            g[1] = min(g[1], free_mem)
        devices = tuple(Device(k, nm, min(c, 4096), m, fm)
                        for (k, nm, m), (c, fm) in sorted(groups.items()))[:64]
        return Capacity(res, total, free, held, reserve, max(min(slots, 4096), 0), len(nodes), devices,
                        sum(draws) / len(draws) if draws else None)

    def describe(self) -> str:
        """One line for the daemon's log: where, what, and what is offered."""
        c = self.initial
        what = f"{c.total:g} {c.slot_resource} on {c.nodes} node(s), {c.free:g} free" if c else "not read yet"
        res = ",".join(f"{k}={v:g}" for k, v in sorted(self.reserve.items())) or "none"
        return (f"Ray cluster {self.address}: {what}; reserve {res}; offering {c.slots if c else 0} "
                f"slot(s) of {self.slot_resource} to the swarm")

    def gpu_power(self) -> dict[str, float] | None:
        """NVML's default and enforced power limits (W, mean per GPU), if probed."""
        rows = [x for v in self._gpu_info.values() for x in v if "limit_w" in x]
        if not rows:
            return None
        limit = sum(x["limit_w"] for x in rows) / len(rows)
        caps = [x["cap_w"] for x in rows if "cap_w" in x]
        cap = sum(caps) / len(caps) if caps else 0.0
        return {"max_w": limit, "cap_w": cap if 0 < cap < limit - 1e-6 else 0.0}

    def shutdown(self) -> None:
        try:
            self.ray.shutdown()
        except Exception:
            pass


def _split_address(address: str) -> tuple[str, int] | None:
    """``HOST:PORT`` of a GCS address, None for ``auto``."""
    if address == "auto":
        return None
    host, sep, port = address.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InputError(f"--ray-address {address!r} is not a Ray address",
                         "give the head's GCS address HOST:PORT (what `ray status` shows), or auto")
    return host, int(port)


def _connect_blocking(ray: Any, address: str) -> None:
    ray.init(address=address, namespace="fedswarm", log_to_driver=False, logging_level=logging.ERROR,
             configure_logging=True)


async def connect_cluster(address: str = "auto", reserve: str | None = None, *, timeout_s: float = 30.0,
                          profile: Any = None) -> RayCluster:
    """Connect to the Ray cluster at ``address`` (``auto``: the local one,
    or ``$RAY_ADDRESS``) and check it; ``InputError`` for each bad input."""
    import os

    ray = import_ray()
    res = parse_reserve(reserve)
    if address.startswith("ray://"):
        raise InputError(f"--ray-address {address}: Ray Client addresses are not supported",
                         "run the peer on a cluster node and give the head's GCS address HOST:PORT, or auto")
    hp = _split_address(address)
    if hp is None and os.environ.get("RAY_ADDRESS", "").strip() not in ("", "auto"):
        env = os.environ["RAY_ADDRESS"].strip()
        if not env.startswith("ray://"):
            hp = _split_address(env)
    if hp is not None:
        host, port = hp
        try:
            with socket.create_connection((host, port), timeout=min(5.0, timeout_s)):
                pass
        except OSError as exc:
            raise InputError(f"no Ray cluster listens at {host}:{port} ({exc.strerror or type(exc).__name__})",
                             "start one with `ray start --head`, or give the head's GCS address") from None
    where = f"{hp[0]}:{hp[1]}" if hp else "auto"
    try:
        with trio.fail_after(timeout_s):
            await trio.to_thread.run_sync(_connect_blocking, ray, address, abandon_on_cancel=True)
    except trio.TooSlowError:
        raise InputError(f"no Ray cluster answered at {where} within {timeout_s:g} s",
                         "is that the head's GCS port (ray start --head --port)?") from None
    except (ConnectionError, RuntimeError, ValueError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        if hp is None:
            raise InputError(f"no local Ray cluster found for --ray-address auto: {first}",
                             "start one with `ray start --head`, set $RAY_ADDRESS, or give --ray-address "
                             "HOST:PORT") from None
        raise InputError(f"cannot connect to the Ray cluster at {where}: {first}") from None
    try:
        total = ray.cluster_resources()
        slot_res = "GPU" if float(total.get("GPU", 0.0)) >= 1 else "CPU"
        if float(total.get(slot_res, 0.0)) < 1:
            raise InputError(f"the Ray cluster at {where} has no CPUs and no GPUs",
                             "start its nodes with --num-cpus / --num-gpus above 0, or wait for nodes to join")
        named = {"slots": slot_res}
        for key, amount in res.items():
            rname = named.get(key, key)
            have = float(total.get(rname, 0.0))
            if key == "slots" and slot_res in res:
                raise InputError(f"--ray-reserve names {slot_res} twice", "give N or RES=N, not both")
            if amount >= have and amount > 0:
                raise InputError(f"--ray-reserve {reserve} is larger than the cluster: it has "
                                 f"{have:g} {rname}" + (" bytes" if rname == "memory" else ""),
                                 "reserve less than the cluster holds, so something is left for the swarm")
        fallback = None
        if profile is not None:
            gpus = [d for d in getattr(profile, "devices", ()) if d.kind != "cpu"]
            fallback = gpus[0] if gpus else None
        cluster = RayCluster(ray, where, res, slot_res, fallback)
        cluster.initial = await trio.to_thread.run_sync(cluster.read, 0.0, abandon_on_cancel=True)
        return cluster
    except BaseException:
        ray.shutdown()
        raise


# ------------------------------------------------------------------- runner

class _Retryable(Exception):
    """The Ray task died with its worker or node (not the task's own error)."""


class RayRunner:
    """Runs ``RunShard`` effects as Ray tasks and keeps ``core.config``'s
    slots and devices in step with the cluster. See the module docstring."""

    def __init__(self, cluster: RayCluster, core: Any, *, refresh_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, first: Capacity | None = None) -> None:
        self.cluster = cluster
        self.core = core
        #: hands the core its measurements (``SetPower``, ``SetThroughput``;
        #: they yield no effects): the agent's ``feed`` once there is one
        self.feed: Callable[[Input], object] = lambda inp: core.handle(time.time(), inp)
        self.refresh_s = refresh_s
        self.clock = clock
        self._tasks = core.config.tasks  # what the profile serves; frozenset() while nothing is free
        self._held = 0.0
        self._lower_seen = 0  # consecutive reads below the advertised slots
        self._limiter = trio.CapacityLimiter(4096)
        #: the running shards' levels and joules at earlier levels (per device)
        self.runs = Runs(lambda level: self.core.config.power.power(level), per_gpu=False)
        #: chain job -> shards waiting or running here
        self._chain: dict[tuple[str, str], set[int]] = {}
        self._chain_changed = trio.Event()
        #: chain job -> its shards that finished here
        self._chain_finished: dict[tuple[str, str], set[int]] = {}
        self.capacity: Capacity | None = None
        self._measured: set[str] = set()  # task kinds timed here (their throughput is an EMA from then on)
        self.stats = {"ray_tasks": 0, "ray_retries": 0, "ray_handed_back": 0, "ray_cancelled": 0}
        self._apply_power()
        first = first or cluster.initial or cluster.read(0.0)
        self.apply(first, force=True)

    # -- capacity
    def apply(self, cap: Capacity, *, force: bool = False) -> None:
        """Write a reading into the core's config (slots drop only when two
        reads in a row agree: Ray frees a finished task's CPU a moment late)."""
        core = self.core
        cur = core.config.slots if self._tasks == core.config.tasks else 0
        slots = cap.slots
        if not force and slots < cur:
            self._lower_seen += 1
            if self._lower_seen < 2:
                slots = cur
        else:
            self._lower_seen = 0
        self.capacity = replace(cap, slots=slots)
        tasks = self._tasks if slots >= 1 else frozenset()
        cfg = core.config
        new = (max(slots, 1), cap.devices or cfg.devices, tasks)
        if (cfg.slots, cfg.devices, cfg.tasks) != new:
            log.info("ray capacity", extra={"fields": {
                "slots": slots, "resource": cap.slot_resource, "total": cap.total, "free": cap.free,
                "held": cap.held, "reserve": cap.reserve, "nodes": cap.nodes}})
            core.config = replace(cfg, slots=new[0], devices=new[1], tasks=new[2])
        if cap.now_w is not None:
            self.feed(SetPower(cap.now_w))

    def _apply_power(self) -> None:
        p = self.cluster.gpu_power()
        if p is None:
            return
        pm = self.core.config.power
        max_w = max(p["max_w"], pm.idle_w)
        self.core.config = replace(self.core.config, power=replace(pm, max_w=max_w, cap_w=p["cap_w"]))

    async def watch(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Re-read the cluster every ``refresh_s`` until cancelled."""
        task_status.started()
        had_gpu_power = self.cluster.gpu_power() is not None
        while True:
            await trio.sleep(self.refresh_s)
            try:
                cap = await trio.to_thread.run_sync(self.cluster.read, self._held, abandon_on_cancel=True)
            except Exception as exc:  # the head went away: offer nothing until it is back
                log.warning("cannot read the Ray cluster: %r", exc)
                if self.capacity is None:
                    continue
                cap = replace(self.capacity, slots=0, free=0.0)
            self.apply(cap)
            if not had_gpu_power and self.cluster.gpu_power() is not None:
                had_gpu_power = True
                self._apply_power()

    # -- levels (modelled: Ray workers cannot lock clocks)
    def set_level(self, eff: SetLevel) -> None:
        self.runs.set_level(self.clock(), eff)

    # -- shards
    def _resources(self, need: int) -> dict[str, float]:
        if self.cluster.slot_resource == "GPU":
            return {"num_gpus": need, "num_cpus": 1}
        return {"num_cpus": need, "num_gpus": 0}

    def _chain_blocked(self, job: tuple[str, str], shard: int) -> bool:
        """Whether a lower shard of this chain job runs here (its lease is
        running in the core, or it is in the runner) and has not finished."""
        t, j = job
        lower = {k[2] for k, lease in self.core.leases.items()
                 if k[0] == t and k[1] == j and k[2] < shard and getattr(lease, "state", "running") == "running"}
        lower |= {s for s in self._chain.get(job, set()) if s < shard}
        return bool(lower - self._chain_finished.get(job, set()))

    async def _chain_turn(self, job: tuple[str, str], shard: int) -> None:
        self._chain.setdefault(job, set()).add(shard)
        while self._chain_blocked(job, shard):
            # woken when a shard here ends; re-checked now and then, since the
            # core drops a finished lease just after the runner returns
            with trio.move_on_after(0.5):
                await self._chain_changed.wait()

    def _chain_done(self, job: tuple[str, str], shard: int) -> None:
        waiting = self._chain.get(job)
        if waiting is not None:
            waiting.discard(shard)
            if not waiting:
                del self._chain[job]
        self._chain_finished.setdefault(job, set()).add(shard)
        # forget finished shards of jobs with nothing left here
        for k in [k for k in self._chain_finished if k not in self._chain
                  and not any(lk[0] == k[0] and lk[1] == k[1] and lk[2] not in self._chain_finished[k]
                              for lk in self.core.leases)]:
            if k != job:
                del self._chain_finished[k]
        self._chain_changed.set()
        self._chain_changed = trio.Event()

    async def _ray_call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await trio.to_thread.run_sync(fn, *args, abandon_on_cancel=True, limiter=self._limiter)

    async def _run_once(self, eff: RunShard, params: dict, need: int) -> dict:
        ray = self.cluster.ray
        from ray import exceptions as rx

        retryable = (rx.WorkerCrashedError, rx.NodeDiedError, rx.ObjectLostError, rx.LocalRayletDiedError,
                     rx.OutOfMemoryError, rx.RaySystemError, rx.ObjectFetchTimedOutError)
        opts: dict[str, Any] = {"name": task_name(eff.task, eff.shard, eff.job_id), "max_retries": 0,
                                "retry_exceptions": False}
        pg = None
        if need > 1:
            from ray.util.placement_group import placement_group, remove_placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            slot = "GPU" if self.cluster.slot_resource == "GPU" else "CPU"
            bundles = [{slot: 1.0} for _ in range(need)]
            pg = await self._ray_call(lambda: placement_group(bundles, strategy="PACK"))
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=0, placement_group_capture_child_tasks=True)
            opts.update(self._resources(1))
        else:
            opts.update(self._resources(need))
        ref = None
        self._held += need
        try:
            if pg is not None:
                await self._ray_call(ray.get, pg.ready())
            ref = self.cluster.remote.options(**opts).remote(eff.task, params, eff.shard, eff.resume)
            self.stats["ray_tasks"] += 1
            return await self._ray_call(ray.get, ref)
        except retryable as exc:
            raise _Retryable(f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc) else ''}") from None
        except BaseException as exc:
            if isinstance(exc, (trio.Cancelled, KeyboardInterrupt)) and ref is not None:
                self.stats["ray_cancelled"] += 1
                try:
                    # force: the worker process ends. An interrupt (force=False) can land
                    # mid-import of torch and leave a half-initialised module in a worker
                    # that Ray then reuses for the next shard.
                    ray.cancel(ref, force=True, recursive=True)
                except Exception:
                    log.debug("ray.cancel failed", exc_info=True)
            raise
        finally:
            self._held -= need
            if pg is not None:
                try:
                    remove_placement_group(pg)
                except Exception:
                    log.debug("removing a placement group failed", exc_info=True)

    async def run_shard(self, eff: RunShard) -> ShardFinished:
        from ray import exceptions as rx

        params = unpack_params(eff.params)  # strict limits; never pickle
        key = run_key(eff)
        need = max(eff.gpus, 1)
        lease = self.core.leases.get(key)
        chain = (eff.tenant, eff.job_id) if lease is not None and lease.job.chain else None
        try:
            if chain is not None:
                await self._chain_turn(chain, eff.shard)
            self.runs.start(self.clock(), eff)
            t0 = self.clock()
            out: dict | None = None
            for attempt in range(2):
                try:
                    out = await self._run_once(eff, params, need)
                    break
                except _Retryable as exc:
                    if attempt == 0:
                        self.stats["ray_retries"] += 1
                        self.core.stats["ray_retries"] += 1
                        log.warning("ray task lost with its worker or node; retrying once",
                                    extra={"fields": {"job": eff.job_id, "shard": eff.shard, "error": str(exc)}})
                        continue
                    self.stats["ray_handed_back"] += 1
                    self.core.stats["ray_handed_back"] += 1
                    log.warning("ray task lost twice; handing the shard back to the swarm",
                                extra={"fields": {"job": eff.job_id, "shard": eff.shard, "error": str(exc)}})
                    return ShardFinished(eff.tenant, eff.job_id, eff.shard, eff.attempt, False,
                                         error=f"ray: lost twice with its node or worker ({exc}); handed back")
                except rx.RayTaskError as exc:  # the task's own exception
                    cause = getattr(exc, "cause", None) or exc
                    text = (str(cause).strip().splitlines() or [type(cause).__name__])[-1]
                    return ShardFinished(eff.tenant, eff.job_id, eff.shard, eff.attempt, False,
                                         error=f"{type(cause).__name__}: {text}"[:500])
                except rx.TaskCancelledError:
                    return ShardFinished(eff.tenant, eff.job_id, eff.shard, eff.attempt, False,
                                         error="ray task cancelled on the cluster")
            assert out is not None
            elapsed = self.clock() - t0
        finally:
            ended = self.runs.end(self.clock(), key)
            if chain is not None:
                self._chain_done(chain, eff.shard)
        wall = float(out["wall_s"])
        energy = out.get("energy_j")
        if energy is None:  # the power model at each level for the time spent at it, on each device
            energy = (ended.energy_j if ended is not None else 0.0) * need
        ref_s = float(out.get("ref_seconds", 0.0))
        if out.get("resumed"):
            ref_s *= eff.left  # it ran only the share left after the checkpoint
        if ref_s > 0 and wall > 0:
            old = self.core.throughput.get(eff.task)
            sample = ref_s / wall
            self.feed(SetThroughput(eff.task, sample if old is None or eff.task not in self._measured
                                    else 0.2 * sample + 0.8 * old))
            self._measured.add(eff.task)
        self.core.stats["ray_tasks_run"] += 1
        log.debug("ray shard done", extra={"fields": {"job": eff.job_id, "shard": eff.shard, "node": out.get("node"),
                                                      "compute_s": wall, "elapsed_s": elapsed}})
        # run_s: the task's own compute time (what the ledger charges), as on a plain peer
        return ShardFinished(eff.tenant, eff.job_id, eff.shard, eff.attempt, True, bytes(out["result"]),
                             run_s=wall, energy_j=float(energy))



# ------------------------------------------------ LLM spans on a Ray actor

class SpanWorker:
    """The Ray actor behind a :class:`RaySpan`: blocks ``[start, end)`` of a
    checkpoint loaded on the node Ray picks, and the KV caches of the
    sessions that use them, by id. The checkpoint must be at ``model_dir`` on
    that node (the same path; a shared file system or the same image)."""

    def __init__(self, model_dir: str, start: int, end: int, device: str, dtype: str | None,
                 threads: int = 1) -> None:
        import torch

        from ..tasks.checkpoint import load_block_span

        torch.set_num_threads(max(threads, 1))
        if device == "cuda":
            import ray

            device = "cuda:0" if ray.get_gpu_ids() else "cpu"  # Ray set CUDA_VISIBLE_DEVICES
        self.span = load_block_span(model_dir, start, end, device=device, dtype=dtype)
        self.caches: dict[int, Any] = {}

    def describe(self) -> dict:
        import ray

        sp = self.span
        return {"config": sp.config, "dtype": str(sp.dtype).removeprefix("torch."), "device": str(sp.device),
                "node": ray.get_runtime_context().get_node_id()}

    def forward(self, hidden: Any, rows: list[tuple[int, int, int]] | None, free: list[int]) -> Any:
        """``rows``: per batch row ``(cache id, length, max_length)``; a cache
        is made on first use, cut to ``length`` (the driver's truncations),
        and extended by the forward. ``free``: caches the driver dropped."""
        for cid in free:
            self.caches.pop(cid, None)
        sp = self.span
        x = hidden.to(sp.device)
        if rows is None:
            return sp(x).cpu()
        caches = []
        for cid, length, max_length in rows:
            c = self.caches.get(cid)
            if c is None:
                c = self.caches[cid] = sp.new_cache(max_length)
            c.truncate(length)
            caches.append(c)
        return sp(x, caches).cpu()

    def cached(self) -> int:
        return len(self.caches)


class RayKVCache:
    """The driver's side of one KV cache held by a :class:`SpanWorker`: its
    length, kept here (``truncate`` is sent with the next forward)."""

    def __init__(self, owner: "RaySpan", cid: int, max_length: int) -> None:
        import torch

        self.cid, self._max, self.length = cid, max_length, 0
        self.k = torch.empty(0, dtype=owner.dtype)  # element size only
        # a cache the server drops is freed on the actor with the next forward
        weakref.finalize(self, owner._dropped.append, cid)

    @property
    def max_length(self) -> int:
        return self._max

    def truncate(self, length: int) -> None:
        from ..tasks.llama import KVCache

        KVCache.truncate(self, length)  # type: ignore[arg-type]  # it only reads and sets .length

    def reset(self) -> None:
        self.length = 0


class RaySpan:
    """A ``LlamaBlockSpan`` that runs in a Ray actor (``SpanWorker``), for a
    ``BlockServer`` on a peer in front of a Ray cluster: the same calls
    (``config``, ``start``/``end``, ``dtype``, ``new_cache``, a batched
    forward over caches), with the weights and KV caches on the actor's node
    and the hidden states going through Ray. Forward calls block (the
    server makes them in a worker thread)."""

    def __init__(self, cluster: RayCluster, model_dir: str, start: int, end: int, *, device: str = "cpu",
                 dtype: str | None = None, threads: int = 1, timeout_s: float = 300.0) -> None:
        import torch

        ray = cluster.ray
        self.ray = ray
        self.start, self.end = start, end
        res = {"num_gpus": 1, "num_cpus": 1} if device.startswith("cuda") else {"num_cpus": threads, "num_gpus": 0}
        self.actor = ray.remote(SpanWorker).options(
            name=f"{TASK_PREFIX} span {start}:{end} {next(_span_ids)}", max_restarts=0, **res,
        ).remote(str(model_dir), start, end, "cuda" if device.startswith("cuda") else "cpu", dtype, threads)
        try:
            d = ray.get(self.actor.describe.remote(), timeout=timeout_s)
        except BaseException:
            ray.kill(self.actor)
            raise
        self.config = d["config"]
        self.dtype = getattr(torch, d["dtype"])
        self.node = d["node"]
        self.actor_device = d["device"]
        self.device = torch.device("cpu")  # where the server's tensors for it live
        self._ids = itertools.count(1)
        self._dropped: list[int] = []

    @property
    def num_layers(self) -> int:
        return self.end - self.start

    def new_cache(self, max_length: int) -> RayKVCache:
        if max_length > self.config.max_position_embeddings:
            raise ValueError(
                f"max_length {max_length} exceeds max_position_embeddings {self.config.max_position_embeddings}")
        return RayKVCache(self, next(self._ids), max_length)

    def __call__(self, hidden: Any, caches: Any = None) -> Any:
        if isinstance(caches, RayKVCache):
            caches = [caches]
        t = int(hidden.shape[1])
        rows = None
        if caches is not None:
            caches = list(caches)
            if len(caches) != int(hidden.shape[0]):
                raise ValueError(f"{len(caches)} caches for a batch of {int(hidden.shape[0])}")
            for c in caches:
                if c.length + t > c.max_length:
                    raise ValueError(f"KV cache overflow: {c.length} + {t} > {c.max_length}")
            rows = [(c.cid, c.length, c.max_length) for c in caches]
        free, self._dropped[:] = list(self._dropped), []
        out = self.ray.get(self.actor.forward.remote(hidden.contiguous(), rows, free))
        for c in caches or ():
            c.length += t
        return out

    forward = __call__

    def close(self) -> None:
        try:
            self.ray.kill(self.actor)
        except Exception:
            log.debug("killing a span actor failed", exc_info=True)


_span_ids = itertools.count(1)  # actor names apart within one driver


def span_loader(cluster: RayCluster, *, threads: int = 1) -> Callable[..., RaySpan]:
    """``load(model_dir, start, end, device=..., dtype=...)`` that puts the
    span in a Ray actor: the loader a ``BlockServer`` on a peer in front of a
    Ray cluster would take where it loads ``load_block_span``."""

    def load(model_dir: Any, start: int, end: int, *, device: str = "cpu", dtype: str | None = None) -> RaySpan:
        return RaySpan(cluster, str(model_dir), start, end, device=str(device), dtype=dtype, threads=threads)

    return load


# ------------------------------------------------ a local cluster (tests, benchmarks)

def _free_port(host: str = "127.0.0.1") -> int:
    """A free TCP port from the kernel's ephemeral range (outside Ray's
    default worker ports, 10002-19999)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class LocalRayCluster:
    """A real Ray cluster on 127.0.0.1 from ``ray start --block`` processes,
    one per node, each in its own process group (so a node can be killed
    whole, the way a machine dies). For tests, benchmarks and demos, like
    ``fedswarm.testing.localswarm``. Readiness is read from ``ray start``'s output.

    ``with LocalRayCluster(tmp, head_cpus=1) as c: c.add_node(cpus=1)``;
    ``c.address`` is the GCS address, ``c.dashboard`` the dashboard URL (the
    state API), ``c.kill_node(n)`` SIGKILLs a node's processes.
    """

    def __init__(self, workdir: Any, *, head_cpus: int = 1, head_gpus: int = 0, env: dict[str, str] | None = None,
                 fast_health_checks: bool = True, object_store_bytes: int = 80 * 1024 * 1024,
                 dashboard: bool = True) -> None:
        import os
        import sys
        from pathlib import Path

        self.workdir = Path(workdir)
        self.head_cpus, self.head_gpus = head_cpus, head_gpus
        self.object_store_bytes = object_store_bytes
        #: the head runs Ray's dashboard, whose state API lists tasks (``ray[default]``)
        self.dashboard_on = dashboard
        self.env = {**os.environ, **(env or {}), "RAY_USAGE_STATS_ENABLED": "0"}
        self.env.pop("RAY_ADDRESS", None)  # `ray start --address` is given explicitly
        if fast_health_checks:
            # A killed node is declared dead ~2 s after it went (its port refuses the
            # check at once: period x threshold), not ~30 s. A live node that is merely
            # slow (a loaded 2-core machine) has 5 s per check, 3 in a row, before the
            # GCS gives up on it: a short timeout here declared healthy nodes dead.
            self.env.update({"RAY_health_check_initial_delay_ms": "1000", "RAY_health_check_period_ms": "500",
                             "RAY_health_check_timeout_ms": "5000", "RAY_health_check_failure_threshold": "3",
                             # task states reach the state API within ~0.1 s, not ~1 s
                             "RAY_task_events_report_interval_ms": "100"})
        self.ray_bin = str(Path(sys.executable).with_name("ray"))
        self.port = _free_port()
        self.dashboard_port = _free_port()
        # a short path: Ray's unix socket names must stay under ~107 bytes
        import tempfile

        self.temp_dir = tempfile.mkdtemp(prefix="fsray-", dir="/tmp")
        self.nodes: list[Any] = []  # subprocess.Popen per node; [0] is the head

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def _spawn(self, args: list[str], what: str, timeout: float) -> Any:
        import subprocess
        import threading

        log_path = self.workdir / f"ray-node{len(self.nodes)}.log"
        self.workdir.mkdir(parents=True, exist_ok=True)
        common = ["--block", "--node-ip-address", "127.0.0.1", "--disable-usage-stats",
                  "--object-store-memory", str(self.object_store_bytes),
                  "--dashboard-agent-listen-port", str(_free_port()),
                  "--metrics-export-port", str(_free_port())]
        proc = subprocess.Popen([self.ray_bin, "start", *args, *common], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=self.env, start_new_session=True)
        ready = threading.Event()
        lines: list[str] = []

        def pump() -> None:
            assert proc.stdout is not None
            with open(log_path, "a") as f:
                for line in proc.stdout:
                    f.write(line)
                    f.flush()
                    lines.append(line.rstrip())
                    if "Ray runtime started" in line:
                        ready.set()
            ready.set()

        threading.Thread(target=pump, daemon=True).start()
        if not ready.wait(timeout) or proc.poll() is not None:
            self._stop(proc)
            raise RuntimeError(f"ray {what} did not start (exit={proc.poll()}): {lines[-5:]}")
        self.nodes.append(proc)
        return proc

    def start(self, timeout: float = 90.0) -> "LocalRayCluster":
        self._spawn(["--head", "--port", str(self.port), "--num-cpus", str(self.head_cpus),
                     "--num-gpus", str(self.head_gpus), f"--include-dashboard={str(self.dashboard_on).lower()}",
                     "--dashboard-host", "127.0.0.1", "--dashboard-port", str(self.dashboard_port),
                     "--ray-client-server-port", str(_free_port()), "--temp-dir", self.temp_dir],
                    "head", timeout)
        return self

    def add_node(self, cpus: int = 1, gpus: int = 0, timeout: float = 90.0) -> Any:
        """Start one more node (``ray start --address``); returns its process."""
        return self._spawn(["--address", self.address, "--num-cpus", str(cpus), "--num-gpus", str(gpus)],
                           "node", timeout)

    def kill_node(self, proc: Any) -> None:
        """SIGKILL every process of that node at once (its raylet, agents and
        workers), the way a machine dies."""
        self._stop(proc)
        if proc in self.nodes:
            self.nodes.remove(proc)

    @staticmethod
    def _node_pids(proc: Any) -> dict[int, str]:
        """pid -> process title of every process of the node that ``ray start``
        process ``proc`` leads: its process group (raylet, agents) and their
        descendants (Ray puts each worker in a process group of its own).
        Read from /proc (Linux)."""
        import os

        table: dict[int, tuple[int, int]] = {}  # pid -> (ppid, pgrp)
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                table[int(name)] = (int(fields[1]), int(fields[2]))
            except (OSError, IndexError, ValueError):
                continue
        mine = {pid for pid, (_, pgrp) in table.items() if pgrp == proc.pid}
        grew = True
        while grew:
            more = {pid for pid, (ppid, _) in table.items() if ppid in mine} - mine
            grew = bool(more)
            mine |= more
        out = {}
        for pid in mine:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    out[pid] = f.read().split(b"\0")[0].decode(errors="replace").strip()
            except OSError:
                continue
        return out

    def busy_workers(self, proc: Any) -> list[str]:
        """The Ray tasks executing on the node of ``proc`` right now: the
        titles (``ray::NAME``) of its worker processes that are not idle (no
        lag, unlike the state API)."""
        idle = ("ray::IDLE", "ray::DashboardAgent", "ray::RuntimeEnvAgent")
        return [t[len("ray::"):] for t in self._node_pids(proc).values() if t.startswith("ray::") and t not in idle]

    @classmethod
    def _stop(cls, proc: Any) -> None:
        """SIGKILL the node's processes, workers included, and reap ``ray start``."""
        import os
        import signal

        for pid in cls._node_pids(proc):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()

    def close(self) -> None:
        """SIGKILL every node's process group at once (a graceful ``ray stop``
        of a head and a node takes ~15-30 s on 2 cores; a throwaway cluster
        keeps nothing worth flushing), then remove its temp dir."""
        import shutil

        for proc in reversed(self.nodes):
            self._stop(proc)
        self.nodes.clear()
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> "LocalRayCluster":
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: Any) -> None:
        self.close()
