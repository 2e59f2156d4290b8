"""Peer identity: an Ed25519 key whose libp2p peer id names the peer.

The peer id is computed exactly as libp2p does for Ed25519 keys: the public
key is wrapped in the libp2p ``PublicKey`` protobuf (``KeyType = Ed25519``,
``Data = 32 raw bytes``), the 36 resulting bytes are put in an *identity*
multihash (code 0x00, because they are shorter than 42 bytes) and the
multihash is base58btc-encoded, giving the familiar ``12D3KooW...`` form. So
the id that signs fedswarm messages and the id the libp2p host authenticates
over Noise are one and the same (a test checks this against py-libp2p).

Key files hold the 32-byte raw private key (PKCS8 would work too; raw keeps
the file trivially portable) and are created with mode 0600. Like ssh, a key
file that its group or others may read (or write) is refused, and so is a
file that does not hold a key: both are the caller's mistake
(``InputError``), named with the path and what to do.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

import nacl.bindings
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from nacl.exceptions import BadSignatureError, CryptoError

from ..errors import InputError, LocalProtocolError, RemoteProtocolError

__all__ = [
    "Identity",
    "peer_id_from_public_bytes",
    "public_bytes_from_peer_id",
    "verify",
    "load_or_create_key",
    "load_key",
    "check_peer_id",
    "b58encode",
    "b58decode",
]

_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_B58_INDEX = {c: i for i, c in enumerate(_B58)}
# protobuf: field 1 (KeyType) varint = 1 (Ed25519); field 2 (Data) bytes, len 32
_PB_PREFIX = b"\x08\x01\x12\x20"
# identity multihash: code 0x00, length 36
_MH_PREFIX = b"\x00\x24"


def b58encode(data: bytes) -> str:
    n = int.from_bytes(data, "big")
    out = []
    while n:
        n, r = divmod(n, 58)
        out.append(_B58[r])
    pad = len(data) - len(data.lstrip(b"\0"))
    return "1" * pad + "".join(reversed(out))


def b58decode(text: str) -> bytes:
    n = 0
    for c in text:
        try:
            n = n * 58 + _B58_INDEX[c]
        except KeyError:
            raise ValueError(f"invalid base58 character {c!r}") from None
    pad = len(text) - len(text.lstrip("1"))
    body = n.to_bytes((n.bit_length() + 7) // 8, "big") if n else b""
    return b"\0" * pad + body


def peer_id_from_public_bytes(raw: bytes) -> str:
    """libp2p peer id (base58) of a raw 32-byte Ed25519 public key."""
    if len(raw) != 32:
        raise LocalProtocolError("bad-key", "an Ed25519 public key has 32 bytes")
    return b58encode(_MH_PREFIX + _PB_PREFIX + raw)


def public_bytes_from_peer_id(peer_id: str) -> bytes:
    """Recover the raw public key from an Ed25519 libp2p peer id.

    Raises:
        RemoteProtocolError: the id is not an identity-multihash Ed25519 id.
    """
    try:
        mh = b58decode(peer_id)
    except ValueError as exc:
        raise RemoteProtocolError("bad-peer-id", str(exc)) from None
    if len(mh) != 38 or not mh.startswith(_MH_PREFIX + _PB_PREFIX):
        raise RemoteProtocolError("bad-peer-id", "not an Ed25519 libp2p peer id")
    return mh[6:]


# peer id -> raw public key (the base58 decode is not free)
_VERIFY_CACHE: dict[str, bytes] = {}


def verify(peer_id: str, signature: bytes, data: bytes) -> None:
    """Check that ``peer_id``'s key signed ``data``.

    Ed25519 by libsodium (PyNaCl): twice as fast as OpenSSL's here (54
    against 113 us a check, docs/benchmarks.md), and strict: it refuses
    non-canonical signatures and small-order keys.

    Raises:
        RemoteProtocolError: ``bad-signature`` or ``bad-peer-id``.
    """
    key = _VERIFY_CACHE.get(peer_id)
    if key is None:
        key = public_bytes_from_peer_id(peer_id)
        if len(_VERIFY_CACHE) > 65536:
            _VERIFY_CACHE.clear()
        _VERIFY_CACHE[peer_id] = key
    if len(signature) != 64:
        raise RemoteProtocolError("bad-signature", f"from {peer_id[:16]}")
    try:
        nacl.bindings.crypto_sign_open(signature + data, key)
    except (BadSignatureError, CryptoError, ValueError):
        raise RemoteProtocolError("bad-signature", f"from {peer_id[:16]}") from None


@dataclass(frozen=True, eq=False)
class Identity:
    """A peer's (or a tenant's) signing key and the peer id derived from it."""

    private_key: Ed25519PrivateKey

    @classmethod
    def generate(cls) -> "Identity":
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> "Identity":
        """Deterministic key from 32 bytes (simulation and tests only)."""
        if len(seed) != 32:
            raise LocalProtocolError("bad-key", "seed must be 32 bytes")
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    def private_bytes(self) -> bytes:
        return self.private_key.private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )

    def public_bytes(self) -> bytes:
        return self.private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )

    @property
    def peer_id(self) -> str:
        pid = self.__dict__.get("_peer_id")
        if pid is None:
            pid = peer_id_from_public_bytes(self.public_bytes())
            object.__setattr__(self, "_peer_id", pid)
        return pid

    def sign(self, data: bytes) -> bytes:
        """The Ed25519 signature of ``data``: libsodium's, 1.7x faster than
        OpenSSL's here; Ed25519 is deterministic, so the bytes are the same."""
        sk = self.__dict__.get("_nacl_sk")
        if sk is None:
            sk = self.private_bytes() + self.public_bytes()  # libsodium's secret key: seed, then public key
            object.__setattr__(self, "_nacl_sk", sk)
        signed: bytes = nacl.bindings.crypto_sign(data, sk)
        return signed[:64]

    def __repr__(self) -> str:
        return f"<Identity {self.peer_id}>"


def check_peer_id(text: str, what: str = "peer id") -> str:
    """``text`` if it is an Ed25519 libp2p peer id (``12D3KooW...``), else InputError."""
    try:
        public_bytes_from_peer_id(text)
    except RemoteProtocolError:
        raise InputError(f"{what} {text!r} is not an Ed25519 libp2p peer id",
                         "copy it from `peer keygen --show` or a daemon's /p2p/ address") from None
    return text


def load_key(path: str | os.PathLike[str]) -> Identity:
    """Load an existing key file; never creates one.

    Raises:
        InputError: the file is missing, readable by group/others, or not a key.
    """
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY)
    except FileNotFoundError:
        raise InputError(f"no key file {p}", f"create one with `peer keygen --key {p}`") from None
    except IsADirectoryError:
        raise InputError(f"{p} is a directory, not a key file") from None
    except PermissionError:
        raise InputError(f"cannot read key file {p}: permission denied") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InputError(f"{p} is not a regular file")
        if st.st_mode & 0o077:
            raise InputError(f"key file {p} is accessible by others (mode {stat.S_IMODE(st.st_mode):04o})",
                             f"chmod 600 {p}")
        raw = os.read(fd, 64)
    except IsADirectoryError:
        raise InputError(f"{p} is a directory, not a key file") from None
    finally:
        os.close(fd)
    if len(raw) != 32:
        raise InputError(f"{p} does not hold a 32-byte Ed25519 key ({len(raw)} bytes)",
                         "point --key at a file made by `peer keygen`")
    return Identity.from_seed(raw)


def load_or_create_key(path: str | os.PathLike[str]) -> Identity:
    """Load the key at ``path``, or create it with mode 0600 if absent.

    The file is created atomically with ``O_EXCL`` so two daemons racing on the
    same path cannot end up with different keys. An existing file is checked
    as :func:`load_key` does.
    """
    p = Path(path)
    if p.exists() or p.is_symlink():
        return load_key(p)
    if not p.parent.is_dir():
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InputError(f"cannot create the directory of key file {p}: {exc.strerror}") from None
    ident = Identity.generate()
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process created it first: use theirs
        return load_key(p)
    except OSError as exc:
        raise InputError(f"cannot create key file {p}: {exc.strerror}") from None
    try:
        os.write(fd, ident.private_bytes())
    finally:
        os.close(fd)
    return ident
