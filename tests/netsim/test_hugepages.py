"""netsim.hugepages: the simulator's objects on huge pages change no result.

Two interpreters run the same seeded scenarios, one with the arena allocator
of ``netsim/_hugearena.c`` and one with ``NETSIM_HUGE_PAGES=0``; the results
must be the same bytes. The first also frees and re-allocates some hundred
MB of objects, so that arenas go back to the allocator's free list and come
out of it again. ``scripts/test.sh`` builds the extension first; under
``FEDSWARM_EXPECT_NATIVE=1`` (CI) a missing build fails instead of skipping.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from netsim import hugepages

REPO = Path(__file__).resolve().parents[2]

_CHILD = """
import gc, hashlib, json, sys
sys.path.insert(0, "benchmarks")
import netsim_scale
from netsim import dumps_results, hugepages, load_scenario, run_scenario
out = {}
for name, seed, peers in [("fault-messages.toml", 1, 0), ("leave-20.toml", 1, 0), ("scale-10k.toml", 1, 300)]:
    sc = netsim_scale.scenario(peers) if peers else load_scenario("netsim/scenarios/" + name)
    out[name] = hashlib.sha256(dumps_results(run_scenario(sc, seed)).encode()).hexdigest()
before = hugepages.stats()
junk = [[i, str(i)] for i in range(1_500_000)]  # about 300 MB of small objects, in new arenas
del junk
gc.collect()
junk = [(i, float(i)) for i in range(1_500_000)]  # the freed arenas, handed out again
out["status"] = hugepages.status()
out["before"], out["after"] = before, hugepages.stats()
print(json.dumps(out))
"""


def _run_both() -> tuple[dict, dict]:
    """The child with huge-page arenas and without, at once (one per core)."""
    procs = []
    for flag in ("1", "0"):
        env = {**os.environ, "NETSIM_HUGE_PAGES": flag, "PYTHONPATH": str(REPO)}
        env.pop("PYTHONMALLOC", None)
        procs.append(subprocess.Popen([sys.executable, "-c", _CHILD], cwd=REPO, env=env, stdout=subprocess.PIPE))
    got = []
    for p in procs:
        out, _ = p.communicate(timeout=600)
        assert p.returncode == 0
        got.append(json.loads(out))
    return got[0], got[1]


def test_a_build_is_used_only_while_it_matches_its_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "_hugearena.c"
    src.write_text("/* the source */\n")
    (tmp_path / "_eventq.c").write_text("/* the event heap's source */\n")
    monkeypatch.setattr(hugepages, "HERE", tmp_path)
    monkeypatch.setattr(hugepages, "SOURCE", src)
    monkeypatch.setattr(hugepages, "NATIVE_DIR", tmp_path / "_native")
    assert not hugepages.build_current()  # nothing built
    hugepages.NATIVE_DIR.mkdir()
    hugepages.built_path().write_bytes(b"\x7fELF")
    (hugepages.NATIVE_DIR / "manifest.json").write_text(json.dumps(hugepages.manifest()))
    assert not hugepages.build_current()  # one extension of the two
    hugepages.built_path("_eventq").write_bytes(b"\x7fELF")
    (hugepages.NATIVE_DIR / "manifest.json").unlink()
    assert not hugepages.build_current()  # built, no manifest
    (hugepages.NATIVE_DIR / "manifest.json").write_text(json.dumps(hugepages.manifest()))
    assert hugepages.build_current()
    src.write_text("/* the source, edited after the build */\n")
    assert not hugepages.build_current()
    src.write_text("/* the source */\n")
    assert hugepages.build_current()
    (tmp_path / "_eventq.c").write_text("/* the event heap's source, edited */\n")
    assert not hugepages.build_current()  # one manifest covers both sources
    (tmp_path / "_eventq.c").write_text("/* the event heap's source */\n")
    assert hugepages.build_current()
    hugepages.built_path().unlink()
    assert not hugepages.build_current()  # a manifest without the extension


def test_huge_page_arenas_give_the_same_bytes() -> None:
    if not hugepages.build_current():
        if os.environ.get("FEDSWARM_EXPECT_NATIVE") == "1":
            pytest.fail("netsim/_hugearena is not built for its source: scripts/build_native.py (run by scripts/test.sh)")
        pytest.skip("netsim/_hugearena is not built (scripts/build_native.py)")
    if not sys.platform.startswith("linux"):
        pytest.skip("Linux only")
    on, off = _run_both()
    assert on.pop("status") == "on"
    assert off.pop("status") == "off (NETSIM_HUGE_PAGES=0)"
    before, after = on.pop("before"), on.pop("after")
    assert off.pop("before") == {} and off.pop("after") == {}
    assert on == off
    assert len(set(on.values())) == 3  # each run its own result
    # the allocator handed out arenas from its regions, and took freed ones back and out again
    assert before["enabled"] == 1 and before["regions"] >= 1 and before["arenas"] >= 1
    assert before["arena_size"] in (1 << 18, 1 << 20)
    assert after["arenas"] > before["arenas"]
    assert after["reused"] > before["reused"]
