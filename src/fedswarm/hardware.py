"""What this machine has: CPU, memory, accelerators, power limits.

``peer start`` without ``--profile`` calls :func:`detect` and writes the
result with :func:`profile_toml` to ``DATA_DIR/profile.toml``: a profile in
the format of ``peers/*.toml`` that the operator can edit (throughput and the
power curve are estimates; the file says so). :func:`check_devices` refuses a
profile that claims accelerators this machine does not have.

Sources, each optional: ``os`` and ``/proc`` for CPUs and memory, torch for
CUDA/ROCm/MPS devices and their memory, NVML for power limits (the
``pynvml`` module when importable, else ``nvidia-smi`` when on PATH).
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Any

from .errors import InputError

__all__ = ["Accelerator", "Machine", "detect", "profile_toml", "check_devices", "available_counts"]

GIB = 1 << 30


@dataclass(frozen=True)
class Accelerator:
    kind: str  # cuda | rocm | mps
    name: str
    mem_bytes: int
    power_limit_w: float | None = None  # NVML enforced power limit
    power_default_w: float | None = None


@dataclass(frozen=True)
class Machine:
    cpu_name: str
    cpu_count: int
    mem_bytes: int
    accelerators: tuple[Accelerator, ...] = ()
    power_source: str = "none"  # where power limits came from: nvml | nvidia-smi | none
    notes: tuple[str, ...] = field(default=())

    def count(self, kind: str) -> int:
        return sum(1 for a in self.accelerators if a.kind == kind)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _mem_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 8 * GIB


def _torch_accelerators() -> list[Accelerator]:
    try:
        import torch
    except ImportError:
        return []
    out: list[Accelerator] = []
    try:
        if torch.cuda.is_available():
            kind = "rocm" if getattr(torch.version, "hip", None) else "cuda"
            for i in range(torch.cuda.device_count()):
                p = torch.cuda.get_device_properties(i)
                out.append(Accelerator(kind, p.name, int(p.total_memory)))
        elif getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            out.append(Accelerator("mps", "Apple MPS", _mem_bytes()))
    except Exception:  # a broken driver reads as no device, never as a crash
        return []
    return out


def _nvml_limits() -> tuple[str, list[tuple[float | None, float | None]]]:
    """Per-GPU (enforced limit W, default limit W), and where they came from."""
    try:
        import pynvml
    except ImportError:
        pynvml = None
    if pynvml is not None:
        try:
            pynvml.nvmlInit()
            try:
                out = []
                for i in range(pynvml.nvmlDeviceGetCount()):
                    h = pynvml.nvmlDeviceGetHandleByIndex(i)
                    lim = pynvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0
                    try:
                        dflt = pynvml.nvmlDeviceGetPowerManagementDefaultLimit(h) / 1000.0
                    except Exception:
                        dflt = None
                    out.append((lim, dflt))
                return "nvml", out
            finally:
                pynvml.nvmlShutdown()
        except Exception:
            pass
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            r = subprocess.run([smi, "--query-gpu=power.limit,power.default_limit", "--format=csv,noheader,nounits"],
                               capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return "none", []
        if r.returncode == 0:
            out = []
            for line in r.stdout.strip().splitlines():
                vals: list[float | None] = []
                for cell in line.split(",")[:2]:
                    try:
                        vals.append(float(cell))
                    except ValueError:
                        vals.append(None)
                while len(vals) < 2:
                    vals.append(None)
                out.append((vals[0], vals[1]))
            return "nvidia-smi", out
    return "none", []


def detect() -> Machine:
    """Read this machine (imports torch when installed)."""
    accs = _torch_accelerators()
    source = "none"
    if any(a.kind == "cuda" for a in accs):
        source, limits = _nvml_limits()
        cuda = [i for i, a in enumerate(accs) if a.kind == "cuda"]
        for j, i in enumerate(cuda):
            if j < len(limits):
                lim, dflt = limits[j]
                a = accs[i]
                accs[i] = Accelerator(a.kind, a.name, a.mem_bytes, lim, dflt)
    return Machine(_cpu_name(), _cpu_count(), _mem_bytes(), tuple(accs), source)


def available_counts(machine: Machine | None = None) -> dict[str, int]:
    """Accelerators by kind (``cpu`` always counts as present)."""
    if machine is None:
        accs = _torch_accelerators()
    else:
        accs = list(machine.accelerators)
    out = {"cpu": 1 << 30}
    for a in accs:
        out[a.kind] = out.get(a.kind, 0) + 1
    return out


def check_devices(profile: Any, *, simulate: bool = False, counts: dict[str, int] | None = None) -> list[str]:
    """Refuse a profile whose accelerators this machine lacks.

    Returns warnings (with ``simulate``); raises ``InputError`` otherwise.
    """
    want: dict[str, int] = {}
    for d in profile.devices:
        if d.kind != "cpu":
            want[d.kind] = want.get(d.kind, 0) + d.count
    if not want:
        return []
    counts = available_counts() if counts is None else counts
    problems = []
    for kind, n in sorted(want.items()):
        have = counts.get(kind, 0)
        if n > have:
            problems.append(f"profile {profile.name} claims {n} {kind} device{'s' if n > 1 else ''}, "
                            f"this machine has {have}")
    if problems and not simulate:
        raise InputError("; ".join(problems),
                         "omit --profile to detect this machine, or pass --simulate-devices to run anyway")
    return [p + " (simulated: shards run on what is here)" for p in problems]


def _q(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def profile_toml(m: Machine, *, name: str = "this-machine") -> str:
    """An editable profile (``peers/*.toml`` format) for machine ``m``."""
    lines = [
        f"# Detected by `peer start` on {platform.node() or 'this machine'}: edit freely, then restart the peer.",
        f"# {m.cpu_count} CPU(s) ({m.cpu_name}), {m.mem_bytes / GIB:.1f} GiB memory, "
        f"{len(m.accelerators)} accelerator(s); power limits from: {m.power_source}.",
        "# throughput and [power] are estimates: measure and correct them (see peers/*.toml for examples).",
        f"name = {_q(name)}",
        f"description = {_q('detected: ' + (', '.join(sorted({a.name for a in m.accelerators})) or m.cpu_name))}",
        'trust = "volunteer"',
        'region = ""',
        "energy_price = 0.2",
        "carbon_g_kwh = 300.0",
        "",
    ]
    groups: dict[tuple[str, str, int], list[Accelerator]] = {}
    for a in m.accelerators:
        groups.setdefault((a.kind, a.name, a.mem_bytes), []).append(a)
    for (kind, aname, mem), accs in groups.items():
        lines += ["[[devices]]", f'kind = "{kind}"', f"name = {_q(aname)}", f"count = {len(accs)}",
                  f"mem_gb = {max(round(mem / GIB, 1), 0.1)}", ""]
    if not groups:
        lines += ["[[devices]]", 'kind = "cpu"', f"name = {_q(m.cpu_name)}", "count = 1",
                  f"mem_gb = {max(round(m.mem_bytes / GIB, 1), 0.1)}", ""]
    if groups:
        thr = 0.3  # a guess for an unknown GPU against the A100 reference
    else:
        thr = round(min(max(0.0025 * m.cpu_count, 0.005), 0.2), 4)
    lines += ["[throughput]", "# relative to one NVIDIA A100 SXM4 at full clock (= 1.0)", f'"*" = {thr}', ""]
    limits = [a.power_limit_w for a in m.accelerators if a.power_limit_w]
    if limits:
        max_w = round(max(limits), 1)
        idle_w = round(0.15 * max_w, 1)
        note = "# per device: max_w is the NVML enforced power limit, idle_w a guess (15%)"
    elif groups:
        max_w, idle_w = 250.0, 30.0
        note = "# per device: no NVML power limit found; both values are guesses"
    else:
        max_w = float(min(15 + 5 * m.cpu_count, 400))
        idle_w = 5.0
        note = "# CPU package power: guesses from the core count"
    lines += ["[power]", note, f"idle_w = {idle_w}", f"max_w = {max_w}", "alpha = 2.5", "levels = [1.0]", ""]
    return "\n".join(lines)
