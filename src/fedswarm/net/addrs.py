"""Checks of the multiaddrs a user types, before anything is started.

Light on purpose (``multiaddr`` only, no libp2p, no trio): ``peer`` checks
``--listen``, ``--bootstrap`` and ``--announce`` here and fails in a
fraction of a second with an ``InputError`` that says what is wrong.
"""

from __future__ import annotations

import errno
import socket

from ..errors import InputError

__all__ = ["parse_bootstrap", "parse_listen_maddr", "parse_announce", "check_tcp_free", "interface_addrs",
           "advertised_addrs"]

_EXAMPLE = "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooW..."


def _parse(text: str, what: str, example: str):  # noqa: ANN202 - multiaddr.Multiaddr
    import multiaddr

    try:
        m = multiaddr.Multiaddr(text)
    except Exception as exc:  # the library raises several types for bad text
        why = str(exc)
        if "': " in why:  # "Invalid MultiAddr 'x': REASON (string: x)" -> REASON
            why = why.split("': ", 1)[1].rsplit(" (string:", 1)[0]
        raise InputError(f"{what} {text!r} is not a multiaddr: {why}", f"expected e.g. {example}") from None
    return m


def _proto_values(m) -> dict[str, str]:  # noqa: ANN001
    out: dict[str, str] = {}
    for proto in m.protocols():
        try:
            out[proto.name] = m.value_for_protocol(proto.code) or ""
        except Exception:
            out[proto.name] = ""
    return out


def _tcp(vals: dict[str, str], text: str, what: str, example: str, *, allow_zero: bool) -> tuple[str, int]:
    host = next((vals[k] for k in ("ip4", "ip6", "dns", "dns4", "dns6") if k in vals), None)
    if host is None or "tcp" not in vals:
        raise InputError(f"{what} {text!r} has no /ip4|/ip6|/dns.../tcp/PORT part", f"expected e.g. {example}")
    try:
        port = int(vals["tcp"])
    except ValueError:
        raise InputError(f"{what} {text!r}: bad tcp port {vals['tcp']!r}") from None
    if not (0 if allow_zero else 1) <= port <= 65535:
        raise InputError(f"{what} {text!r}: tcp port {port} is out of range",
                         "use 0-65535 (0: any free port)" if allow_zero else "use 1-65535")
    return host, port


def parse_bootstrap(text: str, what: str = "bootstrap address") -> tuple[str, str]:
    """``(text, peer_id)`` for a dialable ``/ip4/H/tcp/P/p2p/ID`` address."""
    from ..core.identity import check_peer_id

    m = _parse(text, what, _EXAMPLE)
    vals = _proto_values(m)
    if "p2p" not in vals or not vals["p2p"]:
        raise InputError(f"{what} {text!r} has no /p2p/PEER_ID part",
                         "copy the full address a daemon prints: fedswarm peer listening on ...")
    _tcp(vals, text, what, _EXAMPLE, allow_zero=False)
    check_peer_id(vals["p2p"], f"{what}'s peer id")
    return text, vals["p2p"]


def parse_listen_maddr(text: str) -> tuple[str, int]:
    """``(host, port)`` of a ``--listen`` multiaddr (``/ip4/H/tcp/P``)."""
    ex = "/ip4/0.0.0.0/tcp/4001"
    m = _parse(text, "listen address", ex)
    vals = _proto_values(m)
    if "p2p" in vals:
        raise InputError(f"listen address {text!r} must not name a peer id (/p2p/...)", f"expected e.g. {ex}")
    if "ip4" not in vals and "ip6" not in vals:
        raise InputError(f"listen address {text!r} needs /ip4/ or /ip6/", f"expected e.g. {ex}")
    return _tcp(vals, text, "listen address", ex, allow_zero=True)


def parse_announce(text: str) -> str:
    """An address to advertise instead of the listen addresses."""
    ex = "/ip4/203.0.113.7/tcp/4001"
    m = _parse(text, "announce address", ex)
    _tcp(_proto_values(m), text, "announce address", ex, allow_zero=False)
    return text


def check_tcp_free(host: str, port: int, what: str = "port") -> None:
    """Refuse a TCP port that something already listens on (no SO_REUSEPORT,
    so a listener that has it does not let this bind succeed either)."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
    except OSError as exc:
        raise bind_refusal(exc, host, port, what) from None
    finally:
        s.close()


def bind_refusal(exc: OSError, host: str, port: int, what: str = "port") -> Exception:
    """What to raise for a failed ``bind(host, port)``: an ``InputError`` naming
    the cause a user can fix (port in use, no permission, not our address), else
    the ``OSError`` itself."""
    if exc.errno == errno.EADDRINUSE:
        return InputError(f"{what} {port} on {host} is already in use", "stop the other process or choose another port")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return InputError(f"no permission to listen on {host}:{port}", "use a port above 1023")
    if exc.errno == errno.EADDRNOTAVAIL:
        return InputError(f"{host} is not an address of this machine")
    return exc


def interface_addrs(version: int) -> list[str]:
    """This machine's addresses of IP ``version`` (4 or 6), loopback included."""
    try:
        from multiaddr.utils import get_network_addrs

        addrs = list(get_network_addrs(version) or [])
    except Exception:
        addrs = []
    loop = "127.0.0.1" if version == 4 else "::1"
    if loop not in addrs:
        addrs.append(loop)
    return list(dict.fromkeys(addrs))


def advertised_addrs(listening: list[str], peer_id: str, announce: list[str] | None = None,
                     *, interfaces: "dict[int, list[str]] | None" = None) -> list[str]:
    """The addresses to tell other peers (each with ``/p2p/peer_id``).

    ``announce`` (``--announce``) wins when given. Otherwise each listening
    address, a wildcard (0.0.0.0, ::) replaced by this machine's interface
    addresses of that family (``interfaces`` overrides them, for tests).
    """
    def with_id(a: str) -> str:
        return a if "/p2p/" in a else f"{a}/p2p/{peer_id}"

    if announce:
        return list(dict.fromkeys(with_id(a) for a in announce))
    out = []
    for a in listening:
        i = a.find("/p2p/")
        s = a if i < 0 else a[:i]
        parts = s.split("/")  # "", "ip4", HOST, "tcp", PORT
        if len(parts) > 2 and parts[1] in ("ip4", "ip6") and parts[2] in ("0.0.0.0", "::"):
            ver = 4 if parts[1] == "ip4" else 6
            ips = (interfaces or {}).get(ver) if interfaces is not None else interface_addrs(ver)
            out += [with_id("/".join(["", parts[1], ip, *parts[3:]])) for ip in ips or []]
            continue
        out.append(with_id(s))
    return list(dict.fromkeys(out))
