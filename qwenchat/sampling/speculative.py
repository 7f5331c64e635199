"""Speculative decoding's verification rule: which proposed tokens the target keeps.

The target scores the k proposed tokens and one more in one pass (k + 1 rows of logits); each
row is turned into the distribution the plain sampler would draw from at that step, with the
penalties counting the tokens kept before it, exactly as plain decoding would have them.

- A proposal without a distribution (prompt lookup, or any proposer under greedy decoding) is
  one-hot: the step draws its token as plain decoding does, from the same uniform number, and
  keeps the proposal if the draw is the proposal. Accepting with probability p(d) and else
  drawing from p without d is that same rule, so the reply is plain decoding's, token for token.
- A draft model's sampled proposal d ~ q is kept with probability min(1, p(d) / q(d)) (its own
  uniform number), else the step draws from max(p - q, 0) normalised: the kept and drawn tokens
  are distributed as p (speculative sampling), and the same seed gives the same tokens.

The first token not kept ends the pass; if all k are kept, the last row gives one more token.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from qwenchat.sampling.params import SamplingParams
from qwenchat.sampling.sampler import (
    apply_penalties,
    filtered_distribution,
    sample_token,
    splitmix64,
    uniform,
)

# The uniform streams a reply's seed gives besides the plain draws (uniform(seed, step)): the
# acceptance tests and the draft model's own draws.
ACCEPT_STREAM = 0x243F6A8885A308D3
DRAFT_STREAM = 0x13198A2E03707344


def stream_seed(stream: int, seed: int) -> int:
    """The seed of another stream of uniform numbers than the plain draws' (uniform(seed, .))."""
    return splitmix64(seed ^ stream)


def target_distribution(logits: np.ndarray, params: SamplingParams, context_ids: Sequence[int],
                        reply_counts: Mapping[int, int]) -> np.ndarray:
    """The whole-vocabulary distribution the plain sampler draws from at this step (float64;
    greedy: one-hot at the penalised argmax)."""
    penalised = apply_penalties(logits, params, context_ids, reply_counts)
    p = np.zeros(penalised.shape[0], dtype=np.float64)
    if params.greedy:
        p[int(np.argmax(penalised))] = 1.0
        return p
    order, probs = filtered_distribution(penalised, params)
    p[order] = probs
    return p


def draw_from(p: np.ndarray, u: float) -> int:
    """Inverse-CDF draw from a whole-vocabulary distribution, most likely tokens first (as
    the plain sampler orders its candidates; ties by id)."""
    support = np.flatnonzero(p > 0)
    order = support[np.argsort(-p[support], kind="stable")]
    cumulative = np.cumsum(p[order])
    index = int(np.searchsorted(cumulative, u * cumulative[-1], side="right"))
    return int(order[min(index, order.size - 1)])


def draft_token(logits: np.ndarray, params: SamplingParams, seed: int, step: int,
                context_ids: Sequence[int], reply_counts: Mapping[int, int]
                ) -> tuple[int, np.ndarray]:
    """A draft model's proposal at `step` (the plain sampler on its logits, with its own
    stream of uniform numbers; greedy: its argmax) and the distribution q it was drawn from."""
    q = target_distribution(logits, params, context_ids, reply_counts)
    token = sample_token(logits, params, stream_seed(DRAFT_STREAM, seed), step, context_ids,
                         reply_counts)
    return token, q


def verify(logits: np.ndarray, proposal: Sequence[int], params: SamplingParams, seed: int,
           step: int, context_ids: Sequence[int], reply_counts: Mapping[int, int],
           draft_probs: np.ndarray | None = None, sample: Callable[..., int] = sample_token
           ) -> list[int]:
    """The tokens a target pass keeps: `logits` [k + 1, vocab] scored after the context, after
    each of the k `proposal` tokens in turn; `step` is the reply's step of the first;
    `reply_counts` the reply's tokens so far (for the penalties). `draft_probs` [k, vocab]: the
    draft model's q for each proposal (None: one-hot proposals). Returns the kept proposals and
    the token that ends the pass: 1 to k + 1 tokens. `sample` draws a token as the engine's
    plain steps do (sample_token's signature; the CUDA engine's is sample_token_gpu), so that
    one-hot proposals keep exactly the tokens its plain decoding would draw."""
    k = len(proposal)
    if logits.shape[0] != k + 1:
        raise ValueError(f"{k} proposed tokens need {k + 1} rows of logits; got {logits.shape[0]}")
    counts = Counter(reply_counts)
    out: list[int] = []
    for i in range(k + 1):
        if i == k or draft_probs is None or params.greedy:
            token = sample(logits[i], params, seed, step + i, context_ids, counts)
            out.append(token)
            if i == k or token != proposal[i]:
                return out
        else:
            p = target_distribution(logits[i], params, context_ids, counts)
            q, d = draft_probs[i], int(proposal[i])
            if uniform(stream_seed(ACCEPT_STREAM, seed), step + i) * q[d] < p[d]:
                token = d
            else:
                residual = np.maximum(p - q, 0.0)
                token = draw_from(residual if residual.sum() > 0 else p, uniform(seed, step + i))
                out.append(token)
                return out
            out.append(token)
        counts[token] += 1
    return out


# A decode step's cost that does not grow with the model, in parameters' worth: small models
# decode well below their bytes' floor (H100: 0.6B at 1,250 tok/s, 0.8 ms a step, where its
# bytes alone would take 0.4 ms; 8B at 170 tok/s, 5.9 ms).
STEP_FLOOR_PARAMETERS = 2e9


def draft_cost(draft_parameters: int, model_parameters: int) -> float:
    """A draft model's decode step against the model's, estimated from their sizes (0.25 for
    Qwen3-0.6B drafting for 8B; measured 0.25 on the H100 with the draft's overheads)."""
    return ((draft_parameters + STEP_FLOOR_PARAMETERS)
            / (model_parameters + STEP_FLOOR_PARAMETERS))


class AdaptiveK:
    """How many tokens to propose next, and whether to propose at all.

    k: one more after a pass that kept every proposal, one more than were kept after one that
    did not (between 1 and `most`). Switch-off: when the recent passes (the last WINDOW, or
    fewer once they proposed JUDGED tokens) gave fewer tokens (kept + 1 each) than the plain
    steps their cost would have run (PASS_COST a pass, plus `proposal_cost` a proposed token:
    a draft model's steps, as a share of the model's), speculation pauses for `pause` steps
    (16, doubling on each pause in a row up to 256, back to 16 once a pass keeps something),
    then probes with one token; a probe that keeps nothing pauses again at once. A probe costs
    about a step (a draft catching up with the reply, then the pass), so pauses of 16 keep a
    fruitless stretch within a few percent of plain decoding. Only the proposals decide this,
    never timings, so a seed still gives one reply.
    """

    WINDOW = 4
    JUDGED = 8  # proposals enough to judge by, in fewer than WINDOW passes
    # A pass of up to 8 tokens against a plain step (H100, bench --speculation: 0.9-1.3 from
    # 4B to 32B, bf16 and FP8; 1.7 on 0.6B).
    PASS_COST = 1.25
    FIRST_PAUSE, LONGEST_PAUSE = 16, 256

    def __init__(self, most: int, proposal_cost: float = 0.0):
        if most < 1:
            raise ValueError(f"speculation proposes at least 1 token a step; got {most}")
        self.most = most
        self.proposal_cost = proposal_cost
        self.k = most
        self.pause = self.FIRST_PAUSE
        self.paused = 0  # steps left without proposing
        self._probing = False  # the next pass is the probe after a pause
        self._recent: list[tuple[int, int]] = []

    def ready(self) -> bool:
        """Whether this step proposes (a paused step counts down the pause)."""
        if self.paused:
            self.paused -= 1
            return False
        return True

    def update(self, proposed: int, kept: int) -> None:
        grown = self.k + 1 if kept >= proposed else kept + 1
        self.k = max(1, min(self.most, grown))
        if kept:
            self.pause = self.FIRST_PAUSE
        probe, self._probing = self._probing, False
        self._recent = [*self._recent, (proposed, kept)][-self.WINDOW:]
        total = sum(p for p, _ in self._recent)
        judged = len(self._recent) == self.WINDOW or total >= self.JUDGED
        tokens = sum(k + 1 for _, k in self._recent)
        cost = len(self._recent) * self.PASS_COST + total * self.proposal_cost
        if (probe and not kept) or (judged and tokens < cost):
            self.paused, self.k, self._recent = self.pause, 1, []
            self.pause = min(self.LONGEST_PAUSE, 2 * self.pause)
            self._probing = True
