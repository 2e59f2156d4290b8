"""``peer start``: one peer of a real swarm, on py-libp2p, executing on torch.

``serve_peer(options)`` wires the concrete parts around the core: the key
file, the profile, a ``Libp2pTransport``, a ``ShardExecutor``, the trio
``Agent``, and the metrics/status HTTP server. It prints one line with its
full multiaddr once it accepts connections, and on SIGINT/SIGTERM leaves
gracefully (stop bidding, hand back queued shards, let running ones finish
within ``grace_s``, hand back the rest, tell the swarm) and returns (0 on
SIGTERM, 130 on SIGINT).

Before anything starts, every option is checked (``InputError``): addresses,
ports (a port in use is refused), ``--grace``, ``--serve-model`` (a
directory without a checkpoint), ``--blocks``. The data dir (``--data-dir``,
else ``$FEDSWARM_HOME``, else the platform's per-user data dir) is locked
(``DataDirLock``: one daemon per peer key); without ``--profile`` the machine
is read (``fedswarm.hardware``) and written to ``DATA_DIR/profile.toml``.
Bootstrap peers that do not answer are retried with backoff
(``BootstrapDialer``) and shown in ``/status`` as ``bootstrap``.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import trio

from ..core.identity import Identity, load_or_create_key
from ..core.peer import PeerCore
from ..errors import FederationError, InputError
from ..net.quiet import quiet_libraries
from ..profiles import load_profile
from .runner import ExecutorRunner
from ..runtime.agent import Agent

__all__ = ["PeerOptions", "serve_peer", "ExecutorRunner", "JsonLogFormatter", "DataDirLock", "BootstrapDialer",
           "default_data_dir"]

log = logging.getLogger("fedswarm.daemon")


@dataclass
class PeerOptions:
    """What ``serve_peer`` runs: the options of ``peer start``, one field each."""

    #: profile TOML; None: read this machine and write DATA_DIR/profile.toml
    profile: str | None = None
    listen: str = "/ip4/127.0.0.1/tcp/0"
    bootstrap: list[str] = field(default_factory=list)
    key: str | None = None
    #: None: $FEDSWARM_HOME, else the platform's per-user data directory
    data_dir: str | None = None
    metrics_port: int | None = None
    grace_s: float = 10.0
    serve_model: str | None = None
    blocks: str | None = None
    #: where the served spans compute: "auto" (the first CUDA device, else the
    #: CPU), "cpu", "cuda" or "cuda:N"
    serve_device: str = "auto"
    #: the spans' dtype: "auto" (bfloat16 on a GPU, the checkpoint's own on
    #: the CPU), "float32", "bfloat16" or "float16"
    serve_dtype: str = "auto"
    torch_threads: int | None = None
    membership: str | None = None
    federations: list[str] = field(default_factory=list)
    #: addresses to advertise instead of the listen addresses
    announce: list[str] = field(default_factory=list)
    #: host of the dashboard / status / metrics server (port: metrics_port)
    http_host: str = "127.0.0.1"
    #: run a profile that claims accelerators this machine lacks (warning only)
    simulate_devices: bool = False
    #: longest wait between two tries of an unreachable bootstrap peer
    bootstrap_retry_max_s: float = 30.0
    #: "local": shards run here (ShardExecutor); "ray": on a Ray cluster (runtime.ray_engine)
    engine: str = "local"
    #: the Ray cluster's GCS address HOST:PORT; "auto": the local one ($RAY_ADDRESS)
    ray_address: str = "auto"
    #: Ray capacity kept from the swarm: N slots, or RES=N,... (see ray_engine.parse_reserve)
    ray_reserve: str | None = None
    #: direct lanes for the LLM's requests (fedswarm.net.lane), on this TCP port (0: any free one)
    lane: bool = True
    lane_port: int = 0


def default_data_dir() -> Path:
    """``$FEDSWARM_HOME``, else the platform's user data dir for fedswarm."""
    env = os.environ.get("FEDSWARM_HOME")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_data_dir("fedswarm"))


class DataDirLock:
    """An exclusive ``flock`` on ``DATA_DIR/daemon.lock``, which holds the pid.

    One daemon per data dir (the dir holds its key, so its peer id): a second
    one is refused with the pid of the first. The lock goes with the process,
    so a killed daemon never leaves a stale lock behind.
    """

    def __init__(self, data_dir: Path) -> None:
        self.path = Path(data_dir) / "daemon.lock"
        self._fd: int | None = None

    def acquire(self) -> "DataDirLock":
        import fcntl

        d = self.path.parent
        try:
            d.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise InputError(f"cannot use data dir {d}: {exc.strerror}",
                             "choose a writable --data-dir or set $FEDSWARM_HOME") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            try:
                holder = os.read(fd, 64).decode(errors="replace").strip() or "?"
            finally:
                os.close(fd)
            raise InputError(f"data dir {d} is in use by another daemon (pid {holder})",
                             "stop that one, or give this one its own --data-dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            try:
                os.ftruncate(self._fd, 0)
            except OSError:
                pass
            os.close(self._fd)  # closing drops the flock
            self._fd = None

    def __enter__(self) -> "DataDirLock":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


def check_serve_model(ref: str) -> None:
    """Refuse a ``--serve-model`` path that holds no checkpoint (names of
    shipped or stored models are resolved later, by the model store)."""
    p = Path(ref).expanduser()
    looks_like_path = p.exists() or "/" in ref or ref.startswith(".") or ref.endswith(".gguf")
    if not looks_like_path:
        return
    if p.is_dir():
        if (p / "config.json").is_file() or any(p.glob("*.gguf")):
            return
        raise InputError(f"{p} holds no checkpoint (no config.json and no .gguf file)",
                         "point --serve-model at a Hugging Face-format model directory, a .gguf file "
                         "or a model name")
    if p.is_file():
        return
    raise InputError(f"no such model directory or file {ref}", "check the path, or use a model name")


def check_blocks(text: str | None) -> None:
    if text is None:
        return
    a, sep, b = text.partition(":")
    try:
        if a == "auto":
            if sep and int(b) < 1:
                raise ValueError
            return
        lo, hi = int(a), int(b)
        if not 0 <= lo < hi:
            raise ValueError
    except ValueError:
        raise InputError(f"--blocks {text!r} is not a block span",
                         "use A:B with 0 <= A < B for blocks A..B-1, auto, or auto:N") from None


def resolve_profile(opts: PeerOptions, data_dir: Path) -> tuple[Any, str]:
    """The profile to run and a line saying where it came from."""
    from ..hardware import check_devices, detect, profile_toml

    if opts.profile:
        profile = load_profile(opts.profile)
        where = f"profile {profile.name} from {opts.profile}"
    else:
        path = data_dir / "profile.toml"
        if path.is_file():
            profile = load_profile(path)
            where = f"profile {profile.name} from {path} (detected earlier; edit it, or pass --profile)"
        else:
            text = profile_toml(detect())
            tmp = path.with_suffix(".toml.tmp")
            tmp.write_text(text)
            os.replace(tmp, path)
            profile = load_profile(path)
            devs = ", ".join(f"{d.count}x {d.kind} {d.name}" for d in profile.devices)
            where = f"no --profile: detected {devs}; wrote {path} (edit it to correct throughput and power)"
    for w in check_devices(profile, simulate=opts.simulate_devices):
        log.warning(w)
        print(f"peer start: warning: {w}", file=sys.stderr, flush=True)
    return profile, where


class BootstrapDialer:
    """Dials the bootstrap peers until each one answers.

    ``status`` is a list of ``{addr, peer, state, attempts, last_error,
    retry_in_s}`` (state: ``connecting``, ``retrying`` or ``connected``); the
    daemon publishes it as ``agent.bootstrap_status`` for ``/status``. An
    unreachable peer is retried with exponential backoff (1 s doubling to
    ``max_delay_s``) forever, a warning logged each time; once it connects it
    becomes one of the core's bootstrap peers, so the next gossip round (or
    probe) joins through it.
    """

    def __init__(self, transport: Any, addrs: list[str], *, max_delay_s: float = 30.0,
                 timeout_s: float = 10.0) -> None:
        from ..net.addrs import parse_bootstrap

        self.transport = transport
        self.max_delay_s = max_delay_s
        self.timeout_s = timeout_s
        self.status: list[dict[str, Any]] = []
        for a in addrs:
            addr, pid = parse_bootstrap(a)
            self.status.append({"addr": addr, "peer": pid, "state": "connecting", "attempts": 0,
                                "last_error": None, "retry_in_s": None})
        self.on_connected: Callable[[str], None] = lambda _pid: None

    def connected_ids(self) -> list[str]:
        return list(dict.fromkeys(e["peer"] for e in self.status if e["state"] == "connected"))

    async def try_once(self, e: dict[str, Any]) -> bool:
        e["attempts"] += 1
        e["state"] = "connecting"
        try:
            with trio.fail_after(self.timeout_s):
                await self.transport.connect(e["addr"])
        except (FederationError, trio.TooSlowError, OSError) as exc:
            e["state"] = "retrying"
            e["last_error"] = str(exc) or type(exc).__name__
            return False
        e["state"], e["last_error"], e["retry_in_s"] = "connected", None, None
        log.info("bootstrap connected", extra={"fields": {"addr": e["addr"], "attempts": e["attempts"]}})
        self.on_connected(e["peer"])
        return True

    async def first_round(self) -> None:
        async with trio.open_nursery() as n:
            for e in self.status:
                n.start_soon(self.try_once, e)

    async def keep_dialing(self, e: dict[str, Any]) -> None:
        delay = min(1.0, self.max_delay_s)
        while e["state"] != "connected":
            e["retry_in_s"] = delay
            log.warning("bootstrap unreachable; retrying", extra={"fields": {
                "addr": e["addr"], "attempts": e["attempts"], "retry_in_s": delay, "error": e["last_error"]}})
            await trio.sleep(delay)
            delay = min(delay * 2, self.max_delay_s)
            await self.try_once(e)

    def start_retries(self, nursery: trio.Nursery) -> None:
        for e in self.status:
            if e["state"] != "connected":
                nursery.start_soon(self.keep_dialing, e)


class JsonLogFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        extra = getattr(record, "fields", None)
        if isinstance(extra, dict):
            out.update(extra)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def _event(msg: str, **fields: Any) -> None:
    log.info(msg, extra={"fields": fields})


async def serve_peer(opts: PeerOptions, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> int:
    """Run a peer until SIGINT/SIGTERM; 0 after a graceful leave on SIGTERM,
    130 on SIGINT. Everything checkable is checked before the network or
    torch start (``InputError``)."""
    from ..net.addrs import check_tcp_free, parse_announce, parse_bootstrap, parse_listen_maddr

    if opts.grace_s < 0 or opts.grace_s != opts.grace_s:
        raise InputError(f"--grace {opts.grace_s} is negative", "give the seconds to finish shards on SIGTERM, >= 0")
    listen_host, listen_port = parse_listen_maddr(opts.listen)
    for b in opts.bootstrap:
        parse_bootstrap(b)
    for a in opts.announce:
        parse_announce(a)
    if opts.metrics_port is not None:
        from ..net.http import check_port

        check_port(opts.metrics_port, "--metrics-port")
    check_blocks(opts.blocks)
    if not opts.serve_model:
        given = [flag for flag, v in (("--blocks", opts.blocks), ("--serve-device", opts.serve_device != "auto"),
                                      ("--serve-dtype", opts.serve_dtype != "auto")) if v]
        if given:
            raise InputError(f"{', '.join(given)} without --serve-model: this peer serves no model",
                             "add --serve-model MODEL, or drop " + ", ".join(given))
    else:
        check_serve_model(opts.serve_model)
        from ..llm_serving import serving_device, serving_dtype

        # a Ray engine's spans live in actors on the cluster's nodes: a device
        # named is checked by its spelling, "auto" stays until the cluster is
        # known (below); a dtype of None is the checkpoint's own
        ray = opts.engine == "ray"
        serve_device = serving_device(opts.serve_device, here=not ray)
        serve_dtype = serving_dtype(opts.serve_dtype, "cpu" if ray else serve_device)
    if opts.engine == "ray":  # Ray installed, reserve well-formed: before anything is created
        from ..runtime.ray_engine import import_ray, parse_reserve

        import_ray()
        parse_reserve(opts.ray_reserve)
    elif opts.engine != "local":
        raise InputError(f"--engine {opts.engine!r} is not an engine", "use local or ray")
    membership = b""
    if opts.membership:
        try:
            membership = Path(opts.membership).read_bytes()
        except OSError as exc:
            raise InputError(f"cannot read --membership {opts.membership}: {exc.strerror}") from None
    data_dir = Path(opts.data_dir).expanduser() if opts.data_dir else default_data_dir()
    with DataDirLock(data_dir):
        identity: Identity = load_or_create_key(opts.key or data_dir / "peer.key")
        check_tcp_free(listen_host, listen_port, "listen port")
        if opts.metrics_port:
            check_tcp_free(opts.http_host, opts.metrics_port, "--metrics-port")
        if opts.lane and opts.lane_port:
            if opts.lane_port == listen_port:
                raise InputError(f"--lane-port {opts.lane_port} is the --listen port", "give another port, or 0")
            check_tcp_free(listen_host, opts.lane_port, "--lane-port")
        profile, where = resolve_profile(opts, data_dir)
        ray_cluster = None
        if opts.engine == "ray":  # connect to and check the cluster before the network starts
            from ..runtime.ray_engine import connect_cluster

            ray_cluster = await connect_cluster(opts.ray_address, opts.ray_reserve, profile=profile)
            if opts.serve_model and serve_device == "auto":  # a GPU of the cluster when it has one (with
                # --serve-dtype auto in the checkpoint's dtype: which GPU the actor gets is not known here)
                serve_device = "cuda" if ray_cluster.slot_resource == "GPU" else "cpu"
        if opts.serve_model:  # what the span loads with: a device, and a dtype or "auto" (the checkpoint's)
            opts = replace(opts, serve_device=serve_device, serve_dtype=serve_dtype or "auto")
        _event("data dir", path=str(data_dir), profile=where)
        print(f"fedswarm data dir {data_dir}; {where}", file=sys.stderr, flush=True)
        if ray_cluster is not None:
            print(f"fedswarm ray engine: {ray_cluster.describe()}", file=sys.stderr, flush=True)
        return await _serve(opts, identity, profile, membership, task_status, ray_cluster)


async def _serve(opts: PeerOptions, identity: Identity, profile: Any, membership: bytes, task_status: Any,
                 ray_cluster: Any = None) -> int:
    from dataclasses import replace

    from ..net.libp2p import Libp2pConfig, open_libp2p_transport
    from ..runtime.executor import ShardExecutor

    quiet_libraries()
    if opts.torch_threads:
        import torch

        torch.set_num_threads(opts.torch_threads)
    t0 = time.monotonic()
    left_on = "SIGTERM"
    config = Libp2pConfig(lane=opts.lane, lane_port=opts.lane_port)
    async with open_libp2p_transport(identity, opts.listen, config=config) as transport:
        if opts.announce:
            transport.set_announce(opts.announce)
        dialer = BootstrapDialer(transport, opts.bootstrap, max_delay_s=opts.bootstrap_retry_max_s)
        await dialer.first_round()
        boot_ids = [b for b in dialer.connected_ids() if b != identity.peer_id]
        config = profile.peer_config(
            addrs=tuple(transport.listen_addrs()),
            bootstrap=tuple(boot_ids),
            membership=membership,
            federations=frozenset(opts.federations),
        )
        core = PeerCore(identity, config, random.Random())

        def joined(pid: str) -> None:
            # a late bootstrap peer: the next gossip round (empty view) or
            # probe goes to it
            if pid != identity.peer_id and pid not in core.config.bootstrap:
                core.config = replace(core.config, bootstrap=core.config.bootstrap + (pid,))

        dialer.on_connected = joined
        # no constant power model: without NVML the runner charges the
        # profile's power curve at each shard's clock level
        if ray_cluster is not None:
            from ..runtime.ray_engine import RayRunner

            runner: Any = RayRunner(ray_cluster, core)  # slots and devices from the cluster
        else:
            runner = ExecutorRunner(ShardExecutor(slots=config.slots), core)
        agent = Agent(core, transport, runner=runner)
        runner.feed = agent.feed
        agent.bootstrap_state = dialer.status  # type: ignore[attr-defined]  # /status "bootstrap"
        serving = None
        # signals are caught before readiness is announced: a SIGTERM right
        # after the "listening" line must still mean a graceful leave
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:
                await nursery.start(agent.run)
                if ray_cluster is not None:
                    nursery.start_soon(runner.watch)  # re-reads the cluster as nodes join and leave
                dialer.start_retries(nursery)
                if opts.serve_model:
                    from ..llm_serving import start_block_server

                    if (opts.blocks or "").startswith("auto") and boot_ids:
                        # let gossip show which blocks the swarm already serves (bounded)
                        with trio.move_on_after(3 * config.gossip_interval_s):
                            while len(core.view) < 2:
                                await agent.wait_progress()
                            await trio.sleep(config.gossip_interval_s)
                    # --blocks auto: the server keeps its span placed (a timer task in this nursery)
                    load_span = None
                    if ray_cluster is not None:  # the span lives in a Ray actor, on any node of the cluster
                        from ..runtime.ray_engine import span_loader

                        load_span = span_loader(ray_cluster)
                    serving = await start_block_server(transport, core, opts.serve_model, opts.blocks,
                                                       device=opts.serve_device,
                                                       dtype=None if opts.serve_dtype == "auto" else opts.serve_dtype,
                                                       return_server=True, nursery=nursery, now=agent.now,
                                                       load_span=load_span,
                                                       # the span core's clock level reaches the device through
                                                       # the runner (a Ray span's clocks are the cluster's)
                                                       on_level=getattr(runner, "set_span_level", None))
                    print(f"fedswarm serving blocks {serving.start}:{serving.end} of {opts.serve_model} on "
                          f"{serving.device_name}, {serving.dtype_name}", file=sys.stderr, flush=True)
                if opts.metrics_port is not None:
                    port = await nursery.start(_serve_metrics, opts.metrics_port, agent, opts.http_host, serving)
                    url = f"http://{_url_host(opts.http_host)}:{port}"
                    print(f"fedswarm metrics on {url}/metrics", flush=True)
                    _event("metrics listening", url=f"{url}/metrics")
                for addr in transport.listen_addrs():
                    print(f"fedswarm peer listening on {addr}", flush=True)
                _event(
                    "peer started",
                    peer=identity.peer_id,
                    profile=profile.name,
                    addrs=transport.listen_addrs(),
                    bootstrap=len(boot_ids),
                    bootstrap_pending=len(opts.bootstrap) - len(dialer.connected_ids()),
                    startup_s=round(time.monotonic() - t0, 3),
                    serving=serving is not None,
                )
                task_status.started(transport.listen_addrs())
                async for signum in signals:
                    left_on = signal.Signals(signum).name
                    _event("leaving", signal=left_on, leases=len(core.leases))
                    break
                await agent.leave(grace_s=opts.grace_s)
                _event(
                    "left",
                    shards_run=core.stats["shards_run"],
                    handed_back=core.stats["shards_handed_back"],
                    results_pending=len(core.outbox),
                )
                nursery.cancel_scope.cancel()
    return 130 if left_on == "SIGINT" else 0


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "::", ""):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


async def _serve_metrics(port: int, agent: Agent, host: str = "127.0.0.1", llm: Any = None, *,
                         task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    from .http import serve_http

    await serve_http(port, agent, host=host, llm=llm, task_status=task_status)


def setup_logging(fmt: str = "json", level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLogFormatter() if fmt == "json" else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # quiet_libraries() (it imports py-libp2p, ~1.5 s) runs once the checks passed

