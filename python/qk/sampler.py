"""Head-side token sampling over the engine's top-k candidates, and the temperature policy.

The engine returns the greedy id of the last position and, on request, its top-k ``(id, logit)``
pairs; sampling happens here, over those candidates only. Deterministic by construction: a
SplitMix64 stream per request seeded from ``seed``, ties broken towards the lowest id, arithmetic in
float64 in a fixed order, NaN logits rejected.

Example::

    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=1234)
    sampler = Sampler(params)
    token = sampler.pick(greedy_id, [(17, 3.2), (5, 3.1), (99, 0.4)])
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "SamplerError",
    "Sampler",
    "SamplingParams",
    "SplitMix64",
    "resolve_temperature",
]

_MASK64 = (1 << 64) - 1
#: Most candidates one position can return (docs/architecture.md "Engine contract": k up to 256).
MAX_CANDIDATES = 256


class SamplerError(ValueError):
    """The logits cannot be sampled (NaN, or no candidates)."""


class SplitMix64:
    """Steele, Lea & Flood's SplitMix64 (the constants of the reference implementation, also used
    to seed xoshiro): a fast 64-bit stream whose output depends only on the seed."""

    def __init__(self, seed: int) -> None:
        self.state = seed & _MASK64

    def next_u64(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & _MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return z ^ (z >> 31)

    def next_float(self) -> float:
        """Uniform in [0, 1) with 53 random bits (the float64 mantissa)."""
        return (self.next_u64() >> 11) * (1.0 / (1 << 53))


def resolve_temperature(requested: float | None, env: Mapping[str, str] | None = None) -> float:
    """The temperature a request runs at: an explicit value wins, clamped by ``QK_TEMP_CAP`` when
    that is set; an absent one falls back to ``QK_TEMP_DEFAULT`` (unset: 0, greedy)."""
    env = os.environ if env is None else env
    if requested is None:
        default = env.get("QK_TEMP_DEFAULT", "").strip()
        return max(0.0, float(default)) if default else 0.0
    temperature = max(0.0, float(requested))
    cap = env.get("QK_TEMP_CAP", "").strip()
    if cap:
        temperature = min(temperature, max(0.0, float(cap)))
    return temperature


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    #: Nucleus mass; 1.0 keeps every candidate.
    top_p: float = 1.0
    #: Candidates kept before softmax; 0 keeps all the engine returned.
    top_k: int = 0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def candidates_needed(self) -> int:
        """How many top-k pairs to ask the engine for (0 when greedy: the greedy id suffices)."""
        if self.greedy:
            return 0
        return min(self.top_k, MAX_CANDIDATES) if self.top_k > 0 else MAX_CANDIDATES


def _ranked(candidates: Sequence[tuple[int, float]]) -> list[tuple[int, float]]:
    for token_id, logit in candidates:
        if math.isnan(logit):
            raise SamplerError(f"NaN logit for token {token_id}")
    # Highest logit first; equal logits: lowest id first.
    return sorted(((int(i), float(x)) for i, x in candidates), key=lambda c: (-c[1], c[0]))


def probabilities(ranked: Sequence[tuple[int, float]], params: SamplingParams) -> list[tuple[int, float]]:
    """The distribution one draw picks from: ``ranked`` (best first) cut to ``top_k``, softmax at
    the temperature, cut to the smallest prefix whose mass reaches ``top_p``, renormalised."""
    kept = list(ranked[: params.top_k] if params.top_k > 0 else ranked)
    if not kept:
        raise SamplerError("no candidates to sample from")
    top = kept[0][1]
    if math.isinf(top) and top < 0:
        raise SamplerError("every candidate logit is -inf")
    weights = [math.exp((logit - top) / params.temperature) for _, logit in kept]
    total = math.fsum(weights)
    probs = [w / total for w in weights]
    if params.top_p < 1.0:
        mass, cut = 0.0, len(probs)
        for n, p in enumerate(probs, start=1):
            mass += p
            if mass >= params.top_p:
                cut = n
                break
        kept, probs = kept[:cut], probs[:cut]
        total = math.fsum(probs)
        probs = [p / total for p in probs]
    return [(token_id, p) for (token_id, _), p in zip(kept, probs, strict=True)]


class Sampler:
    """One request's sampler: its parameters and its random stream."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.rng = SplitMix64(params.seed)

    def pick(self, greedy_id: int, candidates: Sequence[tuple[int, float]] | None) -> int:
        """The next token: ``greedy_id`` at temperature 0 (or when the engine gave no candidates),
        else a draw from the candidates."""
        if self.params.greedy or not candidates:
            return int(greedy_id)
        dist = probabilities(_ranked(candidates), self.params)
        u = self.rng.next_float()
        mass = 0.0
        for token_id, p in dist:
            mass += p
            if u < mass:
                return token_id
        # Rounding can leave the running sum a hair under 1; the last candidate owns that sliver.
        return dist[-1][0]
