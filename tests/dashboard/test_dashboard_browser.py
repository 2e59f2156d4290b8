"""The dashboard in a real browser: headless Chromium (Debian's chromium and
chromedriver) driven through Selenium, against a swarm of three real
``peer start`` processes on 127.0.0.1, one of them serving blocks 0:2 of the
4-block shipped model ``tiny-llama-gqa``.

Every wait is a ``WebDriverWait`` on the DOM or a printed line, never a
sleep. The peers run a profile with a short state TTL (6 s) so that a
killed peer leaves the view within seconds.

Set ``FEDSWARM_DASHBOARD_SCREENSHOT=docs/img/dashboard.png`` to keep the
screenshot (the README's picture); it always goes to the test's tmp dir.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from fedswarm.testing.localswarm import LocalSwarm, repo_root

pytestmark = pytest.mark.slow

#: quiet gossip stretches an idle peer's state to 6 s * QUIET_MAX (the
#: default of 8 would keep the killed peer on the page for up to 48 s)
QUIET_MAX = 2
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
CHROME_FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--window-size=1400,900")


def _profile(tmp: Path) -> Path:
    text = (repo_root() / "peers" / "cpu-laptop.toml").read_text()
    assert "[gossip]" in text
    # short-lived states: a peer killed with SIGKILL drops out of every view
    # within 6 s if it held work, 6 s * quiet_max (12 s) if it was idle
    text = text.replace("[gossip]", f"[gossip]\nstate_ttl_s = 6.0\nstate_refresh_s = 1.5\nquiet_max = {QUIET_MAX}", 1)
    p = tmp / "cpu-laptop-short-ttl.toml"
    p.write_text(text.replace('name = "cpu-laptop"', 'name = "cpu-laptop-short-ttl"', 1))
    return p


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
        pytest.fail("Debian's chromium and chromium-driver packages are needed (apt-get install chromium chromium-driver)")
    tmp = tmp_path_factory.mktemp("dash")
    s = LocalSwarm(3, tmp / "swarm", profile=str(_profile(tmp)),
                   per_peer_args=[["--serve-model", "tiny-llama-gqa", "--blocks", "0:2"]])
    with s:
        yield s


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for f in CHROME_FLAGS:
        opts.add_argument(f)
    opts.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    try:
        yield driver
    finally:
        driver.quit()


#: what the page shows, read in one script run: the page redraws itself every
#: second, so element handles held across calls would go stale
SNAPSHOT_JS = """
const q = (sel, root) => Array.from((root || document).querySelectorAll(sel));
return {
  title: document.title,
  conn: document.getElementById("conn").textContent,
  count: document.getElementById("peers-count").textContent,
  rows: q("#peers tbody tr[data-peer]").map(r => r.dataset.peer),
  self: q("#peers tbody tr.self").map(r => [r.dataset.peer, r.textContent]),
  models: q("#models .model").map(m => ({
    text: m.textContent,
    cells: q(".strip .cell", m).map(c => [Number(c.dataset.block), c.className]),
    gaps: m.querySelector(".gaps").dataset.gaps,
    gapText: m.querySelector(".gaps").textContent,
    holders: Array.from(new Set(q(".strip .hold", m).map(h => h.dataset.holder))),
  })),
  tenants: q("#tenants tbody tr[data-tenant]").map(r => r.dataset.tenant),
  sparklines: q("#tenants svg.spark polyline").length,
  marker: window.__no_reload || null,
};
"""


def snap(driver) -> dict:
    return driver.execute_script(SNAPSHOT_JS)


def until(wait, pred) -> dict:
    """Wait until the page's snapshot satisfies ``pred``; return that snapshot."""

    def check(driver):
        s = snap(driver)
        return s if pred(s) else None

    return wait.until(check)


def test_dashboard_shows_peers_coverage_and_a_killed_peer_leaving(swarm, browser, tmp_path) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    server, _, victim = swarm.peers
    ids = {p.peer_id for p in swarm.peers}
    browser.get(server.metrics_url + "/")
    wait = WebDriverWait(browser, 60, poll_frequency=0.2)

    # the three peers, the own row marked, the event stream live
    st = until(wait, lambda s: set(s["rows"]) == ids and s["conn"] == "live")
    assert st["title"] == "fedswarm dashboard"
    assert st["count"] == "3"
    assert len(st["self"]) == 1 and st["self"][0][0] == server.peer_id and "this peer" in st["self"][0][1]

    # block coverage of the served model: 0:2 held by the serving peer, 2:4 missing
    st = until(wait, lambda s: s["models"])
    (model,) = st["models"]
    assert "tiny-llama-gqa" in model["text"] and "4 blocks" in model["text"]
    cells = dict(model["cells"])
    assert sorted(cells) == [0, 1, 2, 3]
    assert [("gap" in cells[i].split()) for i in range(4)] == [False, False, True, True]
    assert model["gaps"] == "2:4" and "missing blocks 2:4" in model["gapText"]
    assert model["holders"] == [server.peer_id]

    # a job through the swarm: its tenant shows up in the tenants table, live
    out = tmp_path / "out.jsonl"
    sub = subprocess.run([sys.executable, "-m", "fedswarm.cli", "submit", "--bootstrap", swarm.bootstrap, "--kind",
                          "tensor-map", "--shards", "6", "--size", "64", "--seed", "3", "--out", str(out),
                          "--min-peers", "3", "--timeout", "120", "--progress", "off"],
                         capture_output=True, text=True, timeout=180)
    assert sub.returncode == 0, sub.stderr
    # the tenant's row, with its share drawn over time once two samples are in
    until(wait, lambda s: s["tenants"] and s["sparklines"] >= 1)

    shot = tmp_path / "dashboard.png"
    assert browser.save_screenshot(str(shot))
    keep = os.environ.get("FEDSWARM_DASHBOARD_SCREENSHOT")
    if keep:
        Path(keep).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, keep)

    # kill -9 a peer: the page drops it when its state expires, without a
    # reload. It is idle by now, so its state lives state_ttl_s * quiet_max
    # (quiet gossip): 12 s, and 39 s to spare
    assert browser.execute_script("window.__no_reload = 1; return window.__no_reload;") == 1
    victim.kill()
    bound = 6.0 * QUIET_MAX
    st = until(WebDriverWait(browser, bound + 39, poll_frequency=0.2), lambda s: victim.peer_id not in s["rows"])
    assert set(st["rows"]) == ids - {victim.peer_id}
    assert st["count"] == "2"
    assert st["marker"] == 1  # the same page, updated in place
    with urllib.request.urlopen(server.metrics_url + "/status", timeout=5) as r:
        status = json.load(r)
    assert victim.peer_id not in {p["peer"] for p in status["peers"]}


def test_a_peer_filling_the_gap_and_a_generation_show_up(swarm, browser) -> None:
    """A fourth peer serves blocks 2:4: the strip turns whole without a
    reload; a real ``peer generate`` through the chain feeds the serving
    peer's LLM metrics (tokens, sessions, per-hop and per-token latency)."""
    from selenium.webdriver.support.ui import WebDriverWait

    server = swarm.peers[0]
    browser.get(server.metrics_url + "/")
    wait = WebDriverWait(browser, 90, poll_frequency=0.2)
    until(wait, lambda s: s["models"] and s["models"][0]["gaps"] == "2:4")
    browser.execute_script("window.__no_reload = 2;")
    filler = swarm.start_peer(3, bootstrap=[server.addr], extra=["--serve-model", "tiny-llama-gqa", "--blocks", "2:4"])
    swarm.peers.append(filler)  # stopped with the others
    st = until(wait, lambda s: s["models"] and s["models"][0]["gaps"] == "")
    (model,) = st["models"]
    assert "every block is served" in model["gapText"]
    assert sorted(model["holders"]) == sorted([server.peer_id, filler.peer_id])
    assert not any("gap" in cls.split() for _, cls in model["cells"])
    assert st["marker"] == 2

    gen = subprocess.run([sys.executable, "-m", "fedswarm.cli", "generate", "--bootstrap", server.addr, "--model",
                          "tiny-llama-gqa", "--prompt", "hello", "--max-new-tokens", "6", "--greedy",
                          "--torch-threads", "1", "-q", "--timeout", "120"],
                         capture_output=True, text=True, timeout=180)
    assert gen.returncode == 0, gen.stderr
    with urllib.request.urlopen(server.metrics_url + "/metrics", timeout=5) as r:
        metrics = r.read().decode()
    values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
              if line and not line.startswith("#")}
    assert values["fedswarm_llm_tokens_total"] >= 6
    assert values["fedswarm_llm_hop_latency_seconds_count"] >= 6
    assert values["fedswarm_llm_token_latency_seconds_count"] == values["fedswarm_llm_hop_latency_seconds_count"]
    assert values["fedswarm_llm_batch_size_count"] >= 1
    assert "fedswarm_llm_sessions" in values
    # the generation's steps reached this peer on a direct lane
    assert values['fedswarm_lane_requests_total{direction="in"}'] >= 6
    assert values['fedswarm_lane_refusals_total{reason="bad-frame"}'] == 0
    with urllib.request.urlopen(server.metrics_url + "/status", timeout=5) as r:
        status = json.load(r)
    (span,) = status["spans"]
    assert (span["start"], span["end"]) == (0, 2) and span["sessions"] == len(status["sessions"])
    assert status["llm"]["tokens"] >= 6 and status["llm"]["sessions_opened"] >= 1
