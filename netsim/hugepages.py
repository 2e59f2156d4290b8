"""Python's small objects on transparent huge pages, for large simulations.

A 10,000-peer run keeps about 4 GB of small objects and touches them in no
useful order (one peer's state, then another's), so on 4 KiB pages much of
its time went to TLB misses. ``netsim/_hugearena.c``, compiled by
``scripts/build_native.py``, hands CPython's allocator its 1 MiB arenas from
2 MiB-aligned regions marked ``MADV_HUGEPAGE``; the kernel then backs them
with huge pages wherever transparent huge pages are "always" or "madvise"
(Debian's default). On this project's 2-core VM that took 10 to 14% off the
CPU of scale-10k's busy phase (docs/benchmarks.md).

Where the arenas lie changes no result. ``enable()`` is called by every
simulator; it does nothing when the extension is missing or was built from
another source or interpreter (the manifest ``build_native`` writes beside it,
checked as for the compiled core: ``fedswarm.core.native_ok``), when
``NETSIM_HUGE_PAGES=0``, or when CPython's own allocator is not in use
(``PYTHONMALLOC``).
"""

from __future__ import annotations

import importlib
import os
import sys
import sysconfig
from pathlib import Path

from fedswarm.core import native_manifest, native_ok

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "_hugearena.c"
#: where scripts/build_native.py puts the extension and its manifest.json
#: (the source's SHA-256 and the interpreter's suffix: fedswarm.core.native_ok)
NATIVE_DIR = HERE / "_native"
#: netsim's C sources, each an extension of the same name in ``NATIVE_DIR``,
#: under one manifest (the event heap, ``netsim.eventq``, is the other)
_SOURCES = (SOURCE.name, "_eventq.c")

_state: dict[str, object] = {}


def built_path(name: str = "_hugearena") -> Path:
    return NATIVE_DIR / (name + (sysconfig.get_config_var("EXT_SUFFIX") or ".so"))


def sources() -> tuple[Path, ...]:
    """netsim's C sources, each built into ``built_path(its stem)``."""
    return tuple(HERE / name for name in _SOURCES)


def manifest() -> dict[str, object]:
    """What a build of the present source is valid for (``native_manifest``)."""
    return native_manifest(HERE, _SOURCES)


def build_current() -> bool:
    """Whether ``_native/`` holds a build of the present sources for this interpreter."""
    return all(built_path(s.stem).is_file() for s in sources()) and native_ok(NATIVE_DIR, HERE, _SOURCES)


def _why_not() -> str:
    if os.environ.get("NETSIM_HUGE_PAGES", "1") == "0":
        return "off (NETSIM_HUGE_PAGES=0)"
    if os.environ.get("PYTHONMALLOC", "") not in ("", "pymalloc"):
        return f"off (PYTHONMALLOC={os.environ['PYTHONMALLOC']})"
    if not sys.platform.startswith("linux"):
        return "off (Linux only)"
    if not build_current():
        return "off (not built: scripts/build_native.py)"
    return ""


def enable() -> bool:
    """Put the interpreter's arenas on huge-page regions from now on (once
    per process, never undone). Returns whether they are."""
    if "on" not in _state:
        why = _why_not()
        if not why:
            try:
                importlib.import_module("netsim._native._hugearena").enable()
            except ImportError as exc:  # a damaged build: run without it, and say why
                why = f"off (cannot load {built_path().name}: {exc})"
        _state["on"] = not why
        _state["why"] = why or "on"
    return bool(_state["on"])


def status() -> str:
    """``on``, or why not (for ``netsim run``'s last line)."""
    return str(_state.get("why", "off (not asked)"))


def stats() -> dict[str, int]:
    """The extension's counters (regions mapped, arenas handed out and
    reused); empty while it is off."""
    if not _state.get("on"):
        return {}
    return dict(importlib.import_module("netsim._native._hugearena").stats())
