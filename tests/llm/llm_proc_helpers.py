"""Helpers of the LLM tests that run real processes (``peer api``, ``peer
generate``, ``peer chat``)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

REAL_MODEL = "smollm2-135m-instruct"


def real_model_or_skip() -> Path:
    from fedswarm.errors import InputError
    from fedswarm.tasks.checkpoint import resolve_model

    try:
        return resolve_model(REAL_MODEL)
    except (InputError, ValueError) as exc:
        pytest.skip(f"{REAL_MODEL} is not in the model store ({exc}); scripts/setup.sh pulls it")


class ApiProcess:
    """``peer api`` as a process; ``url`` once it printed its serving line."""

    def __init__(self, bootstrap: str, models: list[str]) -> None:
        cmd = [sys.executable, "-m", "fedswarm.cli", "api", "--bootstrap", bootstrap, "--listen", "127.0.0.1:0",
               "--torch-threads", "1"]
        for m in models:
            cmd += ["--model", m]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.err: list[str] = []
        threading.Thread(target=lambda: self.err.extend(self.proc.stderr), daemon=True).start()
        self.url = ""
        for line in self.proc.stdout:  # readiness: the printed line, no sleeping
            if "serving" in line and "http://" in line:
                self.url = line.split("http://", 1)[1].split()[0].rstrip("/")
                self.url = "http://" + self.url
                break
        if not self.url:
            self.proc.wait(10)
            raise RuntimeError(f"peer api did not start (exit {self.proc.returncode}): {''.join(self.err)[-2000:]}")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def peer_cli(*args: str, input: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fedswarm.cli", *args], input=input, capture_output=True,
                          text=True, timeout=timeout)
