"""Task kinds a peer can execute, registered by name.

A *task* is any object with::

    name: str
    def estimate(self, params: dict) -> TaskEstimate
    def run(self, params: dict, shard: int, *, device: str) -> dict

``params`` come from untrusted clients. Tasks validate them strictly and raise
``ValueError`` with a clear message; they never run client code and never
unpickle anything. ``run`` returns a msgpack-serialisable dict (str, int,
float, bool, bytes, None, lists and dicts only) and is a plain blocking
function: the executor runs it on a worker thread. Long tasks should call
:func:`check_cancelled` between steps so an abandoned shard stops early.

Resumable tasks (checkpointed re-runs). A task that sets ``resumable = True``
is called as::

    def run(self, params, shard, *, device, resume: bytes | None = None,
            checkpoint: Callable[[float, bytes], None] | None = None) -> dict

and promises three things:

* at its natural step boundaries it calls ``checkpoint(done, state)``:
  ``done`` is the share of the *whole* shard's work behind it (strictly
  between 0 and 1, counting what a resumed-from run had done), ``state`` its
  own encoding of that progress (non-empty bytes, at most
  ``MAX_CHECKPOINT_BYTES``). It may call as often as it likes (the peer
  forwards at most one per ``checkpoint_min_s``), but should encode only
  when it calls, not keep re-encoding between calls. The callback returns
  at once (the state is handed to the event loop, not sent from the
  task's thread); a cancelled run's checkpoints are dropped. A ``done`` or
  ``state`` out of those bounds is the task's bug: the executor raises
  ``ValueError`` from the call.
* given ``resume`` (a ``state`` from an earlier call, possibly by *another*
  peer's run of the same shard, so untrusted), it continues from there. It
  validates the state as strictly as ``params`` and raises
  :class:`BadResumeState` (a ``ValueError``) for anything malformed or
  made for other params or another shard.
* a resumed run returns exactly what an uninterrupted run returns: the
  swarm compares results of different attempts, and the client cannot tell
  a resumed result from a fresh one.

A task without ``resumable`` (or with it false) is called as before and
never receives ``resume``: a re-run after a lost peer runs the whole shard
again, which is slower but just as correct. Use :func:`run_task` to call a
task either way.

Built-ins (``tensor-map``, ``llm-batch``) are imported lazily on first use, so
importing this module does not import torch. Operators add kinds through the
``fedswarm.tasks`` entry-point group; the entry point may name a task
instance, a task class or a zero-argument factory. A plugin cannot replace a
built-in, and one that fails to load is logged and skipped.
"""

from __future__ import annotations

import importlib
import logging
import math
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "TaskEstimate",
    "Task",
    "TaskRegistry",
    "UnknownTask",
    "TaskCancelled",
    "ResumableTask",
    "BadResumeState",
    "Checkpoint",
    "MAX_CHECKPOINT_BYTES",
    "is_resumable",
    "run_task",
    "ENTRY_POINT_GROUP",
    "REF_FLOPS",
    "REF_MEM_BW",
    "default_registry",
    "get_task",
    "check_cancelled",
    "cancellation",
    "check_params",
    "param_int",
    "param_float",
    "param_bool",
    "param_str",
]

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "fedswarm.tasks"

#: The reference GPU-equivalent that ``TaskEstimate.ref_seconds`` is expressed
#: in: 20 TFLOP/s sustained fp32 matmul and 500 GB/s memory bandwidth (roughly
#: an A10 / RTX 3080 class card). A peer's measured speed relative to it is the
#: executor's throughput().
REF_FLOPS = 20e12
REF_MEM_BW = 500e9

_BUILTINS: dict[str, str] = {
    "tensor-map": "fedswarm.tasks.tensor_map:TensorMapTask",
    "llm-batch": "fedswarm.tasks.llm:LlmBatchTask",
}
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")

#: The largest checkpoint state a task may hand ``checkpoint`` (the wire's
#: limit on a ``ShardCheckpoint``, ``fedswarm.core.wire.MAX_CHECKPOINT_BYTES``,
#: repeated here so that tasks need not import the core; a test ties the two).
MAX_CHECKPOINT_BYTES = 1024 * 1024

#: ``checkpoint(done, state)``: what a resumable task calls to save progress
Checkpoint = Callable[[float, bytes], None]


@dataclass(frozen=True)
class TaskEstimate:
    """Resources one shard needs: peak bytes on the device, and seconds on one
    reference GPU-equivalent (see ``REF_FLOPS``)."""

    mem_bytes: int
    ref_seconds: float

    def __post_init__(self) -> None:
        if self.mem_bytes < 0 or not math.isfinite(self.ref_seconds) or self.ref_seconds < 0:
            raise ValueError(f"bad estimate {self!r}")


@runtime_checkable
class Task(Protocol):
    name: str

    def estimate(self, params: dict) -> TaskEstimate: ...

    def run(self, params: dict, shard: int, *, device: str) -> dict: ...


@runtime_checkable
class ResumableTask(Protocol):
    """A task that saves its progress and continues from it (see the module
    docstring); ``resumable`` is ``True``."""

    name: str
    resumable: bool

    def estimate(self, params: dict) -> TaskEstimate: ...

    def run(self, params: dict, shard: int, *, device: str, resume: bytes | None = None,
            checkpoint: Checkpoint | None = None) -> dict: ...


def is_resumable(task: object) -> bool:
    """Whether ``task`` declared ``resumable = True`` (exactly: a truthy
    non-bool is a plugin's mistake, and calling such a task with keywords
    it does not take would fail every shard)."""
    return getattr(task, "resumable", False) is True


def run_task(task: Task, params: dict, shard: int, *, device: str, resume: bytes = b"",
             checkpoint: Checkpoint | None = None) -> dict:
    """Run one shard of ``task`` the way it understands: a resumable task gets
    ``resume`` (``None`` for a fresh run) and ``checkpoint``; any other task
    runs the whole shard and never checkpoints, whatever ``resume`` says."""
    if is_resumable(task):
        return task.run(params, shard, device=device, resume=resume or None,  # type: ignore[call-arg]
                        checkpoint=checkpoint)
    return task.run(params, shard, device=device)


class UnknownTask(ValueError):
    """No task of that kind is registered here."""


class TaskCancelled(Exception):
    """Raised inside a task by :func:`check_cancelled` after its shard was abandoned."""


class BadResumeState(ValueError):
    """A resumable task was given a checkpoint state it cannot continue from
    (malformed, from another version, or made for other params or another
    shard). A ``ValueError``, like bad params: the shard fails rather than
    run on from a state nobody can vouch for."""


# ----------------------------------------------------------- cancellation

_local = threading.local()


@contextmanager
def cancellation(event: threading.Event) -> Iterator[None]:
    """Bind ``event`` as the current thread's cancel flag (used by the executor)."""
    prev = getattr(_local, "event", None)
    _local.event = event
    try:
        yield
    finally:
        _local.event = prev


def check_cancelled() -> None:
    """Raise :class:`TaskCancelled` if the running shard was cancelled."""
    ev = getattr(_local, "event", None)
    if ev is not None and ev.is_set():
        raise TaskCancelled("shard cancelled")


# ------------------------------------------------------- param validation

def check_params(params: Any, allowed: set[str] | frozenset[str], required: tuple[str, ...] = ()) -> dict:
    if not isinstance(params, dict):
        raise ValueError(f"params must be a dict, got {type(params).__name__}")
    unknown = sorted(str(k) for k in params if k not in allowed)
    if unknown:
        raise ValueError(f"unknown params {unknown}; allowed: {sorted(allowed)}")
    missing = [k for k in required if k not in params]
    if missing:
        raise ValueError(f"missing params {missing}")
    return params


def param_int(params: Mapping[str, Any], key: str, default: int | None, lo: int, hi: int) -> int:
    v = params.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"param {key!r} must be an int, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise ValueError(f"param {key!r} must be in [{lo}, {hi}], got {v}")
    return v


def param_float(params: Mapping[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    v = params.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"param {key!r} must be a finite number")
    if not lo <= v <= hi:
        raise ValueError(f"param {key!r} must be in [{lo}, {hi}], got {v}")
    return float(v)


def param_bool(params: Mapping[str, Any], key: str, default: bool) -> bool:
    v = params.get(key, default)
    if not isinstance(v, bool):
        raise ValueError(f"param {key!r} must be a bool")
    return v


def param_str(params: Mapping[str, Any], key: str, default: str | None, *, max_len: int = 256,
              choices: tuple[str, ...] | None = None) -> str:
    v = params.get(key, default)
    if not isinstance(v, str) or len(v) > max_len:
        raise ValueError(f"param {key!r} must be a string of at most {max_len} chars")
    if choices is not None and v not in choices:
        raise ValueError(f"param {key!r} must be one of {list(choices)}, got {v!r}")
    return v


# --------------------------------------------------------------- registry

def _validate_task(obj: Any, where: str) -> Task:
    name = getattr(obj, "name", None)
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise TypeError(f"{where}: task name must match {_NAME_RE.pattern}, got {name!r}")
    for meth in ("estimate", "run"):
        if not callable(getattr(obj, meth, None)):
            raise TypeError(f"{where}: task {name!r} has no {meth}()")
    return obj


class TaskRegistry:
    """Name -> task. Thread-safe; built-ins and plugins are loaded lazily."""

    def __init__(self, *, builtins: bool = True, plugins: bool = True) -> None:
        self._tasks: dict[str, Task] = {}
        self._lazy: dict[str, str] = dict(_BUILTINS) if builtins else {}
        self._builtin_names = frozenset(self._lazy)
        self._plugins_pending = plugins
        self._lock = threading.RLock()

    def register(self, task: Task, *, replace: bool = False) -> None:
        task = _validate_task(task, "register")
        with self._lock:
            if not replace and (task.name in self._tasks or task.name in self._lazy):
                raise ValueError(f"task {task.name!r} is already registered")
            self._lazy.pop(task.name, None)
            self._tasks[task.name] = task

    def load_plugins(self, group: str = ENTRY_POINT_GROUP) -> list[str]:
        """Load entry points of ``group``; returns the names added."""
        added = []
        for ep in entry_points(group=group):
            try:
                obj = ep.load()
                if not (hasattr(obj, "run") and hasattr(obj, "estimate") and not isinstance(obj, type)):
                    obj = obj()
                task = _validate_task(obj, f"entry point {ep.name!r}")
                if task.name != ep.name:
                    raise TypeError(f"entry point {ep.name!r} provides a task named {task.name!r}")
                if task.name in self._builtin_names:
                    raise TypeError(f"entry point {ep.name!r} may not replace a built-in task")
                with self._lock:
                    if task.name in self._tasks:
                        continue
                    self._tasks[task.name] = task
                added.append(task.name)
            except Exception:  # a broken plugin must not take the peer down
                log.exception("skipping task plugin %r", ep.name)
        return added

    def _ensure_plugins(self) -> None:
        if self._plugins_pending:
            with self._lock:
                if self._plugins_pending:
                    self._plugins_pending = False
                    self.load_plugins()

    def get(self, name: str) -> Task:
        if not isinstance(name, str):
            raise UnknownTask("task kind must be a string")
        with self._lock:
            task = self._tasks.get(name)
            if task is None and name in self._lazy:
                mod, _, attr = self._lazy[name].partition(":")
                task = _validate_task(getattr(importlib.import_module(mod), attr)(), name)
                self._tasks[name] = task
                del self._lazy[name]
        if task is None:
            self._ensure_plugins()
            with self._lock:
                task = self._tasks.get(name)
        if task is None:
            raise UnknownTask(f"unknown task kind {name[:64]!r}; known: {', '.join(self.names())}")
        return task

    def names(self) -> list[str]:
        self._ensure_plugins()
        with self._lock:
            return sorted(set(self._tasks) | set(self._lazy))

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self.names()


_default: TaskRegistry | None = None
_default_lock = threading.Lock()


def default_registry() -> TaskRegistry:
    """The process-wide registry (built-ins + installed plugins)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = TaskRegistry()
        return _default


def get_task(name: str) -> Task:
    return default_registry().get(name)


TaskFactory = Callable[[], Task]
