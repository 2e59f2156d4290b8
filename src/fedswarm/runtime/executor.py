"""Run task shards from trio code without blocking the event loop.

``ShardExecutor.run(kind, params, shard)``:

1. looks the task up in the registry (``UnknownTask``, a ``ValueError``, if
   absent) and asks it for an estimate (``ValueError`` for bad params);
2. waits for one of ``slots`` execution slots (a ``trio.CapacityLimiter``);
3. admits the shard only if ``estimate.mem_bytes`` fits the free memory of the
   device (``torch.cuda.mem_get_info`` plus what torch's caching allocator
   holds unused, on GPU; ``MemAvailable`` / psutil / ``sysconf`` on CPU;
   optionally capped by ``mem_limit_bytes``) minus the estimates of shards
   already running, scaled by ``headroom``; else raises :class:`ShardRejected`;
4. runs ``task.run`` on a worker thread (``trio.to_thread.run_sync``) so the
   loop stays live, timing it and measuring energy.

Checkpointed re-runs: ``run(..., resume=state, left=share, on_checkpoint=fn)``.
A resumable task (``fedswarm.tasks.registry.is_resumable``) continues from
``resume`` and calls ``fn(done, state)`` on the worker thread at its step
boundaries, after the executor checked ``0 < done < 1`` and the state's size
(a violation is the task's bug and raises in it). ``fn`` must return quickly;
calls after the shard was cancelled are dropped. Any other task ignores both
and runs the whole shard. ``left`` is the share of the shard's work the run
does when it resumes; it scales the throughput sample, so a resumed run that
takes a third of the time is not taken for a three times faster peer.

Cancellation: cancelling ``run`` returns at once (the thread is abandoned) and
sets the shard's cancel flag, which tasks poll between steps via
``fedswarm.tasks.check_cancelled``. A torch kernel already launched cannot be
interrupted, so an abandoned shard may keep its thread, its slot and its
memory reservation until the current step ends; the slot and reservation are
released only when the thread really finishes, so admission stays honest.

Energy: with a GPU and ``pynvml`` importable, the NVML total-energy counter
(or the power reading times the wall time on older GPUs) of the device; it
includes whatever else ran on that GPU meanwhile, e.g. concurrent shards when
``slots > 1``. Otherwise a ``power_model``: constant watts, or a callable
``(device, wall_seconds) -> joules``. Otherwise ``None``.

Clock levels: ``set_level(f)`` applies a relative clock ``f`` in (0, 1] to
the GPU through NVML (locked graphics clocks at ``f`` times the maximum),
which needs administrator rights; without them, without NVML, or on CPU it
applies nothing and returns False, and the level stays a modelled one (the
peer charges ``PowerModel.power(level)`` per second of run time). ``f = 1``
releases the lock.

Throughput: per task kind, an exponential moving average of
``estimate.ref_seconds / wall_seconds``, i.e. this peer's speed in reference
GPU-equivalents (see ``fedswarm.tasks.registry.REF_FLOPS``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import trio

from ..errors import FederationError
from ..tasks.registry import (
    MAX_CHECKPOINT_BYTES,
    Checkpoint,
    TaskRegistry,
    cancellation,
    default_registry,
    is_resumable,
    run_task,
)

__all__ = ["ShardExecutor", "ExecResult", "ShardRejected", "PowerModel", "cpu_free_memory"]

log = logging.getLogger(__name__)

PowerModel = float | Callable[[str, float], float] | None


class ShardRejected(FederationError):
    """The shard was not admitted (it would not fit the device's free memory)."""

    def __init__(self, reason: str, *, needed: int, available: int) -> None:
        super().__init__(f"{reason}: needs {needed} bytes, {available} available")
        self.reason, self.needed, self.available = reason, needed, available


@dataclass(frozen=True)
class ExecResult:
    """One shard's run; ``ref_seconds`` counts the work this run did (the
    estimate times ``left`` when it resumed)."""

    kind: str
    shard: int
    result: dict
    wall_seconds: float
    device: str
    energy_joules: float | None
    ref_seconds: float
    mem_bytes: int


def cpu_free_memory() -> int:
    """Available host memory in bytes (MemAvailable, else psutil, else sysconf)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil  # type: ignore[import-not-found]

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _check_plain(obj: Any, depth: int = 0) -> None:
    if depth > 32:
        raise TypeError("task result nested too deeply")
    if obj is None or isinstance(obj, (str, int, float, bool, bytes)):
        return
    if isinstance(obj, (list, tuple)):
        for x in obj:
            _check_plain(x, depth + 1)
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, (str, int)):
                raise TypeError(f"task result has a non-str key {k!r}")
            _check_plain(v, depth + 1)
        return
    raise TypeError(f"task result holds a {type(obj).__name__}, which is not msgpack-serialisable")


class _Slot:
    """A limiter token taken before the thread starts; trio's to_thread calls
    ``release_on_behalf_of`` when the thread really finishes (even if abandoned)."""

    def __init__(self, limiter: trio.CapacityLimiter, on_release: Callable[[], None]) -> None:
        self._limiter, self._on_release, self._released = limiter, on_release, False

    async def acquire(self) -> None:
        await self._limiter.acquire_on_behalf_of(self)

    async def acquire_on_behalf_of(self, borrower: object) -> None:  # already held
        pass

    def release_on_behalf_of(self, borrower: object = None) -> None:
        if not self._released:
            self._released = True
            self._on_release()
            self._limiter.release_on_behalf_of(self)


class ShardExecutor:
    def __init__(
        self,
        registry: TaskRegistry | None = None,
        *,
        device: str | None = None,
        slots: int = 1,
        power_model: PowerModel = None,
        mem_limit_bytes: int | None = None,
        headroom: float = 0.9,
        ema_alpha: float = 0.2,
        use_nvml: bool = True,
    ) -> None:
        if slots < 1:
            raise ValueError("slots must be >= 1")
        if not 0 < ema_alpha <= 1 or not 0 < headroom <= 1:
            raise ValueError("ema_alpha and headroom must be in (0, 1]")
        self.registry = registry or default_registry()
        if device is None:
            device = "cuda:0" if torch.cuda.is_available() else "cpu"
        dev = torch.device(device)
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError("CUDA requested but not available")
            dev = torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())
        elif dev.type != "cpu":
            raise ValueError(f"unsupported device {device!r}")
        self._dev = dev
        self.slots = slots
        self._limiter = trio.CapacityLimiter(slots)
        self.power_model = power_model
        self.mem_limit_bytes = mem_limit_bytes
        self.headroom = headroom
        self.ema_alpha = ema_alpha
        self._reserved = 0
        self._running = 0
        self._state_lock = threading.Lock()
        self._throughput: dict[str, float] = {}
        self._nvml = self._init_nvml() if use_nvml and dev.type == "cuda" else None

    # ----------------------------------------------------------- devices
    @property
    def device(self) -> str:
        return str(self._dev)

    @property
    def running(self) -> int:
        """Shards whose threads are alive (including abandoned ones)."""
        return self._running

    def _init_nvml(self) -> Any:
        try:
            import pynvml

            pynvml.nvmlInit()
            try:
                uuid = str(torch.cuda.get_device_properties(self._dev).uuid)
                handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
            except Exception:
                handle = pynvml.nvmlDeviceGetHandleByIndex(self._dev.index or 0)
            return pynvml, handle
        except Exception:  # not installed, no driver, ...
            log.info("NVML unavailable; energy comes from the power model", exc_info=True)
            return None

    def set_level(self, level: float) -> bool:
        """Lock the GPU's graphics clock at ``level`` x its maximum; True if applied."""
        if self._nvml is None or self._clock_denied:
            return False
        if not 0 < level <= 1:
            raise ValueError("level must be in (0, 1]")
        pynvml, h = self._nvml
        try:
            if level >= 1.0:
                pynvml.nvmlDeviceResetGpuLockedClocks(h)
            else:
                top = pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_GRAPHICS)
                mhz = max(int(top * level), 1)
                pynvml.nvmlDeviceSetGpuLockedClocks(h, mhz, mhz)
        except Exception as exc:  # no permission, unsupported GPU: modelled from now on
            self._clock_denied = True
            log.info("cannot set GPU clocks (%r); clock levels are modelled", exc)
            return False
        self.level = level
        return True

    _clock_denied = False
    level = 1.0  # the clock level last applied

    def _energy_mark(self) -> tuple[str, float] | None:
        if self._nvml is None:
            return None
        pynvml, h = self._nvml
        try:
            return "mJ", float(pynvml.nvmlDeviceGetTotalEnergyConsumption(h))
        except Exception:
            try:
                return "mW", float(pynvml.nvmlDeviceGetPowerUsage(h))
            except Exception:
                return None

    def _energy(self, start: tuple[str, float] | None, wall: float) -> float | None:
        end = self._energy_mark()
        if start is not None and end is not None and start[0] == end[0]:
            if start[0] == "mJ":
                return (end[1] - start[1]) / 1000.0
            return (start[1] + end[1]) / 2 / 1000.0 * wall
        pm = self.power_model
        if pm is None:
            return None
        if callable(pm):
            return float(pm(self.device, wall))
        return float(pm) * wall

    def total_memory(self) -> int:
        if self._dev.type == "cuda":
            return int(torch.cuda.mem_get_info(self._dev)[1])
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return min(total, self.mem_limit_bytes) if self.mem_limit_bytes else total

    def free_memory(self) -> int:
        """Bytes a new shard may use now (before the ``headroom`` factor)."""
        if self._dev.type == "cuda":
            free = int(torch.cuda.mem_get_info(self._dev)[0])
            # memory torch's caching allocator holds but does not use is ours to reuse
            free += torch.cuda.memory_reserved(self._dev) - torch.cuda.memory_allocated(self._dev)
        else:
            free = cpu_free_memory()
        with self._state_lock:
            reserved = self._reserved
        if self.mem_limit_bytes is not None:
            free = min(free, self.mem_limit_bytes)
        return max(0, free - reserved)

    # ---------------------------------------------------------- running
    def throughput(self) -> dict[str, float]:
        """Per task kind: EMA of ref_seconds / wall_seconds (reference GPU-equivalents)."""
        with self._state_lock:
            return dict(self._throughput)

    def _release(self, mem: int) -> None:
        with self._state_lock:
            self._reserved -= mem
            self._running -= 1

    async def run(self, kind: str, params: dict, shard: int, *, resume: bytes = b"", left: float = 1.0,
                  on_checkpoint: Checkpoint | None = None) -> ExecResult:
        """Run one shard (see the module docstring); ``resume``, ``left`` and
        ``on_checkpoint`` matter only to resumable tasks."""
        if not isinstance(resume, bytes) or len(resume) > MAX_CHECKPOINT_BYTES:
            raise ValueError(f"resume must be at most {MAX_CHECKPOINT_BYTES} bytes")
        if not 0 < left <= 1:
            raise ValueError("left must be in (0, 1]")
        task = self.registry.get(kind)
        resumable = is_resumable(task)
        if not resumable or not resume:
            left = 1.0  # the whole shard runs
        est = await trio.to_thread.run_sync(task.estimate, params)
        mem = int(est.mem_bytes)
        cap = int(self.total_memory() * self.headroom)
        if mem > cap:
            raise ShardRejected("shard can never fit this device", needed=mem, available=cap)

        slot = _Slot(self._limiter, lambda: self._release(mem))
        await slot.acquire()
        try:
            avail = int(self.free_memory() * self.headroom)
            if mem > avail:
                raise ShardRejected("not enough free memory now", needed=mem, available=avail)
        except BaseException:
            self._limiter.release_on_behalf_of(slot)
            raise
        with self._state_lock:
            self._reserved += mem
            self._running += 1

        dev = self._dev
        cancel = threading.Event()
        checkpoint: Checkpoint | None = None
        if on_checkpoint is not None and resumable:
            report = on_checkpoint

            def checkpoint(done: float, state: bytes) -> None:
                if isinstance(done, bool) or not isinstance(done, (int, float)) or not 0 < done < 1:
                    raise ValueError(f"task {kind!r}: checkpoint done must be in (0, 1), got {done!r}")
                if not isinstance(state, bytes) or not 0 < len(state) <= MAX_CHECKPOINT_BYTES:
                    raise ValueError(f"task {kind!r}: checkpoint state must be 1..{MAX_CHECKPOINT_BYTES} bytes")
                if not cancel.is_set():  # an abandoned run's progress is no one's
                    report(float(done), state)

        def work() -> tuple[dict, float, float | None]:
            with cancellation(cancel):
                if dev.type == "cuda":
                    torch.cuda.set_device(dev)
                e0 = self._energy_mark()
                t0 = time.perf_counter()
                result = run_task(task, params, shard, device=str(dev), resume=resume, checkpoint=checkpoint)
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                wall = time.perf_counter() - t0
                energy = self._energy(e0, wall)
                if not isinstance(result, dict):
                    raise TypeError(f"task {kind!r} returned {type(result).__name__}, not a dict")
                _check_plain(result)
                return result, wall, energy

        try:
            result, wall, energy = await trio.to_thread.run_sync(
                work,
                # a _Slot has CapacityLimiter's acquire/release_on_behalf_of, all that trio calls
                limiter=slot,  # type: ignore[arg-type]
                abandon_on_cancel=True,
                thread_name=f"shard {kind}#{shard}",
            )
        finally:
            cancel.set()  # no-op if the thread already finished
        if est.ref_seconds > 0:
            sample = est.ref_seconds * left / max(wall, 1e-9)
            with self._state_lock:
                old = self._throughput.get(kind)
                self._throughput[kind] = sample if old is None else (
                    self.ema_alpha * sample + (1 - self.ema_alpha) * old
                )
        return ExecResult(
            kind=kind, shard=shard, result=result, wall_seconds=wall, device=str(dev),
            energy_joules=energy, ref_seconds=est.ref_seconds * left, mem_bytes=mem,
        )
