"""fedswarm's sans-IO core: state machines with no I/O (docs/design.md).

Its hot modules (``NATIVE_MODULES``) may run compiled: ``scripts/
build_native.py`` compiles them with mypyc into ``_native/``, and this
package puts that directory first on its path while the build matches the
sources byte for byte (``native_ok``). An edited source therefore runs as
Python until the next build, never as a stale extension. ``NATIVE`` says
which is in use; ``FEDSWARM_NATIVE=0`` keeps everything Python.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from pathlib import Path

__all__ = ["NATIVE", "NATIVE_MODULES", "NATIVE_SOURCES", "native_manifest", "native_ok"]

#: the modules compiled by scripts/build_native.py (the rest stay Python:
#: the msgspec wire structs, the events, the identity)
NATIVE_MODULES: tuple[str, ...] = (
    "client_core", "config", "energy", "fairness", "forecast", "ledger", "node", "peer", "runs", "slots",
    "verdict", "view",
)


#: the sources of the compiled modules, as ``native_manifest`` names them
NATIVE_SOURCES: tuple[str, ...] = tuple(f"{m}.py" for m in NATIVE_MODULES)


def native_manifest(source_dir: Path, sources: tuple[str, ...] = NATIVE_SOURCES) -> dict[str, object]:
    """What a build of ``sources`` (in ``source_dir``) is valid for: the
    interpreter's extension suffix and each source's SHA-256."""
    return {
        "ext_suffix": sysconfig.get_config_var("EXT_SUFFIX"),
        "sources": {name: hashlib.sha256((source_dir / name).read_bytes()).hexdigest() for name in sources},
    }


def native_ok(native_dir: Path, source_dir: Path, sources: tuple[str, ...] = NATIVE_SOURCES) -> bool:
    """Whether ``native_dir`` holds a build of exactly ``source_dir``'s
    ``sources`` for this interpreter (its ``manifest.json``; the same rule
    serves netsim's huge-page allocator, netsim.hugepages)."""
    try:
        found = json.loads((native_dir / "manifest.json").read_text())
        return bool(found == native_manifest(source_dir, sources))
    except (OSError, ValueError):
        return False


def _use_native() -> bool:
    if os.environ.get("FEDSWARM_NATIVE", "1") == "0":
        return False
    here = Path(__file__).parent
    if not native_ok(here / "_native", here):
        return False
    __path__.insert(0, str(here / "_native"))
    return True


#: whether the compiled modules are in use
NATIVE: bool = _use_native()
