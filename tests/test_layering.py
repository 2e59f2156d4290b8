"""Dependencies point inward: the core imports no I/O or compute library,
and fedswarm never imports netsim."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_core_imports_no_io_libraries() -> None:
    code = (
        "import sys, pkgutil, importlib, fedswarm.core as c;"
        "[importlib.import_module('fedswarm.core.' + m.name) for m in pkgutil.iter_modules(c.__path__)];"
        "bad = [m for m in ('trio', 'libp2p', 'torch', 'socket', 'netsim', 'numpy') if m in sys.modules];"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"core pulled in {out.stdout.strip()}"


def test_fedswarm_never_imports_netsim() -> None:
    offenders = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "src" / "fedswarm").rglob("*.py")
        if any(line.strip().startswith(("import netsim", "from netsim")) for line in p.read_text().splitlines())
    ]
    assert offenders == []


def test_no_pickle_anywhere() -> None:
    offenders = []
    for p in list((ROOT / "src").rglob("*.py")) + list((ROOT / "netsim").rglob("*.py")):
        text = p.read_text()
        if "import pickle" in text or "pickle.load" in text or "weights_only=False" in text:
            offenders.append(str(p.relative_to(ROOT)))
    assert offenders == []


CLIENT_SIDE = ("fedswarm.client", "fedswarm.llm_client", "fedswarm.api", "fedswarm.llm_cli")
SERVER_SIDE = ("fedswarm.llm_serving", "fedswarm.daemon", "fedswarm.daemon.prometheus", "fedswarm.daemon.runner", "fedswarm.runtime.executor")


def test_client_side_never_imports_the_server_side() -> None:
    """The client library, the LLM client, the API server and the client
    commands speak the shared protocol modules; none of them loads (even
    lazily, in a function) the serving peer's modules."""
    code = (
        "import sys, importlib;"
        f"[importlib.import_module(m) for m in {CLIENT_SIDE!r}];"
        f"print(','.join(m for m in {SERVER_SIDE!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"client side loaded {out.stdout.strip()}"
    offenders = []
    for mod in CLIENT_SIDE:
        path = ROOT / "src" / (mod.replace(".", "/") + ".py")
        for line in path.read_text().splitlines():
            s = line.strip()
            if s.startswith(("from ", "import ")) and any(
                f".{srv.rsplit('.', 1)[1]} import" in s or srv in s for srv in SERVER_SIDE
            ):
                offenders.append(f"{mod}: {s}")
    assert offenders == []
