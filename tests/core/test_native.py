"""The compiled core (scripts/build_native.py) gives exactly what the Python one gives.

netsim runs the same seeded scenarios twice, in two interpreters: one with the
mypyc build of ``fedswarm.core`` and one with ``FEDSWARM_NATIVE=0``. The
results must be the same bytes: churn, crashes, hangs, partitions, message
loss and duplication, batched renewals and sampled ranking all go through the
compiled modules. ``scripts/test.sh`` builds the core first and sets
``FEDSWARM_EXPECT_NATIVE=1``, so there a missing build fails instead of
skipping.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import fedswarm.core as core

REPO = Path(__file__).resolve().parents[2]

# (scenario file, seed, peers (0: as written)): every fault kind, churn,
# partitions, duplicated and reordered messages, LLM sessions, slot offers
# moving queued shards, and a sampled-ranking run with churn
RUNS = [
    ("smoke-20.toml", 3, 0),
    ("fault-crash.toml", 1, 0),
    ("fault-hang.toml", 1, 0),
    ("fault-partition.toml", 1, 0),
    ("fault-messages.toml", 1, 0),
    ("fault-slow.toml", 1, 0),
    ("fault-client.toml", 1, 0),
    ("partition-20.toml", 1, 0),
    ("llm-small.toml", 1, 0),
    ("dup-reorder-20.toml", 2, 0),
    ("leave-20.toml", 1, 0),
    ("offers-30.toml", 2, 0),
    ("scale-10k.toml", 1, 300),
]

_CHILD = """
import hashlib, json, sys
sys.path.insert(0, "benchmarks")
import fedswarm.core
import netsim_scale
from netsim import dumps_results, load_scenario, run_scenario
out = {"native": fedswarm.core.NATIVE}
for name, seed, peers in json.loads(sys.argv[1]):
    # scale-10k as benchmarks/netsim_scale.py scales it (10 shards per peer)
    sc = netsim_scale.scenario(peers) if peers else load_scenario("netsim/scenarios/" + name)
    out[name] = hashlib.sha256(dumps_results(run_scenario(sc, seed)).encode()).hexdigest()
print(json.dumps(out))
"""


def test_a_build_is_used_only_while_it_matches_every_source(tmp_path: Path) -> None:
    src, built = tmp_path / "src", tmp_path / "native"
    src.mkdir()
    built.mkdir()
    for m in core.NATIVE_MODULES:
        (src / f"{m}.py").write_text(f"# {m}\n")
    assert not core.native_ok(built, src)  # nothing built
    (built / "manifest.json").write_text(json.dumps(core.native_manifest(src)))
    assert core.native_ok(built, src)
    (src / "peer.py").write_text("# peer, edited after the build\n")
    assert not core.native_ok(built, src)
    (src / "peer.py").write_text("# peer\n")
    assert core.native_ok(built, src)
    other = {**core.native_manifest(src), "ext_suffix": ".cpython-399-x86_64-linux-gnu.so"}
    (built / "manifest.json").write_text(json.dumps(other))  # built for another interpreter
    assert not core.native_ok(built, src)
    (built / "manifest.json").write_text("{not json")
    assert not core.native_ok(built, src)


def test_the_compiled_core_gives_the_same_bytes_as_the_python_one() -> None:
    if not core.NATIVE:
        if os.environ.get("FEDSWARM_NATIVE") == "0":
            pytest.skip("the compiled core is turned off (FEDSWARM_NATIVE=0)")
        if os.environ.get("FEDSWARM_EXPECT_NATIVE") == "1":
            pytest.fail("no current build of the core: scripts/build_native.py (run by scripts/test.sh)")
        pytest.skip("no current build of the core (scripts/build_native.py)")
    import fedswarm.core.peer

    compiled = fedswarm.core.peer.__file__ or ""
    assert "_native" in compiled and not compiled.endswith(".py"), compiled
    procs = {
        flag: subprocess.Popen([sys.executable, "-c", _CHILD, json.dumps(RUNS)], cwd=REPO, stdout=subprocess.PIPE,
                               env={**os.environ, "FEDSWARM_NATIVE": flag, "PYTHONPATH": str(REPO)})
        for flag in ("1", "0")
    }
    got = {}
    for flag, p in procs.items():
        out, _ = p.communicate(timeout=600)
        assert p.returncode == 0
        got[flag] = json.loads(out)
    assert got["1"].pop("native") is True
    assert got["0"].pop("native") is False
    assert got["1"] == got["0"]
    assert len(set(got["1"].values())) == len(RUNS)  # each run its own result
    assert hashlib.sha256(b"").hexdigest() not in got["1"].values()
