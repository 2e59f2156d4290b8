"""The ``peer`` command: start, status, submit, keygen, admit, completion
(and generate, models, ... registered by their own modules).

The CLI only parses options and wires concrete parts together; the logic
lives in ``fedswarm.daemon`` (a peer), ``fedswarm.client`` (a tenant) and
the tasks.

One error path for every command (``main``): arguments, files and addresses
are checked before anything starts; an expected failure prints one line
``peer CMD: error: WHAT (HINT)`` on stderr, never a traceback (trio's
exception groups are unwrapped to their cause); ``--debug`` adds the
traceback. Exit codes:

==== ==========================================================================
0    success
1    runtime failure (network, job failed or timed out, a daemon unreachable)
2    usage or input error (bad option, file, address, key, profile, port in use)
130  interrupted (Ctrl-C / SIGINT)
==== ==========================================================================

Command functions raise ``fedswarm.errors.InputError`` (exit 2) or a
``FederationError`` (exit 1) and leave the printing to ``main``. Heavy
imports (torch, py-libp2p) happen inside the commands, after the checks, so
a mistake fails in a fraction of a second.

Registering a subcommand from another module: one line in ``build_parser``
calling its ``add_xxx(sub)``, which does ``p = sub.add_parser(...)`` and
``p.set_defaults(func=handler)``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from .errors import FederationError, InputError, JobTimeout

__all__ = ["main", "build_parser", "CommandFailed", "check_writable", "report_failure", "EXIT_OK", "EXIT_FAILURE", "EXIT_USAGE", "EXIT_INTERRUPTED"]

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class CommandFailed(FederationError):
    """A runtime failure with a hint (exit 1), e.g. a daemon that does not answer."""

    def __init__(self, what: str, hint: str = "") -> None:
        super().__init__(f"{what} ({hint})" if hint else what)
        self.what = what
        self.hint = hint


# -- argparse: one-line usage errors, defaults in every help ------------------------------------


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the descriptions' examples as written and appends each option's
    default to its help (unless the help already says it, or there is none)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        h = action.help or ""
        if "%(default)" in h or "default" in h.lower():
            return h
        d = action.default
        if d is None or d is False or d == [] or d is argparse.SUPPRESS or not action.option_strings:
            return h
        return h + " (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        hint = "" if message.endswith(")") else f" (see `{self.prog} --help`)"
        sys.stderr.write(f"{self.prog}: error: {message}{hint}\n")
        sys.exit(EXIT_USAGE)


def _int_at_least(lo: int, hi: int | None = None):  # noqa: ANN202
    def conv(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < lo or (hi is not None and v > hi):
            rng = f">= {lo}" if hi is None else f"in {lo}..{hi}"
            raise argparse.ArgumentTypeError(f"{v} is out of range (must be {rng})")
        return v

    conv.__name__ = "int"
    return conv


def _float_at_least(lo: float, *, open_: bool = False):  # noqa: ANN202
    def conv(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(v) or v < lo or (open_ and v <= lo):
            raise argparse.ArgumentTypeError(f"{text} is out of range (must be {'>' if open_ else '>='} {lo:g})")
        return v

    conv.__name__ = "number"
    return conv


def _port(text: str) -> int:
    return _int_at_least(0, 65535)(text)


def _wrap_input(fn):  # noqa: ANN001, ANN202
    """An InputError-raising check as an argparse type (usage error, exit 2)."""

    def conv(text: str) -> Any:
        try:
            return fn(text)
        except InputError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    conv.__name__ = getattr(fn, "__name__", "value")
    return conv


def _bootstrap_addr(text: str) -> str:
    from .net.addrs import parse_bootstrap

    return parse_bootstrap(text)[0]


def _listen_addr(text: str) -> str:
    from .net.addrs import parse_listen_maddr

    parse_listen_maddr(text)
    return text


def _announce_addr(text: str) -> str:
    from .net.addrs import parse_announce

    return parse_announce(text)


def _peer_id(text: str) -> str:
    from .core.identity import check_peer_id

    return check_peer_id(text)


def _http_listen(text: str) -> tuple[str, int | None]:
    """``HOST:PORT``, ``:PORT`` or ``HOST`` (the port then comes from --metrics-port)."""
    from .net.http import parse_listen

    t = text.strip()
    if t.isdigit() or t.startswith(":") or "]:" in t or (t.count(":") == 1 and not t.startswith("[")):
        return parse_listen(t)
    return t.strip("[]"), None


def check_writable(path: str, what: str = "--out") -> None:
    """Refuse an output path that cannot be written, before any work."""
    p = Path(path)
    if p.is_dir():
        raise InputError(f"{what} {path} is a directory", "give a file path")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise InputError(f"cannot write {what} {path}: directory {parent} does not exist",
                         f"create it first with mkdir -p {parent}, or choose another path")
    if p.exists() and not os.access(p, os.W_OK) or not p.exists() and not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(f"cannot write {what} {path}: permission denied", "choose another path")


def _open_out(path: str) -> Any:
    """The output file, created (truncated) now so nothing is computed for
    a file that cannot be written; rows are appended and flushed as they come."""
    check_writable(path)
    try:
        return open(path, "w", buffering=1)
    except OSError as exc:
        raise InputError(f"cannot write --out {path}: {exc.strerror}", "choose another path") from None


# -- start ------------------------------------------------------------------------------------


def _add_start(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "start", help="run a peer daemon",
        description="Run a peer of a swarm until SIGINT/SIGTERM (then leave gracefully).\n\n"
                    "example:\n  peer start --listen /ip4/0.0.0.0/tcp/4001 --metrics-port 9100 \\\n"
                    "             --bootstrap /ip4/10.0.0.5/tcp/4001/p2p/12D3KooW...\n\n"
                    "Without --profile the machine is read (CPUs, memory, CUDA devices, NVML power limits)\n"
                    "and written to DATA_DIR/profile.toml, which later starts use and you may edit.")
    p.add_argument("--profile", help="peer profile TOML (peers/*.toml); default: DATA_DIR/profile.toml, "
                   "detected from this machine on first start")
    p.add_argument("--simulate-devices", action="store_true",
                   help="run a profile that claims accelerators this machine lacks (a warning, not an error)")
    p.add_argument("--engine", choices=["local", "ray"], default="local",
                   help="where won shards run: local (this process, default) or ray (an existing Ray cluster, "
                        "whose free capacity the peer offers; needs pip install 'fedswarm[ray]', see docs/ray.md)")
    p.add_argument("--ray-address", default="auto", metavar="HOST:PORT",
                   help="--engine ray: the cluster head's GCS address (default: auto, the local cluster or "
                        "$RAY_ADDRESS)")
    p.add_argument("--ray-reserve", metavar="N|RES=N,...",
                   help="--engine ray: capacity kept from the swarm, N slots (GPUs, or CPUs on a CPU-only "
                        "cluster) or Ray resources e.g. CPU=4,GPU=1,memory=16G (default: none)")
    p.add_argument("--listen", default="/ip4/127.0.0.1/tcp/0", type=_wrap_input(_listen_addr),
                   help="multiaddr to listen on (tcp port 0: any free port)")
    p.add_argument("--announce", action="append", default=[], type=_wrap_input(_announce_addr), metavar="MADDR",
                   help="address to advertise instead of the listen addresses (repeatable; default: the "
                        "listen addresses, a wildcard expanded to this machine's interfaces)")
    p.add_argument("--bootstrap", action="append", default=[], type=_wrap_input(_bootstrap_addr), metavar="MADDR",
                   help="multiaddr (with /p2p/) of a peer to join through; retried with backoff until it "
                        "answers (repeatable; default: none, start a new swarm)")
    p.add_argument("--lane-port", type=_port, default=0, metavar="PORT",
                   help="TCP port, on the --listen host, of the direct lanes that carry LLM hidden states "
                        "between peers (sealed, keyed over libp2p; docs/llm.md; default 0: any free port)")
    p.add_argument("--no-lane", action="store_true",
                   help="offer and use no direct lanes: every request goes over libp2p")
    p.add_argument("--bootstrap-retry-max", type=_float_at_least(0.0, open_=True), default=30.0, metavar="SECONDS",
                   help="longest wait between two tries of an unreachable bootstrap peer (the wait starts at 1 s "
                        "and doubles)")
    p.add_argument("--key", help="Ed25519 key file, mode 0600 (created if absent; default: DATA_DIR/peer.key)")
    p.add_argument("--data-dir", help="where the key, profile and lock live "
                   "(default: $FEDSWARM_HOME, else the per-user data dir, e.g. ~/.local/share/fedswarm)")
    p.add_argument("--metrics-port", type=_port, metavar="PORT",
                   help="serve the dashboard, /status and /metrics on PORT (0: any free port; default: no server)")
    p.add_argument("--http-listen", type=_wrap_input(_http_listen), metavar="HOST[:PORT]",
                   help="host (and port) of that server (default: 127.0.0.1, port from --metrics-port)")
    p.add_argument("--grace", type=_float_at_least(0.0), default=10.0, metavar="SECONDS",
                   help="seconds to finish leased shards on SIGTERM")
    p.add_argument("--serve-model", metavar="MODEL",
                   help="checkpoint to serve blocks of: a model name, a Hugging Face-format directory or a "
                        ".gguf file (default: serve none)")
    p.add_argument("--blocks", metavar="A:B|auto[:N]", help="block span to serve (blocks A..B-1; default: all)")
    p.add_argument("--serve-device", default="auto", metavar="auto|cpu|cuda[:N]",
                   help="where the served blocks compute (default: auto, the first CUDA device torch sees, "
                        "else the CPU)")
    p.add_argument("--serve-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="the served blocks' dtype (default: auto, bfloat16 on a GPU, float16 on one without "
                        "bfloat16, the checkpoint's own on the CPU)")
    p.add_argument("--torch-threads", type=_int_at_least(1), metavar="N",
                   help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--membership", metavar="FILE", help="federation membership certificate (from `peer admit`)")
    p.add_argument("--trust-federation", action="append", default=[], type=_wrap_input(_peer_id), metavar="PEER_ID",
                   help="peer id of a federation key whose members this peer trusts (repeatable; default: none)")
    p.add_argument("--log-format", choices=["json", "text"], default="json", help="log lines on stderr")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info",
                   help="log level (-v: debug, -q: warning)")
    p.set_defaults(func=_cmd_start)


def _cmd_start(a: argparse.Namespace) -> int:
    import trio

    from .daemon import PeerOptions, serve_peer, setup_logging

    host, port = "127.0.0.1", a.metrics_port
    if a.http_listen is not None:
        host, hport = a.http_listen
        if hport is not None:
            if a.metrics_port is not None and a.metrics_port != hport:
                raise InputError(f"--http-listen port {hport} differs from --metrics-port {a.metrics_port}",
                                 "give the port once")
            port = hport
        elif port is None:
            raise InputError(f"--http-listen {host} names no port", "add :PORT or give --metrics-port")
    level = "debug" if a.verbose else "warning" if a.quiet else a.log_level
    setup_logging(a.log_format, level)
    opts = PeerOptions(
        profile=a.profile,
        listen=a.listen,
        bootstrap=a.bootstrap,
        key=a.key,
        data_dir=a.data_dir,
        metrics_port=port,
        grace_s=a.grace,
        serve_model=a.serve_model,
        blocks=a.blocks,
        serve_device=a.serve_device,
        serve_dtype=a.serve_dtype,
        torch_threads=a.torch_threads,
        membership=a.membership,
        federations=a.trust_federation,
        announce=a.announce,
        http_host=host,
        simulate_devices=a.simulate_devices,
        bootstrap_retry_max_s=a.bootstrap_retry_max,
        engine=a.engine,
        ray_address=a.ray_address,
        ray_reserve=a.ray_reserve,
        lane=not a.no_lane,
        lane_port=a.lane_port,
    )
    return trio.run(serve_peer, opts)


# -- admit / keygen ---------------------------------------------------------------------------


def _add_admit(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "admit", help="sign a federation membership certificate for a trusted peer",
        description="Sign a certificate admitting PEER_ID to the federation of --federation-key.\n\n"
                    "example:\n  peer admit --federation-key fed.key --peer 12D3KooW... --days 30 --out member.cert")
    p.add_argument("--federation-key", required=True, metavar="FILE",
                   help="the federation's key file, mode 0600 (created if absent)")
    p.add_argument("--peer", required=True, type=_wrap_input(_peer_id), metavar="PEER_ID",
                   help="peer id to admit (12D3KooW...)")
    p.add_argument("--days", type=_float_at_least(0.0, open_=True), default=30.0, help="validity in days (> 0)")
    p.add_argument("--out", required=True, metavar="FILE", help="certificate file to write")
    p.set_defaults(func=_cmd_admit)


def _cmd_admit(a: argparse.Namespace) -> int:
    from .core.identity import load_or_create_key
    from .core.membership import issue_membership

    if a.days > 36500:
        raise InputError(f"--days {a.days:g} is more than 100 years", "give a validity in days, 0 < DAYS <= 36500")
    check_writable(a.out)
    fed = load_or_create_key(a.federation_key)
    cert = issue_membership(fed, a.peer, time.time() + a.days * 86400)
    Path(a.out).write_bytes(cert)
    if not a.quiet:
        print(f"admitted {a.peer} to federation {fed.peer_id} for {a.days:g} days -> {a.out}")
    return 0


def _add_keygen(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "keygen", help="create an Ed25519 key file and print its peer id",
        description="Create a key file (mode 0600) and print its peer id; --show prints the id of an\n"
                    "existing key and never creates one.\n\nexample:\n  peer keygen --key tenant.key\n"
                    "  peer keygen --key tenant.key --show")
    p.add_argument("--key", required=True, metavar="FILE", help="key file")
    p.add_argument("--show", action="store_true", help="print the peer id of an existing key (never creates one)")
    p.set_defaults(func=_cmd_keygen)


def _cmd_keygen(a: argparse.Namespace) -> int:
    from .core.identity import load_key, load_or_create_key

    if a.show:
        print(load_key(a.key).peer_id)
        return 0
    if Path(a.key).exists() or Path(a.key).is_symlink():
        raise InputError(f"{a.key} exists", "use --show to print its peer id")
    print(load_or_create_key(a.key).peer_id)
    return 0


# -- status -----------------------------------------------------------------------------------


def _add_status(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "status", help="what a running daemon sees",
        description="Show a running daemon's view: peers, leases, tenants' shares, bootstrap state.\n\n"
                    "example:\n  peer status --metrics-port 9100\n  peer status --url http://10.0.0.5:9100/status --json")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--metrics-port", type=_port, metavar="PORT", help="the daemon's --metrics-port (on 127.0.0.1)")
    g.add_argument("--url", help="full URL of a daemon's /status")
    p.add_argument("--json", action="store_true", help="print the raw JSON")
    p.add_argument("--timeout", type=_float_at_least(0.0, open_=True), default=5.0, help="seconds to wait for an answer")
    p.set_defaults(func=_cmd_status)


def _fetch_status(url: str, timeout: float) -> dict[str, Any]:
    import urllib.error
    import urllib.request

    if not url.startswith(("http://", "https://")):
        raise InputError(f"--url {url!r} is not an http(s) URL", "e.g. http://127.0.0.1:9100/status")
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            body = r.read(16 << 20)
            ctype = r.headers.get("Content-Type", "")
    except urllib.error.HTTPError as exc:
        raise CommandFailed(f"{url} answered HTTP {exc.code} {exc.reason}", "give the daemon's /status URL") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise CommandFailed(f"cannot reach {url}: {getattr(reason, 'strerror', None) or reason}",
                            "is the daemon running with --metrics-port?") from None
    try:
        st = json.loads(body)
    except ValueError:
        raise InputError(f"{url} did not answer JSON (Content-Type {ctype or 'none'})",
                         "give the daemon's /status URL, e.g. http://127.0.0.1:9100/status") from None
    if not isinstance(st, dict) or "peer" not in st:
        raise InputError(f"{url} is not a fedswarm /status page", "give the daemon's /status URL")
    return st


def _cmd_status(a: argparse.Namespace) -> int:
    url = a.url or f"http://127.0.0.1:{a.metrics_port}/status"
    st = _fetch_status(url, a.timeout)
    if a.json:
        print(json.dumps(st, indent=1))
        return 0
    print(f"peer {st['peer']}{'  (leaving)' if st.get('leaving') else ''}")
    for addr in st.get("addrs", []):
        print(f"  {addr}")
    boot = st.get("bootstrap") or []
    if boot:
        print("\nbootstrap")
        for b in boot:
            line = f"  {b.get('addr')}: {b.get('state')} after {b.get('attempts')} attempt(s)"
            if b.get("state") != "connected":
                if b.get("retry_in_s") is not None:
                    line += f", retrying every <= {b['retry_in_s']:g}s"
                if b.get("last_error"):
                    line += f"; last error: {b['last_error']}"
            print(line)
    peers = st.get("peers", [])
    print(f"\n{len(peers)} live peers (* = this peer)")
    print(f"  {'peer':<21} {'slots':>5} {'backlog_s':>9} {'power_w':>8} {'max_w':>6} {'gCO2/kWh':>8} {'trust':<10} region")
    for p in peers:
        mark = "*" if p.get("self") else " "
        print(f"  {mark}{p['peer'][-20:]:<20} {p['slots']:>5} {p['backlog_s']:>9.1f} {p['power_w']:>8.1f} "
              f"{p['max_w']:>6.0f} {p['carbon_g_kwh']:>8.0f} {p['trust']:<10} {p['region']}")
    spans = st.get("spans", [])
    print(f"\n{len(spans)} spans served here, {st.get('span_changes', 0)} span changes, "
          f"{len(st.get('sessions', []))} open sessions")
    for sp in spans:
        state = f" ({sp['state']})" if sp.get("state", "serving") != "serving" else ""
        where = f" on {sp['device']}, {sp['dtype']}" if "device" in sp else ""
        print(f"  model {sp['model'][:12]} blocks {sp['start']}:{sp['end']}{where}: {sp['sessions']} sessions{state}")
    tr = st.get("transport") or {}
    if "lane_port" in tr:
        if tr["lane_port"]:
            print(f"\ndirect lanes on port {tr['lane_port']}: {tr.get('lanes_live', 0)} live, "
                  f"{tr.get('lane_requests_in', 0)} requests in, {tr.get('lane_requests_out', 0)} out, "
                  f"{tr.get('lane_refused', 0)} refused, {tr.get('lane_failures', 0)} failed")
        else:
            print("\ndirect lanes off (--no-lane): every request goes over libp2p")
    leases = st.get("leases", [])
    print(f"\n{len(leases)} leases, {st.get('results_pending', 0)} results awaiting ack")
    for l in leases:
        print(f"  {l['job_id']} shard {l['shard']} attempt {l['attempt']}: {l['state']} (tenant {l['tenant'][-12:]})")
    print("\ntenant shares")
    for t, s in st.get("tenant_shares", {}).items():
        print(f"  {t[-20:]:<20} {s:.3f}")
    return 0


# -- submit -----------------------------------------------------------------------------------


def _add_submit(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "submit", help="submit a job and write its results as JSON lines",
        description="Submit a job to a swarm (or run it here with --local). Each shard's result is appended\n"
                    "to --out as it arrives; on success the file is rewritten in shard order. On a timeout\n"
                    "or Ctrl-C the shards received stay in the file and the command says how many are missing.\n\n"
                    "example:\n  peer submit --bootstrap /ip4/127.0.0.1/tcp/4001/p2p/12D3KooW... --kind tensor-map \\\n"
                    "              --shards 16 --size 512 --out out.jsonl")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--bootstrap", action="append", type=_wrap_input(_bootstrap_addr), metavar="MADDR",
                       help="multiaddr (with /p2p/) of a swarm peer (repeatable)")
    where.add_argument("--local", action="store_true", help="run the same job in this process, without a swarm")
    p.add_argument("--kind", required=True, help="task kind, e.g. tensor-map")
    p.add_argument("--shards", type=_int_at_least(1, 1 << 20), required=True, metavar="N", help="number of shards")
    p.add_argument("--seed", type=int, default=0, help="task seed")
    p.add_argument("--size", type=_int_at_least(1), help="tensor-map: matrix size (work per shard grows as size^3)")
    p.add_argument("--iters", type=_int_at_least(1), help="tensor-map: matrix products per shard")
    p.add_argument("--input", metavar="FILE", help="JSON file with the task's parameters")
    p.add_argument("--out", required=True, metavar="FILE", help="output file (JSON lines, one per shard)")
    p.add_argument("--key", metavar="FILE", help="tenant key file, mode 0600 (default: a fresh key)")
    p.add_argument("--timeout", type=_float_at_least(0.0, open_=True), default=600.0, metavar="SECONDS",
                   help="give up after this long (partial results stay in --out)")
    p.add_argument("--deadline", type=_float_at_least(0.0, open_=True), metavar="SECONDS",
                   help="seconds from submission the job should finish by (default: none)")
    p.add_argument("--lam", type=_float_at_least(0.0), default=0.0, help="weight of energy (J) against finish time (s)")
    p.add_argument("--weight", type=_float_at_least(0.0, open_=True), default=1.0, help="tenant weight")
    p.add_argument("--min-peers", type=_int_at_least(1), default=1, help="wait until this many peers are known")
    p.add_argument("--progress", choices=["auto", "on", "off"], default="auto",
                   help="progress bar on stderr (auto: when a terminal)")
    p.add_argument("--verify", choices=["none", "auto", "always"], default="auto",
                   help="re-run untrusted peers' shards elsewhere and compare (auto: by reputation)")
    p.add_argument("--trust-federation", action="append", default=[], type=_wrap_input(_peer_id), metavar="PEER_ID",
                   help="peer id of a federation key whose members need no verification (repeatable; default: none)")
    p.add_argument("--json", action="store_true", help="print a JSON summary on stdout")
    p.set_defaults(func=_cmd_submit)


def _params(a: argparse.Namespace) -> dict[str, Any]:
    params: dict[str, Any] = {}
    if a.input:
        try:
            params = json.loads(Path(a.input).read_text())
        except OSError as exc:
            raise InputError(f"cannot read --input {a.input}: {exc.strerror}") from None
        except ValueError as exc:
            raise InputError(f"--input {a.input} is not JSON: {exc}") from None
        if not isinstance(params, dict):
            raise InputError(f"--input {a.input} must hold a JSON object of task parameters")
    params.setdefault("seed", a.seed)
    if a.size is not None:
        params["size"] = a.size
    if a.iters is not None:
        params["iters"] = a.iters
    return params


class _Progress:
    """Shards done, rate, time left and peers in use, on stderr.

    A rich bar on a terminal; elsewhere one line every ``every_s`` seconds
    (and one at the end). ``mode``: auto (bar on a terminal, lines otherwise),
    on (the bar), off (nothing).
    """

    def __init__(self, total: int, mode: str, *, every_s: float = 5.0) -> None:
        self.total = total
        self.mode = mode
        self.t0 = time.monotonic()
        self.every_s = every_s
        self._last_line = self.t0
        self._peers: set[str] = set()
        self._bar: Any = None
        self._task: Any = None
        if mode == "on" or (mode == "auto" and sys.stderr.isatty()):
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(TextColumn("shards"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[rate]}/s"), TimeRemainingColumn(),
                                 TextColumn("{task.fields[peers]} peers"),
                                 console=Console(stderr=True), transient=False)
            self._task = self._bar.add_task("shards", total=total, rate="0.0", peers=0)
            self._bar.start()

    def update(self, done: int, peer: str | None = None) -> None:
        if peer:
            self._peers.add(peer)
        now = time.monotonic()
        rate = done / max(now - self.t0, 1e-9)
        if self._bar is not None:
            self._bar.update(self._task, completed=done, rate=f"{rate:.1f}", peers=len(self._peers))
            if done >= self.total:
                self.close()
        elif self.mode == "auto" and (now - self._last_line >= self.every_s or done >= self.total):
            self._last_line = now
            left = (self.total - done) / rate if rate > 0 else float("inf")
            eta = f", ~{left:.0f}s left" if done < self.total and left != float("inf") else ""
            print(f"peer submit: {done}/{self.total} shards, {rate:.1f}/s, {len(self._peers)} peers{eta}",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


class _Sink:
    """Appends rows to --out as they arrive (flushed), remembers which shards came."""

    def __init__(self, f: Any, path: str, total: int) -> None:
        self.f, self.path, self.total = f, path, total
        self.rows: dict[int, dict[str, Any]] = {}

    def add(self, row: dict[str, Any]) -> None:
        if row["shard"] in self.rows:
            return
        self.rows[row["shard"]] = row
        self.f.write(json.dumps(row, sort_keys=True) + "\n")
        self.f.flush()

    def finish_sorted(self) -> None:
        """All shards in: rewrite the file in shard order (atomically)."""
        self.f.close()
        tmp = f"{self.path}.tmp{os.getpid()}"
        with open(tmp, "w") as g:
            for i in sorted(self.rows):
                g.write(json.dumps(self.rows[i], sort_keys=True) + "\n")
        os.replace(tmp, self.path)

    def missing(self) -> str:
        got = len(self.rows)
        return (f"{got} of {self.total} shards received, {self.total - got} missing"
                + (f" (the {got} received are in {self.path})" if got else f" ({self.path} is empty)"))

    def close(self) -> None:
        if not self.f.closed:
            self.f.close()


def _contains(exc: BaseException, kind: type) -> bool:
    if isinstance(exc, kind):
        return True
    if isinstance(exc, BaseExceptionGroup):
        return any(_contains(e, kind) for e in exc.exceptions)
    return False


def _cmd_submit(a: argparse.Namespace) -> int:
    params = _params(a)
    f = _open_out(a.out)  # before anything is computed or sent
    sink = _Sink(f, a.out, a.shards)
    try:
        from .client import JobRequest, _jsonable
        from .tasks.registry import UnknownTask, default_registry

        try:
            task = default_registry().get(a.kind)
            est = task.estimate(params)  # validates the parameters before anything is sent
        except UnknownTask as exc:
            raise InputError(str(exc), "see the task kinds listed") from None
        except (ValueError, TypeError, KeyError) as exc:
            raise InputError(f"bad parameters for {a.kind}: {exc}") from None
        t0 = time.monotonic()
        try:
            if a.local:
                prog = _Progress(a.shards, "off" if a.quiet else a.progress)
                for i in range(a.shards):
                    sink.add({"shard": i, "peer": "local", "result": _jsonable(task.run(params, i, device="cpu"))})
                    prog.update(i + 1, "local")
                prog.close()
                job_id = "local"
            else:
                import trio

                req = JobRequest(
                    task=a.kind,
                    shards=a.shards,
                    params=params,
                    work_s=max(est.ref_seconds, 1e-3),
                    mem_bytes=int(est.mem_bytes),
                    deadline_s=a.deadline,
                    lam=a.lam,
                    weight=a.weight,
                )
                job_id = trio.run(_submit_swarm, a, req, sink)
        except BaseException as exc:
            if _contains(exc, KeyboardInterrupt):
                raise KeyboardInterrupt(f"interrupted: {sink.missing()}") from None
            raise
        sink.finish_sorted()
    finally:
        sink.close()
    secs = time.monotonic() - t0
    if a.json:
        print(json.dumps({"job_id": job_id, "shards": a.shards, "done": len(sink.rows), "out": a.out,
                          "seconds": round(secs, 3), "local": bool(a.local)}))
    if not a.quiet:
        where = "computed locally" if a.local else "done"
        print(f"{a.shards} shards {where} in {secs:.2f}s -> {a.out}", file=sys.stderr)
    return 0


async def _submit_swarm(a: argparse.Namespace, req: Any, sink: _Sink) -> str:
    import trio

    from .client import open_swarm_client
    from .core.config import ClientConfig
    from .core.identity import Identity, load_or_create_key
    from .net.quiet import quiet_libraries
    from .net import libp2p as _libp2p  # noqa: F401  (import cost kept out of the timing below)

    quiet_libraries()
    identity = load_or_create_key(a.key) if a.key else Identity.generate()
    prog = _Progress(req.shards, "off" if a.quiet else a.progress)
    t0 = time.monotonic()  # from here: open the transport, connect, learn peers, announce
    cfg = ClientConfig(verify=a.verify, federations=frozenset(a.trust_federation))
    stop = _Stop()

    def add(o: Any) -> None:
        sink.add({"shard": o.shard, "peer": o.peer, "attempt": o.attempt,
                  "result": o.as_json()["result"], "energy_j": round(o.energy_j, 3)})

    async def body() -> str | None:
        async with open_swarm_client(a.bootstrap, identity=identity, min_peers=a.min_peers, config=cfg) as client:
            job = None
            with stop.waiting(deadline=trio.current_time() + a.timeout - (time.monotonic() - t0)):
                job = await client.submit(req)
                if not a.quiet:
                    print(f"job {job.job_id}: {req.shards} shards submitted by tenant {client.tenant} "
                          f"({time.monotonic() - t0:.3f}s after opening the transport)", file=sys.stderr)
                async for o in job.results():
                    add(o)
                    prog.update(job.done, o.peer)
                for o in await job.wait():  # raises if the job failed; fills any gap
                    add(o)
                unverified = client.core.stats["results_unverifiable"]
                if unverified and not a.quiet:
                    print(f"note: {unverified} of {req.shards} shards accepted unverified: no other peer in the "
                          "swarm could check them (--verify auto spot-checks untrusted peers)", file=sys.stderr)
                return str(job.job_id)
            # Ctrl-C or --timeout while the job runs: cancel it at the peers that
            # hold its shards (their slots go to other work at once, not when
            # the leases run out), while the client can still send.
            if job is not None and not job.finished:
                await job.cancel()
                await client.agent.drain(2.0)
            return None

    try:
        # the job's own deadline is inside body(); this one also bounds the
        # connect and the cleanup
        with trio.fail_after(a.timeout + 10.0):
            job_id = await stop.run(body, lambda: f"interrupted: {sink.missing()}")
        if job_id is None:  # the job's deadline
            raise trio.TooSlowError
    except trio.TooSlowError:
        raise JobTimeout(f"timed out after {a.timeout:g}s: {sink.missing()}") from None
    finally:
        prog.close()
    return str(job_id)


class _Stop:
    """Ctrl-C for a trio command, taken as a signal instead of trio's
    KeyboardInterrupt (which it raises wherever the main task is, inside a
    library's bookkeeping, say, and that can leave a lock held or an event
    never set, so that the cleanup waits forever).

    The first Ctrl-C cancels the part of the body inside ``waiting()`` if the
    body is there (the body then cleans up and stops), else the whole body;
    either way ``run`` then raises KeyboardInterrupt. A second Ctrl-C exits at
    once with the same message."""

    def __init__(self) -> None:
        import trio

        self.hits = 0
        self._whole = trio.CancelScope()
        self._waiting: Any = None

    def waiting(self, deadline: float) -> Any:
        import trio

        self._waiting = trio.CancelScope(deadline=deadline)
        if self.hits:
            self._waiting.cancel()
        return self._waiting

    def _hit(self, message: Any) -> None:
        self.hits += 1
        if self.hits == 1:
            (self._waiting if self._waiting is not None else self._whole).cancel()
        else:
            print(f"peer submit: error: {message()}", file=sys.stderr, flush=True)
            os._exit(EXIT_INTERRUPTED)

    async def run(self, body: Any, message: Any) -> Any:
        import signal

        import trio

        async def watch(sigs: Any) -> None:
            async for _ in sigs:
                self._hit(message)

        result = None
        try:
            with trio.open_signal_receiver(signal.SIGINT) as sigs:
                async with trio.open_nursery() as n:
                    n.start_soon(watch, sigs)
                    try:
                        with self._whole:
                            result = await body()
                    finally:
                        n.cancel_scope.cancel()
        except BaseException:
            if not self.hits:
                raise
        if self.hits:  # whatever the stopped body raised, this was a Ctrl-C
            raise KeyboardInterrupt(message())
        return result


# -- completion -------------------------------------------------------------------------------

_FILE_OPTS = {"--profile", "--key", "--data-dir", "--input", "--out", "--membership", "--federation-key",
              "--serve-model", "--model"}


def _add_completion(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "completion", help="print a shell completion script",
        description="Print a completion script generated from this command's options.\n\n"
                    "example:\n  source <(peer completion bash)              # bash, this shell\n"
                    "  peer completion zsh > ~/.zfunc/_peer          # zsh, with ~/.zfunc in $fpath")
    p.add_argument("shell", choices=["bash", "zsh"], help="the shell")
    p.set_defaults(func=_cmd_completion)


def _tree(ap: argparse.ArgumentParser) -> tuple[list[str], dict[str, tuple[str, list[argparse.Action]]]]:
    top = [s for act in ap._actions for s in act.option_strings]
    cmds: dict[str, tuple[str, list[argparse.Action]]] = {}
    for act in ap._actions:
        if isinstance(act, argparse._SubParsersAction):
            helps = {c.dest: c.help or "" for c in act._choices_actions}
            for name, sp in act.choices.items():
                cmds[name] = (helps.get(name, ""), [x for x in sp._actions if x.option_strings or x.choices])
    return top, cmds


def _bash_script(ap: argparse.ArgumentParser) -> str:
    top, cmds = _tree(ap)
    out = ["# bash completion for peer (generated by `peer completion bash`)", "_peer_complete() {",
           '    local cur prev cmd i opts',
           '    cur="${COMP_WORDS[COMP_CWORD]}"; prev="${COMP_WORDS[COMP_CWORD-1]}"; cmd=""',
           '    for ((i=1; i<COMP_CWORD; i++)); do',
           '        case "${COMP_WORDS[i]}" in -*) ;; *) cmd="${COMP_WORDS[i]}"; break ;; esac',
           '    done',
           '    case "$cmd" in',
           f'        "") COMPREPLY=($(compgen -W "{" ".join(sorted(cmds))} {" ".join(top)}" -- "$cur")); return ;;']
    for name, (_, actions) in sorted(cmds.items()):
        opts = [s for x in actions for s in x.option_strings]
        pos = [c for x in actions if not x.option_strings and x.choices for c in x.choices]
        cases = []
        for x in actions:
            if not x.option_strings or x.nargs == 0:
                continue
            pat = "|".join(x.option_strings)
            if x.choices:
                cases.append(f'                {pat}) COMPREPLY=($(compgen -W "{" ".join(map(str, x.choices))}" -- "$cur")); return ;;')
            elif set(x.option_strings) & _FILE_OPTS:
                cases.append(f'                {pat}) COMPREPLY=($(compgen -f -- "$cur")); return ;;')
            else:
                cases.append(f'                {pat}) COMPREPLY=(); return ;;')
        out.append(f"        {name})")
        if cases:
            out += ['            case "$prev" in', *cases, "            esac"]
        out.append(f'            opts="{" ".join(opts + pos)}" ;;')
    out += ['        *) opts="" ;;', "    esac", '    COMPREPLY=($(compgen -W "$opts" -- "$cur"))', "}",
            "complete -o default -F _peer_complete peer", ""]
    return "\n".join(out)


def _zq(text: str) -> str:
    return text.replace("'", "").replace("[", "(").replace("]", ")").replace(":", " ").replace("\n", " ")


def _zsh_script(ap: argparse.ArgumentParser) -> str:
    top, cmds = _tree(ap)
    out = ["#compdef peer", "# zsh completion for peer (generated by `peer completion zsh`)", "_peer() {",
           "    local -a cmds", "    cmds=("]
    out += [f"        '{name}:{_zq(h)}'" for name, (h, _) in sorted(cmds.items())]
    out += ["    )", "    if (( CURRENT == 2 )); then", "        _describe 'command' cmds", "        return", "    fi",
            "    local cmd=$words[2]", "    shift words; (( CURRENT-- ))", "    case $cmd in"]
    for name, (_, actions) in sorted(cmds.items()):
        specs = []
        for x in actions:
            h = _zq(x.help or "")
            if not x.option_strings:
                specs.append(f"'1:{x.dest}:({' '.join(map(str, x.choices or ()))})'")
                continue
            for s in x.option_strings:
                if x.nargs == 0:
                    specs.append(f"'{s}[{h}]'")
                elif x.choices:
                    specs.append(f"'{s}[{h}]:value:({' '.join(map(str, x.choices))})'")
                elif s in _FILE_OPTS:
                    specs.append(f"'{s}[{h}]:file:_files'")
                else:
                    specs.append(f"'{s}[{h}]:value:'")
        out.append(f"        {name}) _arguments \\")
        out += [f"            {sp} \\" for sp in specs]
        out.append("            ;;")
    out += ["    esac", "}", '_peer "$@"', ""]
    return "\n".join(out)


def _cmd_completion(a: argparse.Namespace) -> int:
    ap = build_parser()
    print(_bash_script(ap) if a.shell == "bash" else _zsh_script(ap), end="")
    return 0


# -- main -------------------------------------------------------------------------------------


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("fedswarm")
    except Exception:
        return "unknown"


def _add_common(p: argparse.ArgumentParser, *, top: bool) -> None:
    """--debug / -q / -v, on the top parser and (without overriding it) on every subcommand."""
    kw: dict[str, Any] = {} if top else {"default": argparse.SUPPRESS}
    taken = {s for x in p._actions for s in x.option_strings}
    for flags, dest, h in ((("--debug",), "debug", "show the traceback of an error"),
                           (("-q", "--quiet"), "quiet", "print only results and errors"),
                           (("-v", "--verbose"), "verbose", "more detail (debug logs)")):
        free = [f for f in flags if f not in taken]
        if free:
            p.add_argument(*free, dest=dest, action="store_true", help=h, **kw)


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="peer", description="fedswarm: a peer-to-peer compute federation.\n\n"
                 "example:\n  peer start --metrics-port 9100\n  peer status --metrics-port 9100\n\n"
                 "exit codes: 0 ok, 1 runtime failure, 2 usage or input error, 130 interrupted")
    ap.add_argument("--version", action="version", version=f"peer (fedswarm) {_version()}")
    _add_common(ap, top=True)
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    _add_start(sub)
    _add_status(sub)
    _add_submit(sub)
    _add_admit(sub)
    _add_keygen(sub)
    _add_completion(sub)
    # other modules' subcommands: one line each, `add_xxx(sub)` with p.set_defaults(func=...)
    from .llm_cli import add_generate

    add_generate(sub)
    __import__("fedswarm.models_cli", fromlist=["add_models"]).add_models(sub)
    for sp in sub.choices.values():
        _add_common(sp, top=False)
    return ap


def _leaf(exc: BaseException) -> BaseException:
    """The cause of an exception group: Ctrl-C first, else the first
    exception that is not a cancellation."""
    while isinstance(exc, BaseExceptionGroup):
        leaves: list[BaseException] = []

        def walk(e: BaseException) -> None:
            if isinstance(e, BaseExceptionGroup):
                for x in e.exceptions:
                    walk(x)
            else:
                leaves.append(e)

        walk(exc)
        exc = (next((e for e in leaves if isinstance(e, KeyboardInterrupt)), None)
               or next((e for e in leaves if type(e).__name__ != "Cancelled"), None)
               or leaves[0])
    return exc


def _describe(exc: BaseException) -> tuple[int, str]:
    """(exit code, one-line message) for an exception out of a command."""
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED, str(exc) or "interrupted"
    if isinstance(exc, InputError):
        return EXIT_USAGE, str(exc)
    if type(exc).__name__ == "TooSlowError":
        return EXIT_FAILURE, "timed out (raise --timeout)"
    if isinstance(exc, FederationError):
        return EXIT_FAILURE, str(exc) or type(exc).__name__
    if isinstance(exc, OSError):
        what = exc.strerror or str(exc) or type(exc).__name__
        if exc.filename:
            what = f"{exc.filename}: {what}"
        return EXIT_FAILURE, what
    if isinstance(exc, MemoryError):
        return EXIT_FAILURE, "out of memory"
    return EXIT_FAILURE, (f"internal error: {type(exc).__name__}: {exc} "
                          "(rerun with --debug for the traceback, and please report it)")


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    a, extra = ap.parse_known_args(argv)
    if extra:  # named by the subcommand's parser: "peer start: error: ..."
        sub = next(x for x in ap._actions if isinstance(x, argparse._SubParsersAction))
        sub.choices[a.cmd].error(f"unrecognized arguments: {' '.join(extra)}")
    debug = bool(getattr(a, "debug", False)) or os.environ.get("FEDSWARM_DEBUG") == "1"
    prog = f"peer {a.cmd}"
    try:
        if a.cmd == "generate":  # py-libp2p logs every failed dial as an error
            from .net.quiet import quiet_libraries

            quiet_libraries()
        return int(a.func(a) or 0)
    except SystemExit:
        raise
    except BrokenPipeError:
        # the reader went away (`peer models | head`): nothing left to say to it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except BaseException as exc:  # the one place a failure is turned into a line and an exit code
        return report_failure(prog, exc, debug=debug)


def report_failure(prog: str, exc: BaseException, *, debug: bool = False) -> int:
    """Print ``PROG: error: WHAT (HINT)`` (after the traceback with ``debug``)
    and return the exit code; also used by ``netsim``."""
    code, msg = _describe(_leaf(exc))
    if debug:
        import traceback

        traceback.print_exception(exc)
    sys.stderr.write(f"{prog}: error: {msg.replace(chr(10), ' ')}\n")
    sys.stderr.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())
