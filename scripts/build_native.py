"""Compile the hot modules of fedswarm's sans-IO core to C with mypyc.

    .venv/bin/python scripts/build_native.py [--force] [--check] [--quiet]

The core (``fedswarm.core``: peer, client, placement forecasts, view, ledger,
fairness, ...) is plain, fully annotated Python that mypy checks strictly.
mypyc turns those modules into one C extension; the same source, compiled,
runs netsim's 1,000-peer scale run in about 0.75x the CPU time and answers
the same bytes (tests/core/test_native.py checks that). Nothing else
changes: the wire codec (msgspec), the events and the identity stay Python.

Where it goes: ``src/fedswarm/core/_native/``, with ``manifest.json`` naming
the SHA-256 of every compiled source and the interpreter's extension suffix.
``fedswarm.core`` uses the compiled modules only while every hash still
matches (``fedswarm.core.native_ok``), so an edited source is never
shadowed by a stale build: it runs as Python until this script runs again.
``FEDSWARM_NATIVE=0`` turns the compiled modules off. ``fedswarm.core.NATIVE``
says which is in use.

It also compiles ``netsim/_hugearena.c`` (netsim.hugepages: the simulator's
objects on transparent huge pages) with the C compiler directly, in about a
second, into ``netsim/_native/`` with a manifest of its own, used by the
same rule.

Takes about 35 s here (mypy's analysis of the core, then gcc -O3); does
nothing when the build matches the sources (``--force`` rebuilds).
``--check`` only reports whether the build is current (exit 1 if not).
Needs a C compiler and mypy (the ``dev`` extra).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CORE = REPO / "src" / "fedswarm" / "core"
OUT = CORE / "_native"
sys.path.insert(0, str(REPO / "src"))

from fedswarm.core import NATIVE_MODULES, native_manifest, native_ok  # noqa: E402

# netsim/hugepages.py alone, by its path: the netsim package would import the core
_spec = importlib.util.spec_from_file_location("_netsim_hugepages", REPO / "netsim" / "hugepages.py")
assert _spec is not None and _spec.loader is not None
hugepages = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hugepages)

# Run by a child interpreter in the build directory: mypyc's setuptools build.
_SETUP = """
import sys
from setuptools import setup
from mypyc.build import mypycify
paths = sys.argv[1:]
sys.argv = [sys.argv[0], "build_ext", "--build-lib", "lib", "--build-temp", "tmp", "--parallel", "2"]
setup(name="fedswarm_core_native", ext_modules=mypycify(paths, group_name="fedswarm.core._native",
                                                     opt_level="3"))
"""


def _missing_tools() -> str:
    """What the build needs and this machine lacks ("" when nothing)."""
    if importlib.util.find_spec("mypyc") is None:
        return "mypyc is not installed (it comes with mypy, the dev extra: pip install -e '.[dev]')"
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None:
        return f"no C compiler ({cc}) on PATH (Debian: apt-get install gcc)"
    return ""


def build() -> None:
    with tempfile.TemporaryDirectory(prefix="fedswarm-native-") as tmp:
        work = Path(tmp)
        src = work / "src"
        shutil.copytree(REPO / "src" / "fedswarm", src / "fedswarm",
                        ignore=shutil.ignore_patterns("_native", "__pycache__", "*.so"))
        # the package's __init__ names the whole API for type checkers
        # (client, daemon, LLM): the core needs none of it to compile
        (src / "fedswarm" / "__init__.py").write_text("from .errors import *  # noqa: F403\n")
        shutil.copytree(REPO / "scripts" / "stubs", work / "stubs")  # msgpack's types
        # mypy follows the core's imports only (pyproject's settings would
        # check the whole package, torch and trio included: minutes longer)
        (work / "mypy.ini").write_text("[mypy]\npython_version = 3.11\nmypy_path = src:stubs\n"
                                       "explicit_package_bases = True\n")
        (work / "setup_native.py").write_text(_SETUP)
        paths = [f"src/fedswarm/core/{m}.py" for m in NATIVE_MODULES]
        env = {**os.environ, "MYPYPATH": "src:stubs"}
        done = subprocess.run([sys.executable, "setup_native.py", *paths], cwd=work, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if done.returncode:
            raise SystemExit(f"build_native: mypyc failed:\n{done.stdout[-4000:]}")
        built = sorted((work / "lib" / "fedswarm" / "core").glob("*" + sysconfig.get_config_var("EXT_SUFFIX")))
        if len(built) != len(NATIVE_MODULES) + 1:  # each module's shim and the shared library
            raise SystemExit(f"build_native: expected {len(NATIVE_MODULES) + 1} extensions, got "
                             f"{[p.name for p in built]}")
        if OUT.exists():
            shutil.rmtree(OUT)
        OUT.mkdir()
        for p in built:
            shutil.copy2(p, OUT / p.name)
        # the hashes of the sources as they were copied for the build
        manifest = native_manifest(src / "fedswarm" / "core")
        (OUT / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


def build_arena() -> None:
    """Compile netsim's C sources (netsim/_hugearena.c, netsim/_eventq.c)
    against this interpreter's headers, into netsim/_native/ with their
    manifest (the same rule as the core's build)."""
    cc = (sysconfig.get_config_var("CC") or "cc").split()
    include = sysconfig.get_paths()["include"]
    manifest = hugepages.manifest()  # the sources' hashes before the build
    with tempfile.TemporaryDirectory(prefix="fedswarm-arena-") as tmp:
        built = []
        for source in hugepages.sources():
            so = Path(tmp) / hugepages.built_path(source.stem).name
            done = subprocess.run([*cc, "-O2", "-Wall", "-shared", "-fPIC", f"-I{include}", str(source),
                                   "-o", str(so)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if done.returncode:
                raise SystemExit(f"build_native: compiling {source.name} failed:\n{done.stdout[-4000:]}")
            built.append(so)
        if hugepages.NATIVE_DIR.exists():
            shutil.rmtree(hugepages.NATIVE_DIR)
        hugepages.NATIVE_DIR.mkdir()
        for so in built:
            shutil.copy2(so, hugepages.NATIVE_DIR / so.name)
    (hugepages.NATIVE_DIR / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--force", action="store_true", help="rebuild even when the build is current")
    ap.add_argument("--check", action="store_true", help="only say whether the build is current")
    ap.add_argument("--quiet", action="store_true", help="say nothing when the build is current")
    args = ap.parse_args()
    current = native_ok(OUT, CORE) and hugepages.build_current()
    if args.check:
        print("build_native: current" if current else "build_native: missing or stale")
        return 0 if current else 1
    if current and not args.force:
        if not args.quiet:
            print("build_native: current, nothing to do")
        return 0
    missing = _missing_tools()
    if missing:
        now = "the current build stays in use" if native_ok(OUT, CORE) else "it runs as Python"
        print(f"build_native: cannot compile the core: {missing}; {now}", file=sys.stderr)
        return 1
    if args.force or not native_ok(OUT, CORE):
        print(f"build_native: compiling {len(NATIVE_MODULES)} modules of fedswarm.core with mypyc "
              "(about 35 s)", flush=True)
        build()
        if not native_ok(OUT, CORE):
            raise SystemExit("build_native: the new build does not match the sources (edited during the build?)")
        print(f"build_native: done, {OUT.relative_to(REPO)}")
    if args.force or not hugepages.build_current():
        build_arena()
        if not hugepages.build_current():
            raise SystemExit("build_native: the new arena build does not match its source (edited during the build?)")
        print(f"build_native: done, {hugepages.NATIVE_DIR.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
