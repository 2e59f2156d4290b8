"""Llama checkpoints: partial loading and model hashing.

Two formats are accepted wherever a checkpoint path is: a Hugging Face
directory (described below) and a single llama.cpp ``.gguf`` file (handled by
:mod:`fedswarm.tasks.gguf_model`, which reads and dequantizes with the
``gguf`` package). ``load_config``, ``load_tensors``, ``load_block_span``,
``load_client_head`` and ``model_hash`` dispatch on the path.

A checkpoint directory holds ``config.json`` and either ``model.safetensors``
or shards ``model-0000k-of-0000n.safetensors`` listed by
``model.safetensors.index.json``. Loading a block span opens each needed file
with ``safetensors.safe_open`` and reads only that span's tensors (the rest of
the file is never touched), so a server holding layers 40..47 of a large model
reads roughly 1/10 of it. Nothing here unpickles anything.

``model_hash(dir)`` is the identity peers and clients agree on: sha256 over the
canonical (computation-relevant) config and every tensor's name, dtype, shape
and raw bytes in sorted-name order. It does not depend on how the weights are
sharded into files. Tensor bytes are streamed from the files (the safetensors
header is parsed directly, nothing is materialised as a tensor) and the result
is memoised per directory, keyed by the (size, mtime, inode) of every file, so
repeated calls cost a few ``stat``s.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import InputError
from . import gguf_model as _gguf
from .llama import DTYPES, LlamaBlockSpan, LlamaClientHead, LlamaConfig, block_keys, head_keys

__all__ = [
    "SHIPPED_MODELS_DIR",
    "shipped_models",
    "resolve_model",
    "known_models",
    "is_gguf",
    "load_config",
    "weight_map",
    "load_tensors",
    "load_block_span",
    "load_client_head",
    "model_hash",
    "save_checkpoint",
]

SHIPPED_MODELS_DIR = Path(__file__).resolve().parent.parent / "assets" / "models"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MODEL_DIRS_ENV = "FEDSWARM_MODEL_DIRS"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_FILE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,254}\.safetensors$")
_MAX_HEADER = 100 * 1024 * 1024


def shipped_models() -> list[str]:
    """Names of the tiny checkpoints shipped with the package."""
    if not SHIPPED_MODELS_DIR.is_dir():
        return []
    return sorted(p.name for p in SHIPPED_MODELS_DIR.iterdir() if (p / "config.json").is_file())


def _model_roots(extra: Sequence[str | os.PathLike[str]] | None) -> list[Path]:
    from ..models import store_dir

    roots = [Path(r) for r in (extra or ())]
    env = os.environ.get(MODEL_DIRS_ENV, "")
    roots += [Path(r) for r in env.split(os.pathsep) if r]
    roots.append(store_dir())
    roots.append(SHIPPED_MODELS_DIR)
    return roots


def is_gguf(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is a GGUF file (rather than a HF checkpoint directory)."""
    return _gguf.is_gguf(path)


def _looks_like_path(ref: str) -> bool:
    return "/" in ref or os.sep in ref or ref.startswith(("~", ".")) or ref.lower().endswith(".gguf")


def _lookup(root: Path, name: str) -> Path | None:
    """``name`` inside one model root: a HF dir, a pulled-model dir (manifest or
    a single .gguf inside), or a ``NAME.gguf`` / ``NAME`` GGUF file."""
    cand = root / name
    if cand.is_dir():
        if (cand / "config.json").is_file():
            return cand
        manifest = cand / "manifest.json"
        if manifest.is_file():
            try:
                fn = _read_json(manifest, 1 << 20).get("file")
            except (OSError, ValueError, AttributeError):
                fn = None
            if isinstance(fn, str) and _NAME_RE.match(fn) and (cand / fn).is_file():
                return cand / fn
        ggufs = sorted(p for p in cand.glob("*.gguf") if p.is_file())
        if len(ggufs) == 1:
            return ggufs[0]
        return None
    if cand.is_file() and cand.suffix.lower() == ".gguf":
        return cand
    g = root / f"{name}.gguf"
    if g.is_file():
        return g
    return None


def known_models(roots: Sequence[str | os.PathLike[str]] | None = None) -> list[str]:
    """Names :func:`resolve_model` accepts here (shipped, pulled, found in model dirs)."""
    names: set[str] = set()
    for root in _model_roots(roots):
        if not root.is_dir():
            continue
        for p in root.iterdir():
            if not _NAME_RE.match(p.name):
                continue
            if p.is_dir() and _lookup(root, p.name) is not None:
                names.add(p.name)
            elif p.is_file() and p.suffix.lower() == ".gguf":
                names.add(p.stem)
    return sorted(names)


def resolve_model(
    ref: str | os.PathLike[str],
    *,
    allow_paths: bool = True,
    roots: Sequence[str | os.PathLike[str]] | None = None,
) -> Path:
    """Map a model reference to a HF checkpoint directory or a ``.gguf`` file.

    A plain name (``tiny-llama``, ``smollm2-135m-instruct``, the stem of a
    GGUF file) is looked up in ``roots``, then ``$FEDSWARM_MODEL_DIRS``
    (``os.pathsep``-separated), then the per-user model store (see
    :mod:`fedswarm.models`), then the shipped models.

    With ``allow_paths`` (an operator's own command line) a reference that
    looks like a path (contains a ``/``, starts with ``.`` or ``~``, or ends
    in ``.gguf``) is used as one. Names that come from the network (a job's
    or an API request's ``model``) must use ``allow_paths=False``: then only
    names are accepted, so a remote caller can never make us read an
    arbitrary path. Raises :class:`InputError`.
    """
    is_path = isinstance(ref, os.PathLike)
    if is_path:
        if not allow_paths:
            raise InputError(f"bad model name {os.fspath(ref)!r}: a name is expected, not a path")
        ref = os.fspath(ref)
    if not isinstance(ref, str) or not ref:
        raise InputError(f"bad model name {ref!r}")
    if allow_paths and (is_path or _looks_like_path(ref)):
        p = Path(ref).expanduser()
        if p.is_dir() and (p / "config.json").is_file():
            return p
        if p.is_file():
            if not is_gguf(p):
                raise InputError(f"{p}: not a GGUF file or a checkpoint directory")
            return p
        if p.is_dir():
            hit = _lookup(p.parent, p.name)  # a pulled-model directory: its one .gguf file
            if hit is not None:
                return hit
            raise InputError(f"{p}: directory has no config.json and not exactly one .gguf file",
                             "give a Hugging Face checkpoint directory or a .gguf file")
        if _looks_like_path(ref):
            raise InputError(f"no model file or directory at {p}")
        # a Path holding a plain name: resolve it as a name
    if not _NAME_RE.match(ref) or ".." in ref:
        raise InputError(
            f"bad model name {ref!r}", "expected letters, digits, '.', '_', '-', at most 128 chars, no path"
        )
    for root in _model_roots(roots):
        hit = _lookup(root, ref)
        if hit is not None:
            return hit
    from ..models import PULLABLE

    if ref in PULLABLE:
        raise InputError(f"model {ref!r} is not pulled yet", f"run `peer models pull {ref}`")
    known = sorted(set(known_models(roots)) | set(PULLABLE))
    raise InputError(
        f"unknown model {ref!r}",
        f"known: {', '.join(known) or 'none'}; fetch one with `peer models pull NAME`",
    )


def _read_json(path: Path, limit: int = 16 * 1024 * 1024) -> Any:
    if path.stat().st_size > limit:
        raise ValueError(f"{path.name} is too large")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def load_config(model_dir: str | os.PathLike[str]) -> LlamaConfig:
    """The config of a HF checkpoint directory or a GGUF file."""
    if is_gguf(model_dir):
        return _gguf.load_config(model_dir)
    return LlamaConfig.from_hf_dict(_read_json(Path(model_dir) / "config.json"))


def weight_map(model_dir: str | os.PathLike[str]) -> dict[str, str]:
    """Tensor name -> safetensors file name (relative to ``model_dir``)."""
    if is_gguf(model_dir):
        return _gguf.weight_map(model_dir)
    d = Path(model_dir)
    if (d / INDEX_FILE).is_file():
        wm = _read_json(d / INDEX_FILE).get("weight_map")
        if not isinstance(wm, dict) or not wm:
            raise ValueError(f"{INDEX_FILE} has no weight_map")
        for fn in set(wm.values()):
            if not isinstance(fn, str) or not _FILE_RE.match(fn) or not (d / fn).is_file():
                raise ValueError(f"{INDEX_FILE} names a bad or missing file {fn!r}")
        return dict(wm)
    if (d / SINGLE_FILE).is_file():
        return {k: SINGLE_FILE for k in _read_header(d / SINGLE_FILE)[0] if k != "__metadata__"}
    raise ValueError(f"no {SINGLE_FILE} or {INDEX_FILE} in {d}")


def load_tensors(
    model_dir: str | os.PathLike[str],
    names: Iterable[str],
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """Read exactly ``names`` from the checkpoint (each file opened once)."""
    if is_gguf(model_dir):
        return _gguf.load_tensors(model_dir, names, device=device, dtype=dtype)
    d = Path(model_dir)
    wm = weight_map(d)
    by_file: dict[str, list[str]] = {}
    for n in names:
        if n not in wm:
            raise ValueError(f"checkpoint {d.name} has no tensor {n!r}")
        by_file.setdefault(wm[n], []).append(n)
    out: dict[str, torch.Tensor] = {}
    for fn, keys in by_file.items():
        with safe_open(str(d / fn), framework="pt", device="cpu") as f:
            for k in keys:
                t = f.get_tensor(k)
                out[k] = t.to(device=device, dtype=dtype or t.dtype)
    return out


def _dtype(cfg: LlamaConfig, dtype: torch.dtype | str | None) -> torch.dtype:
    if dtype is None:
        return DTYPES[cfg.dtype]
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}")
        return DTYPES[dtype]
    return dtype


def _check_hash(model_dir: Path, expected: str | None) -> None:
    if expected is not None and model_hash(model_dir) != expected:
        raise ValueError(f"model hash mismatch for {model_dir.name}")


def load_block_span(
    model_dir: str | os.PathLike[str],
    start: int,
    end: int,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str | None = None,
    expected_hash: str | None = None,
) -> LlamaBlockSpan:
    """Build blocks ``[start, end)`` reading only their tensors."""
    d = Path(model_dir)
    _check_hash(d, expected_hash)
    cfg = load_config(d)
    dt = _dtype(cfg, dtype)
    with torch.device("meta"):
        span = LlamaBlockSpan(cfg, start, end)
    names = [k for layer in range(start, end) for k in block_keys(cfg, layer)]
    tensors = load_tensors(d, names, device=device, dtype=dt)
    sd = {}
    for layer in range(start, end):
        prefix = f"model.layers.{layer}."
        for k in block_keys(cfg, layer):
            sd[f"blocks.{layer - start}.{k[len(prefix):]}"] = tensors[k]
    span.load_state_dict(sd, strict=True, assign=True)
    return span.eval()


def load_client_head(
    model_dir: str | os.PathLike[str],
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str | None = None,
    expected_hash: str | None = None,
) -> LlamaClientHead:
    """Build embeddings + final norm + lm_head reading only those tensors."""
    d = Path(model_dir)
    _check_hash(d, expected_hash)
    cfg = load_config(d)
    dt = _dtype(cfg, dtype)
    with torch.device("meta"):
        head = LlamaClientHead(cfg)
    t = load_tensors(d, head_keys(cfg), device=device, dtype=dt)
    sd = {"embed_tokens.weight": t["model.embed_tokens.weight"], "norm.weight": t["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        sd["lm_head.weight"] = t["lm_head.weight"]
    head.load_state_dict(sd, strict=True, assign=True)
    return head.eval()


# ----------------------------------------------------------------- hashing

def _read_header(path: Path) -> tuple[dict[str, Any], int]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path.name}: truncated safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if n > _MAX_HEADER:
            raise ValueError(f"{path.name}: safetensors header too large")
        header = json.loads(f.read(n))
    if not isinstance(header, dict):
        raise ValueError(f"{path.name}: bad safetensors header")
    return header, 8 + n


_hash_cache: dict[str, tuple[tuple[Any, ...], str]] = {}
_hash_lock = threading.Lock()


def _fingerprint(d: Path) -> tuple[Any, ...]:
    files = ["config.json", INDEX_FILE] + sorted(set(weight_map(d).values()))
    out = []
    for fn in files:
        try:
            st = (d / fn).stat()
        except FileNotFoundError:
            continue
        out.append((fn, st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(out)


def model_hash(model_dir: str | os.PathLike[str]) -> str:
    """sha256 hex of the canonical config and all tensors (see module doc)."""
    if is_gguf(model_dir):
        return _gguf.model_hash(model_dir)
    d = Path(model_dir).resolve()
    fp = _fingerprint(d)
    key = str(d)
    with _hash_lock:
        hit = _hash_cache.get(key)
        if hit is not None and hit[0] == fp:
            return hit[1]
    h = hashlib.sha256(b"fedswarm-model-v1\0")
    h.update(json.dumps(load_config(d).canonical(), sort_keys=True, separators=(",", ":")).encode())
    wm = weight_map(d)
    headers = {fn: _read_header(d / fn) for fn in set(wm.values())}
    for name in sorted(wm):
        header, base = headers[wm[name]]
        meta = header.get(name)
        if not isinstance(meta, dict):
            raise ValueError(f"tensor {name!r} missing from {wm[name]}")
        b, e = meta["data_offsets"]
        h.update(json.dumps([name, meta["dtype"], meta["shape"], e - b]).encode() + b"\0")
        with open(d / wm[name], "rb") as f:
            f.seek(base + b)
            left = e - b
            while left:
                chunk = f.read(min(left, 1 << 22))
                if not chunk:
                    raise ValueError(f"{wm[name]}: truncated")
                h.update(chunk)
                left -= len(chunk)
    digest = h.hexdigest()
    with _hash_lock:
        _hash_cache[key] = (fp, digest)
    return digest


# ----------------------------------------------------------------- writing

def save_checkpoint(
    model_dir: str | os.PathLike[str],
    config: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
    *,
    num_shards: int = 1,
) -> None:
    """Write a HF-format checkpoint (``config.json`` + one or ``num_shards`` files)."""
    d = Path(model_dir)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(dict(config), indent=2, sort_keys=True) + "\n")
    names = list(tensors)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    if num_shards == 1:
        save_file(tensors, str(d / SINGLE_FILE), metadata={"format": "pt"})
        return
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    target = total / num_shards
    groups: list[list[str]] = [[]]
    acc = 0
    for n in names:
        nb = tensors[n].numel() * tensors[n].element_size()
        if groups[-1] and acc + nb > target * len(groups) and len(groups) < num_shards:
            groups.append([])
        groups[-1].append(n)
        acc += nb
    wm = {}
    for i, g in enumerate(groups):
        fn = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: tensors[k] for k in g}, str(d / fn), metadata={"format": "pt"})
        wm.update({k: fn for k in g})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(wm.items()))}
    (d / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
