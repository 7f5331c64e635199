"""The NumPy reference engine: Qwen3 in float32, the correctness oracle and the CPU fallback."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from qwenchat.engine.base import CacheBookkeeping, GenerateRequest
from qwenchat.model import fp8, rope
from qwenchat.model.checkpoint import WeightSource
from qwenchat.model.config import Qwen3Config
from qwenchat.model.kv_cache import cached
from qwenchat.sampling.params import SamplingParams
from qwenchat.sampling.sampler import sample_token
from qwenchat.sampling.speculative import verify

ATTENTION_SCORE_BUDGET = 32 * 1024 * 1024  # float32 scores held at once while attending
# What a linear layer's input goes through first: nothing, or FP8 activations' rounding.
LinearInput = Callable[[np.ndarray], np.ndarray]


@dataclass
class DenseMLP:
    """SwiGLU: down(silu(gate(h)) * up(h))."""

    gate: np.ndarray
    up: np.ndarray
    down: np.ndarray

    @classmethod
    def load(cls, checkpoint: WeightSource, prefix: str) -> DenseMLP:
        t = checkpoint.float32
        return cls(t(prefix + "gate_proj.weight"), t(prefix + "up_proj.weight"),
                   t(prefix + "down_proj.weight"))

    def __call__(self, h: np.ndarray, into: LinearInput) -> np.ndarray:
        return into(silu(h @ self.gate.T) * (h @ self.up.T)) @ self.down.T


@dataclass
class SparseMoE:
    """A mixture of experts as transformers' Qwen3MoeSparseMoeBlock computes it: the router
    picks `top_k` experts a token, and the token's output is their SwiGLU MLPs' outputs
    weighted by its routing weights (route).

    The experts stay in the checkpoint's own bytes (memory-mapped) and are widened to float32
    as tokens pick them: a token uses top_k of them, and Qwen3-30B-A3B's 6,144 (128 in each of
    48 layers) widened all at once would take 116 GB."""

    router: np.ndarray  # (experts, hidden)
    checkpoint: WeightSource
    prefix: str  # "model.layers.{i}.mlp."
    top_k: int
    norm_topk_prob: bool

    @classmethod
    def load(cls, checkpoint: WeightSource, prefix: str, config: Qwen3Config) -> SparseMoE:
        return cls(checkpoint.float32(prefix + "gate.weight"), checkpoint, prefix,
                   config.num_experts_per_tok, config.norm_topk_prob)

    def expert(self, e: int) -> DenseMLP:
        return DenseMLP.load(self.checkpoint, f"{self.prefix}experts.{e}.")

    def __call__(self, h: np.ndarray, into: LinearInput) -> np.ndarray:
        weights, chosen = route(h @ self.router.T, self.top_k, self.norm_topk_prob)
        out = np.zeros_like(h)
        # Expert by expert, each over all the tokens routed to it (in increasing expert order,
        # as transformers adds them up). A token picks an expert at most once, so `tokens`
        # holds no repeats and += adds each row once.
        for e in np.unique(chosen):
            tokens, slot = np.nonzero(chosen == e)
            out[tokens] += self.expert(int(e))(h[tokens], into) * weights[tokens, slot, None]
        return out


def route(logits: np.ndarray, top_k: int, norm_topk_prob: bool) -> tuple[np.ndarray, np.ndarray]:
    """transformers' Qwen3MoeTopKRouter: the softmax of the router's logits (tokens x experts)
    in float32, its `top_k` largest a token, divided by their sum when `norm_topk_prob`.
    Returns (weights, experts), each (tokens, top_k), largest first. Equal probabilities go to
    the lower expert number (torch.topk does not promise an order among ties; they need
    bit-equal float32 probabilities, which real activations do not give)."""
    scores = np.exp(logits - logits.max(axis=-1, keepdims=True))
    scores /= scores.sum(axis=-1, keepdims=True)
    chosen = np.argsort(-scores, axis=-1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(scores, chosen, axis=-1)
    if norm_topk_prob:
        weights /= weights.sum(axis=-1, keepdims=True)
    return weights, chosen


@dataclass
class LayerWeights:
    input_norm: np.ndarray
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    o: np.ndarray
    q_norm: np.ndarray
    k_norm: np.ndarray
    post_norm: np.ndarray
    mlp: DenseMLP | SparseMoE

    @classmethod
    def load(cls, checkpoint: WeightSource, config: Qwen3Config, index: int) -> LayerWeights:
        p = f"model.layers.{index}."
        t = checkpoint.float32
        return cls(
            input_norm=t(p + "input_layernorm.weight"),
            q=t(p + "self_attn.q_proj.weight"),
            k=t(p + "self_attn.k_proj.weight"),
            v=t(p + "self_attn.v_proj.weight"),
            o=t(p + "self_attn.o_proj.weight"),
            q_norm=t(p + "self_attn.q_norm.weight"),
            k_norm=t(p + "self_attn.k_norm.weight"),
            post_norm=t(p + "post_attention_layernorm.weight"),
            mlp=(SparseMoE.load(checkpoint, p + "mlp.", config) if config.sparse_layer(index)
                 else DenseMLP.load(checkpoint, p + "mlp.")),
        )


def _unchanged(x: np.ndarray) -> np.ndarray:
    return x


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    variance = np.mean(x * x, axis=-1, keepdims=True)
    return weight * (x / np.sqrt(variance + np.float32(eps)))


def silu(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return x / (np.float32(1.0) + np.exp(-x))


def rope_tables(positions: np.ndarray, inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin (positions × head_dim) for rotate-half RoPE with these inverse frequencies
    (rope.inv_freq), computed in float32 as HF does."""
    freqs = positions.astype(np.float32)[:, None] * inv_freq[None, :]
    angles = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(angles), np.sin(angles)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x: (tokens, heads, head_dim); cos/sin: (tokens, head_dim)."""
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class ReferenceEngine(CacheBookkeeping):
    name = "reference (NumPy, CPU)"
    # (it runs a prefill in one pass of NumPy products; the chat prefills in parts of this many
    # tokens to show progress and stop between two, which changes the cache only by float
    # rounding, if at all)
    prefill_chunk = 256

    def __init__(self, config: Qwen3Config, checkpoint: WeightSource, ctx: int | None = None,
                 kv_cache: str = "bf16", fp8_activations: bool = False):
        super().__init__(ctx or config.context_limit)
        self.inv_freq = rope.inv_freq(config)
        self.config = config
        self.weight_format = checkpoint.weight_format
        self.kv_format = kv_cache  # what the cache holds (qwenchat/model/kv_cache.py)
        # Every linear layer's input as e4m3 codes and a scale a token and 128 columns, as FP8
        # tensor cores take it (fp8.quantize_activations); the LM head keeps its input.
        self.linear_input = fp8.quantize_activations if fp8_activations else _unchanged
        # observe(layer, "qkv" | "o" | "mlp", x): the inputs of a layer's linear layers as they
        # are computed (`qwenchat quantize --calibrate` collects them); None: nothing watches.
        self.observe: Callable[[int, str, np.ndarray], None] | None = None
        self.embed = checkpoint.float32("model.embed_tokens.weight")
        self.layers = [LayerWeights.load(checkpoint, config, i)
                       for i in range(config.num_hidden_layers)]
        self.final_norm = checkpoint.float32("model.norm.weight")
        head = checkpoint.lm_head_name()
        tied = head == "model.embed_tokens.weight"
        self.lm_head = self.embed if tied else checkpoint.float32(head)
        shape = (config.num_hidden_layers, config.num_key_value_heads, 0, config.head_dim)
        self._k = np.zeros(shape, np.float32)
        self._v = np.zeros(shape, np.float32)
        self._logits: np.ndarray | None = None

    def prefill(self, token_ids: Sequence[int]) -> None:
        self._check_prefill(token_ids, self.config.vocab_size)
        self._logits = self._forward(list(token_ids))[-1]

    def prefill_logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Prefill, returning the logits of every new position (tokens × vocab), for tests."""
        self._check_prefill(token_ids, self.config.vocab_size)
        logits = self._forward(list(token_ids), all_positions=True)
        self._logits = logits[-1]
        return logits

    def last_logits(self) -> np.ndarray:
        if self._logits is None:
            raise RuntimeError("no logits yet: prefill first")
        return self._logits.copy()

    def close(self) -> None:
        self._k = self._v = np.zeros((0,), np.float32)

    def _has_logits(self) -> bool:
        return self._logits is not None

    def _drop_logits(self) -> None:
        self._logits = None

    def _begin_reply(self, request: GenerateRequest) -> None:
        self._reply_counts: Counter[int] = Counter()

    def _next_token(self, fed: int | None, params: SamplingParams, seed: int, step: int) -> int:
        if fed is not None:
            self._logits = self._forward([fed])[-1]
        token = sample_token(self._logits, params, seed, step, self._tokens, self._reply_counts)
        self._reply_counts[token] += 1
        return token

    def _speculative_pass(self, fed: int, proposal: list[int], params: SamplingParams,
                          seed: int, step: int, draft_probs: np.ndarray | None) -> list[int]:
        context = list(self._tokens)
        self._pass_rows = self._forward([fed, *proposal], all_positions=True)
        return verify(self._pass_rows, proposal, params, seed, step, context,
                      self._reply_counts, draft_probs)

    def _rewind(self, position: int, row: int, emitted: list[int]) -> None:
        del self._tokens[position:]  # (the cache arrays past it are written over later)
        self._logits = self._pass_rows[row]
        self._pass_rows = None
        self._reply_counts.update(emitted)

    def _forward(self, ids: list[int], all_positions: bool = False) -> np.ndarray:
        cfg = self.config
        start, count = self.position, len(ids)
        self._reserve(start + count)
        cos, sin = rope_tables(np.arange(start, start + count), self.inv_freq)
        x = self.embed[np.asarray(ids)]
        into = self.linear_input
        for index, w in enumerate(self.layers):
            h = into(rms_norm(x, w.input_norm, cfg.rms_norm_eps))
            if self.observe is not None:
                self.observe(index, "qkv", h)
            q = (h @ w.q.T).reshape(count, cfg.num_attention_heads, cfg.head_dim)
            k = (h @ w.k.T).reshape(count, cfg.num_key_value_heads, cfg.head_dim)
            v = (h @ w.v.T).reshape(count, cfg.num_key_value_heads, cfg.head_dim)
            q = apply_rope(rms_norm(q, w.q_norm, cfg.rms_norm_eps), cos, sin)
            k = apply_rope(rms_norm(k, w.k_norm, cfg.rms_norm_eps), cos, sin)
            self._k[index, :, start : start + count] = cached(k, self.kv_format).transpose(1, 0, 2)
            self._v[index, :, start : start + count] = cached(v, self.kv_format).transpose(1, 0, 2)
            attended = into(self._attend(index, q, start))
            if self.observe is not None:
                self.observe(index, "o", attended)
            x = x + attended @ w.o.T
            h = into(rms_norm(x, w.post_norm, cfg.rms_norm_eps))
            if self.observe is not None:
                self.observe(index, "mlp", h)
            x = x + w.mlp(h, into)
        self._tokens.extend(ids)
        rows = x if all_positions else x[-1:]
        return rms_norm(rows, self.final_norm, cfg.rms_norm_eps) @ self.lm_head.T

    def _attend(self, layer: int, q: np.ndarray, start: int) -> np.ndarray:
        """Causal grouped-query attention of new queries (tokens × heads × dim) over the cache."""
        cfg = self.config
        count, group = q.shape[0], cfg.group_size
        length = start + count
        keys = self._k[layer, :, :length]  # (kv_heads, length, dim)
        values = self._v[layer, :, :length]
        # (kv_heads, group, tokens, dim): query head h reads key/value head h // group
        queries = q.reshape(count, cfg.num_key_value_heads, group, cfg.head_dim)
        queries = queries.transpose(1, 2, 0, 3)
        out = np.empty((cfg.num_key_value_heads, group, count, cfg.head_dim), np.float32)
        scale = np.float32(rope.softmax_scale(cfg))
        chunk = max(1, ATTENTION_SCORE_BUDGET // (cfg.num_attention_heads * length))
        key_pos = np.arange(length)
        for a in range(0, count, chunk):
            b = min(count, a + chunk)
            scores = np.matmul(queries[:, :, a:b], keys[:, None].swapaxes(-1, -2)) * scale
            future = key_pos[None, :] > (start + np.arange(a, b))[:, None]
            scores = np.where(future, np.float32(-np.inf), scores)
            scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
            scores /= scores.sum(axis=-1, keepdims=True)
            out[:, :, a:b] = np.matmul(scores, values[:, None])
        return out.transpose(2, 0, 1, 3).reshape(count, cfg.q_size)

    def _reserve(self, length: int) -> None:
        """Grow the cache arrays geometrically so long chats do not copy on every token."""
        have = self._k.shape[2]
        if length <= have:
            return
        new = min(self.capacity, max(length, 2 * have, 256))
        grow = [(0, 0), (0, 0), (0, new - have), (0, 0)]
        self._k = np.pad(self._k, grow)
        self._v = np.pad(self._v, grow)
