from __future__ import annotations

from pathlib import Path
from typing import Any


REPO = Path(__file__).resolve().parents[2]

from netsim.scenario import Scenario, parse_scenario

PEERS = REPO / "peers"
SCENARIOS = REPO / "netsim" / "scenarios"


def make_scenario(**data: Any) -> Scenario:
    """A scenario from keyword tables, profiles from the repo's peers/."""
    data.setdefault("name", "test")
    data.setdefault("swarm", [{"profile": "workstation-rtx4090", "count": 10}])
    return parse_scenario(data, src="<test>", base_dir=REPO, profiles_dir=PEERS)


