"""The ``peer`` command: start, status, keygen, submit (and generate).

The CLI only parses options and wires concrete parts together; the logic
lives in ``fedswarm.daemon`` (a peer), ``fedswarm.client`` (a tenant) and
the tasks.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import trio

__all__ = ["main"]


def _add_start(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("start", help="run a peer daemon")
    p.add_argument("--profile", required=True, help="peer profile TOML (peers/*.toml)")
    p.add_argument("--listen", default="/ip4/127.0.0.1/tcp/0", help="multiaddr to listen on")
    p.add_argument("--bootstrap", action="append", default=[], help="multiaddr of a peer to join through (repeatable)")
    p.add_argument("--key", help="Ed25519 key file (created with mode 0600 if absent; default DATA_DIR/peer.key)")
    p.add_argument("--data-dir", default=".fedswarm", help="where the key and state live")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics and JSON /status on 127.0.0.1:PORT")
    p.add_argument("--grace", type=float, default=10.0, help="seconds to finish leased shards on SIGTERM")
    p.add_argument("--serve-model", help="Hugging Face-format checkpoint directory to serve blocks of")
    p.add_argument("--blocks", help="block span A:B to serve (blocks A..B-1)")
    p.add_argument("--torch-threads", type=int, help="torch intra-op threads")
    p.add_argument("--membership", help="federation membership certificate (from `peer admit`)")
    p.add_argument("--trust-federation", action="append", default=[],
                   help="peer id of a federation key whose members this peer trusts (repeatable)")
    p.add_argument("--log-format", choices=["json", "text"], default="json")
    p.add_argument("--log-level", default="info")


def _cmd_start(a: argparse.Namespace) -> int:
    from .daemon import PeerOptions, serve_peer, setup_logging

    setup_logging(a.log_format, a.log_level)
    opts = PeerOptions(
        profile=a.profile,
        listen=a.listen,
        bootstrap=a.bootstrap,
        key=a.key,
        data_dir=a.data_dir,
        metrics_port=a.metrics_port,
        grace_s=a.grace,
        serve_model=a.serve_model,
        blocks=a.blocks,
        torch_threads=a.torch_threads,
        membership=a.membership,
        federations=a.trust_federation,
    )
    return trio.run(serve_peer, opts)


def _cmd_admit(a: argparse.Namespace) -> int:
    from .core.identity import load_or_create_key
    from .core.membership import issue_membership

    fed = load_or_create_key(a.federation_key)
    cert = issue_membership(fed, a.peer, time.time() + a.days * 86400)
    Path(a.out).write_bytes(cert)
    print(f"admitted {a.peer} to federation {fed.peer_id} for {a.days} days -> {a.out}")
    return 0


def _cmd_keygen(a: argparse.Namespace) -> int:
    from .core.identity import load_or_create_key

    if Path(a.key).exists() and not a.show:
        print(f"{a.key} exists; use --show to print its peer id", file=sys.stderr)
        return 1
    print(load_or_create_key(a.key).peer_id)
    return 0


def _cmd_status(a: argparse.Namespace) -> int:
    url = a.url or f"http://127.0.0.1:{a.metrics_port}/status"
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            st = json.load(r)
    except OSError as exc:
        print(f"cannot reach {url}: {exc}", file=sys.stderr)
        return 1
    if a.json:
        print(json.dumps(st, indent=1))
        return 0
    print(f"peer {st['peer']}{'  (leaving)' if st['leaving'] else ''}")
    for addr in st["addrs"]:
        print(f"  {addr}")
    print(f"\n{len(st['peers'])} live peers")
    print(f"  {'peer':<20} {'slots':>5} {'backlog_s':>9} {'power_w':>8} {'max_w':>6} {'gCO2/kWh':>8} {'trust':<10} region")
    for p in st["peers"]:
        print(f"  {p['peer'][-20:]:<20} {p['slots']:>5} {p['backlog_s']:>9.1f} {p['power_w']:>8.1f} {p['max_w']:>6.0f} {p['carbon_g_kwh']:>8.0f} {p['trust']:<10} {p['region']}")
    print(f"\n{len(st['leases'])} leases, {st['results_pending']} results awaiting ack")
    for l in st["leases"]:
        print(f"  {l['job_id']} shard {l['shard']} attempt {l['attempt']}: {l['state']} (tenant {l['tenant'][-12:]})")
    print("\ntenant shares")
    for t, s in st["tenant_shares"].items():
        print(f"  {t[-20:]:<20} {s:.3f}")
    return 0


def _add_submit(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("submit", help="submit a job and write its results as JSON lines")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--bootstrap", action="append", help="multiaddr of a swarm peer (repeatable)")
    where.add_argument("--local", action="store_true", help="run the same job in this process, without a swarm")
    p.add_argument("--kind", required=True, help="task kind, e.g. tensor-map")
    p.add_argument("--shards", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--size", type=int, help="tensor-map: matrix size (work per shard grows as size^3)")
    p.add_argument("--iters", type=int, help="tensor-map: matrix products per shard")
    p.add_argument("--input", help="JSON file with the task's parameters")
    p.add_argument("--out", required=True, help="output file (JSON lines, one per shard)")
    p.add_argument("--key", help="tenant key file (default: a fresh key)")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--deadline", type=float, help="seconds from submission the job should finish by")
    p.add_argument("--lam", type=float, default=0.0, help="weight of energy (J) against finish time (s)")
    p.add_argument("--weight", type=float, default=1.0)
    p.add_argument("--min-peers", type=int, default=1, help="wait until this many peers are known")
    p.add_argument("--progress", choices=["auto", "on", "off"], default="auto")
    p.add_argument("--verify", choices=["none", "auto", "always"], default="auto",
                   help="re-run untrusted peers' shards elsewhere and compare (auto: by reputation)")
    p.add_argument("--trust-federation", action="append", default=[],
                   help="peer id of a federation key whose members need no verification (repeatable)")


def _params(a: argparse.Namespace) -> dict[str, Any]:
    params: dict[str, Any] = {}
    if a.input:
        params = json.loads(Path(a.input).read_text())
        if not isinstance(params, dict):
            raise SystemExit("--input must hold a JSON object of task parameters")
    params.setdefault("seed", a.seed)
    if a.size is not None:
        params["size"] = a.size
    if a.iters is not None:
        params["iters"] = a.iters
    return params


class _Progress:
    def __init__(self, total: int, mode: str) -> None:
        self.total = total
        self.on = mode == "on" or (mode == "auto" and sys.stderr.isatty())
        self.t0 = time.monotonic()

    def update(self, done: int) -> None:
        if not self.on:
            return
        width = 30
        fill = int(width * done / max(self.total, 1))
        sys.stderr.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {done}/{self.total} shards  {time.monotonic() - self.t0:5.1f}s")
        if done >= self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _write_lines(path: str, rows: list[dict[str, Any]]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row, sort_keys=True) + "\n")


def _cmd_submit(a: argparse.Namespace) -> int:
    from .client import JobRequest, _jsonable
    from .tasks.registry import default_registry

    params = _params(a)
    task = default_registry().get(a.kind)
    est = task.estimate(params)  # validates the parameters before anything is sent
    if a.local:
        rows = []
        prog = _Progress(a.shards, a.progress)
        for i in range(a.shards):
            rows.append({"shard": i, "peer": "local", "result": _jsonable(task.run(params, i, device="cpu"))})
            prog.update(i + 1)
        _write_lines(a.out, rows)
        print(f"{a.shards} shards computed locally -> {a.out}", file=sys.stderr)
        return 0
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
    return trio.run(_submit_swarm, a, req)


async def _submit_swarm(a: argparse.Namespace, req: Any) -> int:
    from .client import open_swarm_client
    from .core.identity import Identity, load_or_create_key
    from .errors import FederationError

    from .core.config import ClientConfig
    from .net import libp2p as _libp2p  # noqa: F401  (import cost kept out of the timing below)

    identity = load_or_create_key(a.key) if a.key else Identity.generate()
    prog = _Progress(req.shards, a.progress)
    t0 = time.monotonic()  # from here: open the transport, connect, learn peers, announce
    cfg = ClientConfig(verify=a.verify, federations=frozenset(a.trust_federation))
    try:
        async with open_swarm_client(a.bootstrap, identity=identity, min_peers=a.min_peers, config=cfg) as client:
            job = await client.submit(req)
            print(f"job {job.job_id}: {req.shards} shards submitted by tenant {client.tenant} "
                  f"({time.monotonic() - t0:.3f}s after opening the transport)", file=sys.stderr)
            with trio.fail_after(a.timeout):
                async for _ in job.results():
                    prog.update(job.done)
            outs = await job.wait()
    except trio.TooSlowError:
        print(f"timeout after {a.timeout}s", file=sys.stderr)
        return 2
    except FederationError as exc:
        print(f"job failed: {exc}", file=sys.stderr)
        return 1
    rows = [{"shard": o.shard, "peer": o.peer, "attempt": o.attempt, "result": o.as_json()["result"],
             "energy_j": round(o.energy_j, 3)} for o in outs]
    _write_lines(a.out, rows)
    if len(rows) != req.shards:  # pragma: no cover - wait() guarantees it
        return 1
    print(f"{len(rows)} shards done in {time.monotonic() - t0:.2f}s -> {a.out}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="peer", description="fedswarm: a peer-to-peer compute federation")
    sub = ap.add_subparsers(dest="cmd", required=True)
    _add_start(sub)
    p = sub.add_parser("status", help="what a running daemon sees")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--metrics-port", type=int, help="the daemon's --metrics-port")
    g.add_argument("--url", help="full URL of a daemon's /status")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("admit", help="sign a federation membership certificate for a trusted peer")
    p.add_argument("--federation-key", required=True, help="the federation's key file (created if absent)")
    p.add_argument("--peer", required=True, help="peer id to admit")
    p.add_argument("--days", type=float, default=30.0)
    p.add_argument("--out", required=True)
    p = sub.add_parser("keygen", help="create an Ed25519 key file and print its peer id")
    p.add_argument("--key", required=True)
    p.add_argument("--show", action="store_true", help="print the peer id of an existing key")
    _add_submit(sub)
    try:
        from .llm_cli import add_generate

        add_generate(sub)
    except ImportError:
        pass
    a = ap.parse_args(argv)
    if a.cmd in ("submit", "generate"):
        from .daemon import quiet_libraries

        quiet_libraries()
    handler = {
        "start": _cmd_start,
        "status": _cmd_status,
        "keygen": _cmd_keygen,
        "submit": _cmd_submit,
        "admit": _cmd_admit,
    }.get(a.cmd) or a.func
    return int(handler(a) or 0)


if __name__ == "__main__":
    sys.exit(main())
