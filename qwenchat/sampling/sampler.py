"""Choosing the next token from logits, in NumPy: the reference for the GPU sampling kernel.

Order (as in transformers): repetition penalty over every token in the context, presence and
frequency penalties over the reply's own tokens, then greedy argmax if temperature is 0, else
temperature, top-k, top-p, min-p and one draw. The draw's uniform number is a pure function
of (seed, step) so a GPU kernel can produce the very same number without shared state.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from qwenchat.sampling.params import SamplingParams

MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def uniform(seed: int, step: int) -> float:
    """A uniform number in [0, 1) for draw `step` of a reply seeded with `seed`."""
    bits = splitmix64(seed ^ splitmix64(step))
    return (bits >> 11) * (1.0 / (1 << 53))


def apply_penalties(
    logits: np.ndarray,
    params: SamplingParams,
    context_ids: Iterable[int],
    reply_counts: Mapping[int, int],
) -> np.ndarray:
    """Penalised copy of `logits` (float32); unchanged values when every penalty is off."""
    out = np.array(logits, dtype=np.float32, copy=True)
    if params.repetition_penalty != 1.0:
        seen = np.fromiter(set(context_ids) | set(reply_counts), dtype=np.int64)
        if seen.size:
            vals = out[seen]
            rp = np.float32(params.repetition_penalty)
            out[seen] = np.where(vals > 0, vals / rp, vals * rp)
    if reply_counts and (params.presence_penalty or params.frequency_penalty):
        ids = np.fromiter(reply_counts.keys(), dtype=np.int64)
        counts = np.fromiter(reply_counts.values(), dtype=np.float32)
        presence = np.float32(params.presence_penalty)
        out[ids] -= presence + np.float32(params.frequency_penalty) * counts
    return out


def filtered_distribution(
    logits: np.ndarray, params: SamplingParams
) -> tuple[np.ndarray, np.ndarray]:
    """Candidate ids (most likely first) and their renormalised probabilities."""
    scaled = logits.astype(np.float64) / params.temperature
    vocab = scaled.shape[0]
    if 0 < params.top_k < vocab:
        kth = np.partition(scaled, vocab - params.top_k)[vocab - params.top_k]
        candidates = np.flatnonzero(scaled >= kth)
    else:
        candidates = np.arange(vocab)
    order = candidates[np.argsort(-scaled[candidates], kind="stable")]
    probs = np.exp(scaled[order] - scaled[order[0]])
    probs /= probs.sum()
    if params.top_p < 1.0:
        mass_before = np.cumsum(probs) - probs
        keep = max(1, int(np.count_nonzero(mass_before < params.top_p)))
        order, probs = order[:keep], probs[:keep]
    if params.min_p > 0.0:
        keep = max(1, int(np.count_nonzero(probs >= params.min_p * probs[0])))
        order, probs = order[:keep], probs[:keep]
    return order, probs / probs.sum()


def sample_token(
    logits: np.ndarray,
    params: SamplingParams,
    seed: int,
    step: int,
    context_ids: Iterable[int] = (),
    reply_counts: Mapping[int, int] | None = None,
) -> int:
    penalised = apply_penalties(logits, params, context_ids, reply_counts or {})
    if params.greedy:
        return int(np.argmax(penalised))
    order, probs = filtered_distribution(penalised, params)
    u = uniform(seed, step)
    index = int(np.searchsorted(np.cumsum(probs), u, side="right"))
    return int(order[min(index, order.size - 1)])


def sample_token_gpu(
    logits: np.ndarray,
    params: SamplingParams,
    seed: int,
    step: int,
    context_ids: Iterable[int] = (),
    reply_counts: Mapping[int, int] | None = None,
) -> int:
    """The token the GPU sampler (cuda_src/sampling.cuh) draws from `logits`: sample_token's
    rules with the GPU's arithmetic, which gives other tokens for the same uniform number:
    weights exp((l - max) / T) as 2^32 fixed point, and the inverse CDF taken in vocabulary
    order rather than by falling probability. The CUDA engine verifies speculative passes with
    it, so that a pass keeps the tokens its plain steps would draw."""
    pen = apply_penalties(logits, params, context_ids, reply_counts or {})
    if params.greedy:
        return int(np.argmax(pen))
    keep = np.ones(pen.size, bool)
    if 0 < params.top_k < pen.size:
        keep = pen >= np.partition(pen, pen.size - params.top_k)[pen.size - params.top_k]
    z = (pen - pen.max()) * (np.float32(1) / np.float32(params.temperature))
    weights = np.where(keep, np.exp(z).astype(np.float64) * 2.0**32, 0).astype(np.uint64)
    if params.top_p < 1:  # the largest logit whose descending running mass reaches top_p
        target = max(1, int(float(np.float32(params.top_p)) * float(int(weights.sum()))))
        values, index = np.unique(pen, return_inverse=True)
        mass = np.cumsum(np.bincount(index, weights=weights.astype(np.float64))[::-1])
        keep &= pen >= values[::-1][int(np.argmax(mass >= target))]
    keep &= weights >= np.uint64(float(np.float32(params.min_p)) * 2.0**32)
    kept = np.where(keep, weights, 0).astype(np.uint64)
    target = int(uniform(seed, step) * float(int(kept.sum())))
    return int(np.argmax(np.cumsum(kept) > np.uint64(target)))
