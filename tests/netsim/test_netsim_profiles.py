import netsim_helpers  # noqa: F401  (must come first: fixes sys.path)
import pytest

from fedswarm.core.config import PeerConfig
from fedswarm.profiles import ProfileError, load_profile, parse_profile

from netsim_helpers import PEERS

SHIPPED = ["datacenter-a100", "datacenter-v100", "workstation-rtx4090", "volunteer-gaming", "cpu-laptop"]


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_profiles_load(name):
    p = load_profile(PEERS / f"{name}.toml")
    cfg = p.peer_config(bootstrap=("x",))
    assert isinstance(cfg, PeerConfig)
    assert cfg.slots == p.slots >= 1
    assert cfg.power.max_w > cfg.power.idle_w > 0
    assert cfg.bootstrap == ("x",)


def test_reference_and_figures():
    a100 = load_profile(PEERS / "datacenter-a100.toml")
    assert a100.speed() == 1.0 and a100.slots == 8 and a100.trust == "datacenter"
    assert (a100.power.idle_w, a100.power.max_w) == (60.0, 400.0)
    cpu = load_profile(PEERS / "cpu-laptop.toml")
    assert [d.kind for d in cpu.devices] == ["cpu"]
    gaming = load_profile(PEERS / "volunteer-gaming.toml")
    assert gaming.slots == 1 and gaming.speed() < 1 and gaming.carbon_g_kwh > a100.carbon_g_kwh


BASE = {"devices": [{"kind": "cuda", "count": 2, "mem_gb": 24}], "power": {"idle_w": 20, "max_w": 300}}


def test_minimal_and_policy():
    p = parse_profile({**BASE, "policy": {"queue_policy": "fifo", "race_to_idle": True},
                       "gossip": {"interval_s": 3.0, "fanout": 4}, "lease": {"renew_interval_s": 5.0}}, name="m")
    cfg = p.peer_config()
    assert (cfg.queue_policy, cfg.race_to_idle, cfg.gossip_interval_s, cfg.gossip_fanout, cfg.renew_interval_s) == (
        "fifo", True, 3.0, 4, 5.0)
    assert cfg.slots == 2
    assert p.peer_config(fairness_knob=0.5).fairness_knob == 0.5
    # the level rule leaves room for a re-run only when the profile asks
    assert cfg.rerun_room is False
    assert parse_profile({**BASE, "policy": {"rerun_room": True}}, name="m").peer_config().rerun_room is True
    # slot offers are off unless the profile sets an interval
    assert cfg.offer_interval_s == 0.0
    offers = {"offer_interval_s": 2.0, "offer_backoff_max": 64, "offer_max_ratio": 2.0}
    got = parse_profile({**BASE, "policy": offers}, name="m").peer_config()
    assert (got.offer_interval_s, got.offer_backoff_max, got.offer_max_ratio) == (2.0, 64, 2.0)
    # how often a running shard's checkpoints go out: 0 sends each one
    assert cfg.checkpoint_min_s == 10.0
    for every in (0, 2.5):
        lease = {"lease": {"checkpoint_min_s": every}}
        assert parse_profile({**BASE, **lease}, name="m").peer_config().checkpoint_min_s == every


@pytest.mark.parametrize(
    "patch, msg",
    [
        ({"colour": "red"}, "unknown key"),
        ({"power": {"idle_w": 20, "max_w": 300, "turbo": 1}}, "unknown key"),
        ({"gossip": {"interval": 1}}, "unknown key"),
        ({"devices": [{"kind": "tpu", "count": 1}]}, "tpu"),
        ({"devices": []}, "non-empty"),
        ({"power": {"idle_w": 300, "max_w": 20}}, "below idle_w"),
        ({"power": {"idle_w": 20, "max_w": 300, "levels": [0, 1]}}, "out of range"),
        ({"slots": 3}, "exceeds"),
        ({"trust": "superuser"}, "trust"),
        ({"policy": {"queue_policy": "lottery"}}, "queue_policy"),
        ({"policy": {"rerun_room": 1}}, "true or false"),
        ({"lease": {"checkpoint_min_s": -1}}, "checkpoint_min_s"),
        ({"policy": {"offer_interval_s": -2}}, "offer_interval_s"),
        ({"policy": {"offer_backoff_max": 0}}, "offer_backoff_max"),
        ({"policy": {"offer_max_ratio": -1}}, "offer_max_ratio"),
        ({"throughput": {"*": -1}}, "throughput"),
        ({"energy_price": "cheap"}, "must be a number"),
    ],
)
def test_validation_errors(patch, msg):
    with pytest.raises(ProfileError, match=msg):
        parse_profile({**BASE, **patch}, name="bad", src="bad.toml")


def test_missing_file_and_bad_toml(tmp_path):
    with pytest.raises(ProfileError, match="no such profile"):
        load_profile(tmp_path / "nope.toml")
    f = tmp_path / "x.toml"
    f.write_text("slots = [")
    with pytest.raises(ProfileError, match="invalid TOML"):
        load_profile(f)
    with pytest.raises(ProfileError, match="override"):
        load_profile(PEERS / "cpu-laptop.toml").peer_config(warp_drive=True)
