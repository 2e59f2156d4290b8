"""Logging policy for the network libraries, shared by every process that
opens a transport (daemon, client commands, the API server)."""

from __future__ import annotations

import logging

__all__ = ["quiet_libraries"]


def quiet_libraries() -> None:
    """py-libp2p logs every failed dial as an error; fedswarm maps those to
    ``PeerUnreachable`` and counts them, so the library's own log is muted.

    py-libp2p resets its logger when first imported, so import it first.
    """
    import libp2p  # noqa: F401

    for noisy in ("libp2p", "multiaddr", "async_service"):
        logging.getLogger(noisy).setLevel(logging.CRITICAL)
