import netsim_helpers  # noqa: F401  (must come first: fixes sys.path)
import gc
import math
import statistics

from hypothesis import given, settings
from hypothesis import strategies as st

from netsim import Simulator
from netsim.network import NetworkModel
from netsim_helpers import make_scenario

ids = st.text(alphabet="abcdefXYZ0123456789", min_size=1, max_size=12)
regions = st.sampled_from(["us", "eu", "asia"])


@settings(max_examples=200)
@given(a=ids, b=ids, ra=regions, rb=regions, seed=st.integers(0, 2**64 - 1))
def test_link_latency_is_a_symmetric_function_of_the_link_within_its_range(a, b, ra, rb, seed):
    net = NetworkModel(seed=seed)
    lat = net.latency(a, b, ra, rb)
    assert lat == net.latency(b, a, rb, ra) == NetworkModel(seed=seed).latency(a, b, ra, rb)
    lo, hi = net.intra_ms if ra == rb else net.inter_ms
    assert lo / 1000.0 <= lat <= hi / 1000.0


def test_link_latencies_are_lognormal_around_the_geometric_mean():
    net = NetworkModel(seed=7)
    lo, hi = net.inter_ms
    xs = [net.latency(f"p{i}", f"q{i}", "us", "eu") * 1000.0 for i in range(4000)]
    # median at the geometric mean; +-2 sigma is the range, so ~2.3% clip at each end
    assert abs(statistics.median(xs) / math.sqrt(lo * hi) - 1.0) < 0.05
    clipped_hi = sum(x == hi for x in xs) / len(xs)
    clipped_lo = sum(x == lo for x in xs) / len(xs)
    assert 0.01 < clipped_hi < 0.04 and 0.01 < clipped_lo < 0.04
    # another seed draws other links
    other = NetworkModel(seed=8)
    assert sum(other.latency(f"p{i}", f"q{i}", "us", "eu") * 1000.0 == x for i, x in enumerate(xs)) < 40


def test_the_loop_restores_the_collector_it_tunes(monkeypatch):
    import netsim.sim

    monkeypatch.setattr(netsim.sim, "_FREEZE_EVERY", 0xFF)  # freeze every 256 events
    frozen = []
    real_freeze = gc.freeze

    def spy() -> None:
        frozen.append(gc.get_freeze_count())
        real_freeze()

    monkeypatch.setattr(gc, "freeze", spy)
    before = gc.get_threshold()
    sim = Simulator(make_scenario(), seed=1)
    sim.run_until(30.0)
    assert sim.events > 512 and len(frozen) >= 2 and frozen[-1] > 0  # the earlier freezes held
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
