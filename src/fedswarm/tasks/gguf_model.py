"""Llama-family GGUF checkpoints: config, partial loading, model hashing.

A GGUF file (llama.cpp's format) holds metadata (``llama.*`` hyperparameters,
``tokenizer.*``) and tensors, possibly quantized. This module reads it with
``gguf.GGUFReader`` (a memory map: only the pages of the tensors we touch are
read) and dequantizes with ``gguf.quants.dequantize``; nothing here decodes
a quantization format by hand.

* :func:`load_config` builds a :class:`LlamaConfig` from the ``llama.*`` keys
  (``tie_word_embeddings`` when the file has no ``output.weight``).
* :func:`load_tensors` maps the HF names the loaders in ``checkpoint`` use
  (``model.layers.N.self_attn.q_proj.weight``, ...) to GGUF names
  (``blk.N.attn_q.weight``, ...), dequantizes just those tensors, and undoes
  the row permutation llama.cpp's converter applies to Q and K for its rotary
  layout (the same reverse permutation as transformers' GGUF loader).
* :func:`model_hash` hashes the canonical config and every mapped tensor's
  name, GGML type, shape and raw (still quantized) bytes in sorted-name
  order; it dequantizes nothing and is memoised per file by
  (size, mtime, inode).

Anything unusable (not GGUF, truncated, another architecture, a tensor type
``gguf.quants`` cannot dequantize, missing or misshapen tensors) raises
:class:`fedswarm.errors.InputError` with one line naming the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import InputError
from .llama import LlamaConfig

__all__ = [
    "GGUF_MAGIC",
    "is_gguf",
    "open_gguf",
    "load_config",
    "weight_map",
    "load_tensors",
    "model_hash",
    "hf_to_gguf_name",
    "permute_for_gguf",
    "metadata",
]

GGUF_MAGIC = b"GGUF"
SUPPORTED_ARCHITECTURES = ("llama",)

_BLOCK_MAP = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.bias": "attn_output.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate_proj.bias": "ffn_gate.bias",
    "mlp.up_proj.bias": "ffn_up.bias",
    "mlp.down_proj.bias": "ffn_down.bias",
}
_BLOCK_MAP_REV = {v: k for k, v in _BLOCK_MAP.items()}
_HEAD_MAP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_HEAD_MAP_REV = {v: k for k, v in _HEAD_MAP.items()}
_HF_BLOCK_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_GGUF_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
# tensors llama.cpp files may carry that the computation does not use
_IGNORED = {"rope_freqs.weight"}


def hf_to_gguf_name(name: str) -> str:
    """HF tensor name -> GGUF tensor name (KeyError if it has none)."""
    if name in _HEAD_MAP:
        return _HEAD_MAP[name]
    m = _HF_BLOCK_RE.match(name)
    if m and m.group(2) in _BLOCK_MAP:
        return f"blk.{m.group(1)}.{_BLOCK_MAP[m.group(2)]}"
    raise KeyError(name)


def _gguf_to_hf_name(name: str) -> str | None:
    if name in _HEAD_MAP_REV:
        return _HEAD_MAP_REV[name]
    m = _GGUF_BLOCK_RE.match(name)
    if m and m.group(2) in _BLOCK_MAP_REV:
        return f"model.layers.{int(m.group(1))}.{_BLOCK_MAP_REV[m.group(2)]}"
    return None


def permute_for_gguf(w: np.ndarray | torch.Tensor, n_head: int) -> Any:
    """llama.cpp's converter permutation of Q/K rows (what a GGUF writer applies)."""
    shape = tuple(w.shape)
    dim = shape[0] // n_head // 2
    return w.reshape(n_head, 2, dim, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of :func:`permute_for_gguf` (transformers' reverse permutation)."""
    shape = w.shape
    dim = shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *shape[1:]).swapaxes(2, 1).reshape(shape)


def is_gguf(path: str | os.PathLike[str]) -> bool:
    """True for a regular file whose name ends in ``.gguf`` or that starts with the GGUF magic."""
    p = Path(path)
    if not p.is_file():
        return False
    if p.suffix.lower() == ".gguf":
        return True
    try:
        with open(p, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


# ----------------------------------------------------------------- reading

_SUPPORTED_QTYPES: dict[int, bool] = {}


def _qtype_supported(qtype: Any) -> bool:
    """Whether ``gguf.quants.dequantize`` handles ``qtype`` (probed on one zero block)."""
    import gguf

    key = int(qtype)
    if key not in _SUPPORTED_QTYPES:
        try:
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            gguf.quants.dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
            ok = True
        except (NotImplementedError, KeyError, ValueError, TypeError):
            ok = False
        _SUPPORTED_QTYPES[key] = ok
    return _SUPPORTED_QTYPES[key]


def _reader_class() -> Any:
    """``gguf.GGUFReader`` reading its header through a plain ndarray view of
    its memory map.

    The reader slices its ``np.memmap`` once or twice per metadata value, and
    every ``memmap`` slice pays for subclass bookkeeping: for SmolLM2's
    98,000 tokenizer strings that is most of a 3 s open. A plain view of the
    same mapping gives the same bytes (and the tensors stay views of the
    file) at a fraction of the cost. Everything else is gguf's own parsing.
    """
    import gguf

    class _Reader(gguf.GGUFReader):
        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self.__dict__["_plain"] = self.data.view(np.ndarray)
            count = int(count)
            dt = np.dtype(dtype)
            arr = plain[offset:offset + dt.itemsize * count].view(dt)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    return _Reader


@dataclass
class GGUFModel:
    """An opened, validated GGUF checkpoint (cached per file; see :func:`open_gguf`)."""

    path: Path
    reader: Any
    config: LlamaConfig
    tensors: dict[str, Any]  # HF name -> gguf ReaderTensor
    fingerprint: tuple[int, int, int]

    def field(self, key: str, default: Any = None) -> Any:
        f = self.reader.fields.get(key)
        if f is None:
            return default
        try:
            return f.contents()
        except Exception as e:  # noqa: BLE001 -- a malformed field in an untrusted file
            raise InputError(f"{self.path.name}: unreadable GGUF metadata field {key!r} ({e})") from None


_cache: dict[str, GGUFModel] = {}
_cache_lock = threading.Lock()


def _fp(p: Path) -> tuple[int, int, int]:
    try:
        st = p.stat()
    except OSError as e:
        raise InputError(f"cannot read model file {p}: {e.strerror or e}") from None
    return (st.st_size, st.st_mtime_ns, st.st_ino)


def _file_key(p: Path, fp: tuple[int, int, int]) -> str:
    return f"{p.stat().st_dev}:{fp[2]}"


def open_gguf(path: str | os.PathLike[str]) -> GGUFModel:
    """Open and validate ``path`` (memoised by (size, mtime, inode))."""
    p = Path(path).resolve()
    fp = _fp(p)
    key = _file_key(p, fp)  # hard links and renames of one file share an entry
    with _cache_lock:
        hit = _cache.get(key)
        if hit is not None and hit.fingerprint == fp:
            return hit
    m = _open_uncached(p, fp)
    with _cache_lock:
        _cache[key] = m
    return m


def _open_uncached(p: Path, fp: tuple[int, int, int]) -> GGUFModel:
    import gguf

    name = p.name
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise InputError(f"{name}: not a GGUF file (no GGUF magic at its start)")
    try:
        reader = _reader_class()(str(p), "r")
    except Exception as e:  # noqa: BLE001 -- gguf raises ValueError, IndexError, struct errors... on bad input
        detail = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise InputError(f"{name}: corrupt or truncated GGUF file ({detail})") from None
    size = fp[0]
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise InputError(f"{name}: truncated GGUF file (tensor {t.name} ends at byte {end}, file has {size})")
    m = GGUFModel(p, reader, None, {}, fp)  # type: ignore[arg-type]
    arch = m.field("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise InputError(
            f"{name}: unsupported GGUF architecture {arch!r}", f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    tensors: dict[str, Any] = {}
    for t in reader.tensors:
        hf = _gguf_to_hf_name(t.name)
        if hf is None:
            if t.name in _IGNORED:
                continue
            raise InputError(f"{name}: unexpected tensor {t.name!r} for a llama model")
        if not _qtype_supported(t.tensor_type):
            tname = getattr(t.tensor_type, "name", str(t.tensor_type))
            raise InputError(f"{name}: tensor {t.name} has quantization type {tname}, which gguf cannot dequantize")
        tensors[hf] = t
    m.tensors = tensors
    m.config = _config(m, arch)
    _check_shapes(m)
    return m


def _config(m: GGUFModel, arch: str) -> LlamaConfig:
    a = arch

    def get(key: str, default: Any = None) -> Any:
        return m.field(f"{a}.{key}", default)

    if "model.embed_tokens.weight" not in m.tensors:
        raise InputError(f"{m.path.name}: GGUF file has no token_embd.weight")
    embd = m.tensors["model.embed_tokens.weight"]
    vocab = get("vocab_size")
    if vocab is None:
        toks = m.reader.fields.get("tokenizer.ggml.tokens")
        vocab = len(toks.data) if toks is not None else int(embd.shape[1])
    heads = get("attention.head_count")
    hidden = get("embedding_length")
    d: dict[str, Any] = {
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": get("rope.freq_base", 10000.0),
        "max_position_embeddings": get("context_length", 2048),
        "tie_word_embeddings": "lm_head.weight" not in m.tensors,
        "attention_bias": "model.layers.0.self_attn.q_proj.bias" in m.tensors,
        "mlp_bias": "model.layers.0.mlp.gate_proj.bias" in m.tensors,
        "dtype": "float32",
        "fedswarm_tokenizer": "gguf",
    }
    head_dim = get("rope.dimension_count") or get("attention.key_length")
    if head_dim is not None:
        d["head_dim"] = head_dim
    for k in ("bos_token_id", "eos_token_id"):
        v = m.field(f"tokenizer.ggml.{k}")
        if v is not None:
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise InputError(f"{m.path.name}: GGUF tokenizer.ggml.{k} is not an integer")
            d[k] = int(v)
    stype = get("rope.scaling.type")
    if stype not in (None, "none"):
        if stype == "linear":
            d["rope_scaling"] = {"rope_type": "linear", "factor": get("rope.scaling.factor", 1.0)}
        else:
            raise InputError(f"{m.path.name}: unsupported rope scaling type {stype!r} in GGUF metadata")
    if "rope_freqs.weight" in {t.name for t in m.reader.tensors}:
        raise InputError(f"{m.path.name}: GGUF rope_freqs tensors (llama3 rope scaling) are not supported")
    for k, v in list(d.items()):
        if isinstance(v, np.generic):
            d[k] = v.item()
    try:
        cfg = LlamaConfig.from_hf_dict(d)
    except ValueError as e:
        raise InputError(f"{m.path.name}: unusable GGUF metadata: {e}") from None
    return cfg


def _expected_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    from .llama import block_keys, head_keys

    h, i, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    nq, nkv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    per = {
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (nq, h), "self_attn.k_proj.weight": (nkv, h),
        "self_attn.v_proj.weight": (nkv, h), "self_attn.o_proj.weight": (h, nq),
        "self_attn.q_proj.bias": (nq,), "self_attn.k_proj.bias": (nkv,), "self_attn.v_proj.bias": (nkv,),
        "self_attn.o_proj.bias": (h,), "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h),
        "mlp.down_proj.weight": (h, i), "mlp.gate_proj.bias": (i,), "mlp.up_proj.bias": (i,),
        "mlp.down_proj.bias": (h,),
    }
    heads = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,),
             "lm_head.weight": (cfg.vocab_size, h)}
    out = {k: heads[k] for k in head_keys(cfg)}
    for layer in range(cfg.num_hidden_layers):
        for k in block_keys(cfg, layer):
            out[k] = per[k.split(".", 3)[3]]
    return out


def _hf_shape(t: Any) -> tuple[int, ...]:
    # GGUF lists dimensions fastest-first; torch/numpy order is the reverse
    return tuple(int(x) for x in reversed(list(t.shape)))


def _check_shapes(m: GGUFModel) -> None:
    exp = _expected_shapes(m.config)
    for name, shape in exp.items():
        t = m.tensors.get(name)
        if t is None:
            raise InputError(f"{m.path.name}: GGUF file lacks tensor {hf_to_gguf_name(name)}")
        if _hf_shape(t) != shape:
            raise InputError(
                f"{m.path.name}: tensor {t.name} has shape {_hf_shape(t)}, the metadata implies {shape}"
            )
    extra = sorted(set(m.tensors) - set(exp))
    if extra:
        raise InputError(f"{m.path.name}: unexpected tensor {hf_to_gguf_name(extra[0])} for this config")


def load_config(path: str | os.PathLike[str]) -> LlamaConfig:
    return open_gguf(path).config


def metadata(path: str | os.PathLike[str], key: str, default: Any = None) -> Any:
    """One metadata value (``tokenizer.chat_template``, ...) of a GGUF file."""
    return open_gguf(path).field(key, default)


def weight_map(path: str | os.PathLike[str]) -> dict[str, str]:
    """HF tensor name -> the GGUF file's name (mirrors ``checkpoint.weight_map``)."""
    m = open_gguf(path)
    return {k: m.path.name for k in m.tensors}


def load_tensors(
    path: str | os.PathLike[str],
    names: Iterable[str],
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """Dequantize exactly ``names`` (HF names) to fp32 and cast to ``dtype``."""
    import gguf

    m = open_gguf(path)
    cfg = m.config
    out: dict[str, torch.Tensor] = {}
    for n in names:
        t = m.tensors.get(n)
        if t is None:
            raise InputError(f"{m.path.name}: GGUF file has no tensor for {n!r}")
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type)
        except Exception as e:  # noqa: BLE001 -- a damaged block in an untrusted file
            raise InputError(f"{m.path.name}: cannot dequantize tensor {t.name} ({e})") from None
        w = np.asarray(w, dtype=np.float32).reshape(_hf_shape(t))
        if n.endswith("self_attn.q_proj.weight"):
            w = _unpermute(w, cfg.num_attention_heads)
        elif n.endswith("self_attn.k_proj.weight"):
            w = _unpermute(w, cfg.num_key_value_heads)
        if not (w.flags.writeable and w.flags.c_contiguous):
            w = np.array(w, order="C", copy=True)  # F32 data is a read-only view of the file's map
        tt = torch.from_numpy(w)
        out[n] = tt.to(device=device, dtype=dtype or torch.float32)
    return out


# ----------------------------------------------------------------- hashing

_hash_cache: dict[str, tuple[tuple[int, int, int], str]] = {}
_hash_lock = threading.Lock()


def model_hash(path: str | os.PathLike[str]) -> str:
    """sha256 hex of the canonical config and every served tensor's name, GGML
    type, shape and raw bytes (sorted by HF name); no dequantization."""
    p = Path(path).resolve()
    fp = _fp(p)
    key = _file_key(p, fp)
    with _hash_lock:
        hit = _hash_cache.get(key)
        if hit is not None and hit[0] == fp:
            return hit[1]
    m = open_gguf(p)
    h = hashlib.sha256(b"fedswarm-gguf-v1\0")
    h.update(json.dumps(m.config.canonical(), sort_keys=True, separators=(",", ":")).encode())
    for name in sorted(m.tensors):
        t = m.tensors[name]
        tname = getattr(t.tensor_type, "name", str(int(t.tensor_type)))
        h.update(json.dumps([name, tname, list(_hf_shape(t)), int(t.n_bytes)]).encode() + b"\0")
        h.update(np.ascontiguousarray(t.data).data.cast("B"))
    digest = h.hexdigest()
    with _hash_lock:
        _hash_cache[key] = (fp, digest)
    return digest
