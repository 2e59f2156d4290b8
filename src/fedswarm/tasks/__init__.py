"""Task kinds a peer executes (plain blocking functions; no trio here).

Importing this package does not import torch; the built-in tasks
(``tensor-map``, ``llm-batch``) load on first use through the registry.
"""

from .registry import (
    ENTRY_POINT_GROUP,
    Task,
    TaskCancelled,
    TaskEstimate,
    TaskRegistry,
    UnknownTask,
    check_cancelled,
    default_registry,
    get_task,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "Task",
    "TaskCancelled",
    "TaskEstimate",
    "TaskRegistry",
    "UnknownTask",
    "check_cancelled",
    "default_registry",
    "get_task",
]
