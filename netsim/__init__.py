"""netsim: thousands of fedswarm peers in one process, in virtual time.

A deterministic discrete-event loop drives the sans-IO cores
(``fedswarm.core``) from one seeded event queue. See docs/netsim.md.
"""

from .scenario import Scenario, ScenarioError, load_scenario
from .sim import Simulator
from .workload import TraceError, TraceJob, generate, read_trace

__all__ = ["Scenario", "ScenarioError", "Simulator", "TraceError", "TraceJob", "generate", "load_scenario",
           "read_trace", "run_scenario", "dumps_results"]


def run_scenario(scenario: Scenario, seed: int = 0, jobs: list[TraceJob] | None = None) -> dict:
    """Run a scenario to the end and return the results dict (unrounded)."""
    sim = Simulator(scenario, seed, jobs=jobs)
    sim.run()
    return sim.results()


def dumps_results(results: dict) -> str:
    """Canonical JSON: sorted keys, floats at 6 significant digits."""
    import json

    from .stats import round_floats

    return json.dumps(round_floats(results), sort_keys=True, indent=1, allow_nan=False) + "\n"
