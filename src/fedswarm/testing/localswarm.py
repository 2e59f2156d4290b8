"""Start a swarm of real ``peer start`` processes on 127.0.0.1.

Used by the demo, the multi-process tests and the benchmarks. Readiness is
read from each daemon's stdout (the line with its multiaddr), never guessed
with sleeps; every wait is bounded.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["PeerProcess", "LocalSwarm", "repo_root"]


def repo_root() -> Path:
    return Path(__file__).resolve().parents[3]


@dataclass
class PeerProcess:
    proc: subprocess.Popen[str]
    data_dir: Path
    addr: str = ""
    metrics_url: str = ""
    lines: list[str] = field(default_factory=list)

    @property
    def peer_id(self) -> str:
        return self.addr.rsplit("/p2p/", 1)[-1]

    def __post_init__(self) -> None:
        # a reader thread per daemon: select() on a buffered text pipe can miss
        # lines already pulled into Python's buffer
        self._lines: "queue.Queue[str | None]" = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Block until the daemon printed its multiaddr (bounded)."""
        deadline = time.monotonic() + timeout
        while not self.addr:
            left = deadline - time.monotonic()
            try:
                line = self._lines.get(timeout=max(left, 0.001))
            except queue.Empty:
                line = None
            if line is None:
                raise RuntimeError(f"peer in {self.data_dir} not ready (exit={self.proc.poll()}): {self.lines[-5:]}")
            self.lines.append(line)
            if line.startswith("fedswarm metrics on "):
                self.metrics_url = line.split()[-1].rsplit("/", 1)[0]
            if line.startswith("fedswarm peer listening on "):
                self.addr = line.split()[-1]

    def status(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.metrics_url + "/status", timeout=5) as r:
            return json.load(r)

    def terminate(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


class LocalSwarm:
    """``with LocalSwarm(3, workdir) as swarm:`` runs 3 daemons; the first is
    the bootstrap peer of the others."""

    def __init__(
        self,
        n: int,
        workdir: str | os.PathLike[str],
        *,
        profile: str | None = None,
        torch_threads: int = 1,
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
        log_file: bool = True,
        per_peer_args: list[list[str]] | None = None,
    ) -> None:
        self.n = n
        self.workdir = Path(workdir)
        self.profile = profile or str(repo_root() / "peers" / "cpu-laptop.toml")
        self.torch_threads = torch_threads
        self.extra_args = extra_args or []
        self.env = {**os.environ, **(env or {})}
        self.log_file = log_file
        self.per_peer_args = per_peer_args or []
        self.peers: list[PeerProcess] = []

    def spawn_peer(self, i: int, *, bootstrap: list[str] | None = None, extra: list[str] | None = None) -> PeerProcess:
        d = self.workdir / f"peer{i}"
        d.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable, "-m", "fedswarm.cli", "start",
            "--profile", self.profile,
            "--data-dir", str(d),
            "--metrics-port", "0",
            "--torch-threads", str(self.torch_threads),
            "--grace", "5",
        ]
        for b in bootstrap or []:
            cmd += ["--bootstrap", b]
        own = self.per_peer_args[i] if i < len(self.per_peer_args) else []
        cmd += self.extra_args + own + (extra or [])
        err = open(d / "peer.log", "a") if self.log_file else subprocess.DEVNULL
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=self.env)
        return PeerProcess(proc, d)

    def start_peer(self, i: int, *, bootstrap: list[str] | None = None, extra: list[str] | None = None) -> PeerProcess:
        """Spawn a daemon and wait until it prints its multiaddr."""
        p = self.spawn_peer(i, bootstrap=bootstrap, extra=extra)
        p.wait_ready()
        return p

    def __enter__(self) -> "LocalSwarm":
        try:
            first = self.start_peer(0)
            self.peers.append(first)
            # the others start side by side: readiness is awaited after all spawned
            rest = [self.spawn_peer(i, bootstrap=[first.addr]) for i in range(1, self.n)]
            self.peers.extend(rest)
            for p in rest:
                p.wait_ready()
        except BaseException:
            self.close()
            raise
        return self

    @property
    def bootstrap(self) -> str:
        return self.peers[0].addr

    def close(self) -> list[int]:
        """SIGTERM every daemon at once, then collect their exit codes."""
        for p in self.peers:
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGTERM)
        return [p.terminate() for p in self.peers]

    def __exit__(self, *exc: Any) -> None:
        self.close()
