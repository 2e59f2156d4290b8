"""Shared pieces of the GGUF / tokenizer / SmolLM2 tests.

* :func:`smollm_path`: the pulled SmolLM2 GGUF, or a test failure that says
  how to pull it (never a silent skip).
* :func:`write_tiny_gguf`: a small Llama GGUF with UNtied embeddings written
  with ``gguf.GGUFWriter`` from the shipped tiny-llama-gqa weights (plus a
  seeded ``output.weight``), Q/K permuted the way llama.cpp's converter does,
  F32 norms, F16 and Q8_0 matrices, and a small byte-level BPE tokenizer
  trained with ``tokenizers``; next to it a safetensors checkpoint with the
  very same (dequantized) numbers.
* ``hf_*``: transformers' references, computed once per process
  (``lru_cache``), because loading transformers' GGUF model is slow.
  :func:`hf_greedy`'s tokens are also kept in ``oracle_tokens.json`` beside
  this file, keyed by the GGUF file's SHA-256, the prompt, the count,
  the transformers and torch versions and a dtype other than float32: loading SmolLM2 into transformers
  takes about 20 s of the suite. Any other file, prompt or version runs
  transformers; ``FEDSWARM_ORACLE_WRITE=1`` records what it answered.
"""

from __future__ import annotations

import hashlib
import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

PULL_HINT = ("SmolLM2 is not in the model store: run `peer models pull smollm2-135m-instruct` "
             "(scripts/setup.sh does this; $FEDSWARM_HOME moves the store)")

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Hello, swarm! Peers serve blocks of a model and a client runs the head.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # 5",
    "Grüße aus Köln, naïve café, 日本語, emoji 😀 and more text for merges.",
    "the theory then these those there their they them thermal thesis",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def smollm_path() -> Path:
    from fedswarm.errors import InputError
    from fedswarm.tasks.checkpoint import resolve_model

    try:
        return resolve_model("smollm2-135m-instruct", allow_paths=False)
    except InputError:
        pass
    pytest.fail(PULL_HINT, pytrace=False)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    from fedswarm.tasks.gguf_model import permute_for_gguf

    return np.ascontiguousarray(permute_for_gguf(w, n_head))


def _train_tokenizer(vocab_size: int) -> tuple[list[str], list[str]]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    model = json.loads(tok.to_str())["model"]
    vocab = model["vocab"]
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    n = len(tokens)
    tokens += [f"<unused{i}>" for i in range(vocab_size - n)]
    return tokens, merges


def write_tiny_gguf(out_dir: Path) -> tuple[Path, Path]:
    """(gguf_path, safetensors_dir) of the same untied tiny model (see module doc)."""
    import gguf

    from fedswarm.tasks.checkpoint import load_config, load_tensors, resolve_model, save_checkpoint

    Q8 = gguf.GGMLQuantizationType.Q8_0
    src = resolve_model("tiny-llama-gqa")
    cfg = load_config(src)
    sd = {k: v.float().numpy() for k, v in load_tensors(src, _all_names(cfg)).items()}
    g = torch.Generator().manual_seed(26)
    sd["lm_head.weight"] = (0.05 * torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g)).numpy()
    eps = float(np.float32(cfg.rms_norm_eps))
    tokens, merges = _train_tokenizer(cfg.vocab_size)
    types = [3 if t in SPECIALS else 1 for t in tokens]

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "tiny-untied.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny untied test model")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    exact: dict[str, np.ndarray] = {}  # what the file's numbers dequantize to, in HF layout
    from fedswarm.tasks.gguf_model import hf_to_gguf_name

    for name in sorted(sd, key=_order):
        a = sd[name].astype(np.float32)
        if name.endswith("q_proj.weight"):
            stored = _permute(a, cfg.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            stored = _permute(a, cfg.num_key_value_heads)
        else:
            stored = a
        gname = hf_to_gguf_name(name)
        if a.ndim == 1:
            w.add_tensor(gname, stored)
            exact[name] = a
        elif "mlp." in name or name == "lm_head.weight":
            q = gguf.quants.quantize(stored, Q8)
            w.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=Q8)
            deq = gguf.quants.dequantize(q, Q8).reshape(a.shape)
            exact[name] = deq  # mlp and lm_head are not permuted
        else:
            h = stored.astype(np.float16)
            w.add_tensor(gname, h)
            back = h.astype(np.float32)
            if name.endswith("q_proj.weight"):
                back = _unpermute(back, cfg.num_attention_heads)
            elif name.endswith("k_proj.weight"):
                back = _unpermute(back, cfg.num_key_value_heads)
            exact[name] = back
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    st_dir = out_dir / "tiny-untied-st"
    hf_cfg = json.loads((src / "config.json").read_text())
    hf_cfg.pop("rope_scaling", None)
    hf_cfg.update(tie_word_embeddings=False, rms_norm_eps=eps)
    save_checkpoint(st_dir, hf_cfg, {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in exact.items()})
    return path, st_dir


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    shape = w.shape
    dim = shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *shape[1:]).swapaxes(2, 1).reshape(shape)


def _all_names(cfg: Any) -> list[str]:
    from fedswarm.tasks.llama import block_keys, head_keys

    return head_keys(cfg) + [k for i in range(cfg.num_hidden_layers) for k in block_keys(cfg, i)]


def _order(name: str) -> tuple[int, str]:
    if name.startswith("model.layers."):
        return (int(name.split(".")[2]) + 1, name)
    return (0 if "embed" in name else 10_000, name)


@lru_cache(maxsize=None)
def tiny_files(root: str) -> tuple[Path, Path]:
    return write_tiny_gguf(Path(root))


@lru_cache(maxsize=None)
def hf_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    p = Path(path)
    return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)


@lru_cache(maxsize=None)
def hf_model(path: str, dtype: str = "float32") -> Any:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as tlog

    tlog.disable_progress_bar()
    p = Path(path)
    return AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=getattr(torch, dtype)).eval()


ORACLE_FILE = Path(__file__).with_name("oracle_tokens.json")


def _oracle_key(path: str, prompt: tuple[int, ...], n: int, dtype: str = "float32") -> str:
    import transformers

    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    key = [digest, list(prompt), n, transformers.__version__, torch.__version__]
    return json.dumps(key if dtype == "float32" else key + [dtype])


@lru_cache(maxsize=None)
def hf_greedy(path: str, prompt: tuple[int, ...], n: int, dtype: str = "float32") -> list[int]:
    """transformers' greedy continuation of ``prompt`` for the GGUF at ``path``,
    the model loaded in ``dtype`` (see the module's docstring for the recorded
    answers)."""
    key = _oracle_key(path, prompt, n, dtype)
    known = json.loads(ORACLE_FILE.read_text()) if ORACLE_FILE.exists() else {}
    if key in known:
        return list(known[key])
    toks = _hf_greedy(path, prompt, n, dtype)
    if os.environ.get("FEDSWARM_ORACLE_WRITE") == "1":
        known[key] = toks
        ORACLE_FILE.write_text("{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in sorted(known.items()))
                               + "\n}\n")
    return toks


def hf_margins(path: str, prompt: list[int], tokens: list[int], dtype: str) -> list[float]:
    """Read ``tokens`` as a continuation of ``prompt`` teacher-forced by
    transformers' model in ``dtype`` (one forward pass): at each step, how
    far the chosen token's logit is below the step's top logit (0: it is a
    top token)."""
    m = hf_model(path, dtype)
    with torch.no_grad():
        logits = m(torch.tensor([list(prompt) + list(tokens)])).logits[0].float()
    first = len(prompt) - 1
    return [float(logits[first + i].max() - logits[first + i][t]) for i, t in enumerate(tokens)]


def _hf_greedy(path: str, prompt: tuple[int, ...], n: int, dtype: str = "float32") -> list[int]:
    """transformers' greedy continuation with its KV cache (argmax each step,
    no early stop at EOS, so exactly ``n`` tokens)."""
    m = hf_model(path, dtype)
    out_ids: list[int] = []
    with torch.no_grad():
        out = m(torch.tensor([list(prompt)]), use_cache=True)
        for _ in range(n):
            tok = int(out.logits[0, -1].argmax())
            out_ids.append(tok)
            if len(out_ids) < n:
                out = m(torch.tensor([[tok]]), cache=out.cache, use_cache=True)
    return out_ids
