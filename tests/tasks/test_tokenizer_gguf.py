"""Tokenizers: ids, decoding and chat templates equal transformers' for the
SmolLM2 GGUF, a small GGUF we write, and a tokenizer.json directory; streamed
decoding never shows half a character; the byte tokenizer keeps working."""

from __future__ import annotations

import json

import pytest

from fedswarm.errors import InputError
from fedswarm.tasks.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from gguf_testing import CHAT_TEMPLATE, hf_tokenizer, smollm_path, tiny_files

TEXTS = [
    "Hello world",
    "The capital of France is Paris.",
    "  leading spaces,   runs of   spaces\n\n\n\ttabs\r\nand CRLF  ",
    "Grüße aus Köln — naïve café, 日本語のテキスト, Ελληνικά, עברית",
    "emoji: 😀👍🏽 🇫🇷 👩‍👩‍👧 and ✨",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # 1234567890\n",
    "<|im_start|>user\nspecial tokens inline<|im_end|>\n<|endoftext|>",
    "x" * 300 + " 3.14159 0xDEADBEEF",
    "",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."},
     {"role": "user", "content": "Colour of the sky? 🌤"},
     {"role": "assistant", "content": "Blue."},
     {"role": "user", "content": "And at night?\n  (be brief)"}],
]


@pytest.fixture(scope="module")
def smollm():
    return smollm_path()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_files(str(tmp_path_factory.mktemp("tok")))[0]


def _hf_chat_ids(ht, msgs):
    ids = ht.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.mark.parametrize("which", ["smollm", "tiny"])
def test_gguf_ids_equal_transformers(which, smollm, tiny):
    path = smollm if which == "smollm" else tiny
    tok, ht = load_tokenizer(path), hf_tokenizer(str(path))
    assert isinstance(tok, Tokenizer)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == ht(text)["input_ids"], text
        assert tok.encode(text, add_special_tokens=False) == ht(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == ht.decode(ids, skip_special_tokens=True), text
        assert tok.decode(ids, skip_special_tokens=False) == ht.decode(ids, skip_special_tokens=False), text
    for msgs in CHATS:
        rendered = tok.apply_chat_template(msgs)
        assert rendered == ht.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert tok.encode(rendered, add_special_tokens=False) == _hf_chat_ids(ht, msgs)
        assert tok.apply_chat_template(msgs, add_generation_prompt=False) == ht.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=False)


def test_smollm2_tokenizer_facts(smollm):
    tok = load_tokenizer(smollm)
    assert tok.vocab_size == 49152 and tok.bos_id == 1 and 2 in tok.eos_ids
    rendered = tok.apply_chat_template(CHATS[0])
    assert rendered.startswith("<|im_start|>system\n") and rendered.endswith("<|im_start|>assistant\n")
    assert load_tokenizer(smollm) is tok  # cached


@pytest.mark.parametrize("which", ["smollm", "tiny"])
def test_stream_decoder_never_splits_a_character(which, smollm, tiny):
    tok = load_tokenizer(smollm if which == "smollm" else tiny)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        dec = tok.stream_decoder()
        pieces = [dec.push(i) for i in ids] + [dec.flush()]
        assert "".join(pieces) == tok.decode(ids), text
        assert not any("\ufffd" in p for p in pieces), (text, pieces)
    # an emoji's bytes span several byte-level tokens: nothing shows until it is whole
    ids = tok.encode("😀", add_special_tokens=False)
    dec = tok.stream_decoder()
    out = [dec.push(i) for i in ids]
    if len(ids) > 1:
        assert out[:-1] == [""] * (len(ids) - 1)
    assert out[-1] == "😀" and dec.flush() == ""
    # a cut-off character comes out at flush, replaced
    dec = tok.stream_decoder()
    assert dec.push(ids[0]) == "" or len(ids) == 1
    assert len(ids) == 1 or dec.flush() == "\ufffd"


def test_tokenizer_json_directory_equals_transformers(tiny, tmp_path):
    from transformers import AutoTokenizer

    ht = hf_tokenizer(str(tiny))
    d = tmp_path / "hf-tok"
    ht.save_pretrained(str(d))
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    ours = load_tokenizer(d)
    ref = AutoTokenizer.from_pretrained(str(d))
    for text in TEXTS:
        assert ours.encode(text) == ref(text)["input_ids"], text
    assert ours.apply_chat_template(CHATS[1]) == ref.apply_chat_template(CHATS[1], tokenize=False,
                                                                         add_generation_prompt=True)


def test_byte_tokenizer_protocol():
    tok = ByteTokenizer()
    assert isinstance(tok, Tokenizer)
    ids = tok.encode("héllo 😀")
    assert ids[0] == tok.bos_id and tok.decode(ids) == "héllo 😀"
    assert tok.encode("a", add_special_tokens=False) == [97] == tok.encode("a", add_bos=False)
    dec = tok.stream_decoder()
    pieces = [dec.push(i) for i in ids] + [dec.flush()]
    assert "".join(pieces) == "héllo 😀" and "\ufffd" not in "".join(pieces)
    assert pieces[-5:-1] == ["", "", "", "😀"]
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "user: hi\nassistant:"
    assert load_tokenizer(__import__("fedswarm.tasks.checkpoint", fromlist=["x"]).resolve_model("tiny-llama")) \
        .name == "bytes"


def test_bad_chats_are_input_errors(smollm):
    tok = load_tokenizer(smollm)
    for bad in ([], "hi", [{"role": "user"}], [{"content": "x"}], [1, 2], [{"role": "user", "content": 5}]):
        with pytest.raises(InputError):
            tok.apply_chat_template(bad)
    assert tok.decode([10 ** 6, 19556]) == tok.decode([19556]) == "Hello"  # unknown ids decode to nothing
