"""Federation membership: how a datacenter peer is admitted as *trusted*.

A federation is an Ed25519 key held by its operator. Admitting a peer means
signing ``b"fedswarm-membership/1" + peer_id + expiry`` with that key; the
certificate (``msgpack([federation_id, expiry, signature])``) travels in the
peer's ``PeerState.membership``. A receiver that lists the federation's id
among the ones it trusts treats the peer as trusted until ``expiry``; any
other claim of ``trust = "datacenter"`` counts for nothing: trust is what a
known federation signed, never what a peer says about itself.
"""

from __future__ import annotations

import msgpack

from ..errors import RemoteProtocolError
from .identity import Identity, verify

__all__ = ["issue_membership", "check_membership", "TRUSTED", "UNTRUSTED"]

TRUSTED = "datacenter"
UNTRUSTED = "volunteer"
_DOMAIN = b"fedswarm-membership/1"


def issue_membership(federation: Identity, peer_id: str, expiry: float) -> bytes:
    sig = federation.sign(_DOMAIN + peer_id.encode() + repr(float(expiry)).encode())
    return msgpack.packb([federation.peer_id, float(expiry), sig], use_bin_type=True)


def check_membership(cert: bytes, peer_id: str, now: float, federations: frozenset[str]) -> bool:
    """True if ``cert`` admits ``peer_id`` by a trusted federation at ``now``."""
    if not cert or not federations:
        return False
    try:
        fed, expiry, sig = msgpack.unpackb(cert, raw=False, max_ext_len=0)
    except Exception:
        return False
    if type(fed) is not str or type(expiry) is not float or type(sig) is not bytes or fed not in federations:
        return False
    if expiry <= now:
        return False
    try:
        verify(fed, sig, _DOMAIN + peer_id.encode() + repr(expiry).encode())
    except RemoteProtocolError:
        return False
    return True
