"""The pieces behind the command-line checks, in process: advertised
addresses, the detected profile, the device check, the data-dir lock, keys."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

import pytest

from fedswarm.errors import InputError

PID = "12D3KooWF5f1CXwH9C6195mWsx6wLBUWPnNm3keM357KFYBbjMeG"


def test_a_wildcard_listener_advertises_interface_addresses_never_the_wildcard() -> None:
    from fedswarm.net.addrs import advertised_addrs

    got = advertised_addrs(["/ip4/0.0.0.0/tcp/4001", "/ip6/::/tcp/4001"], PID,
                           interfaces={4: ["192.0.2.2", "127.0.0.1"], 6: ["::1"]})
    assert got == [f"/ip4/192.0.2.2/tcp/4001/p2p/{PID}", f"/ip4/127.0.0.1/tcp/4001/p2p/{PID}",
                   f"/ip6/::1/tcp/4001/p2p/{PID}"]
    # this machine's real interfaces: never 0.0.0.0, loopback always there
    real = advertised_addrs(["/ip4/0.0.0.0/tcp/4001"], PID)
    assert real and not any("0.0.0.0" in a for a in real)
    assert f"/ip4/127.0.0.1/tcp/4001/p2p/{PID}" in real
    # --announce replaces them
    assert advertised_addrs(["/ip4/0.0.0.0/tcp/1"], PID, ["/ip4/203.0.113.7/tcp/4001"]) == \
        [f"/ip4/203.0.113.7/tcp/4001/p2p/{PID}"]


def test_the_detected_profile_is_a_valid_editable_profile() -> None:
    from fedswarm.hardware import Accelerator, Machine, detect, profile_toml
    from fedswarm.profiles import parse_profile

    here = parse_profile(tomllib.loads(profile_toml(detect())), name="x")
    assert here.devices and here.power.max_w > here.power.idle_w
    gpus = Machine("cpu", 64, 512 << 30, tuple(Accelerator("cuda", "NVIDIA H100", 80 << 30, 700.0, 700.0)
                                                 for _ in range(4)), "nvidia-smi")
    text = profile_toml(gpus)
    prof = parse_profile(tomllib.loads(text), name="gpu")
    assert [(d.kind, d.name, d.count) for d in prof.devices] == [("cuda", "NVIDIA H100", 4)]
    assert prof.slots == 4 and prof.power.max_w == 700.0
    assert "NVML enforced power limit" in text


def test_a_profile_claiming_devices_this_machine_lacks() -> None:
    from fedswarm.hardware import check_devices
    from fedswarm.profiles import load_profile

    repo = Path(__file__).resolve().parents[2]
    a100 = load_profile(repo / "peers" / "datacenter-a100.toml")
    with pytest.raises(InputError, match="claims 8 cuda devices, this machine has 2"):
        check_devices(a100, counts={"cpu": 1, "cuda": 2})
    assert check_devices(a100, counts={"cuda": 8}) == []
    warn = check_devices(a100, simulate=True, counts={})
    assert len(warn) == 1 and "simulated" in warn[0]
    assert check_devices(load_profile(repo / "peers" / "cpu-laptop.toml"), counts={}) == []


def test_the_data_dir_lock_names_the_holder(tmp_path: Path) -> None:
    from fedswarm.daemon import DataDirLock

    with DataDirLock(tmp_path):
        assert (tmp_path / "daemon.lock").read_text().strip() == str(os.getpid())
        with pytest.raises(InputError, match=rf"in use by another daemon \(pid {os.getpid()}\)"):
            DataDirLock(tmp_path).acquire()
    with DataDirLock(tmp_path):  # released: taken again
        pass


def test_key_files(tmp_path: Path) -> None:
    from fedswarm.core.identity import load_key, load_or_create_key

    k = tmp_path / "sub" / "k.key"
    ident = load_or_create_key(k)
    assert k.stat().st_mode & 0o777 == 0o600
    assert load_key(k).peer_id == ident.peer_id
    k.chmod(0o640)
    with pytest.raises(InputError, match=r"mode 0640.*chmod 600"):
        load_or_create_key(k)
    with pytest.raises(InputError, match="no key file"):
        load_key(tmp_path / "none.key")
    assert not (tmp_path / "none.key").exists()


def test_serve_device_and_dtype_resolve_auto_and_check_what_is_named() -> None:
    import torch

    from fedswarm.llm_serving import serving_device, serving_dtype

    gpu = torch.cuda.is_available()
    assert serving_device("auto") == ("cuda:0" if gpu else "cpu")
    assert serving_device("cpu") == "cpu"
    assert serving_dtype("auto", "cpu") is None  # the checkpoint's own
    assert serving_dtype("float16", "cpu") == "float16"
    if gpu:
        assert serving_dtype("auto", "cuda:0") in ("bfloat16", "float16")
    # a Ray node's device is not this machine's: the spelling is all that is checked
    assert serving_device("cuda:3", here=False) == "cuda:3"
    assert serving_device("auto", here=False) == "auto"
    for bad in ("tpu", "cuda:x", "cuda:-1", ""):
        with pytest.raises(InputError, match="is not a device"):
            serving_device(bad, here=False)
    with pytest.raises(InputError, match="is not a dtype"):
        serving_dtype("int8", "cpu")
    # the CLI spells the choices out (it imports no torch before its checks): the same ones
    from fedswarm.cli import build_parser
    from fedswarm.llm_serving import SERVE_DTYPES

    start = build_parser()._subparsers._group_actions[0].choices["start"]
    assert tuple(next(a for a in start._actions if a.dest == "serve_dtype").choices) == SERVE_DTYPES
