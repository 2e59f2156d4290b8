"""A Llama-family decoder in plain torch, cut for Petals-style serving.

The model is split the way a swarm serves it:

* :class:`LlamaClientHead` -- token embeddings, the final RMSNorm and the
  ``lm_head`` (tied to the embeddings when the config says so). The client
  keeps it.
* :class:`LlamaBlockSpan` -- decoder blocks ``[start, end)``. A server holds one
  span; activations (``hidden``, shape ``(batch, seq, hidden_size)``) travel
  between spans.
* :class:`KVCache` -- one per (session, span): preallocated key/value tensors of
  shape ``(layers_in_span, kv_heads, max_length, head_dim)`` and a ``length``.

Batching sessions that sit at different positions
-------------------------------------------------
``LlamaBlockSpan.forward(hidden, caches)`` takes one cache per batch row. Row
``b`` gets positions ``caches[b].length + arange(T)``; its new keys/values are
written into its own cache. For attention the rows' cached keys/values are
copied into a zero-padded ``(B, kv_heads, max_len, head_dim)`` tensor and a
boolean mask hides the padding and the future (query ``t`` of row ``b`` sees
key ``j`` iff ``j <= caches[b].length + t``). The copy is ``O(B * len)`` per
layer and step: simple and correct, not paged attention. With one row the
cache is used in place with no copy.

Numerics follow Hugging Face ``LlamaForCausalLM`` (RMSNorm in fp32, RoPE
cos/sin in fp32 cast to the activation dtype), so greedy decoding matches it
token for token in fp32.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "LlamaConfig",
    "RMSNorm",
    "LlamaBlock",
    "LlamaBlockSpan",
    "LlamaClientHead",
    "KVCache",
    "rope_inv_freq",
    "generate",
    "generate_greedy",
    "random_state_dict",
    "block_keys",
    "head_keys",
    "DTYPES",
]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class _NoInitOnMeta(torch.overrides.TorchFunctionMode):
    """Turn ``torch.nn.init`` calls on meta tensors into no-ops.

    Building a module under ``with torch.device("meta")`` still runs every
    submodule's ``reset_parameters``; on meta tensors ``normal_``/``uniform_``
    go through torch's Python reference kernels, whose first use imports
    ``torch._dynamo`` (about 1.5 s here, 3.5 s on a loaded machine). The
    weights are replaced by ``load_state_dict(assign=True)`` anyway, so
    initialising them is pure waste.
    """

    _INIT = frozenset(getattr(nn.init, n) for n in (
        "normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_",
        "trunc_normal_", "zeros_", "ones_", "constant_", "orthogonal_"))

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in self._INIT:
            t = args[0] if args else kwargs.get("tensor")
            if isinstance(t, torch.Tensor) and t.is_meta:
                return t
        return func(*args, **kwargs)


def _pos_int(d: Mapping[str, Any], key: str, default: Any = None, *, lo: int = 1, hi: int = 1 << 24) -> int:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ValueError(f"config {key!r} must be an int in [{lo}, {hi}], got {v!r}")
    return v


def _pos_float(d: Mapping[str, Any], key: str, default: Any = None) -> float:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"config {key!r} must be a positive number, got {v!r}")
    return float(v)


@dataclass(frozen=True)
class LlamaConfig:
    """The subset of a Hugging Face ``config.json`` that the computation uses."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    dtype: str = "float32"
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> LlamaConfig:
        """Parse and validate a HF config dict (legacy ``rope_theta``/``rope_scaling``
        or transformers-5 ``rope_parameters``)."""
        if not isinstance(d, Mapping):
            raise ValueError("config must be a JSON object")
        mt = d.get("model_type", "llama")
        if mt != "llama":
            raise ValueError(f"unsupported model_type {mt!r}: only 'llama' is supported")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}: only 'silu' is supported")
        hidden = _pos_int(d, "hidden_size")
        heads = _pos_int(d, "num_attention_heads", hi=4096)
        kv_heads = _pos_int(d, "num_key_value_heads", heads, hi=4096)
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        head_dim = d.get("head_dim") or (hidden // heads)
        head_dim = _pos_int({"head_dim": head_dim}, "head_dim", hi=4096)
        if head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {head_dim}")

        rope_params = d.get("rope_parameters")
        if isinstance(rope_params, Mapping):
            theta = rope_params.get("rope_theta", d.get("rope_theta", 10000.0))
            scaling: dict[str, Any] | None = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        else:
            theta = d.get("rope_theta", 10000.0)
            scaling = dict(d["rope_scaling"]) if d.get("rope_scaling") else None
        if scaling is not None:
            rtype = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
            scaling.pop("type", None)
            if rtype not in SUPPORTED_ROPE_TYPES:
                raise ValueError(
                    f"unsupported rope_scaling type {rtype!r}: supported are {', '.join(SUPPORTED_ROPE_TYPES)}"
                )
            scaling = None if rtype == "default" else {"rope_type": rtype, **scaling}
        theta = _pos_float({"rope_theta": theta}, "rope_theta")

        dtype = d.get("dtype") or d.get("torch_dtype") or "float32"
        if dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}: supported are {', '.join(DTYPES)}")
        cfg = cls(
            vocab_size=_pos_int(d, "vocab_size", hi=1 << 22),
            hidden_size=hidden,
            intermediate_size=_pos_int(d, "intermediate_size"),
            num_hidden_layers=_pos_int(d, "num_hidden_layers", hi=4096),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=_pos_float(d, "rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=_pos_int(d, "max_position_embeddings", 2048, hi=1 << 24),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)),
            mlp_bias=bool(d.get("mlp_bias", False)),
            dtype=dtype,
            extra={k: d[k] for k in ("fedswarm_tokenizer", "bos_token_id", "eos_token_id") if k in d},
        )
        rope_inv_freq(cfg)  # validate the scaling parameters now
        return cfg

    def canonical(self) -> dict[str, Any]:
        """Computation-relevant fields only, JSON-ready (used by ``model_hash``)."""
        d = asdict(self)
        d.pop("extra")
        return d

    @property
    def tokenizer(self) -> str | None:
        return self.extra.get("fedswarm_tokenizer")

    def block_param_count(self) -> int:
        h, i, hd = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * hd * (2 * self.num_attention_heads + 2 * self.num_key_value_heads)
        return attn + 3 * h * i + 2 * h

    def head_param_count(self) -> int:
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2) + self.hidden_size

    def param_count(self) -> int:
        return self.block_param_count() * self.num_hidden_layers + self.head_param_count()


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """Inverse RoPE frequencies (fp32, CPU), as transformers computes them."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    sc = cfg.rope_scaling
    if sc is None:
        return inv
    rtype = sc["rope_type"]
    try:
        factor = float(sc["factor"])
        if rtype == "linear":
            if factor <= 0:
                raise ValueError
            return inv / factor
        if rtype == "llama3":
            low = float(sc["low_freq_factor"])
            high = float(sc["high_freq_factor"])
            old_ctx = sc["original_max_position_embeddings"]
            if factor <= 0 or high <= low or old_ctx <= 0:
                raise ValueError
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"bad rope_scaling parameters for type {rtype!r}: {sc!r}") from None
    low_wl = old_ctx / low
    high_wl = old_ctx / high
    wavelen = 2 * math.pi / inv
    inv_l = torch.where(wavelen > low_wl, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
    is_medium = ~(wavelen < high_wl) * ~(wavelen > low_wl)
    return torch.where(is_medium, smoothed, inv_l)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dt)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = nn.Linear(h, self.n_heads * hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, self.n_kv * hd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, self.n_kv * hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * hd, h, bias=cfg.attention_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: _StepKV, layer: int) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        keys, values, mask, causal = kv.update(layer, k, v)
        # grouped-query attention reads each key/value head for its group of
        # query heads in place: repeating the heads copied the whole cache, per
        # layer and step (SmolLM2, one layer: 0.84 against 0.37 ms at 2,048
        # positions, 7.2 against 1.6 ms at 8,192; the same bits on the CPU:
        # benchmarks/llm_attention_gqa.py)
        scale, gqa = self.head_dim**-0.5, self.n_heads != self.n_kv
        if kv.per_row:
            # a batch of decode steps: each row attends to its own cache, read
            # in place; copying every cache into one padded tensor with a mask
            # cost 1.8x-2.1x the attention (benchmarks/llm_attention_gqa.py)
            out = torch.cat([
                F.scaled_dot_product_attention(q[i : i + 1], kk, vv, scale=scale, enable_gqa=gqa)
                for i, (kk, vv) in enumerate(kv.rows(layer))
            ])
        else:
            out = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(i, h, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    """One decoder layer; parameter names match HF's ``model.layers.N.*``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: _StepKV, layer: int) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class KVCache:
    """Per-session, per-span key/value cache, preallocated to ``max_length``.

    ``length`` is the number of positions already processed. ``truncate(n)``
    rolls back (e.g. to retry a step after a failure downstream).
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_length: int,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if max_length < 1:
            raise ValueError("max_length must be >= 1")
        shape = (num_layers, num_kv_heads, max_length, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0

    @property
    def max_length(self) -> int:
        return self.k.shape[2]

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.length = length

    def reset(self) -> None:
        self.length = 0


class _StepKV:
    """Key/value bookkeeping for one span forward (shared by its layers)."""

    #: device types whose batches of decode steps attend row by row (below)
    per_row_devices: tuple[str, ...] = ("cpu",)

    def __init__(self, caches: Sequence[KVCache] | None, t: int, device: torch.device) -> None:
        self.caches = caches
        self.t = t
        self.mask: torch.Tensor | None = None
        self.causal = False
        self.per_row = False
        if caches is None:
            self.causal = t > 1
            return
        # decode steps on the CPU: each row attends to its own cache in place,
        # all of it (``LlamaAttention.forward``), no mask, no padded copy. On
        # an accelerator one padded call stays: a call per row and layer
        # would be a kernel launch each, and its copies are cheap there (not
        # measured: no GPU on this project's machines)
        self.per_row = t == 1 and len(caches) > 1 and device.type in self.per_row_devices
        if self.per_row or len(caches) == 1 and t == 1:
            return
        lens = [c.length for c in caches]
        total = max(lens) + t
        j = torch.arange(total, device=device)
        pos = torch.tensor(lens, device=device)[:, None] + torch.arange(t, device=device)[None, :]  # (B, T)
        self.mask = (j[None, None, :] <= pos[:, :, None]).unsqueeze(1)  # (B, 1, T, total)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        if self.caches is None:
            return k, v, None, self.causal
        t = self.t
        for b, c in enumerate(self.caches):
            c.k[layer, :, c.length : c.length + t] = k[b]
            c.v[layer, :, c.length : c.length + t] = v[b]
        if len(self.caches) == 1:
            keys, values = self._so_far(self.caches[0], layer)
            return keys, values, self.mask, False
        if self.per_row:  # LlamaAttention reads each row's cache (``rows``)
            return None, None, None, False
        assert self.mask is not None  # __init__ sets it whenever two caches or more step together
        total = self.mask.shape[-1]
        bsz, nkv, _, hd = k.shape
        keys = k.new_zeros(bsz, nkv, total, hd)
        values = v.new_zeros(bsz, nkv, total, hd)
        for b, c in enumerate(self.caches):
            n = c.length + t
            keys[b, :, :n] = c.k[layer, :, :n]
            values[b, :, :n] = c.v[layer, :, :n]
        return keys, values, self.mask, False

    def rows(self, layer: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each row's keys and values of ``layer`` so far, its step included (views)."""
        assert self.caches is not None
        return [self._so_far(c, layer) for c in self.caches]

    def _so_far(self, c: KVCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = c.length + self.t
        return c.k[layer, :, :n][None], c.v[layer, :, :n][None]


class LlamaBlockSpan(nn.Module):
    """Decoder blocks ``[start, end)`` of a Llama model.

    ``blocks[i]`` is global layer ``start + i`` (HF key ``model.layers.{start+i}``).
    """

    def __init__(self, cfg: LlamaConfig, start: int, end: int) -> None:
        super().__init__()
        if not 0 <= start < end <= cfg.num_hidden_layers:
            raise ValueError(f"bad block span [{start}, {end}) for a model of {cfg.num_hidden_layers} layers")
        self.config, self.start, self.end = cfg, start, end
        with _NoInitOnMeta():
            self.blocks = nn.ModuleList(LlamaBlock(cfg) for _ in range(start, end))
        self._inv_freq = rope_inv_freq(cfg)

    @property
    def num_layers(self) -> int:
        return self.end - self.start

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def new_cache(self, max_length: int) -> KVCache:
        if max_length > self.config.max_position_embeddings:
            raise ValueError(
                f"max_length {max_length} exceeds max_position_embeddings {self.config.max_position_embeddings}"
            )
        c = self.config
        return KVCache(self.num_layers, c.num_key_value_heads, c.head_dim, max_length, device=self.device, dtype=self.dtype)

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv = self._inv_freq.to(positions.device)
        freqs = positions[..., None].float() * inv  # (B, T, hd/2), fp32 like HF
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @torch.no_grad()
    def forward(
        self,
        hidden: torch.Tensor,
        caches: KVCache | Sequence[KVCache] | None = None,
        *,
        start_pos: int = 0,
    ) -> torch.Tensor:
        """Run the span on ``hidden`` of shape ``(B, T, hidden_size)``.

        Without ``caches``: a full causal pass at positions ``start_pos + arange(T)``.
        With ``caches`` (one :class:`KVCache` per row, or one cache for B=1):
        row ``b`` is at positions ``caches[b].length + arange(T)``; the caches
        are extended by ``T`` (prefill when empty, then ``T=1`` decode steps).
        """
        if hidden.dim() != 3 or hidden.shape[-1] != self.config.hidden_size:
            raise ValueError(f"hidden must be (batch, seq, {self.config.hidden_size}), got {tuple(hidden.shape)}")
        bsz, t, _ = hidden.shape
        dev = hidden.device
        if isinstance(caches, KVCache):
            caches = [caches]
        if caches is not None:
            caches = list(caches)
            if len(caches) != bsz:
                raise ValueError(f"{len(caches)} caches for a batch of {bsz}")
            if len({id(c) for c in caches}) != bsz:
                raise ValueError("a cache appears twice in one batch")
            for c in caches:
                if c.k.shape[0] != self.num_layers:
                    raise ValueError("cache belongs to a span of a different size")
                if c.length + t > c.max_length:
                    raise ValueError(f"KV cache overflow: {c.length} + {t} > {c.max_length}")
            positions = torch.tensor([c.length for c in caches], device=dev)[:, None] + torch.arange(t, device=dev)
        else:
            if start_pos < 0 or start_pos + t > self.config.max_position_embeddings:
                raise ValueError("positions out of range")
            positions = (start_pos + torch.arange(t, device=dev)).expand(bsz, t)
        cos, sin = self._rope(positions, hidden.dtype)
        kv = _StepKV(caches, t, dev)
        x = hidden
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, kv, i)
        if caches is not None:
            for c in caches:
                c.length += t
        return x


class LlamaClientHead(nn.Module):
    """Embeddings + final norm + lm_head: the part of the model a client runs."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        with _NoInitOnMeta():  # built on meta by the loaders: skip the costly meta init
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @torch.no_grad()
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dtype != torch.long or ids.dim() != 2:
            raise ValueError("ids must be a (batch, seq) int64 tensor")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size):
            raise ValueError(f"token id out of range [0, {self.config.vocab_size})")
        return self.embed_tokens(ids)

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + lm_head; returns fp32 logits ``(batch, seq, vocab)``."""
        h = self.norm(hidden)
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(h, w).float()


def block_keys(cfg: LlamaConfig, layer: int) -> list[str]:
    """HF tensor names of one decoder layer."""
    p = f"model.layers.{layer}."
    names = [
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    ]
    if cfg.attention_bias:
        names += [f"self_attn.{n}_proj.bias" for n in "qkvo"]
    if cfg.mlp_bias:
        names += [f"mlp.{n}_proj.bias" for n in ("gate", "up", "down")]
    return [p + n for n in names]


def head_keys(cfg: LlamaConfig) -> list[str]:
    keys = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.tie_word_embeddings:
        keys.append("lm_head.weight")
    return keys


def random_state_dict(cfg: LlamaConfig, seed: int, *, std: float = 0.05) -> dict[str, torch.Tensor]:
    """Deterministic random weights in HF naming (fp32, CPU) for tests and tiny models."""
    g = torch.Generator().manual_seed(seed)
    shapes: dict[str, tuple[int, ...]] = {}
    h, i, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    nq, nkv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    shapes["model.embed_tokens.weight"] = (cfg.vocab_size, h)
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (nq, h),
            p + "self_attn.k_proj.weight": (nkv, h),
            p + "self_attn.v_proj.weight": (nkv, h),
            p + "self_attn.o_proj.weight": (h, nq),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        })
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    out = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            out[name] = 1.0 + 0.1 * torch.randn(shape, generator=g)
        else:
            out[name] = std * torch.randn(shape, generator=g)
    return out


def _check_spans(head: LlamaClientHead, spans: Sequence[LlamaBlockSpan]) -> None:
    pos = 0
    for s in spans:
        if s.start != pos:
            raise ValueError(f"spans are not contiguous: expected a span starting at {pos}, got {s.start}")
        pos = s.end
    if pos != head.config.num_hidden_layers:
        raise ValueError(f"spans cover layers [0, {pos}) of {head.config.num_hidden_layers}")


@torch.no_grad()
def generate(
    head: LlamaClientHead,
    spans: Sequence[LlamaBlockSpan],
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    greedy: bool = True,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
    eos_id: int | None = None,
    check_cancelled: Callable[[], None] | None = None,
) -> list[list[int]]:
    """Generate for several prompts locally: head + all spans in one process.

    Each prompt is prefilled on its own (no padding), then all unfinished
    sessions decode together, one batched forward per step. Sampling
    (``greedy=False``) draws on the CPU from ``generator`` for reproducibility.
    Returns the new token ids per prompt (stopping after ``eos_id`` if given).
    """
    _check_spans(head, spans)
    if max_new_tokens < 0:
        raise ValueError("max_new_tokens must be >= 0")
    dev, hdt = head.embed_tokens.weight.device, head.embed_tokens.weight.dtype
    # each span computes in its own dtype, the head in its own, as across peers
    # (a server casts what it receives, the client what comes back)
    where = [(s.device, s.dtype) for s in spans]
    outs: list[list[int]] = [[] for _ in prompts]
    if max_new_tokens == 0:
        return outs

    def pick(logits: torch.Tensor) -> list[int]:  # logits (B, V) fp32
        if greedy:
            return logits.argmax(-1).tolist()
        probs = torch.softmax(logits.cpu() / temperature, dim=-1)
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1).tolist()

    caches: list[list[KVCache]] = []
    active: list[int] = []
    for idx, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError("empty prompt")
        total = len(p) + max_new_tokens
        cs = [s.new_cache(total) for s in spans]
        h = head.embed(torch.tensor([list(p)], dtype=torch.long, device=dev))
        for s, c, w in zip(spans, cs, where):
            h = s(h.to(*w), c)
        tok = pick(head.logits(h.to(dev, hdt)[:, -1]))[0]
        outs[idx].append(tok)
        caches.append(cs)
        if not (eos_id is not None and tok == eos_id):
            active.append(idx)
        if check_cancelled:
            check_cancelled()
    for _ in range(max_new_tokens - 1):
        if not active:
            break
        ids = torch.tensor([[outs[i][-1]] for i in active], dtype=torch.long, device=dev)
        h = head.embed(ids)
        for j, (s, w) in enumerate(zip(spans, where)):
            h = s(h.to(*w), [caches[i][j] for i in active])
        toks = pick(head.logits(h.to(dev, hdt))[:, -1])
        still = []
        for i, tok in zip(active, toks):
            outs[i].append(tok)
            if not (eos_id is not None and tok == eos_id):
                still.append(i)
        active = still
        if check_cancelled:
            check_cancelled()
    return outs


def generate_greedy(
    head: LlamaClientHead,
    spans: Sequence[LlamaBlockSpan],
    prompt_ids: Sequence[int] | Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    eos_id: int | None = None,
) -> list[int] | list[list[int]]:
    """Reference greedy decoding. One prompt (list of ints) -> list of new ids;
    a list of prompts -> a list of lists."""
    single = len(prompt_ids) > 0 and isinstance(prompt_ids[0], int)
    prompts = [prompt_ids] if single else prompt_ids
    out = generate(head, spans, prompts, max_new_tokens, greedy=True, eos_id=eos_id)  # type: ignore[arg-type]
    return out[0] if single else out
