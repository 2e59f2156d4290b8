"""``tensor-map``: a deterministic, size-tunable numeric shard.

Shard ``i`` of a job with seed ``S`` computes, for ``k = 0 .. iters-1``::

    A, B   ~ N(0, 1)^(n x n)   from a CPU torch.Generator seeded by sha256("tensor-map", S, i)
    C_k    = sin(A + k) @ B    (float32 matmul on the device)
    norm_k = sum(C_k ** 2)     (reduced in float64)

and returns ``checksum = sum_k norm_k`` and a ``digest`` over the per-iteration
norms, each rounded to 6 significant digits.

Determinism: inputs are drawn on the CPU, so every peer multiplies identical
matrices. The float32 matmul itself differs by a few ulps between CPU/GPU
kernels and thread counts, but a sum of squares has no cancellation and the
errors average out over n^2 entries, so the relative error of each norm is
~1e-9, far below the 1e-6 rounding quantum. A value lying within that error
of a rounding boundary can still round differently (rare); verifiers that
compare heterogeneous peers should use :func:`results_agree` (relative
tolerance on the checksum) rather than demand equal digests. Each iteration
uses a fresh nonlinear left operand so no iteration can be derived from
another, and errors do not compound. On CUDA, TF32 matmul is disabled for
this reason (a process-wide torch setting).

Cost: ``2 n^3`` flops per iteration (n in 8..4096, iters in 1..1000), i.e.
from microseconds to minutes per shard.

Resumable (see ``fedswarm.tasks.registry``): after each iteration but the
last, the run calls ``checkpoint(k / iters, state)`` where ``state`` is the
msgpack map ``{"v": 1, "seed", "size", "iters", "shard", "k", "norms"}``
holding the ``k`` norms computed so far (as float64, exactly). Since the
iterations are independent, a run resumed from such a state draws the same
``A`` and ``B``, computes iterations ``k .. iters-1`` only, and returns
exactly what an uninterrupted run returns. The state comes from whichever
peer ran the shard before, so it is checked strictly: this version, these
params and this shard, ``1 <= k < iters``, ``k`` finite non-negative floats
and nothing else; anything else is a ``BadResumeState``. What the check
cannot tell is whether the norms are *right*: a run resumed from a forged
state returns a wrong result, so the client takes checkpoints only from
peers whose results it would accept anyway.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import msgpack

from .registry import (
    MAX_CHECKPOINT_BYTES,
    REF_FLOPS,
    BadResumeState,
    Checkpoint,
    TaskEstimate,
    check_cancelled,
    check_params,
    param_int,
)

__all__ = ["TensorMapTask", "results_agree", "round_sig", "encode_state", "decode_state"]

MIN_SIZE, MAX_SIZE, DEFAULT_SIZE = 8, 4096, 64
MAX_ITERS = 1000
MAX_SEED = (1 << 63) - 1
MAX_SHARD = (1 << 32) - 1
SIG_DIGITS = 6
_PARAMS = frozenset({"seed", "size", "iters"})
STATE_VERSION = 1
_STATE_KEYS = frozenset({"v", "seed", "size", "iters", "shard", "k", "norms"})


def round_sig(x: float, digits: int = SIG_DIGITS) -> float:
    """Round to ``digits`` significant digits (float, via its decimal repr)."""
    if x == 0 or not math.isfinite(x):
        return float(x)
    return float(f"{x:.{digits - 1}e}")


def results_agree(a: dict[str, Any], b: dict[str, Any], rel: float = 1e-5) -> bool:
    """Whether two tensor-map results for the same shard agree within ``rel``."""
    if a.get("size") != b.get("size") or a.get("iters") != b.get("iters"):
        return False
    ca, cb = float(a["checksum"]), float(b["checksum"])
    return math.isclose(ca, cb, rel_tol=rel)


def _seed(seed: int, shard: int) -> int:
    h = hashlib.sha256(f"tensor-map\0{seed}\0{shard}".encode()).digest()
    return int.from_bytes(h[:8], "little") & MAX_SEED


def encode_state(seed: int, size: int, iters: int, shard: int, norms: list[float]) -> bytes:
    """A checkpoint after ``len(norms)`` iterations of shard ``shard``."""
    return msgpack.packb(
        {"v": STATE_VERSION, "seed": seed, "size": size, "iters": iters, "shard": shard, "k": len(norms),
         "norms": norms},
        use_bin_type=True,
    )


def decode_state(raw: object, seed: int, size: int, iters: int, shard: int) -> list[float]:
    """The norms a checkpoint holds, if it is one of this shard's under these
    params; else ``BadResumeState`` (it may come from any peer)."""
    if not isinstance(raw, bytes) or not 0 < len(raw) <= MAX_CHECKPOINT_BYTES:
        raise BadResumeState(f"a tensor-map resume state is 1..{MAX_CHECKPOINT_BYTES} bytes")
    try:
        st = msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=True,
                             max_array_len=MAX_ITERS, max_map_len=len(_STATE_KEYS), max_ext_len=0)
    except Exception as exc:  # msgpack raises several kinds for malformed input
        raise BadResumeState(f"tensor-map resume state is not valid msgpack: {type(exc).__name__}") from None
    if not isinstance(st, dict) or set(st) != _STATE_KEYS:
        raise BadResumeState(f"tensor-map resume state must be a map of exactly {sorted(_STATE_KEYS)}")

    def exact_int(key: str) -> int:
        v = st[key]
        if isinstance(v, bool) or not isinstance(v, int):
            raise BadResumeState(f"tensor-map resume state: {key!r} must be an int")
        return v

    if exact_int("v") != STATE_VERSION:
        raise BadResumeState(f"tensor-map resume state has version {st['v']}, not {STATE_VERSION}")
    for key, want in (("seed", seed), ("size", size), ("iters", iters), ("shard", shard)):
        if exact_int(key) != want:
            raise BadResumeState(f"tensor-map resume state is for {key} {st[key]}, not {want}")
    k = exact_int("k")
    if not 1 <= k < iters:
        raise BadResumeState(f"tensor-map resume state has k {k}, not in [1, {iters - 1}]")
    norms = st["norms"]
    if not isinstance(norms, list) or len(norms) != k:
        raise BadResumeState(f"tensor-map resume state must hold {k} norms")
    if not all(isinstance(x, float) and math.isfinite(x) and x >= 0.0 for x in norms):
        raise BadResumeState("tensor-map resume state norms must be finite non-negative floats")
    return norms


class TensorMapTask:
    name = "tensor-map"
    resumable = True

    def _parse(self, params: dict) -> tuple[int, int, int]:
        check_params(params, _PARAMS)
        seed = param_int(params, "seed", 0, 0, MAX_SEED)
        size = param_int(params, "size", DEFAULT_SIZE, MIN_SIZE, MAX_SIZE)
        iters = param_int(params, "iters", 1, 1, MAX_ITERS)
        return seed, size, iters

    def estimate(self, params: dict) -> TaskEstimate:
        _, n, iters = self._parse(params)
        # A, B (on CPU and device), sin(A+k), C (fp32) + C**2 in fp64.
        mem = 4 * n * n * 4 + 8 * n * n + (1 << 20)
        flops = 2.0 * n**3 * iters
        return TaskEstimate(mem_bytes=mem, ref_seconds=flops / REF_FLOPS + 1e-4 * iters)

    def run(self, params: dict, shard: int, *, device: str = "cpu", resume: bytes | None = None,
            checkpoint: Checkpoint | None = None) -> dict:
        seed, n, iters = self._parse(params)
        if isinstance(shard, bool) or not isinstance(shard, int) or not 0 <= shard <= MAX_SHARD:
            raise ValueError(f"shard must be an int in [0, {MAX_SHARD}]")
        # checked before torch loads and before A and B are drawn: a bad state costs nothing
        norms = decode_state(resume, seed, n, iters, shard) if resume is not None else []
        import torch  # lazily: clients estimate shards without loading torch

        dev = torch.device(device)
        if dev.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = False
        g = torch.Generator(device="cpu").manual_seed(_seed(seed, shard))
        with torch.no_grad():
            a = torch.randn(n, n, generator=g, dtype=torch.float32).to(dev)
            b = torch.randn(n, n, generator=g, dtype=torch.float32).to(dev)
            for k in range(len(norms), iters):
                c = torch.sin(a + float(k)) @ b
                norms.append(float(c.double().square().sum().item()))
                check_cancelled()
                if checkpoint is not None and k + 1 < iters:
                    # O(k) per call, O(iters^2) in all: under 1 ms per call at iters = 1000
                    checkpoint((k + 1) / iters, encode_state(seed, n, iters, shard, norms))
        rounded = [round_sig(x) for x in norms]
        digest = hashlib.sha256(
            f"{n}:{iters}:".encode() + ",".join(f"{x:.{SIG_DIGITS - 1}e}" for x in rounded).encode()
        ).hexdigest()
        return {"checksum": round_sig(math.fsum(norms)), "size": n, "iters": iters, "digest": digest}
