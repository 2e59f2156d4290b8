"""Tokenizers: the model's own (Hugging Face ``tokenizer.json`` or the one
embedded in a GGUF file) and a byte-level one for the tiny shipped models.

Every tokenizer implements :class:`Tokenizer`:

* ``encode(text, *, add_special_tokens=True)`` / ``decode(ids, *, skip_special_tokens=True)``;
* ``apply_chat_template(messages, *, add_generation_prompt=True)``: the
  model's jinja2 chat template rendered the way transformers renders it (a
  sandboxed environment with ``trim_blocks``/``lstrip_blocks``, the variables
  ``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``, the
  other special tokens, and ``raise_exception``);
* ``stream_decoder()``: incremental decoding whose ``push(id)`` returns only
  newly complete text, never half a UTF-8 character.

:func:`load_tokenizer` picks one for a checkpoint path:

* a GGUF file: its ``tokenizer.ggml.*`` metadata (``model == "gpt2"``:
  byte-level BPE) is built into a ``tokenizers.Tokenizer`` the way
  transformers' GGUF loader builds it (BPE over the file's tokens and merges,
  byte-level pre-tokenizer and decoder, control tokens added as special
  tokens), so the ids are the same; the chat template is
  ``tokenizer.chat_template``;
* a HF directory with ``tokenizer.json``: ``tokenizers.Tokenizer.from_file``,
  chat template and special tokens from ``tokenizer_config.json``;
* a model whose config says ``fedswarm_tokenizer: bytes``: :class:`ByteTokenizer`.

ByteTokenizer: ids 0..255 are the raw UTF-8 bytes; then three special ids
follow. A model that uses it must have ``vocab_size >= BYTE_VOCAB_SIZE``
(259); ids at or above 259 (the spare rows of a larger embedding table)
decode to nothing.
"""

from __future__ import annotations

import codecs
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ..errors import InputError

__all__ = [
    "Tokenizer",
    "StreamDecoder",
    "ByteTokenizer",
    "HFTokenizer",
    "load_tokenizer",
    "render_chat_template",
    "BOS_ID",
    "EOS_ID",
    "PAD_ID",
    "BYTE_VOCAB_SIZE",
    "BYTE_CHAT_TEMPLATE",
]

BOS_ID = 256
EOS_ID = 257
PAD_ID = 258
BYTE_VOCAB_SIZE = 259
MAX_MESSAGES = 4096

# A plain template for models without one: "role: content" lines, then "assistant:".
BYTE_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


class StreamDecoder(Protocol):
    def push(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


@runtime_checkable
class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eos_ids: frozenset[int]

    @property
    def bos_id(self) -> int | None: ...  # read-only here, so a tokenizer that always has one (int) fits

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *,
                            add_generation_prompt: bool = True) -> str: ...

    def stream_decoder(self) -> StreamDecoder: ...


# ----------------------------------------------------------------- chat templates

@lru_cache(maxsize=16)
def _compile(template: str) -> Any:
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise InputError(f"the model's chat template does not parse: {e}") from None


def _check_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
        raise InputError("messages must be a non-empty list of {role, content} objects")
    if len(messages) > MAX_MESSAGES:
        raise InputError(f"too many messages ({len(messages)} > {MAX_MESSAGES})")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise InputError(f"message {i} is not an object")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            raise InputError(f"message {i} has no 'role' string")
        if not isinstance(content, str):
            raise InputError(f"message {i} has no 'content' string")
        out.append(dict(m))
    return out


def render_chat_template(template: str, messages: Sequence[Mapping[str, Any]], *,
                         add_generation_prompt: bool = True, special_tokens: Mapping[str, str | None]) -> str:
    """Render a chat template with transformers' variables (InputError on failure)."""
    import jinja2

    msgs = _check_messages(messages)
    tpl = _compile(template)
    try:
        return tpl.render(messages=msgs, add_generation_prompt=add_generation_prompt, **dict(special_tokens))
    except jinja2.exceptions.TemplateError as e:
        raise InputError(f"chat template refused the conversation: {e}") from None


# ----------------------------------------------------------------- byte tokenizer

class _ByteStream:
    def __init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        if 0 <= token_id < 256:
            return self._dec.decode(bytes((token_id,)))
        return ""

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


class ByteTokenizer:
    """UTF-8 bytes in, ids out. Stateless and thread-safe."""

    name = "bytes"
    bos_id = BOS_ID
    eos_id = EOS_ID
    pad_id = PAD_ID
    eos_ids = frozenset({EOS_ID})
    vocab_size = BYTE_VOCAB_SIZE
    chat_template = BYTE_CHAT_TEMPLATE

    def encode(self, text: str, *, add_special_tokens: bool = True, add_bos: bool | None = None) -> list[int]:
        """UTF-8 bytes, after BOS when ``add_special_tokens`` (``add_bos`` is the older name)."""
        ids = list(text.encode("utf-8"))
        bos = add_special_tokens if add_bos is None else add_bos
        return [BOS_ID, *ids] if bos else ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        """Decode ids; special and out-of-range ids are dropped, bad UTF-8 replaced."""
        data = bytes(i for i in ids if 0 <= i < 256)
        return data.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *,
                            add_generation_prompt: bool = True) -> str:
        return render_chat_template(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                                    special_tokens={"bos_token": "", "eos_token": ""})

    def stream_decoder(self) -> _ByteStream:
        return _ByteStream()


# ----------------------------------------------------------------- tokenizers-backed

class _TextStream:
    """Incremental decoding over ``tokenizers``' decode: text is emitted once the
    decoded suffix grew and does not end in U+FFFD (an incomplete character).
    Decoding from ``prefix`` (the previous emission's start) keeps decoders that
    strip a leading space from dropping it mid-stream."""

    def __init__(self, tok: HFTokenizer) -> None:
        self._tok = tok
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def _delta(self, final: bool) -> str:
        ids = self._ids
        prev = self._tok.decode(ids[self._prefix:self._read])
        new = self._tok.decode(ids[self._prefix:])
        if len(new) > len(prev) and (final or not new.endswith("\ufffd")):
            out = new[len(prev):]
            self._prefix, self._read = self._read, len(ids)
            return out
        return ""

    def push(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        return self._delta(False)

    def flush(self) -> str:
        if self._read >= len(self._ids):
            return ""
        return self._delta(True)


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` with its special tokens and chat template."""

    def __init__(self, backend: Any, *, name: str, chat_template: str | None, bos_token: str | None,
                 eos_token: str | None, extra_special: Mapping[str, str | None] | None = None,
                 eos_ids: Iterable[int] = (), add_bos: bool = False) -> None:
        self.backend = backend
        self.name = name
        self.chat_template = chat_template
        self.bos_token, self.eos_token = bos_token, eos_token
        self.vocab_size = int(backend.get_vocab_size(with_added_tokens=True))
        self.bos_id = backend.token_to_id(bos_token) if bos_token else None
        eos = set(int(i) for i in eos_ids)
        if eos_token and backend.token_to_id(eos_token) is not None:
            eos.add(int(backend.token_to_id(eos_token)))
        self.eos_ids = frozenset(eos)
        self._special = {"bos_token": bos_token, "eos_token": eos_token, **dict(extra_special or {})}
        self._add_bos = add_bos and self.bos_id is not None

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise InputError("text to encode must be a string")
        ids = list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)
        if add_special_tokens and self._add_bos and (not ids or ids[0] != self.bos_id):
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        """Decode ids; ids the tokenizer does not have (spare rows of a larger
        embedding table) decode to nothing, as with ByteTokenizer."""
        ids = [i for i in (int(x) for x in ids) if 0 <= i < self.vocab_size]
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *,
                            add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise InputError(f"tokenizer {self.name} has no chat template")
        return render_chat_template(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                                    special_tokens=self._special)

    def stream_decoder(self) -> _TextStream:
        return _TextStream(self)


def _gguf_tokenizer(path: Path) -> HFTokenizer:
    from tokenizers import AddedToken, Tokenizer as TkTokenizer, decoders, models, pre_tokenizers

    from .gguf_model import open_gguf

    m = open_gguf(path)
    kind = m.field("tokenizer.ggml.model")
    if kind != "gpt2":
        raise InputError(f"{path.name}: GGUF tokenizer type {kind!r} is not supported", "supported: gpt2 (byte-level BPE)")
    tokens = m.field("tokenizer.ggml.tokens")
    merges = m.field("tokenizer.ggml.merges") or []
    types = m.field("tokenizer.ggml.token_type") or []
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise InputError(f"{path.name}: GGUF file has no usable tokenizer.ggml.tokens")
    if not isinstance(merges, list) or not all(isinstance(x, str) for x in merges):
        raise InputError(f"{path.name}: GGUF tokenizer.ggml.merges is not a list of strings")
    if not isinstance(types, list):
        types = []
    alphabet = _byte_alphabet()
    charset = set(alphabet.values())
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        spelled = t if set(t) <= charset else "".join(alphabet[b] for b in t.encode("utf-8"))
        vocab[spelled] = i
    pairs = []
    for mg in merges:
        a, sep, b = mg.partition(" ")
        if not sep:
            raise InputError(f"{path.name}: malformed BPE merge {mg[:40]!r}")
        pairs.append((a, b))
    try:
        backend = TkTokenizer(models.BPE(vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="",
                                         end_of_word_suffix="", fuse_unk=False))
    except Exception as e:  # noqa: BLE001 -- tokenizers raises a bare Exception on a bad vocabulary
        raise InputError(f"{path.name}: unusable GGUF tokenizer ({e})") from None
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    control = [AddedToken(t, normalized=False, special=True)
               for t, ty in zip(tokens, types) if ty == 3 and set(t) <= charset]
    if control:
        backend.add_special_tokens(control)
    user = [AddedToken(t, normalized=False, special=False)
            for t, ty in zip(tokens, types) if ty == 4 and t in vocab]
    if user:
        backend.add_tokens(user)

    def tid(key: str) -> int | None:
        i = m.field(f"tokenizer.ggml.{key}")
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(tokens):
            return None
        return i

    def tok(key: str) -> str | None:
        i = tid(key)
        return None if i is None else tokens[i]

    eos_ids = [i for i in (tid("eos_token_id"), tid("eot_token_id")) if i is not None]
    return HFTokenizer(
        backend, name=f"gguf:{path.name}", chat_template=m.field("tokenizer.chat_template"),
        bos_token=tok("bos_token_id"), eos_token=tok("eos_token_id"),
        extra_special={"unk_token": tok("unknown_token_id"), "pad_token": tok("padding_token_id")},
        eos_ids=eos_ids, add_bos=bool(m.field("tokenizer.ggml.add_bos_token", False)),
    )


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level BPE alphabet)."""
    from tokenizers import pre_tokenizers

    return {i: ch for i, ch in enumerate(_alphabet_order(pre_tokenizers.ByteLevel.alphabet()))}


def _alphabet_order(chars: Iterable[str]) -> list[str]:
    # GPT-2 maps the printable bytes to themselves and the rest, in byte order, to U+0100 upwards
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    table: dict[int, str] = {}
    n = 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    if set(table.values()) != set(chars):
        raise RuntimeError("the tokenizers package's byte-level alphabet is not GPT-2's")
    return [table[b] for b in range(256)]


def _token_str(v: Any) -> str | None:
    if isinstance(v, str):
        return v
    if isinstance(v, Mapping) and isinstance(v.get("content"), str):
        return v["content"]
    return None


def _hf_dir_tokenizer(d: Path) -> HFTokenizer:
    from tokenizers import Tokenizer as TkTokenizer

    try:
        backend = TkTokenizer.from_file(str(d / "tokenizer.json"))
    except Exception as e:  # noqa: BLE001 -- tokenizers raises a bare Exception on a bad file
        raise InputError(f"{d.name}/tokenizer.json: unusable ({str(e)[:200]})") from None
    cfg: dict[str, Any] = {}
    if (d / "tokenizer_config.json").is_file():
        try:
            cfg = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise InputError(f"{d.name}/tokenizer_config.json: unreadable ({e})") from None
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: use "default"
        template = next((t.get("template") for t in template if isinstance(t, Mapping)
                         and t.get("name") == "default"), None)
    if template is None and (d / "chat_template.jinja").is_file():
        template = (d / "chat_template.jinja").read_text(encoding="utf-8")
    eos_ids: list[int] = []
    for fn in ("generation_config.json", "config.json"):
        if (d / fn).is_file():
            try:
                v = json.loads((d / fn).read_text(encoding="utf-8")).get("eos_token_id")
            except (OSError, ValueError):
                v = None
            eos_ids += [v] if isinstance(v, int) else [x for x in v or () if isinstance(x, int)]
    return HFTokenizer(
        backend, name=f"hf:{d.name}", chat_template=template if isinstance(template, str) else None,
        bos_token=_token_str(cfg.get("bos_token")), eos_token=_token_str(cfg.get("eos_token")),
        extra_special={"unk_token": _token_str(cfg.get("unk_token")), "pad_token": _token_str(cfg.get("pad_token"))},
        eos_ids=eos_ids, add_bos=False,
    )


_tok_cache: dict[tuple[str, Any], Tokenizer] = {}


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """The tokenizer of the checkpoint at ``path`` (a GGUF file or a HF dir).

    Cached per (path, mtime). Raises InputError when the checkpoint has none.
    """
    from .checkpoint import is_gguf, load_config

    p = Path(path)
    try:
        st = p.stat()
    except OSError as e:
        raise InputError(f"cannot read {p}: {e.strerror or e}") from None
    key = (str(p.resolve()), (st.st_size, st.st_mtime_ns, st.st_ino))
    hit = _tok_cache.get(key)
    if hit is not None:
        return hit
    if is_gguf(p):
        tok: Tokenizer = _gguf_tokenizer(p)
    elif (p / "tokenizer.json").is_file():
        tok = _hf_dir_tokenizer(p)
    elif load_config(p).tokenizer == "bytes":
        tok = ByteTokenizer()
    else:
        raise InputError(f"checkpoint {p.name} has no tokenizer (no tokenizer.json, not a byte-tokenizer model)",
                         "give token ids instead")
    _tok_cache[key] = tok
    return tok
