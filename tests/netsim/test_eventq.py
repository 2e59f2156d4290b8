"""netsim.eventq: the compiled event heap pops what heapq pops.

The simulator's events are ordered by (time, sequence number), the numbers
unique. ``netsim/_eventq.c`` keeps the keys in a C array; ``PyEventQueue``
is its heapq twin. Hypothesis drives both, and a heapq list of tuples as the
simulator kept it, through the same pushes and pops; a scenario must give
the same bytes with either. Under ``FEDSWARM_EXPECT_NATIVE=1`` (CI) a
missing build fails instead of skipping.
"""

from __future__ import annotations

import gc
import heapq
import os
import sys

import netsim_helpers  # noqa: F401  (must come first: fixes sys.path)
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from netsim import Simulator, dumps_results, eventq, load_scenario
from netsim_helpers import SCENARIOS


def _native() -> type:
    cls = eventq.native_queue()
    if cls is None:
        if os.environ.get("FEDSWARM_EXPECT_NATIVE") == "1":
            pytest.fail("netsim/_eventq is not built for its source: scripts/build_native.py (run by scripts/test.sh)")
        pytest.skip("netsim/_eventq is not built (scripts/build_native.py)")
    return cls


# a time: floats with many ties, and whole numbers as ints (a scenario's
# start times are); ops: push (True) or pop (False)
_times = st.one_of(st.sampled_from([0.0, 0.5, 1.0, 2.0]), st.integers(0, 3),
                   st.floats(0, 1e6, allow_nan=False, allow_infinity=False))
_ops = st.lists(st.one_of(st.tuples(st.just(True), _times, st.integers(0, 12)), st.tuples(st.just(False))),
                max_size=300)


@settings(max_examples=300, deadline=None)
@given(_ops)
def test_both_queues_pop_what_heapq_pops(ops: list[tuple]) -> None:
    native = _native()
    queues = [native(), eventq.PyEventQueue()]
    ref: list[tuple] = []
    seq = 0
    for op in ops:
        if op[0]:
            seq += 1
            payload = (f"node{seq}", None, (seq,))
            heapq.heappush(ref, (op[1], seq, op[2], *payload))
            for q in queues:
                q.push(op[1], seq, op[2], *payload)
        elif ref:
            t, _seq, kind, a, b, c = heapq.heappop(ref)
            for q in queues:
                got = q.pop()
                assert got == (t, kind, a, b, c)
                assert type(got[0]) is type(t)  # the time as pushed: an int stays an int
        else:
            for q in queues:
                with pytest.raises(IndexError):
                    q.pop()
        for q in queues:
            assert len(q) == len(ref) and bool(q) == bool(ref)
            if ref:
                assert q.peek_time() == ref[0][0] and type(q.peek_time()) is type(ref[0][0])


def test_the_native_queue_holds_and_lets_go_of_its_events() -> None:
    native = _native()
    item = ["payload"]
    q = native()
    refs = sys.getrefcount(item)
    q.push(1.0, 1, 0, item, item, item)
    assert sys.getrefcount(item) == refs + 3
    got = q.pop()
    held = sys.getrefcount(item)  # (counted before assert keeps its operands)
    assert got[2] is got[3] is got[4] is item
    assert held == refs + 3  # now held by the tuple
    del got
    assert sys.getrefcount(item) == refs
    q.push(2.0, 2, 0, item, None, None)
    del q  # a queue freed with events in it lets go of them
    assert sys.getrefcount(item) == refs
    # the collector sees through it: a cycle through a queue is collected
    q = native()
    box: list = [q]
    q.push(0.5, 1, 0, box, None, None)
    del q, box
    assert gc.collect() >= 2
    with pytest.raises(TypeError):
        native().push(1.0, 1, 0)


def test_a_scenario_gives_the_same_bytes_with_either_queue(monkeypatch: pytest.MonkeyPatch) -> None:
    _native()
    sc = SCENARIOS / "churn-200.toml"
    runs = []
    for cls in (None, eventq.native_queue()):
        monkeypatch.setattr(eventq, "_native", [cls])
        sim = Simulator(load_scenario(sc), 2)
        assert type(sim.q).__name__ == ("EventQueue" if cls is not None else "PyEventQueue")
        sim.run()
        runs.append(dumps_results(sim.results()))
    assert runs[0] == runs[1]
