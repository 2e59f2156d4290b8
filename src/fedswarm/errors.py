"""Exception hierarchy shared by the core, the runtime and the transports.

Leaf module: it imports nothing from fedswarm.

Two families:

* ``ProtocolError``: a message or an action broke the protocol.
  ``LocalProtocolError`` means *we* tried something illegal (a bug or a misuse
  of the API); ``RemoteProtocolError`` means a *peer* sent something invalid.
  The core only raises ``LocalProtocolError`` internally; its single receive
  entry point relabels failures while decoding/validating a peer's bytes as
  ``RemoteProtocolError`` and counts them instead of crashing.
* ``TransportError``: the network failed us (``PeerUnreachable``,
  ``TransportTimeout``). Transports map their library's exceptions onto these
  at the boundary.
"""

from __future__ import annotations

__all__ = [
    "FederationError",
    "ProtocolError",
    "LocalProtocolError",
    "RemoteProtocolError",
    "TransportError",
    "PeerUnreachable",
    "TransportTimeout",
    "JobFailed",
    "JobTimeout",
    "JobCancelled",
    "InputError",
]


class FederationError(Exception):
    """Base class of every error fedswarm raises on purpose."""


class ProtocolError(FederationError):
    """A protocol rule was broken. Do not raise directly: use a subclass.

    ``reason`` is a short machine-readable tag (for example ``"bad-signature"``)
    that the core uses as the label of its rejection counter.
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        if type(self) is ProtocolError:
            raise TypeError("raise LocalProtocolError or RemoteProtocolError")
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class LocalProtocolError(ProtocolError):
    """We tried to do something the protocol forbids (a caller bug)."""


class RemoteProtocolError(ProtocolError):
    """A peer sent something malformed, unsigned, forged, stale or replayed."""


class TransportError(FederationError):
    """The network could not carry a message."""


class PeerUnreachable(TransportError):
    """No connection to the peer could be made or kept."""


class TransportTimeout(TransportError):
    """The peer did not answer in time."""


class JobFailed(FederationError):
    """A submitted job could not complete (a shard failed too many times)."""


class JobTimeout(JobFailed):
    """A submitted job did not complete before the caller's deadline."""


class JobCancelled(JobFailed):
    """The job was cancelled by its tenant."""


class InputError(FederationError, ValueError):
    """A caller gave us something unusable: a bad option, file, address,
    model name or request body. The ``peer`` command prints it as one line
    and exits 2; the HTTP API answers 400 (or 404 for an unknown model).

    ``hint`` is a short suggestion of what to do instead (may be empty).
    """

    def __init__(self, what: str, hint: str = "") -> None:
        super().__init__(f"{what} ({hint})" if hint else what)
        self.what = what
        self.hint = hint
