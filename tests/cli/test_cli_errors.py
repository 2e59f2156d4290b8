"""Mistakes on the command line, each run as a real ``peer`` / ``netsim`` process.

Every case checks the exit code (2: usage or input error, 1: runtime
failure), that exactly one line ``peer CMD: error: WHAT (HINT)`` is printed
and no traceback, and where it matters that nothing was written or created.
Argument mistakes fail before torch or py-libp2p are imported, so each case
is one short process.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from cli_helpers import NETSIM, PEER, REPO, error_line, free_port, run

DEAD_ID = "12D3KooWF5f1CXwH9C6195mWsx6wLBUWPnNm3keM357KFYBbjMeG"  # nobody listens for it
SCENARIO = REPO / "netsim" / "scenarios" / "smoke.toml"

# (id, command after `peer`, exit code, pattern of the error line, paths that must not exist afterwards)
CASES = [
    # the examples of issue 20
    ("grace-negative", "start --grace -5", 2, r"--grace: -5 is out of range", []),
    ("metrics-port-range", "start --metrics-port 99999", 2, r"--metrics-port: 99999 is out of range", []),
    ("lane-port-range", "start --lane-port 70000", 2, r"--lane-port: 70000 is out of range", []),
    ("bootstrap-not-multiaddr", "start --bootstrap not-a-multiaddr", 2, r"not a multiaddr", []),
    ("bootstrap-no-p2p", "start --bootstrap /ip4/127.0.0.1/tcp/4001", 2, r"has no /p2p/PEER_ID", []),
    ("submit-out-missing-dir", f"submit --bootstrap /ip4/127.0.0.1/tcp/1/p2p/{DEAD_ID} --kind tensor-map --shards 2 "
     "--out {tmp}/no/such/dir/x.jsonl", 2, r"directory \S+/no/such/dir does not exist", []),
    ("submit-shards-negative", "submit --local --kind tensor-map --shards -3 --out {tmp}/neg.jsonl", 2,
     r"--shards: -3 is out of range", ["{tmp}/neg.jsonl"]),
    ("admit-bad-peer", "admit --federation-key {tmp}/fed.key --peer notapeerid --days 30 --out {tmp}/a.cert", 2,
     r"'notapeerid' is not an Ed25519 libp2p peer id", ["{tmp}/a.cert", "{tmp}/fed.key"]),
    ("admit-negative-days", f"admit --federation-key {{tmp}}/fed.key --peer {DEAD_ID} --days -5 --out {{tmp}}/b.cert",
     2, r"--days: -5 is out of range", ["{tmp}/b.cert", "{tmp}/fed.key"]),
    ("keygen-show-missing", "keygen --key {tmp}/missing.key --show", 2, r"no key file \S+missing.key",
     ["{tmp}/missing.key"]),
    ("key-world-readable", "keygen --key {key644} --show", 2, r"accessible by others \(mode 0644\) \(chmod 600", []),
    ("start-key-world-readable", "start --data-dir {tmp}/d644 --key {key644}", 2, r"chmod 600", []),
    ("serve-model-empty-dir", "start --data-dir {tmp}/dsm --serve-model {empty}", 2, r"holds no checkpoint", []),
    # others found on the way
    ("no-command", "", 2, r"required: COMMAND", []),
    ("unknown-command", "bogus", 2, r"invalid choice: 'bogus'", []),
    ("unknown-option", "start --bogus", 2, r"unrecognized arguments: --bogus", []),
    ("days-zero", f"admit --federation-key {{tmp}}/fed.key --peer {DEAD_ID} --days 0 --out {{tmp}}/c.cert", 2,
     r"--days: 0 is out of range", ["{tmp}/c.cert"]),
    ("admit-out-missing-dir", f"admit --federation-key {{tmp}}/fed.key --peer {DEAD_ID} --out {{tmp}}/x/y.cert", 2,
     r"does not exist", ["{tmp}/fed.key"]),
    ("keygen-exists", "keygen --key {key600}", 2, r"exists \(use --show", []),
    ("keygen-not-a-key", "keygen --key {notakey} --show", 2, r"does not hold a 32-byte Ed25519 key", []),
    ("listen-port-range", "start --listen /ip4/127.0.0.1/tcp/70000", 2, r"not a multiaddr", []),
    ("listen-not-ip", "start --listen /dns4/localhost/tcp/1", 2, r"needs /ip4/ or /ip6/", []),
    ("announce-bad", "start --announce nope", 2, r"announce address 'nope' is not a multiaddr", []),
    ("http-listen-range", "start --http-listen 127.0.0.1:99999", 2, r"out of range", []),
    ("http-listen-no-port", "start --data-dir {tmp}/dh --http-listen 127.0.0.1", 2, r"names no port", []),
    ("torch-threads-zero", "start --torch-threads 0", 2, r"--torch-threads: 0 is out of range", []),
    ("trust-bad-peer", "start --trust-federation xyz", 2, r"not an Ed25519 libp2p peer id", []),
    ("blocks-bad", "start --data-dir {tmp}/db --blocks 3:1", 2, r"not a block span", []),
    ("blocks-without-model", "start --data-dir {tmp}/dbm --blocks 0:2 --serve-dtype bfloat16", 2,
     r"--blocks, --serve-dtype without --serve-model", []),
    ("serve-device-bad", "start --data-dir {tmp}/dsb --serve-model tiny-llama --serve-device tpu", 2,
     r"--serve-device 'tpu' is not a device \(use auto, cpu, cuda or cuda:N\)", []),
    ("serve-dtype-bad", "start --serve-model tiny-llama --serve-dtype int8", 2,
     r"--serve-dtype: invalid choice: 'int8'", []),
    ("membership-missing", "start --data-dir {tmp}/dm --membership {tmp}/none.cert", 2, r"cannot read --membership", []),
    ("profile-missing", "start --data-dir {tmp}/dp --profile {tmp}/none.toml", 2, r"no such profile file", []),
    ("profile-bad-toml", "start --data-dir {tmp}/dq --profile {badtoml}", 2, r"invalid TOML", []),
    ("submit-unknown-kind", "submit --local --kind nope --shards 1 --out {tmp}/k.jsonl", 2, r"unknown task kind 'nope'", []),
    ("submit-bad-input", "submit --local --kind tensor-map --shards 1 --input {tmp}/none.json --out {tmp}/i.jsonl", 2,
     r"cannot read --input", ["{tmp}/i.jsonl"]),
    ("submit-timeout-negative", "submit --local --kind tensor-map --shards 1 --timeout -1 --out {tmp}/t.jsonl", 2,
     r"--timeout: -1 is out of range", []),
    ("submit-bad-bootstrap", "submit --bootstrap nope --kind tensor-map --shards 1 --out {tmp}/b.jsonl", 2,
     r"not a multiaddr", []),
    ("submit-out-is-dir", "submit --local --kind tensor-map --shards 1 --out {tmp}", 2, r"is a directory", []),
    ("status-port-range", "status --metrics-port 99999", 2, r"out of range", []),
    ("status-not-http", "status --url ftp://x/status", 2, r"not an http\(s\) URL", []),
    ("status-unreachable", "status --metrics-port {closed}", 1, r"cannot reach http://127.0.0.1:\d+/status", []),
    ("generate-weight-zero", f"generate --bootstrap /ip4/127.0.0.1/tcp/1/p2p/{DEAD_ID} --model tiny-llama --prompt hi "
     "--weight 0", 2, r"--weight: a weight is in \(0, 1000\], got 0", []),
    ("api-tenant-too-long", f"api --bootstrap /ip4/127.0.0.1/tcp/1/p2p/{DEAD_ID} --tenant {'x' * 65}", 2,
     r"--tenant: a tenant name is 1..64 characters, got 65", []),
]


@pytest.fixture(scope="module")
def ctx(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("cli")
    key644 = tmp / "open.key"
    key644.write_bytes(os.urandom(32))
    key644.chmod(0o644)
    key600 = tmp / "own.key"
    fd = os.open(key600, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, os.urandom(32))
    os.close(fd)
    notakey = tmp / "short.key"
    fd = os.open(notakey, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"hello")
    os.close(fd)
    (tmp / "empty").mkdir()
    (tmp / "bad.toml").write_text("name = [\n")
    return {"tmp": str(tmp), "key644": str(key644), "key600": str(key600), "notakey": str(notakey),
            "empty": str(tmp / "empty"), "badtoml": str(tmp / "bad.toml"), "closed": str(free_port())}


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_mistake_gets_one_line_and_the_right_exit_code(case, ctx: dict[str, str]) -> None:
    _, args, code, pattern, absent = case
    argv = [a.format(**ctx) for a in args.split()]
    p = run(PEER + argv, env={"FEDSWARM_HOME": os.path.join(ctx["tmp"], "home")}, timeout=60)
    line = error_line(p, code, pattern)
    assert line.startswith(f"peer {argv[0]}: error: " if argv and not argv[0].startswith("-") and
                           argv[0] != "bogus" else "peer: error: "), line
    for path in absent:
        assert not Path(path.format(**ctx)).exists(), f"{path} was written"


def test_a_profile_claiming_cuda_is_refused_without_the_devices(ctx: dict[str, str]) -> None:
    import torch

    if torch.cuda.device_count() >= 8:
        pytest.skip("this machine has the 8 CUDA devices the profile claims")
    p = run(PEER + ["start", "--data-dir", f"{ctx['tmp']}/dcuda", "--profile", str(REPO / "peers" / "datacenter-a100.toml")])
    error_line(p, 2, r"claims 8 cuda devices, this machine has \d+ \(.*--simulate-devices")


def test_a_serve_device_torch_cannot_see_is_refused(ctx: dict[str, str]) -> None:
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    p = run(PEER + ["start", "--data-dir", f"{ctx['tmp']}/dsc", "--serve-model", "tiny-llama",
                    "--serve-device", f"cuda:{n}"])
    error_line(p, 2, r"--serve-device cuda:\d+: torch sees (no CUDA device here|\d+ CUDA device)")


def test_netsim_out_is_checked_before_simulating(ctx: dict[str, str]) -> None:
    p = run(NETSIM + ["run", str(SCENARIO), "--out", f"{ctx['tmp']}/no/dir/r.json"])
    error_line(p, 2, r"^netsim run: error: cannot write --out .*does not exist")
    p = run(NETSIM + ["run", f"{ctx['tmp']}/none.toml"])
    error_line(p, 2, r"no such scenario file")


def test_generate_against_a_dead_bootstrap_is_one_line(ctx: dict[str, str]) -> None:
    port = ctx["closed"]
    p = run(PEER + ["generate", "--bootstrap", f"/ip4/127.0.0.1/tcp/{port}/p2p/{DEAD_ID}", "--model", "tiny-llama",
                    "--prompt", "hi", "--max-new-tokens", "2", "--connect-timeout", "5", "--torch-threads", "1"])
    error_line(p, 1, r"unreachable|cannot dial|no bootstrap peer", only_line=False)


def test_version_and_debug() -> None:
    p = run(PEER + ["--version"])
    assert p.returncode == 0 and p.stdout.startswith("peer (fedswarm) "), p
    # --debug shows the traceback, then the same one line
    p = run(PEER + ["keygen", "--key", "/nonexistent/dir/k", "--show", "--debug"])
    assert p.returncode == 2
    assert "Traceback" in p.stderr
    assert p.stderr.rstrip().splitlines()[-1].startswith("peer keygen: error: no key file")


def test_every_help_has_an_example_and_every_option_a_default_or_help() -> None:
    import argparse

    from fedswarm.cli import build_parser

    ap = build_parser()
    sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    for name in ("start", "status", "submit", "admit", "keygen", "completion"):
        sp = sub.choices[name]
        assert "example" in (sp.description or ""), f"peer {name}: no example in --help"
        text = " ".join(sp.format_help().split())
        for act in sp._actions:
            if act.option_strings and act.dest != "help":
                assert act.help, f"peer {name} {act.option_strings}: no help"
                if act.default not in (None, False, [], argparse.SUPPRESS):
                    assert "default" in (act.help % {"default": act.default}).lower() or \
                        f"(default: {act.default})" in text, f"peer {name} {act.option_strings}: default not shown"


def test_bash_completion_is_generated_from_the_parser(tmp_path: Path) -> None:
    p = run(PEER + ["completion", "bash"])
    assert p.returncode == 0, p.stderr
    script = tmp_path / "peer.bash"
    script.write_text(p.stdout)
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0

    def complete(*words: str) -> list[str]:
        body = (f"source {script}; COMP_WORDS=({' '.join(repr(w) for w in words)}); "
                f"COMP_CWORD={len(words) - 1}; _peer_complete; printf '%s\\n' \"${{COMPREPLY[@]}}\"")
        r = subprocess.run(["bash", "-c", body], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        return r.stdout.split()

    assert complete("peer", "sta") == ["start", "status"]
    assert complete("peer", "start", "--log-f") == ["--log-format"]
    assert complete("peer", "start", "--log-format", "") == ["json", "text"]
    assert "--shards" in complete("peer", "submit", "--sh")
    p = run(PEER + ["completion", "zsh"])
    assert p.returncode == 0 and p.stdout.startswith("#compdef peer")
    if shutil.which("zsh"):
        zs = tmp_path / "_peer"
        zs.write_text(p.stdout)
        assert subprocess.run(["zsh", "-n", str(zs)]).returncode == 0


def test_a_reader_that_goes_away_is_not_an_error() -> None:
    """`peer models --json | head -c 1`: the closed pipe ends the command quietly, exit 0."""
    r, w = os.pipe()
    os.close(r)  # the reader is gone before the listing is written
    proc = subprocess.Popen([*PEER, "models", "--json"], stdout=w, stderr=subprocess.PIPE)
    os.close(w)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert b"error" not in err and b"Traceback" not in err
