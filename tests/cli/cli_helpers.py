"""Running ``peer`` / ``netsim`` as real commands and checking their error line."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_SCRIPT = Path(sys.executable).with_name("peer")
PEER = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "fedswarm.cli"]
NETSIM = [sys.executable, "-m", "netsim.cli"]

#: the one line every expected failure prints: ``peer CMD: error: WHAT (HINT)``
ERROR_LINE = re.compile(r"^(peer|netsim)( [a-z-]+)?: error: \S.*$")


def run(cmd: list[str], *, env: dict[str, str] | None = None, timeout: float = 120,
        cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=timeout, cwd=cwd or REPO)


def error_line(p: subprocess.CompletedProcess[str], code: int, pattern: str, *, only_line: bool = True) -> str:
    """Assert exit ``code``, no traceback, and an error line matching ``pattern``."""
    assert "Traceback" not in p.stderr, p.stderr
    assert "ExceptionGroup" not in p.stderr, p.stderr
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert lines, f"nothing on stderr (rc={p.returncode}, stdout={p.stdout!r})"
    last = lines[-1]
    assert p.returncode == code, f"rc={p.returncode}, want {code}: {p.stderr}"
    assert ERROR_LINE.match(last), last
    assert re.search(pattern, last), f"{pattern!r} not in {last!r}"
    if only_line:
        assert len(lines) == 1, p.stderr
    return last


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port
