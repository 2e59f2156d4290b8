"""One HTTP stack for every server fedswarm runs: Starlette apps on hypercorn's
trio worker.

The daemon's dashboard, ``/status`` and ``/metrics``, and ``peer api``'s
OpenAI-compatible endpoints all go through :func:`serve_asgi`. The listening
socket is bound here, not by hypercorn, so that

* a port already in use is refused (no ``SO_REUSEPORT``: hypercorn's own
  binder sets it, which lets a second server steal part of the first one's
  connections), and the error names the port;
* a port out of range is an :class:`~fedswarm.errors.InputError`;
* port 0 picks a free port, and the caller learns which through
  ``task_status`` (``nursery.start`` returns ``(host, port)``).
"""

from __future__ import annotations

import logging
import socket
from typing import Any

import trio

from ..errors import InputError

__all__ = ["parse_listen", "bind_tcp", "serve_asgi"]


def parse_listen(text: str, *, default_host: str = "127.0.0.1") -> tuple[str, int]:
    """``HOST:PORT``, ``:PORT`` or ``PORT`` -> ``(host, port)``; checks the range."""
    host, sep, port_s = str(text).rpartition(":")
    if not sep:
        host, port_s = "", str(text)
    host = host.strip("[]") or default_host
    try:
        port = int(port_s)
    except ValueError:
        raise InputError(f"bad listen address {text!r}", "expected HOST:PORT, e.g. 127.0.0.1:8000") from None
    check_port(port)
    return host, port


def check_port(port: int, what: str = "port") -> int:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise InputError(f"{what} {port!r} is out of range", "use 1-65535, or 0 for any free port")
    return port


def bind_tcp(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (SO_REUSEADDR only)."""
    check_port(port)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise InputError(f"cannot resolve listen host {host!r}: {exc.strerror}") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        from .addrs import bind_refusal

        refusal = bind_refusal(exc, host, port)
        if refusal is exc:
            raise
        raise refusal from None
    sock.setblocking(False)
    return sock


async def serve_asgi(
    app: Any,
    sock: socket.socket,
    *,
    task_status: Any = trio.TASK_STATUS_IGNORED,
    graceful_timeout: float = 1.0,
) -> None:
    """Serve ``app`` on the bound ``sock`` until cancelled.

    ``task_status.started((host, port))`` reports the bound address.
    """
    from hypercorn.config import Config, Sockets
    from hypercorn.trio.run import worker_serve
    from hypercorn.utils import wrap_app

    config = Config()
    config.graceful_timeout = graceful_timeout
    config.accesslog = None
    config.errorlog = logging.getLogger("fedswarm.net.http")
    host, port = sock.getsockname()[:2]

    class _Status:
        def started(self, _binds: Any = None) -> None:
            task_status.started((host, port))

    await worker_serve(
        wrap_app(app, config.wsgi_max_body_size, None),
        config,
        sockets=Sockets(secure_sockets=[], insecure_sockets=[sock], quic_sockets=[]),
        task_status=_Status(),
    )
