"""``llm-batch``: batch LLM inference over a list of prompts.

Params (all validated; unknown keys rejected)::

    model           name of a shipped model or of a directory under the
                    operator's model roots (never a path; see resolve_model)
    model_hash      optional: the expected model_hash; mismatch -> ValueError
    prompts         list[str]            (needs a model using the byte tokenizer)
    prompt_ids      list[list[int]]      (exactly one of prompts / prompt_ids)
    max_new_tokens  int 1..1024, default 16
    greedy          bool, default True; False samples with `temperature`
    temperature     float (0, 10], default 1.0
    seed            int, sampling seed (combined with the shard index)
    shard_size      prompts per shard, 1..64, default 8
    dtype           "float32" (default) | "bfloat16" | "float16"
    stop_at_eos     bool, default True

Shard ``i`` handles ``prompts[i*shard_size : (i+1)*shard_size]``; use
``num_shards(params)`` for the count. The result::

    {"model", "model_hash", "shard", "first_index", "dtype",
     "outputs": [{"index", "prompt_tokens", "token_ids", "text"?}]}

``text`` is present only for byte-tokenizer models. Loaded models are kept in
a small in-process LRU keyed by (hash, device, dtype).
"""

from __future__ import annotations

import hashlib
import math
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch

from .checkpoint import load_block_span, load_client_head, load_config, model_hash, resolve_model
from .llama import DTYPES, LlamaBlockSpan, LlamaClientHead, LlamaConfig, generate
from .registry import (
    REF_FLOPS,
    REF_MEM_BW,
    TaskEstimate,
    check_cancelled,
    check_params,
    param_bool,
    param_float,
    param_int,
    param_str,
)
from .tokenizer import ByteTokenizer

__all__ = ["LlmBatchTask"]

_PARAMS = frozenset({
    "model", "model_hash", "prompts", "prompt_ids", "max_new_tokens", "greedy", "temperature",
    "seed", "shard_size", "dtype", "stop_at_eos",
})
MAX_PROMPTS = 4096
MAX_PROMPT_CHARS = 8192
MAX_NEW_TOKENS = 1024
MAX_SHARD_SIZE = 64
_TOKENIZER = ByteTokenizer()


class _Job:
    __slots__ = ("model_dir", "config", "prompts", "max_new", "greedy", "temperature", "seed",
                 "shard_size", "dtype", "stop_at_eos", "name", "expected_hash")
    model_dir: os.PathLike[str]
    config: LlamaConfig
    prompts: list[list[int]]
    max_new: int
    greedy: bool
    temperature: float
    seed: int
    shard_size: int
    dtype: str
    stop_at_eos: bool
    name: str
    expected_hash: str | None


class LlmBatchTask:
    name = "llm-batch"

    def __init__(self, model_roots: Sequence[str | os.PathLike[str]] | None = None, cache_size: int = 2) -> None:
        self.model_roots = list(model_roots or [])
        self._cache: OrderedDict[tuple[str, str, str], tuple[LlamaClientHead, LlamaBlockSpan]] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    # ------------------------------------------------------------ params
    def _parse(self, params: dict) -> _Job:
        check_params(params, _PARAMS, required=("model",))
        j = _Job()
        j.name = param_str(params, "model", None, max_len=128)
        j.model_dir = resolve_model(j.name, allow_paths=False, roots=self.model_roots)
        j.config = cfg = load_config(j.model_dir)
        j.expected_hash = params.get("model_hash")
        if j.expected_hash is not None:
            param_str(params, "model_hash", None, max_len=64)
        j.max_new = param_int(params, "max_new_tokens", 16, 1, MAX_NEW_TOKENS)
        j.greedy = param_bool(params, "greedy", True)
        j.temperature = param_float(params, "temperature", 1.0, 1e-3, 10.0)
        j.seed = param_int(params, "seed", 0, 0, (1 << 63) - 1)
        j.shard_size = param_int(params, "shard_size", 8, 1, MAX_SHARD_SIZE)
        j.dtype = param_str(params, "dtype", "float32", choices=tuple(DTYPES))
        j.stop_at_eos = param_bool(params, "stop_at_eos", True)
        if ("prompts" in params) == ("prompt_ids" in params):
            raise ValueError("give exactly one of 'prompts' (list of str) or 'prompt_ids' (list of int lists)")
        limit = cfg.max_position_embeddings - j.max_new
        if "prompts" in params:
            ps = params["prompts"]
            if cfg.tokenizer != "bytes":
                raise ValueError(f"model {j.name!r} has no built-in tokenizer: send 'prompt_ids'")
            if not isinstance(ps, list) or not 1 <= len(ps) <= MAX_PROMPTS:
                raise ValueError(f"'prompts' must be a list of 1..{MAX_PROMPTS} strings")
            if not all(isinstance(p, str) and len(p) <= MAX_PROMPT_CHARS for p in ps):
                raise ValueError(f"each prompt must be a string of at most {MAX_PROMPT_CHARS} chars")
            ids = [_TOKENIZER.encode(p) for p in ps]
        else:
            ids = params["prompt_ids"]
            if not isinstance(ids, list) or not 1 <= len(ids) <= MAX_PROMPTS:
                raise ValueError(f"'prompt_ids' must be a list of 1..{MAX_PROMPTS} lists of ints")
            for p in ids:
                if not isinstance(p, list) or not p:
                    raise ValueError("each entry of 'prompt_ids' must be a non-empty list of ints")
                if not all(type(t) is int and 0 <= t < cfg.vocab_size for t in p):
                    raise ValueError(f"token ids must be ints in [0, {cfg.vocab_size})")
        for p in ids:
            if len(p) > limit:
                raise ValueError(
                    f"prompt of {len(p)} tokens + max_new_tokens {j.max_new} exceeds the model's "
                    f"{cfg.max_position_embeddings} positions"
                )
        j.prompts = ids
        return j

    def num_shards(self, params: dict) -> int:
        j = self._parse(params)
        return math.ceil(len(j.prompts) / j.shard_size)

    # ---------------------------------------------------------- estimate
    def estimate(self, params: dict) -> TaskEstimate:
        j = self._parse(params)
        return self._estimate(j.config, j)

    @staticmethod
    def _estimate(cfg: LlamaConfig, j: _Job) -> TaskEstimate:
        # Per shard, sized for the worst one: the `shard_size` longest prompts.
        lens = sorted((len(p) for p in j.prompts), reverse=True)[: j.shard_size]
        bsz = len(lens)
        seq = max(lens) + j.max_new
        el = DTYPES[j.dtype].itemsize
        weights = cfg.param_count() * el
        kv = bsz * seq * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * el
        # Peak activations: a prefill (attention scores dominate for long prompts)
        # or the batched decode with its padded K/V copy and fp32 logits.
        prefill = max(lens) * (4 * cfg.hidden_size + 2 * cfg.intermediate_size) * el \
            + cfg.num_attention_heads * max(lens) ** 2 * 4
        decode = bsz * seq * 2 * cfg.num_attention_heads * cfg.head_dim * el + bsz * cfg.vocab_size * 8
        mem = weights + kv + max(prefill, decode) + (16 << 20)
        tokens = sum(lens) + bsz * j.max_new
        flops = 2.0 * cfg.param_count() * tokens
        # Each prefill and each batched decode step streams all weights once.
        streamed = weights * (bsz + j.max_new)
        return TaskEstimate(mem_bytes=int(mem), ref_seconds=flops / REF_FLOPS + streamed / REF_MEM_BW + 0.01)

    # --------------------------------------------------------------- run
    def _model(self, j: _Job, digest: str, device: str) -> tuple[LlamaClientHead, LlamaBlockSpan]:
        key = (digest, device, j.dtype)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        head = load_client_head(j.model_dir, device=device, dtype=j.dtype)
        span = load_block_span(j.model_dir, 0, j.config.num_hidden_layers, device=device, dtype=j.dtype)
        with self._lock:
            self._cache[key] = (head, span)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return head, span

    def run(self, params: dict, shard: int, *, device: str = "cpu") -> dict:
        j = self._parse(params)
        n_shards = math.ceil(len(j.prompts) / j.shard_size)
        if isinstance(shard, bool) or not isinstance(shard, int) or not 0 <= shard < n_shards:
            raise ValueError(f"shard must be an int in [0, {n_shards})")
        digest = model_hash(j.model_dir)
        if j.expected_hash is not None and j.expected_hash != digest:
            raise ValueError(f"model {j.name!r} has hash {digest}, not the requested {j.expected_hash}")
        first = shard * j.shard_size
        prompts = j.prompts[first : first + j.shard_size]
        head, span = self._model(j, digest, str(torch.device(device)))
        gen = None
        if not j.greedy:
            s = hashlib.sha256(f"llm-batch\0{j.seed}\0{shard}".encode()).digest()
            gen = torch.Generator(device="cpu").manual_seed(int.from_bytes(s[:8], "little") >> 1)
        eos = j.config.extra.get("eos_token_id") if j.stop_at_eos else None
        if not isinstance(eos, int):
            eos = None
        outs = generate(
            head, [span], prompts, j.max_new, greedy=j.greedy, temperature=j.temperature,
            generator=gen, eos_id=eos, check_cancelled=check_cancelled,
        )
        results = []
        for k, (p, toks) in enumerate(zip(prompts, outs)):
            r: dict = {"index": first + k, "prompt_tokens": len(p), "token_ids": toks}
            if j.config.tokenizer == "bytes":
                r["text"] = _TOKENIZER.decode(toks)
            results.append(r)
        return {
            "model": j.name,
            "model_hash": digest,
            "shard": shard,
            "first_index": first,
            "dtype": j.dtype,
            "outputs": results,
        }

