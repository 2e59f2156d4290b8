"""The daemon behind ``peer start``, in three rooms:

* ``serve``: option checks, the data dir lock, bootstrap dialing, and
  ``serve_peer``, which wires key, profile, transport, executor and agent;
* ``runner``: ``ExecutorRunner``, which performs the core's shard effects on
  the executor (torch, off the event loop);
* ``http`` and ``prometheus``: ``/status``, ``/events``, the dashboard and
  ``/metrics`` (the collector and the telemetry it reads).
"""

from .runner import ExecutorRunner
from .serve import DataDirLock, PeerOptions, serve_peer, setup_logging

__all__ = ["DataDirLock", "ExecutorRunner", "PeerOptions", "serve_peer", "setup_logging"]
