"""Choosing the next token: greedy, temperature, top-k, top-p, repetition
penalty, a seed; and where generation stops (EOS, stop strings, a budget).

:class:`SamplingParams` is what a caller asks for (``peer generate``'s
options, an OpenAI request's fields); its constructor validates every field
and raises :class:`~fedswarm.errors.InputError` for a bad value, so a bad
request is refused before any peer is contacted.

:class:`Sampler` draws one token per step from fp32 logits. It is
deterministic: the same seed, the same prompt and the same logits give the
same tokens. Each sampled step consumes exactly one uniform number from a
``torch.Generator`` seeded with the request's seed and picks the token where
the cumulative probability (in float64, tokens ordered by descending
probability, ties by id) first exceeds it. So the random stream does not
depend on top-k/top-p, and a swarm run and a local run of the same model and
route give the same text. ``temperature == 0`` (or ``greedy``) is argmax and
draws nothing.

:class:`StopMatcher` turns a stream of decoded text pieces into the text to
show: it holds back any tail that could still become a stop string, and ends
the stream at the first stop string (which is not shown).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ..errors import InputError

if TYPE_CHECKING:
    import torch

__all__ = ["SamplingParams", "Sampler", "StopMatcher", "MAX_STOP_STRINGS", "MAX_STOP_LENGTH"]

MAX_STOP_STRINGS = 8
MAX_STOP_LENGTH = 256
_SEED_MAX = 2**63 - 1


def _num(name: str, v: Any, *, integer: bool = False) -> Any:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise InputError(f"{name} must be {'an integer' if integer else 'a number'}, got {v!r}")
    if isinstance(v, float) and not math.isfinite(v):
        raise InputError(f"{name} must be finite, got {v!r}")
    return v


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    Args:
        max_new_tokens: the most tokens to generate (>= 1).
        temperature: 0 means greedy; otherwise logits are divided by it (>= 0).
        top_k: keep only the k most likely tokens (0: all).
        top_p: keep the smallest set of most likely tokens whose probability
            reaches ``top_p`` (in (0, 1]; 1: all).
        repetition_penalty: CTRL-style penalty (> 0; 1: off) on every token
            already in the prompt or the output: positive logits are divided
            by it, negative ones multiplied.
        seed: seeds the sampler; None draws a fresh seed (reported back in
            :attr:`Sampler.seed`).
        stop: strings that end generation; the stop string is not output.
        stop_at_eos: stop after one of the tokenizer's EOS tokens.
        greedy: force argmax whatever the temperature.
    """

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default=())
    stop_at_eos: bool = True
    greedy: bool = False

    def __post_init__(self) -> None:
        n = _num("max_tokens", self.max_new_tokens, integer=True)
        if n < 1:
            raise InputError(f"max_tokens must be at least 1, got {n}")
        t = _num("temperature", self.temperature)
        if t < 0:
            raise InputError(f"temperature must be >= 0, got {t}", "0 means greedy")
        if t > 100:
            raise InputError(f"temperature must be <= 100, got {t}")
        k = _num("top_k", self.top_k, integer=True)
        if k < 0:
            raise InputError(f"top_k must be >= 0, got {k}", "0 keeps every token")
        p = _num("top_p", self.top_p)
        if not 0 < p <= 1:
            raise InputError(f"top_p must be in (0, 1], got {p}")
        r = _num("repetition_penalty", self.repetition_penalty)
        if not 0 < r <= 100:
            raise InputError(f"repetition_penalty must be in (0, 100], got {r}", "1 is off")
        if self.seed is not None:
            s = _num("seed", self.seed, integer=True)
            if not -_SEED_MAX <= s <= _SEED_MAX:
                raise InputError(f"seed must fit in 64 bits, got {s}")
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, (tuple, list)) or not all(isinstance(s, str) for s in stop):
            raise InputError("stop must be a string or a list of strings")
        if len(stop) > MAX_STOP_STRINGS:
            raise InputError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
        if any(not s or len(s) > MAX_STOP_LENGTH for s in stop):
            raise InputError(f"a stop string must have 1 to {MAX_STOP_LENGTH} characters")
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_p", float(p))
        object.__setattr__(self, "repetition_penalty", float(r))
        if not isinstance(self.stop_at_eos, bool) or not isinstance(self.greedy, bool):
            raise InputError("stop_at_eos and greedy must be booleans")

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0.0

    def with_(self, **kw: Any) -> "SamplingParams":
        return replace(self, **kw)

    def sampler(self) -> "Sampler":
        return Sampler(self)


class Sampler:
    """Seeded token picker for one generation (see the module doc)."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        import torch  # here, not at import: a bad option is reported before torch loads

        self.seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(7), "little")
        # torch generators take a 64-bit unsigned seed; map negatives into it
        self._gen = torch.Generator().manual_seed(self.seed % 2**64)

    def penalize(self, logits: "torch.Tensor", history: Iterable[int]) -> "torch.Tensor":
        import torch

        r = self.params.repetition_penalty
        if r == 1.0:
            return logits
        ids = torch.tensor(sorted(set(int(i) for i in history)), dtype=torch.long)
        if not len(ids):
            return logits
        out = logits.clone()
        sel = out[ids]
        out[ids] = torch.where(sel > 0, sel / r, sel * r)
        return out

    def distribution(self, logits: "torch.Tensor", history: Sequence[int] = ()) -> tuple["torch.Tensor", "torch.Tensor"]:
        """The (token ids, probabilities) the next token is drawn from, most
        likely first (ties by id). Greedy gives one token with probability 1."""
        import torch

        p = self.params
        x = self.penalize(logits.float().reshape(-1), history)
        if p.is_greedy:
            return torch.tensor([int(x.argmax())]), torch.ones(1, dtype=torch.float64)
        x = x.double() / p.temperature
        # stable sort: descending logit, ascending id on ties
        vals, idx = torch.sort(x, descending=True, stable=True)
        if p.top_k:
            vals, idx = vals[: p.top_k], idx[: p.top_k]
        probs = torch.softmax(vals, dim=0)
        if p.top_p < 1.0:
            cum = torch.cumsum(probs, dim=0)
            # keep tokens until the mass before them reaches top_p
            keep = int((cum - probs < p.top_p).sum())
            vals, idx = vals[: max(keep, 1)], idx[: max(keep, 1)]
            probs = torch.softmax(vals, dim=0)
        return idx, probs

    def pick(self, logits: "torch.Tensor", history: Sequence[int] = ()) -> int:
        """The next token for fp32 ``logits`` (shape ``(vocab,)``); ``history``
        is the prompt plus the tokens generated so far (for the penalty)."""
        import torch

        idx, probs = self.distribution(logits, history)
        if len(idx) == 1:
            return int(idx[0])
        u = float(torch.rand(1, generator=self._gen, dtype=torch.float64))
        cum = torch.cumsum(probs, dim=0)
        j = int(torch.searchsorted(cum, torch.tensor([u * float(cum[-1])], dtype=torch.float64), right=True))
        return int(idx[min(j, len(idx) - 1)])


class StopMatcher:
    """Feed decoded text pieces; get back the text that is safe to show.

    ``push(piece)`` returns the newly showable text; once a stop string has
    been seen, :attr:`stopped` is set and nothing more is returned (the stop
    string and anything after it are dropped). ``finish()`` returns what was
    held back when generation ends for another reason.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        self.stop = tuple(stop)
        self.text = ""  # all generated text so far
        self.shown = 0  # characters of it already returned
        self.stopped: str | None = None

    def push(self, piece: str) -> str:
        if self.stopped is not None or not piece:
            return ""
        self.text += piece
        if not self.stop:
            out = self.text[self.shown:]
            self.shown = len(self.text)
            return out
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, self.shown)) >= 0]
        if hits:
            i, s = min(hits)
            out = self.text[self.shown:i]
            self.shown = i
            self.stopped = s
            return out
        # hold back the longest tail that is a prefix of a stop string
        pending = self.text[self.shown:]
        hold = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(pending)), hold, -1):
                if pending.endswith(s[:n]):
                    hold = n
                    break
        out = pending[: len(pending) - hold]
        self.shown += len(out)
        return out

    def finish(self, tail: str = "") -> str:
        out = self.push(tail) if tail else ""
        if self.stopped is not None:
            return out
        rest = self.text[self.shown:]
        self.shown = len(self.text)
        return out + rest

    @property
    def output(self) -> str:
        """All text shown so far."""
        return self.text[: self.shown]
