"""fedswarm.testing.MiniSwarm's public driving calls: submit and cancel."""

from __future__ import annotations

from fedswarm.core.client_core import JobRequest
from fedswarm.testing import MiniSwarm


def test_submit_runs_a_job_to_its_end() -> None:
    s = MiniSwarm(6, seed=2)
    c = s.add_client()
    s.step_until(s.now + 10)
    jid = s.submit(c, JobRequest("sim", 5, work_s=2.0))
    assert jid not in s.finished
    s.step_until(s.now + 600, stop=lambda: jid in s.finished)
    assert s.finished[jid].ok
    assert sorted(d.shard for d in s.delivered if d.job_id == jid) == list(range(5))


def test_cancel_stops_the_job_everywhere() -> None:
    s = MiniSwarm(4, seed=5)
    c = s.add_client()
    s.step_until(s.now + 10)
    jid = s.submit(c, JobRequest("sim", 6, work_s=50.0))
    s.step_until(s.now + 5)
    assert any(p.leases for p in s.peers.values())
    s.cancel(c, jid)
    s.step_until(s.now + 5)
    assert not any(p.leases for p in s.peers.values())
    assert s.finished[jid].error == "cancelled"
