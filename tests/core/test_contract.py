"""Both cores satisfy the one driving contract (core.contract.Core), and the
inputs that replaced the direct calls do what the calls did."""

from __future__ import annotations

import random

import pytest

from fedswarm.core.client_core import ClientCore, JobRequest
from fedswarm.core.config import ClientConfig, PeerConfig
from fedswarm.core.contract import Core
from fedswarm.core.events import (
    TOPIC_ACCUSATIONS,
    TOPIC_PEERS,
    CancelJob,
    HandBackRunning,
    JobAccepted,
    JobFinished,
    Leave,
    SetPower,
    SetSpans,
    SetThroughput,
    Submit,
)
from fedswarm.core.peer import PeerCore
from fedswarm.errors import LocalProtocolError
from fedswarm.testing import MiniSwarm, ident


def _peer() -> PeerCore:
    return PeerCore(ident(1), PeerConfig(bootstrap=(ident(3).peer_id,)), random.Random(1))


def _client() -> ClientCore:
    return ClientCore(ident(2), ClientConfig(bootstrap=(ident(1).peer_id,)), random.Random(2))


def test_both_cores_satisfy_the_core_protocol() -> None:
    # typed: `scripts/typecheck.sh tests/core/test_contract.py` checks these against the Protocol
    peer: Core = _peer()
    client: Core = _client()
    for core in (peer, client):
        assert isinstance(core, Core)
        assert core.idle
        assert core.start(1000.0)  # a join (peer) / a first pull (client) to the bootstrap peer
        assert core.next_deadline() > 1000.0
    assert peer.topics == (TOPIC_PEERS, TOPIC_ACCUSATIONS)
    assert client.topics == (TOPIC_ACCUSATIONS,)
    assert not isinstance(object(), Core)


def test_settings_are_inputs_without_effects() -> None:
    peer = _peer()
    assert peer.handle(0.0, SetThroughput("sim", 2.5)) == []
    assert peer.handle(0.0, SetPower(123.0)) == []
    assert peer.handle(0.0, SetSpans(("span",))) == []
    assert peer.throughput["sim"] == 2.5 and peer.now_w == 123.0 and peer.spans == ("span",)
    assert peer.handle(0.0, HandBackRunning()) == []  # nothing running
    with pytest.raises(LocalProtocolError):
        peer.handle(0.0, Submit(JobRequest("sim", 1)))
    with pytest.raises(LocalProtocolError):
        _client().handle(0.0, Leave())


def test_submit_and_cancel_inputs_open_and_end_a_job() -> None:
    s = MiniSwarm(3, seed=4)
    c = s.add_client()
    s.step_until(s.now + 5)
    effects = c.handle(s.now, Submit(JobRequest("sim", 2, work_s=100.0)))
    assert isinstance(effects[0], JobAccepted)
    job_id = effects[0].job_id
    assert not c.idle
    s.perform(c.id, effects)
    s.step_until(s.now + 5)
    effects = c.handle(s.now, CancelJob(job_id))
    assert JobFinished(job_id, False, "cancelled") in effects and c.idle
    s.perform(c.id, effects)
    assert s.finished[job_id].error == "cancelled"
    assert c.handle(s.now, CancelJob(job_id)) == []  # already over


def test_sends_carry_the_addresses_of_the_peer_from_the_view() -> None:
    s = MiniSwarm(3, seed=5, peer_config=lambda i: PeerConfig(addrs=(f"/ip4/10.0.0.{i}/tcp/4001",)))
    c = s.add_client()
    s.step_until(s.now + 5)
    sends = [e for e in c.handle(s.now, Submit(JobRequest("sim", 1, work_s=1.0)))[1:] if hasattr(e, "addrs")]
    assert sends and all(e.addrs and e.addrs[0].startswith("/ip4/10.0.0.") for e in sends)
