"""Fixtures shared by the LLM tests that run real processes: two ``peer
start`` processes serving SmolLM2 and a ``peer api`` process in front of them
(session scope: started once for test_api_processes.py and test_chat.py)."""

from __future__ import annotations

import pytest

from llm_proc_helpers import REAL_MODEL, ApiProcess, real_model_or_skip


@pytest.fixture(scope="session")
def smol_swarm(tmp_path_factory):
    """Two ``peer start`` processes serving SmolLM2's blocks 0:15 and 15:30."""
    from fedswarm.testing.localswarm import LocalSwarm

    real_model_or_skip()
    sw = LocalSwarm(2, tmp_path_factory.mktemp("smol-swarm"), torch_threads=1)
    try:
        first = sw.start_peer(0, extra=["--serve-model", REAL_MODEL, "--blocks", "0:15"])
        sw.peers.append(first)
        second = sw.spawn_peer(1, bootstrap=[first.addr], extra=["--serve-model", REAL_MODEL, "--blocks", "15:30"])
        sw.peers.append(second)
        second.wait_ready(timeout=120)
        yield sw
    finally:
        sw.close()


@pytest.fixture(scope="session")
def smol_api(smol_swarm):
    api = ApiProcess(smol_swarm.bootstrap, [REAL_MODEL])
    try:
        yield api
    finally:
        api.close()
