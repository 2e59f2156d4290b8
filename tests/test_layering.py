"""Dependencies point inward: the core imports no I/O or compute library,
and fedswarm never imports netsim."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_core_imports_no_io_libraries() -> None:
    code = (
        "import sys, fedswarm.core.peer, fedswarm.core.client, fedswarm.core.wire;"
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
