"""netsim.timing: a run timed by input kind is the same run."""

import netsim_helpers  # noqa: F401  (must come first: fixes sys.path)
from collections import Counter

from fedswarm.core.wire import peek_kind
from netsim import dumps_results, load_scenario
from netsim.sim import Simulator
from netsim.timing import TimedSimulator, format_table
from netsim_helpers import SCENARIOS


def smoke():
    return load_scenario(SCENARIOS / "smoke-20.toml")


def test_a_timed_run_gives_the_same_results_and_counts_every_input():
    plain = Simulator(smoke(), 3)
    plain.run()
    timed = TimedSimulator(smoke(), 3)
    timed.run()
    assert dumps_results(timed.results()) == dumps_results(plain.results())
    assert timed.events == plain.events
    t = timed.timing
    # every message a core took is filed under its kind: as many as were
    # handled (sent, less those lost, to the dead or never delivered)
    received = Counter()
    for (kind, side), tally in t.items():
        assert tally.calls > 0 and tally.seconds >= 0.0
        received[kind] += tally.calls
    sent = plain.msg_kinds
    for kind in ("Gossip", "CallForBids", "Bid", "Award", "ShardResult", "ResultAck"):
        assert 0 < received[kind] <= sent[kind], kind
    assert ("Bid", "client") in t and ("Bid", "peer") not in t  # bids go to clients
    assert ("CallForBids", "peer") in t and ("poll", "peer") in t and ("ShardFinished", "peer") in t
    table = format_table(t, 10.0)
    assert table.count("\n") == len(t) + 3 and "| Bid | client |" in table


def test_peek_kind_reads_the_header_only():
    sim = Simulator(smoke(), 3)
    sim.run_until(30.0)
    seen = list(sim.cache._seen.items())[:50]
    assert len(seen) == 50
    assert all(peek_kind(raw) == type(signed.msg).__name__ for (raw, _), signed in seen)
    assert peek_kind(b"") is None and peek_kind(b"\x92\xc4\x00\xc4\x01\x90") is None
