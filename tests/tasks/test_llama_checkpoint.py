import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from fedswarm.tasks import checkpoint as ck
from fedswarm.tasks.llama import LlamaConfig, block_keys, head_keys


class RecordingSafeOpen:
    """Wraps safetensors.safe_open and records every tensor actually read."""

    def __init__(self):
        self.read = []
        self.opened = []

    def __call__(self, path, framework, device="cpu"):
        self.opened.append(path)
        real = ck.__dict__["_real_safe_open"](path, framework=framework, device=device)
        rec = self

        class Handle:
            def __enter__(self):
                self.f = real.__enter__()
                return self

            def __exit__(self, *a):
                return real.__exit__(*a)

            def get_tensor(self, k):
                rec.read.append(k)
                return self.f.get_tensor(k)

        return Handle()


@pytest.fixture
def recorder(monkeypatch):
    monkeypatch.setitem(ck.__dict__, "_real_safe_open", ck.safe_open)
    r = RecordingSafeOpen()
    monkeypatch.setattr(ck, "safe_open", r)
    return r


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-llama-gqa"])
def test_span_reads_only_its_keys(recorder, name):
    d = ck.resolve_model(name)
    cfg = ck.load_config(d)
    span = ck.load_block_span(d, 1, 3)
    expected = {k for layer in (1, 2) for k in block_keys(cfg, layer)}
    assert set(recorder.read) == expected and len(recorder.read) == len(expected)
    assert span.start == 1 and span.end == 3 and len(span.blocks) == 2
    assert not any(p.is_meta for p in span.parameters())
    recorder.read.clear()
    head = ck.load_client_head(d)
    assert set(recorder.read) == set(head_keys(cfg))
    assert (head.lm_head is None) == cfg.tie_word_embeddings


def test_sharded_checkpoint_loads_and_hash_ignores_sharding(gqa_dir, tmp_path, recorder):
    assert (gqa_dir / ck.INDEX_FILE).exists()
    wm = ck.weight_map(gqa_dir)
    assert len(set(wm.values())) == 2
    # A span whose layers live in the second file opens only that file.
    cfg = ck.load_config(gqa_dir)
    last = cfg.num_hidden_layers - 1
    files = {wm[k] for k in block_keys(cfg, last)}
    ck.load_block_span(gqa_dir, last, last + 1)
    assert {p.rsplit("/", 1)[-1] for p in recorder.opened} == files
    # Re-save as a single file: same tensors, same model hash.
    tensors = {}
    for fn in set(wm.values()):
        tensors.update(load_file(gqa_dir / fn))
    single = tmp_path / "single"
    ck.save_checkpoint(single, json.loads((gqa_dir / "config.json").read_text()), tensors)
    assert not (single / ck.INDEX_FILE).exists()
    assert ck.model_hash(single) == ck.model_hash(gqa_dir)
    a, b = ck.load_block_span(single, 0, 4), ck.load_block_span(gqa_dir, 0, 4)
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)


def test_model_hash_stable_and_sensitive(tiny_dir, tmp_path):
    h = ck.model_hash(tiny_dir)
    assert len(h) == 64 and h == ck.model_hash(tiny_dir)
    d = tmp_path / "m"
    shutil.copytree(tiny_dir, d)
    assert ck.model_hash(d) == h
    # Change one weight by one ulp-ish amount: the hash changes (cache invalidated).
    t = load_file(d / "model.safetensors")
    t["model.layers.2.mlp.up_proj.weight"][3, 5] += 1e-3
    (d / "model.safetensors").unlink()
    save_file(t, d / "model.safetensors", metadata={"format": "pt"})
    h2 = ck.model_hash(d)
    assert h2 != h
    # A computation-relevant config change changes it; a cosmetic one does not.
    cfg = json.loads((d / "config.json").read_text())
    cfg["transformers_version"] = "9.9.9"
    (d / "config.json").write_text(json.dumps(cfg))
    assert ck.model_hash(d) == h2
    cfg["rms_norm_eps"] = 1e-6
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    assert ck.model_hash(d) != h2


def test_expected_hash_checked(tiny_dir):
    with pytest.raises(ValueError, match="hash mismatch"):
        ck.load_block_span(tiny_dir, 0, 1, expected_hash="0" * 64)
    ck.load_block_span(tiny_dir, 0, 1, expected_hash=ck.model_hash(tiny_dir))


@pytest.mark.parametrize("name", ["../tiny-llama", "/etc", "a/b", "", ".hidden", "x" * 200, "nope"])
def test_resolve_model_rejects_paths_and_unknown(name):
    with pytest.raises(ValueError):
        ck.resolve_model(name)


def test_resolve_model_operator_roots(tiny_dir, tmp_path, monkeypatch):
    shutil.copytree(tiny_dir, tmp_path / "mine")
    monkeypatch.setenv(ck.MODEL_DIRS_ENV, str(tmp_path))
    assert ck.resolve_model("mine") == tmp_path / "mine"
    assert set(ck.shipped_models()) >= {"tiny-llama", "tiny-llama-gqa"}


def test_bad_span_and_dtype(tiny_dir):
    with pytest.raises(ValueError, match="bad block span"):
        ck.load_block_span(tiny_dir, 2, 9)
    span = ck.load_block_span(tiny_dir, 0, 1, dtype="bfloat16")
    assert span.dtype == torch.bfloat16
    with pytest.raises(ValueError):
        ck.load_block_span(tiny_dir, 0, 1, dtype="int8")


def test_config_validation():
    base = json.loads((ck.resolve_model("tiny-llama") / "config.json").read_text())
    LlamaConfig.from_hf_dict(base)
    for bad in (
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
        {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
        {"num_key_value_heads": 3},
        {"hidden_act": "gelu"},
        {"model_type": "gpt2"},
        {"vocab_size": -1},
    ):
        with pytest.raises(ValueError):
            LlamaConfig.from_hf_dict({**base, **bad})
    # transformers-5 style rope_parameters is accepted too.
    v5 = {k: v for k, v in base.items() if k not in ("rope_scaling", "rope_theta")}
    v5["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    assert LlamaConfig.from_hf_dict(v5).canonical() == LlamaConfig.from_hf_dict(base).canonical()
