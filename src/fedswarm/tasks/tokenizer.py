"""A byte-level tokenizer that needs no downloaded vocabulary.

Ids 0..255 are the raw UTF-8 bytes; then three special ids follow. A model
that uses it must have ``vocab_size >= BYTE_VOCAB_SIZE`` (259); ids at or above
259 (the spare rows of a larger embedding table) decode to nothing.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["ByteTokenizer", "BOS_ID", "EOS_ID", "PAD_ID", "BYTE_VOCAB_SIZE"]

BOS_ID = 256
EOS_ID = 257
PAD_ID = 258
BYTE_VOCAB_SIZE = 259


class ByteTokenizer:
    """UTF-8 bytes in, ids out. Stateless and thread-safe."""

    name = "bytes"
    bos_id = BOS_ID
    eos_id = EOS_ID
    pad_id = PAD_ID
    vocab_size = BYTE_VOCAB_SIZE

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [BOS_ID, *ids] if add_bos else ids

    def decode(self, ids: Iterable[int]) -> str:
        """Decode ids; special and out-of-range ids are dropped, bad UTF-8 replaced."""
        data = bytes(i for i in ids if 0 <= i < 256)
        return data.decode("utf-8", errors="replace")
