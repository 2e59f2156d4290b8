import os
import sys

import pytest
from hypothesis import settings

# shared test helpers (MiniSwarm, ...) live in tests/support; adding tests/
# itself to sys.path would let tests/netsim shadow the netsim package
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "support"))

# nothing is ever fetched from a model hub: the models ship with the project
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# tests never time things: hypothesis's default 200 ms limit per example is
# a timing check, and on a loaded 2-core box it failed correct property
# tests (test_slots, 276 ms) as flaky
settings.register_profile("fedswarm", deadline=None)
settings.load_profile("fedswarm")


@pytest.fixture(scope="session", autouse=True)
def _torch_threads():
    """Two torch threads (this machine's cores) for the tests that use torch."""
    import torch

    torch.set_num_threads(2)


@pytest.fixture
def mock_clock():
    """trio's virtual clock for ``trio.run(main, clock=mock_clock)``.

    ``autojump_threshold=0``: whenever every task is blocked the clock jumps
    to the next deadline at once, so timeouts of many seconds take no wall
    time and a test waits for events, never for real seconds. A new clock per
    test (it keeps its time).
    """
    import trio.testing

    return trio.testing.MockClock(autojump_threshold=0)


@pytest.fixture(scope="session")
def tiny_dir():
    from fedswarm.tasks.checkpoint import resolve_model

    return resolve_model("tiny-llama")


@pytest.fixture(scope="session")
def gqa_dir():
    from fedswarm.tasks.checkpoint import resolve_model

    return resolve_model("tiny-llama-gqa")


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Leave at once once everything is reported, when Ray was imported.

    Ray installs a C++ terminate handler in this process. A daemon thread
    still alive at interpreter shutdown (here one freeing a torch tensor) is
    stopped by CPython with a forced unwind, which that handler turns into
    SIGABRT: a CI run of 2026-12-07 had all 820 tests pass and then exited
    with 134. Nothing is left to do at this point but that shutdown.
    """
    status = config.stash.get(_EXIT_STATUS, None)
    if status is None or "ray" not in sys.modules:
        return  # no session ran (a usage error): pytest exits as it would
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


_EXIT_STATUS = pytest.StashKey[int]()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config.stash[_EXIT_STATUS] = int(exitstatus)
