"""The daemon's live dashboard: one static page (HTML, JS, CSS) shipped in
the package and served by ``fedswarm.daemon.http`` at ``/``.

The page subscribes to ``/events`` (server-sent events carrying the
``/status`` JSON) and redraws itself without reloading; it needs no build
step and fetches nothing from outside the daemon. Every peer-supplied string
is inserted as text, never as HTML.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["STATIC_DIR"]

STATIC_DIR = Path(__file__).resolve().parent / "static"
