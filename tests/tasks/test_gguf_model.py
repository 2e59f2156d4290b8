"""GGUF checkpoints: config from metadata, tensors equal to a safetensors copy
of the same numbers, transformers' parity, hashing, resolution by name, and
refusal of files we cannot serve."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from fedswarm.errors import InputError
from fedswarm.tasks import checkpoint
from fedswarm.tasks import gguf_model as gm
from fedswarm.tasks.checkpoint import (
    load_block_span,
    load_client_head,
    load_config,
    model_hash,
    resolve_model,
)
from fedswarm.tasks.llama import generate_greedy
from gguf_testing import hf_greedy, smollm_path, tiny_files


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_files(str(tmp_path_factory.mktemp("gguf")))


@pytest.fixture(scope="module")
def smollm():
    return smollm_path()


def test_smollm2_config_from_metadata(smollm):
    cfg = load_config(smollm)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.vocab_size == 49152 and cfg.rope_theta == 100000.0 and cfg.rope_scaling is None
    assert cfg.tie_word_embeddings and cfg.max_position_embeddings == 8192
    assert cfg.extra["eos_token_id"] == 2
    head = load_client_head(smollm)
    assert head.lm_head is None and head.embed_tokens.weight.shape == (49152, 576)


def test_untied_gguf_equals_its_safetensors_twin(tiny):
    g, st = tiny
    cfg = load_config(g)
    assert not cfg.tie_word_embeddings
    assert cfg.canonical() == load_config(st).canonical()
    for a, b in ((load_block_span(g, 0, 4), load_block_span(st, 0, 4)), (load_client_head(g), load_client_head(st))):
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k
    assert "lm_head.weight" in load_client_head(g).state_dict()


def test_untied_gguf_greedy_equals_transformers_and_safetensors(tiny):
    g, st = tiny
    prompt = [1, 344, 263, 201, 74, 75, 2, 1, 80]
    ours = generate_greedy(load_client_head(g), [load_block_span(g, 0, 1), load_block_span(g, 1, 4)], prompt, 12)
    twin = generate_greedy(load_client_head(st), [load_block_span(st, 0, 4)], prompt, 12)
    ref = hf_greedy(str(g), tuple(prompt), 12)
    assert len(set(ref)) > 3
    assert ours == ref == twin


def test_a_span_reads_only_its_tensors(tiny, monkeypatch):
    g, _ = tiny
    asked: list[list[str]] = []
    real = gm.load_tensors

    def spy(path, names, **kw):
        names = list(names)
        asked.append(names)
        return real(path, names, **kw)

    monkeypatch.setattr(gm, "load_tensors", spy)
    load_block_span(g, 2, 3)
    assert asked and all(n.startswith("model.layers.2.") for n in asked[-1]) and len(asked[-1]) == 9
    load_client_head(g)
    assert sorted(asked[-1]) == ["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"]


def test_hash_is_of_content_and_needs_no_dequantization(tiny, tmp_path, monkeypatch):
    g, _ = tiny
    h = model_hash(g)
    assert len(h) == 64 and h == model_hash(g)
    copy = tmp_path / "copy.gguf"
    shutil.copy(g, copy)

    def no_dequant(*a, **k):
        raise AssertionError("model_hash dequantized a tensor")

    monkeypatch.setattr(gguf.quants, "dequantize", no_dequant)
    assert model_hash(copy) == h  # same bytes elsewhere: same model
    # flip one byte inside the last tensor's data: another model
    t = gm.open_gguf(copy).reader.tensors[-1]
    off = int(t.data_offset) + int(t.n_bytes) // 2
    data = bytearray(copy.read_bytes())
    data[off] ^= 0x40
    st = copy.stat()
    copy.write_bytes(bytes(data))
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a new fingerprint even on coarse clocks
    assert model_hash(copy) != h


def test_names_and_paths_resolve(tiny, tmp_path, monkeypatch):
    g, _ = tiny
    d = tmp_path / "extra"
    d.mkdir()
    shutil.copy(g, d / "my-tiny.gguf")
    monkeypatch.setenv("FEDSWARM_MODEL_DIRS", str(d))
    assert resolve_model("my-tiny", allow_paths=False) == d / "my-tiny.gguf"
    assert resolve_model("my-tiny.gguf", allow_paths=False) == d / "my-tiny.gguf"
    assert resolve_model(str(g)) == Path(g)
    assert "my-tiny" in checkpoint.known_models()
    # names from the network never become paths
    for bad in (str(g), "../etc", "/etc/passwd", "a/b"):
        with pytest.raises(InputError):
            resolve_model(bad, allow_paths=False)
    with pytest.raises(InputError) as e:
        resolve_model("no-such-model", allow_paths=False)
    assert "tiny-llama" in str(e.value) and "peer models pull" in str(e.value)
    monkeypatch.setenv("FEDSWARM_HOME", str(tmp_path / "empty-home"))
    with pytest.raises(InputError) as e:
        resolve_model("smollm2-135m-instruct", allow_paths=False)
    assert "peer models pull smollm2-135m-instruct" in str(e.value)


# ----------------------------------------------------------------- refusals

def _refused(path: Path, *words: str) -> str:
    with pytest.raises(InputError) as e:
        load_config(path)
    msg = str(e.value)
    assert "\n" not in msg and path.name in msg, msg
    for w in words:
        assert w in msg, msg
    return msg


def test_truncated_file_is_refused(tiny, tmp_path):
    g, _ = tiny
    data = g.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 1000])  # inside the tensor data
    _refused(cut, "truncated")
    head = tmp_path / "head.gguf"
    head.write_bytes(data[:3000])  # inside the metadata
    _refused(head)


def test_not_a_gguf_is_refused(tmp_path):
    p = tmp_path / "notes.gguf"
    p.write_text("this is not a model\n")
    _refused(p, "not a GGUF")
    with pytest.raises(InputError):
        resolve_model(str(tmp_path / "missing.gguf"))


def _write(path: Path, arch: str, tensors: dict[str, np.ndarray]) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_context_length(32)
    for name, a in tensors.items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_wrong_architecture_is_refused(tmp_path):
    p = _write(tmp_path / "gpt2.gguf", "gpt2", {"token_embd.weight": np.zeros((16, 8), np.float32)})
    _refused(p, "architecture", "gpt2")


def test_unknown_tensor_type_is_refused(tmp_path):
    p = _write(tmp_path / "int.gguf", "llama", {"token_embd.weight": np.zeros((16, 8), np.float32),
                                                 "blk.0.attn_norm.weight": np.zeros(8, np.int32)})
    _refused(p, "I32", "blk.0.attn_norm.weight")
