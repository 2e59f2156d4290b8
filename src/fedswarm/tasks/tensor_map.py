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
"""

from __future__ import annotations

import hashlib
import math
from typing import Any


from .registry import REF_FLOPS, TaskEstimate, check_cancelled, check_params, param_int

__all__ = ["TensorMapTask", "results_agree", "round_sig"]

MIN_SIZE, MAX_SIZE, DEFAULT_SIZE = 8, 4096, 64
MAX_ITERS = 1000
MAX_SEED = (1 << 63) - 1
MAX_SHARD = (1 << 32) - 1
SIG_DIGITS = 6
_PARAMS = frozenset({"seed", "size", "iters"})


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


class TensorMapTask:
    name = "tensor-map"

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

    def run(self, params: dict, shard: int, *, device: str = "cpu") -> dict:
        seed, n, iters = self._parse(params)
        if isinstance(shard, bool) or not isinstance(shard, int) or not 0 <= shard <= MAX_SHARD:
            raise ValueError(f"shard must be an int in [0, {MAX_SHARD}]")
        import torch  # lazily: clients estimate shards without loading torch

        dev = torch.device(device)
        if dev.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = False
        g = torch.Generator(device="cpu").manual_seed(_seed(seed, shard))
        with torch.no_grad():
            a = torch.randn(n, n, generator=g, dtype=torch.float32).to(dev)
            b = torch.randn(n, n, generator=g, dtype=torch.float32).to(dev)
            norms = []
            for k in range(iters):
                c = torch.sin(a + float(k)) @ b
                norms.append(float(c.double().square().sum().item()))
                check_cancelled()
        rounded = [round_sig(x) for x in norms]
        digest = hashlib.sha256(
            f"{n}:{iters}:".encode() + ",".join(f"{x:.{SIG_DIGITS - 1}e}" for x in rounded).encode()
        ).hexdigest()
        return {"checksum": round_sig(math.fsum(norms)), "size": n, "iters": iters, "digest": digest}
