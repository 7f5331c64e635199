"""`qwenchat bench`: how fast an engine prefills and decodes, beside the bytes each step moves.

Everything is measured through the Engine protocol, so the same code times the NumPy
reference and the CUDA engine. Each decode rate sits next to its napkin math: the bytes one
step must read (bf16 weights, the LM head in full, the KV cache up to that position), the
bandwidth that implies, and its fraction of the device's measured copy bandwidth when the
engine can measure it. `--compare-hf` times transformers on the same weights in the same run.

Engines may offer, and the bench uses when present: `copy_bandwidth() -> float` (bytes read
plus written per second by a device-to-device copy), `peak_memory_bytes() -> int` and
`device_name: str`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

import numpy as np

from qwenchat.engine import (
    Engine,
    EngineFlags,
    GenerateRequest,
    Generation,
    create_engine,
)
from qwenchat.engine.reference import ReferenceEngine
from qwenchat.engine.speculate import SPECULATE_MOST, DraftProposer
from qwenchat.errors import UsageError
from qwenchat.model import kv_cache
from qwenchat.model.checkpoint import Checkpoint, WeightSource
from qwenchat.model.config import Qwen3Config, parameters_text
from qwenchat.model.formats import FORMATS
from qwenchat.model.loader import open_model
from qwenchat.model.presets import named_config
from qwenchat.model.random_weights import RandomWeights
from qwenchat.sampling.params import NON_THINKING, LiveParams, SamplingParams

DEFAULT_CONFIG = "qwen3-0.6b"
DEFAULT_PROMPTS = (512, 4096)
DEFAULT_POSITIONS = (1, 1024, 4096, 16384, 32768)
HF_VARIANTS = ("eager", "static+compile")
# transformers in float32 on a CPU needs minutes to prefill beyond this; the bench skips it.
HF_CPU_MAX_POSITION = 2048
HF_WARMUP_STEPS = 3  # torch.compile traces on the 1st call, CUDA graphs record on the 2nd
COPY_PROBE_BYTES = 512 << 20
# `--speculation`: the oracle proposer's shares of proposals made wrong on purpose.
ORACLE_CORRUPTION = (0.0, 0.1, 0.3)
ORACLE_ROUNDS = 4  # at most, to find the continuation speculative greedy decoding gives
DRAFT_CONFIG = "qwen3-0.6b"  # the random draft's shape (draft_shape): it never agrees

Tick = Callable[[str], None]  # told what is measured next, once per planned item


def _silent(_: str) -> None:
    pass


@dataclass(frozen=True)
class BenchSettings:
    prompts: tuple[int, ...] = DEFAULT_PROMPTS
    positions: tuple[int, ...] = DEFAULT_POSITIONS
    steps: int = 64
    repeats: int = 3
    seed: int = 0  # of the random prompt ids
    sampled: bool = False  # decode with Qwen3's non-thinking sampler instead of greedy
    speculation: bool = False  # also measure speculative decoding's mechanism (first position)
    after: int = 0  # cached tokens each prompt is prefilled after (a chat's later turn)

    def __post_init__(self) -> None:
        for flag, sizes in (("--prompts", self.prompts), ("--positions", self.positions)):
            if not sizes or min(sizes) < 1:
                raise UsageError(f"{flag} needs token counts of at least 1; got {list(sizes)}")
        for flag, value in (("--steps", self.steps), ("--repeats", self.repeats)):
            if value < 1:
                raise UsageError(f"{flag} must be at least 1; got {value}")
        if self.after < 0:
            raise UsageError(f"--after takes a count of cached tokens, 0 or more; got {self.after}")

    def default_ctx(self, config: Qwen3Config) -> int:
        """Room for the longest prompt and the last position's steps, within the model's limit."""
        ahead = SPECULATE_MOST + 1 if self.speculation else 0  # (a pass past the last step)
        needed = max(max(self.positions) + self.steps + 1 + ahead,
                     max(self.prompts) + self.after)
        return min(needed, config.context_limit)

    def planned_items(self, compare_hf: bool) -> int:
        """How many times the measuring functions call their Tick (for a progress bar)."""
        items = 1 + len(self.prompts) + len(self.positions)
        if self.speculation:
            items += len(ORACLE_CORRUPTION) + 1
        if compare_hf:
            items += 1 + len(HF_VARIANTS) * (1 + len(self.positions)) + len(self.prompts)
        return items


def parse_sizes(text: str, flag: str) -> tuple[int, ...]:
    """`1,1024,4096` → (1, 1024, 4096); anything else is a one-line usage error."""
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise UsageError(f"{flag} takes comma-separated token counts like 1,1024,4096; "
                         f"got {text!r}") from None
    if min(sizes) < 1:
        raise UsageError(f"{flag} needs token counts of at least 1; got {text!r}")
    return sizes


def weight_bytes_per_step(config: Qwen3Config, weight_format: str = "bf16") -> int:
    """Weight bytes one decode step reads: every tensor once, the LM head in full; the linear
    layers in `weight_format` (FP8: codes and block scales as the GPU stores them), the rest
    (norms, LM head) in bf16.

    The embedding table counts only when it is the (tied) LM head: otherwise a step reads one
    row of it, which is negligible. A mixture of experts' sparse layer counts the
    num_experts_per_tok experts a token routes to (its experts are all one size, so which
    ones does not change the count) beside its router.
    """
    shapes = config.tensor_shapes()
    if not config.tie_word_embeddings:
        del shapes["model.embed_tokens.weight"]
    for name in [n for n in shapes if ".mlp.experts." in n]:
        if int(name.split(".mlp.experts.")[1].split(".")[0]) >= config.num_experts_per_tok:
            del shapes[name]
    return FORMATS[weight_format].weight_bytes(shapes)


def expert_bytes(config: Qwen3Config, weight_format: str = "bf16") -> int:
    """The bytes of one expert's gate, up and down rows (0 for a dense model)."""
    shapes = {n: s for n, s in config.tensor_shapes().items() if ".mlp.experts.0." in n}
    if not shapes:
        return 0
    layer = next(iter(shapes)).split(".mlp.")[0]
    return FORMATS[weight_format].weight_bytes(
        {n: s for n, s in shapes.items() if n.startswith(layer + ".")})


def pass_weight_bytes(config: Qwen3Config, weight_format: str, experts_a_layer: float) -> int:
    """Weight bytes a speculative pass reads: a decode step's, with each sparse layer's
    num_experts_per_tok experts replaced by the `experts_a_layer` its tokens chose."""
    extra = (experts_a_layer - config.num_experts_per_tok) * config.sparse_layers
    return weight_bytes_per_step(config, weight_format) + round(
        extra * expert_bytes(config, weight_format))


def bytes_per_step(config: Qwen3Config, position: int, weight_format: str = "bf16",
                   kv_format: str = "bf16") -> int:
    """Weights plus the keys and values of `position` cached tokens (with their scales in an
    8-bit cache)."""
    return (weight_bytes_per_step(config, weight_format)
            + kv_cache.bytes_per_position(config, kv_format) * position)


@dataclass
class PrefillResult:
    tokens: int
    tok_s: float | None = None
    seconds: float | None = None
    ttft_s: float | None = None  # prefill plus the first generated token
    skipped: str | None = None
    after: int = 0  # cached tokens before the prompt (--after)
    # The attention's share: the same prefill timed again with the attention kernels left
    # out (an engine with a prefill_attention switch: the CUDA one), the difference, and the
    # attention's FLOP rate over it (attention_flops).
    attention_s: float | None = None
    attention_tflop_s: float | None = None


def attention_flops(config: Qwen3Config, tokens: int, after: int = 0) -> int:
    """The causal prefill attention's floating-point operations for a prompt of `tokens`
    after `after` cached ones: Q.K^T and P.V, 2 x head_dim multiply-adds each, for every
    query head, layer and (query, key <= query) pair (FlashAttention's count)."""
    pairs = tokens * after + tokens * (tokens + 1) // 2
    return 4 * config.head_dim * config.num_attention_heads * config.num_hidden_layers * pairs


@dataclass
class DecodeResult:
    position: int
    bytes_per_step: int
    tok_s: float | None = None
    gb_s: float | None = None  # bytes_per_step × tok_s, in 10^9 bytes per second
    copy_fraction: float | None = None  # of the measured copy bandwidth
    # tok/s if bytes_per_step moved at the copy bandwidth, and if the weights were bf16
    floor_tok_s: float | None = None
    bf16_floor_tok_s: float | None = None
    skipped: str | None = None


@dataclass
class SpeculationResult:
    """Speculative decoding at one position, beside plain decoding's rate from the same run.
    `proposer` "oracle": the target's own greedy continuation from a plain run, a `corrupt`
    share of its proposals made wrong; "draft": a random draft model (it never agrees)."""

    proposer: str
    position: int
    corrupt: float | None
    tok_s: float
    plain_tok_s: float
    passes: int
    proposed: int
    accepted: int
    tokens: int
    seconds: float
    # a mixture of experts: the experts a pass read a sparse layer, on average (each chosen
    # expert once for all of the pass's tokens; a plain step reads num_experts_per_tok)
    experts_a_layer: float | None = None

    @property
    def speedup(self) -> float:
        return self.tok_s / self.plain_tok_s

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None

    @property
    def pass_cost(self) -> float | None:
        """A pass's time over a plain step's, where (nearly) every step was a pass."""
        steps = self.tokens - self.accepted  # target forwards: passes and plain steps
        if not self.passes or self.passes < 0.9 * steps:
            return None
        return self.seconds / steps * self.plain_tok_s


@dataclass
class TransformersResult:
    variant: str
    device: str | None = None
    dtype: str | None = None
    copy_bandwidth_bytes_s: float | None = None
    peak_memory_bytes: int | None = None
    decode: list[DecodeResult] = field(default_factory=list)
    # one forward over each prompt into a fresh cache (eager only: the compiled variant's
    # prefill is the same eager forward)
    prefill: list[PrefillResult] = field(default_factory=list)
    unavailable: str | None = None


@dataclass
class BenchResult:
    model: str
    weights: str
    engine: str
    device: str | None
    config: Qwen3Config
    parameters: int
    ctx: int
    steps: int
    repeats: int
    sampler: str  # what chose the decoded tokens
    weight_format: str  # of the linear layers, as the engine ran them
    weight_bytes_per_step: int
    kv_format: str  # of the KV cache, as the engine ran it
    kv_bytes_per_position: int
    copy_bandwidth_bytes_s: float | None
    peak_memory_bytes: int | None
    prefill: list[PrefillResult]
    decode: list[DecodeResult]
    transformers: list[TransformersResult] = field(default_factory=list)
    speculation: list[SpeculationResult] = field(default_factory=list)

    def to_json(self) -> str:
        data = asdict(self)
        for row, result in zip(data["speculation"], self.speculation, strict=True):
            row.update(speedup=result.speedup, acceptance=result.acceptance,
                       pass_cost=result.pass_cost)
        return json.dumps(data)


def measure_engine(engine: Engine, settings: BenchSettings, model: str, weights: str,
                   tick: Tick = _silent, draft: Engine | None = None) -> BenchResult:
    """Prefill and TTFT for every prompt size, decode rate at every position, on `engine`;
    with settings.speculation, speculative decoding at the first position (the oracle, and
    `draft` if given)."""
    config = engine.config
    rng = np.random.default_rng(settings.seed)
    tick("warming up")
    engine.truncate(0)
    engine.prefill(_random_ids(rng, config, 1))
    _drain(engine.generate(_greedy(2)))
    copy_bandwidth = _optional_call(engine, "copy_bandwidth")
    prefill = []
    for tokens in settings.prompts:
        tick(f"prefill {tokens} tokens")
        prefill.append(_measure_prefill(engine, tokens, settings, rng))
    decode = []
    for position in settings.positions:
        tick(f"decode at position {position}")
        decode.append(_measure_decode(engine, position, settings, rng, copy_bandwidth))
    speculation = []
    if settings.speculation and engine.can_speculate and decode[0].tok_s:
        speculation = _measure_speculation(engine, settings, rng, decode[0].tok_s, draft, tick)
    return BenchResult(
        model=model, weights=weights, engine=engine.name,
        device=getattr(engine, "device_name", None), config=config,
        parameters=config.parameter_count(), ctx=engine.capacity, steps=settings.steps,
        repeats=settings.repeats, sampler=_sampler_name(settings),
        weight_format=engine.weight_format,
        weight_bytes_per_step=weight_bytes_per_step(config, engine.weight_format),
        kv_format=engine.kv_format,
        kv_bytes_per_position=kv_cache.bytes_per_position(config, engine.kv_format),
        copy_bandwidth_bytes_s=copy_bandwidth,
        peak_memory_bytes=_optional_call(engine, "peak_memory_bytes"),
        prefill=prefill, decode=decode, speculation=speculation,
    )


def _measure_prefill(engine: Engine, tokens: int, settings: BenchSettings,
                     rng: np.random.Generator) -> PrefillResult:
    after = settings.after
    if tokens + after > engine.capacity:
        return PrefillResult(tokens, skipped=f"does not fit the {engine.capacity}-token "
                                             "context (raise --ctx)", after=after)
    if after:  # the history, once: each run below starts from it
        engine.truncate(0)
        engine.prefill(_random_ids(rng, engine.config, after))
    ids = _random_ids(rng, engine.config, tokens)
    durations, ttfts = [], []
    for _ in range(settings.repeats):
        engine.truncate(after)
        start = time.perf_counter()
        engine.prefill(ids)
        prefilled = time.perf_counter()
        generation = engine.generate(_greedy(1))
        next(generation)
        ttfts.append(time.perf_counter() - start)
        durations.append(prefilled - start)
        _drain(generation)
    seconds = statistics.median(durations)
    result = PrefillResult(tokens, tokens / seconds, seconds, statistics.median(ttfts),
                           after=after)
    # The same prompts without the attention kernels (the cache is refilled by the next
    # measurement's prefill): what is left is the rest of the prefill's time. Not for a mixture
    # of experts: without attention the hidden states, so the routing and the experts' share
    # of the time, are not the real prefill's, and the difference says nothing.
    if getattr(engine, "prefill_attention", None) is True and not engine.config.is_moe:
        engine.prefill_attention = False
        try:
            without = []
            for _ in range(settings.repeats):
                engine.truncate(after)
                start = time.perf_counter()
                engine.prefill(ids)
                without.append(time.perf_counter() - start)
        finally:
            engine.prefill_attention = True
            engine.truncate(after)
        result.attention_s = seconds - statistics.median(without)
        if result.attention_s > 0:
            result.attention_tflop_s = (attention_flops(engine.config, tokens, after)
                                        / result.attention_s / 1e12)
    return result


def _measure_decode(engine: Engine, position: int, settings: BenchSettings,
                    rng: np.random.Generator, copy_bandwidth: float | None) -> DecodeResult:
    config, weight_format, kv_format = engine.config, engine.weight_format, engine.kv_format
    if position + settings.steps > engine.capacity:
        return DecodeResult(position, bytes_per_step(config, position, weight_format, kv_format),
                            skipped=_no_room(settings.steps, engine.capacity))
    ids = _random_ids(rng, config, position)
    engine.truncate(0)
    engine.prefill(ids)
    rates = []
    for repeat in range(settings.repeats):
        if repeat:
            # Back to `position` cached tokens with fresh logits, reusing the prefilled cache.
            engine.truncate(position - 1)
            engine.prefill(ids[-1:])
        rates.append(_decode_rate(engine, settings.steps, settings.sampled))
    return _decode_result(config, position, statistics.median(rates), copy_bandwidth,
                          weight_format, kv_format)


def _decode_rate(engine: Engine, steps: int, sampled: bool = False) -> float:
    produced, elapsed = _timed_steps(engine, _sampled(steps + 1) if sampled
                                     else _greedy(steps + 1))
    return produced / elapsed


def _timed_steps(engine: Engine, request: GenerateRequest) -> tuple[int, float]:
    """The request's tokens after the first (sampled from the prefill's logits: no decode step
    behind it), and the seconds they took; all max_tokens - 1 of them, or an error."""
    generation = engine.generate(request)
    next(generation)
    start = time.perf_counter()
    produced = sum(1 for _ in generation)
    elapsed = time.perf_counter() - start
    steps = request.params.current.max_tokens - 1
    if produced < steps:
        raise RuntimeError(f"the engine stopped after {produced} of {steps} decode steps "
                           f"({generation.stop_reason})")
    return produced, elapsed


def draft_shape(config: Qwen3Config) -> Qwen3Config:
    """`--speculation`'s random draft: Qwen3-0.6B's shape with the model's vocabulary, or for
    a model no larger, the model's own shape with a quarter of its layers."""
    small = named_config(DRAFT_CONFIG)
    if config.parameter_count() > small.parameter_count():
        return dataclasses.replace(small, vocab_size=config.vocab_size)
    return dataclasses.replace(config, num_hidden_layers=max(1, config.num_hidden_layers // 4))


class OracleProposer:
    """Proposes the target's own greedy continuation (as speculation decodes it), each proposal made
    wrong with probability `corrupt` (decided by its index in the reply, so every run is the
    same): a proposer whose acceptance is chosen, for measuring the mechanism."""

    def __init__(self, continuation: list[int], corrupt: float, vocab_size: int):
        self.continuation = continuation
        rng = np.random.default_rng(1)
        self.wrong = rng.random(len(continuation)) < corrupt
        self.vocab_size = vocab_size
        self.emitted = 0

    def start(self, context: list[int]) -> None:
        self.emitted = 0

    def extend(self, tokens: list[int]) -> None:
        self.emitted += len(tokens)

    def propose(self, k: int, params: SamplingParams, seed: int, step: int
                ) -> tuple[list[int], None]:
        at = self.emitted
        proposal = []
        for i in range(at, min(at + k, len(self.continuation))):
            token = self.continuation[i]
            proposal.append((token + 1) % self.vocab_size if self.wrong[i] else token)
        return proposal, None


def _measure_speculation(engine: Engine, settings: BenchSettings, rng: np.random.Generator,
                         plain_tok_s: float, draft: Engine | None,
                         tick: Tick) -> list[SpeculationResult]:
    """Greedy replies of `settings.steps` tokens at the first position, proposed by the oracle
    at each ORACLE_CORRUPTION and by `draft`, each the median of `settings.repeats` by rate."""
    position, steps = settings.positions[0], settings.steps
    if position + steps + SPECULATE_MOST + 2 > engine.capacity:
        return []
    ids = _random_ids(rng, engine.config, position)
    engine.truncate(0)
    engine.prefill(ids)
    continuation = list(engine.generate(_greedy(steps + SPECULATE_MOST + 1)))
    # A pass may choose the other token of a near-tie (its kernels sum in other orders than a
    # plain step's), after which plain decoding's continuation stops being the reply: the
    # oracle's continuation is the reply it gets itself, found in a few rounds.
    for _ in range(ORACLE_ROUNDS):
        engine.truncate(0)
        engine.prefill(ids)
        oracle = OracleProposer(continuation, 0.0, engine.config.vocab_size)
        request = dataclasses.replace(_greedy(len(continuation)), speculate=SPECULATE_MOST,
                                      proposer=oracle)
        reply = list(engine.generate(request))
        if reply == continuation:
            break
        continuation = reply
    proposers: list[tuple[str, float | None, Callable[[], Any]]] = [
        ("oracle", corrupt, lambda c=corrupt: OracleProposer(continuation, c,
                                                             engine.config.vocab_size))
        for corrupt in ORACLE_CORRUPTION]
    if draft is not None:
        proposers.append(("draft", None,
                          lambda: DraftProposer(draft, engine.config.vocab_size)))
    results = []
    for name, corrupt, make in proposers:
        tick(f"speculation: {name}" + ("" if corrupt is None else f" {corrupt:.0%} wrong"))
        runs = []
        for _ in range(settings.repeats):
            engine.truncate(0)
            engine.prefill(ids)
            request = dataclasses.replace(_greedy(steps + 1), speculate=SPECULATE_MOST,
                                          proposer=make())
            read = _optional_call(engine, "experts_read")
            tokens, seconds = _timed_steps(engine, request)
            stats = engine.speculation
            after = _optional_call(engine, "experts_read")
            experts = (None if read is None or after is None or not stats.passes
                       or not engine.config.sparse_layers else
                       (after - read) / (stats.passes * engine.config.sparse_layers))
            runs.append(SpeculationResult(name, position, corrupt, tokens / seconds,
                                          plain_tok_s, stats.passes, stats.proposed,
                                          stats.accepted, tokens, seconds, experts))
        results.append(sorted(runs, key=lambda r: r.tok_s)[len(runs) // 2])
    return results


def _decode_result(config: Qwen3Config, position: int, tok_s: float,
                   copy_bandwidth: float | None, weight_format: str = "bf16",
                   kv_format: str = "bf16") -> DecodeResult:
    """The rate beside its napkin math: the bytes the step actually reads (in the engine's
    weight and KV-cache formats), and the floors those bytes and bf16 weights and cache would
    give."""
    nbytes = bytes_per_step(config, position, weight_format, kv_format)
    achieved = nbytes * tok_s
    if not copy_bandwidth:
        return DecodeResult(position, nbytes, tok_s, achieved / 1e9)
    return DecodeResult(position, nbytes, tok_s, achieved / 1e9, achieved / copy_bandwidth,
                        copy_bandwidth / nbytes,
                        copy_bandwidth / bytes_per_step(config, position))


def _no_room(steps: int, capacity: int) -> str:
    return f"{steps} steps from here do not fit the {capacity}-token context (raise --ctx)"


def _greedy(max_tokens: int) -> GenerateRequest:
    return _request(SamplingParams(temperature=0.0, max_tokens=max_tokens))


def _sampled(max_tokens: int) -> GenerateRequest:
    return _request(dataclasses.replace(NON_THINKING, max_tokens=max_tokens))


def _request(params: SamplingParams) -> GenerateRequest:
    # No EOS ids: every request runs for exactly max_tokens.
    return GenerateRequest(LiveParams(params), eos_ids=frozenset(), seed=0)


def _sampler_name(settings: BenchSettings) -> str:
    if not settings.sampled:
        return "greedy"
    p = NON_THINKING
    return f"sampled (temperature {p.temperature}, top-p {p.top_p}, top-k {p.top_k})"


def _drain(generation: Generation) -> None:
    for _ in generation:
        pass


def _random_ids(rng: np.random.Generator, config: Qwen3Config, count: int) -> list[int]:
    return rng.integers(0, config.vocab_size, count).tolist()


def _optional_call(engine: Engine, method: str) -> Any:
    """The result of an engine capability the protocol does not require, or None without it."""
    capability = getattr(engine, method, None)
    return capability() if callable(capability) else None


def measure_transformers(config: Qwen3Config, weights: WeightSource, settings: BenchSettings,
                         ctx: int, device_index: int = 0,
                         tick: Tick = _silent) -> list[TransformersResult]:
    """Decode rates of transformers' Qwen3ForCausalLM on the same weights, per HF_VARIANTS,
    and (eager) its prefill rate at every prompt size: one forward over the prompt with SDPA
    attention, the median of `repeats` after one untimed run.

    bf16 on the GPU when torch sees one, else float32 on the CPU. A variant that cannot run
    here is reported as unavailable, with the reason, instead of failing the bench.
    """
    tick("transformers: building the model")
    try:
        import torch
        import transformers
    except ImportError as exc:
        return _unavailable(f"needs torch and transformers ({exc}); "
                            "pip install torch transformers", settings, tick)
    on_gpu = torch.cuda.is_available()
    try:
        device = torch.device(f"cuda:{device_index}" if on_gpu else "cpu")
        model = transformers_model(config, weights, device,
                                   torch.bfloat16 if on_gpu else torch.float32)
        copy_bandwidth = _torch_copy_bandwidth(torch, device) if on_gpu else None
    except Exception as exc:
        return _unavailable(_describe(exc), settings, tick)
    rng = np.random.default_rng(settings.seed)
    results = []
    for variant in HF_VARIANTS:
        tick(f"transformers {variant}: setting up")
        result = TransformersResult(
            variant, torch.cuda.get_device_name(device) if on_gpu else "CPU",
            str(model.dtype).removeprefix("torch."), copy_bandwidth)
        runner: _HfRunner | None = None
        if variant == "eager":
            runner = _EagerRunner(torch, model)
        elif on_gpu:
            runner = _CompiledRunner(torch, transformers, model)
        else:
            result.unavailable = "needs a CUDA GPU: mode=reduce-overhead replays CUDA graphs"
        if on_gpu:
            torch.cuda.reset_peak_memory_stats(device)
        if variant == "eager":
            for tokens in settings.prompts:
                tick(f"transformers {variant}: prefill {tokens} tokens")
                if result.unavailable is not None:
                    continue
                try:
                    with torch.no_grad():
                        result.prefill.append(_hf_prefill(runner, config, tokens, settings,
                                                          ctx, rng))
                except Exception as exc:
                    result.unavailable = f"prefill of {tokens} tokens: {_describe(exc)}"
        for position in settings.positions:
            tick(f"transformers {variant}: decode at position {position}")
            if runner is None or result.unavailable is not None:
                continue
            try:
                with torch.no_grad():
                    result.decode.append(_hf_decode(runner, config, position, settings, ctx,
                                                    rng, copy_bandwidth))
            except Exception as exc:
                # What ran stays reported; positions after a failure are not tried.
                result.unavailable = f"at position {position}: {_describe(exc)}"
        if on_gpu and result.decode:
            result.peak_memory_bytes = torch.cuda.max_memory_allocated(device)
        results.append(result)
    return results


def _hf_decode(runner: _HfRunner, config: Qwen3Config, position: int,
               settings: BenchSettings, ctx: int, rng: np.random.Generator,
               copy_bandwidth: float | None) -> DecodeResult:
    skipped = None
    if position + settings.steps > ctx:
        skipped = _no_room(settings.steps, ctx)
    elif runner.on_cpu and position > HF_CPU_MAX_POSITION:
        skipped = (f"beyond position {HF_CPU_MAX_POSITION}, transformers on the CPU takes "
                   "minutes per prefill")
    if skipped:
        return DecodeResult(position, bytes_per_step(config, position), skipped=skipped)
    ids = _random_ids(rng, config, position)
    # Untimed: the first run at a new cache size compiles and records CUDA graphs.
    _hf_rate(runner, ids, settings.steps, repeats=1,
             timed_steps=min(HF_WARMUP_STEPS, settings.steps))
    tok_s = _hf_rate(runner, ids, settings.steps, settings.repeats, settings.steps)
    return _decode_result(config, position, tok_s, copy_bandwidth)


def _hf_prefill(runner: _HfRunner, config: Qwen3Config, tokens: int, settings: BenchSettings,
                ctx: int, rng: np.random.Generator) -> PrefillResult:
    skipped = None
    if settings.after:
        skipped = "with --after: transformers' prefill here starts from an empty cache"
    elif tokens > ctx:
        skipped = f"does not fit the {ctx}-token context (raise --ctx)"
    elif runner.on_cpu and tokens > HF_CPU_MAX_POSITION:
        skipped = (f"beyond {HF_CPU_MAX_POSITION} tokens, transformers on the CPU takes "
                   "minutes per prefill")
    if skipped:
        return PrefillResult(tokens, skipped=skipped)
    ids = _random_ids(rng, config, tokens)
    durations = []
    for timed in (False, *[True] * settings.repeats):  # the first run warms up, untimed
        runner.sync()
        start = time.perf_counter()
        runner.start(ids, 1)  # the forward over the prompt and its next token's argmax
        runner.sync()
        if timed:
            durations.append(time.perf_counter() - start)
    seconds = statistics.median(durations)
    return PrefillResult(tokens, tokens / seconds, seconds)


def _unavailable(reason: str, settings: BenchSettings, tick: Tick) -> list[TransformersResult]:
    for variant in HF_VARIANTS:
        for position in (None, *settings.positions):  # keep the progress count honest
            tick(f"transformers {variant}: " + ("unavailable" if position is None
                                                 else f"position {position}"))
    for tokens in settings.prompts:
        tick(f"transformers eager: prefill {tokens} tokens")
    return [TransformersResult(variant, unavailable=reason) for variant in HF_VARIANTS]


def transformers_model(config: Qwen3Config, weights: WeightSource, device: Any = "cpu",
                       dtype: Any = None) -> Any:
    """transformers' Qwen3ForCausalLM (Qwen3MoeForCausalLM for a mixture of experts) with our
    config and weights, on `device` in `dtype` (a torch dtype; float32 when None)."""
    import torch
    import transformers

    fields = dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim,
        rms_norm_eps=config.rms_norm_eps, rope_parameters=_hf_rope(config),
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings, attn_implementation="sdpa")
    if config.is_moe:
        hf_config = transformers.Qwen3MoeConfig(
            **fields, num_experts=config.num_experts,
            num_experts_per_tok=config.num_experts_per_tok,
            moe_intermediate_size=config.moe_intermediate_size,
            norm_topk_prob=config.norm_topk_prob,
            decoder_sparse_step=config.decoder_sparse_step,
            mlp_only_layers=list(config.mlp_only_layers))
    else:
        hf_config = transformers.Qwen3Config(**fields)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(hf_config,
                                                              dtype=dtype or torch.float32)
    for name in config.tensor_shapes():
        # copy_ casts (bf16 values stay exact) and moves to the device in one go.
        _hf_parameter(model, name).copy_(torch.from_numpy(weights.float32(name)))
    return model.eval()


_EXPERT = re.compile(
    r"(?P<experts>.+\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate|up|down)_proj\.weight")


def _hf_parameter(model: Any, name: str) -> Any:
    """The tensor of `model` that the checkpoint's `name` fills. transformers 5 keeps a sparse
    layer's experts as two 3-D parameters, gate_up_proj (experts x 2·moe_intermediate x hidden,
    gate's rows first) and down_proj (experts x hidden x moe_intermediate), where the published
    files (and transformers 4) have one matrix per expert and projection."""
    try:
        return model.get_parameter(name).data
    except AttributeError:
        match = _EXPERT.fullmatch(name)
        if match is None:
            raise
    experts = model.get_submodule(match["experts"])
    e, proj = int(match["e"]), match["proj"]
    if proj == "down":
        return experts.down_proj.data[e]
    gate, up = experts.gate_up_proj.data[e].chunk(2)
    return gate if proj == "gate" else up


def _hf_rope(config: Qwen3Config) -> dict[str, Any]:
    """transformers' rope_parameters for our config: plain RoPE, or the same YaRN."""
    yarn = config.rope_scaling
    if yarn is None:
        return {"rope_type": "default", "rope_theta": config.rope_theta}
    params = {"rope_type": "yarn", "rope_theta": config.rope_theta, "factor": yarn.factor,
              "original_max_position_embeddings": yarn.original_max_position_embeddings,
              "beta_fast": yarn.beta_fast, "beta_slow": yarn.beta_slow,
              "truncate": yarn.truncate}
    for name in ("attention_factor", "mscale", "mscale_all_dim"):
        if getattr(yarn, name) is not None:
            params[name] = getattr(yarn, name)
    return params


def _torch_copy_bandwidth(torch: Any, device: Any) -> float:
    """Bytes read plus written per second by a device-to-device copy: the best of ten."""
    source = torch.empty(COPY_PROBE_BYTES, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    best = math.inf
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        target.copy_(source)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1000)
    return 2 * COPY_PROBE_BYTES / best


class _HfRunner:
    """One way of running transformers: prefill a prompt, then one greedy token per step."""

    def __init__(self, torch: Any, model: Any):
        self.torch = torch
        self.model = model

    def start(self, ids: list[int], steps: int) -> Any:
        """Prefill `ids` into a fresh cache with room for `steps` more; the first token."""
        raise NotImplementedError

    def step(self, token: Any) -> Any:
        raise NotImplementedError

    @property
    def on_cpu(self) -> bool:
        return self.model.device.type != "cuda"

    def sync(self) -> None:
        if not self.on_cpu:
            self.torch.cuda.synchronize(self.model.device)

    def _prefill(self, ids: list[int], cache: Any) -> tuple[Any, Any]:
        prompt = self.torch.tensor([ids], device=self.model.device)
        # logits_to_keep=1: a 32K-token prompt's full logits would take 10 GB.
        out = self.model(input_ids=prompt, past_key_values=cache, use_cache=True,
                         logits_to_keep=1)
        return out.logits[:, -1].argmax(-1, keepdim=True), out.past_key_values


class _EagerRunner(_HfRunner):
    """The plain loop: a DynamicCache grown by each forward, argmax on the device."""

    def start(self, ids: list[int], steps: int) -> Any:
        token, self.cache = self._prefill(ids, None)
        return token

    def step(self, token: Any) -> Any:
        logits = self.model(input_ids=token, past_key_values=self.cache, use_cache=True).logits
        return logits[:, -1].argmax(-1, keepdim=True)


class _CompiledRunner(_HfRunner):
    """transformers' documented fast path: a StaticCache, and the one-token decode step
    compiled with mode="reduce-overhead" (CUDA graphs); the prefill stays eager."""

    def __init__(self, torch: Any, transformers: Any, model: Any):
        super().__init__(torch, model)
        self.transformers = transformers
        self.decode = torch.compile(_decode_one_token, mode="reduce-overhead", fullgraph=True)
        self.cache: Any = None
        self.cache_len = 0

    def start(self, ids: list[int], steps: int) -> Any:
        # Sized for the request, as generate() sizes it: attention reads the whole static
        # cache, so one sized for the longest position would slow every shorter one.
        if self.cache_len != len(ids) + steps:
            self.cache_len = len(ids) + steps
            self.cache = self.transformers.StaticCache(config=self.model.config,
                                                       max_cache_len=self.cache_len)
        self.cache.reset()
        token, _ = self._prefill(ids, self.cache)
        self.position = self.torch.tensor([[len(ids)]], device=self.model.device)
        return token

    def step(self, token: Any) -> Any:
        # The clone keeps the CUDA graph's output buffer from being fed back in as its input.
        token = self.decode(self.model, token.clone(), self.position, self.cache)
        self.position += 1
        return token


def _decode_one_token(model: Any, token: Any, position: Any, cache: Any) -> Any:
    logits = model(input_ids=token, position_ids=position, past_key_values=cache,
                   use_cache=True).logits
    return logits[:, -1].argmax(-1, keepdim=True)


def _hf_rate(runner: _HfRunner, ids: list[int], steps: int, repeats: int,
             timed_steps: int) -> float:
    """Median tokens per second of `timed_steps` decode steps after a fresh prefill of `ids`
    into a cache with room for `steps`."""
    rates = []
    for _ in range(repeats):
        token = runner.start(ids, steps)
        runner.sync()
        start = time.perf_counter()
        for _ in range(timed_steps):
            token = runner.step(token)
        runner.sync()
        rates.append(timed_steps / (time.perf_counter() - start))
    return statistics.median(rates)


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else 'no message'}"


SMALL_SIZE = 128  # positions and prompts the CPU reference engine gets through in seconds


def cpu_warning(settings: BenchSettings) -> str:
    """What the bench says before timing the CPU reference engine: it is slow at real model
    sizes, and (only for the sizes the user left large) the small ones to try."""
    warning = ("the CPU reference engine takes minutes per prefill and seconds per token at "
               "real model sizes")
    advice = [f"{flag} {small}" for flag, sizes, small in (
        ("--positions", settings.positions, f"1,{SMALL_SIZE}"),
        ("--prompts", settings.prompts, str(SMALL_SIZE))) if max(sizes) > SMALL_SIZE]
    return f"{warning}; try small sizes, e.g. {' '.join(advice)}" if advice else warning


@dataclass
class BenchOptions(EngineFlags):
    config: str | None = None  # a preset name or a config.json path: random weights
    model: str | None = None  # a model directory or hub id: its real weights
    settings: BenchSettings = field(default_factory=BenchSettings)
    as_json: bool = False
    compare_hf: bool = False


def run_bench(options: BenchOptions, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """The whole command: a progress bar on `err`, then a table or one JSON object on `out`."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    if options.config is not None and options.model is not None:
        raise UsageError("give --config (random weights) or --model (a checkpoint), not both")
    options.check_engine_flags()
    settings = options.settings
    console = Console(file=err)

    def say(message: str) -> None:
        console.print(f"qwenchat: {message}", markup=False, highlight=False, soft_wrap=True)

    columns = (TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
    # Only a terminal gets the bar: in a pipe or a log it would be noise.
    with Progress(*columns, console=console, transient=True,
                  disable=not console.is_terminal) as bar:
        task = bar.add_task("loading", total=1 + settings.planned_items(options.compare_hf))
        started = 0

        def tick(label: str) -> None:
            nonlocal started
            bar.update(task, description=label, completed=started)
            started += 1

        tick("building the engine")
        name, config, weights, label = _open_weights(options)
        config = options.roped(config)
        try:
            ctx = settings.default_ctx(config) if options.ctx is None else options.ctx
            engine = create_engine(options.backend, config, weights, ctx, notice=say,
                                   **options.engine_options())
            draft = None
            try:
                if isinstance(engine, ReferenceEngine):
                    say(cpu_warning(settings))
                if settings.speculation and engine.can_speculate:
                    draft_config = draft_shape(config)
                    draft = create_engine(options.backend, draft_config,
                                          RandomWeights(draft_config, seed=1), ctx,
                                          device=options.device, notice=say,
                                          decode=options.decode)
                result = measure_engine(engine, settings, name, label, tick, draft)
            finally:
                if draft is not None:
                    draft.close()
                engine.close()  # frees the device for transformers
            if options.compare_hf:
                result.transformers = measure_transformers(config, weights, settings,
                                                           result.ctx, options.device, tick)
        finally:
            weights.close()
    if options.as_json:
        out.write(result.to_json() + "\n")
    else:
        render(result, out)
    out.flush()
    return 0


def _open_weights(options: BenchOptions) -> tuple[str, Qwen3Config, Checkpoint | RandomWeights,
                                                   str]:
    """(what is benched, its config, its weights, how the weights were made)."""
    if options.model is not None:
        model = open_model(options.model)
        return model.spec, model.config, model.checkpoint, "checkpoint"
    name = options.config or DEFAULT_CONFIG
    config = named_config(name)
    if options.quantize in ("fp8", "int4"):  # drawn narrow directly: seconds on 32B
        label = {"fp8": "FP8", "int4": "int4"}[options.quantize]
        return (name, config, RandomWeights(config, weight_format=options.quantize),
                f"random {label} (seed 0)")
    return name, config, RandomWeights(config), "random (seed 0)"


def render(result: BenchResult, out: TextIO) -> None:
    """The results as text: what was run, a prefill table, a decode table per system."""
    from rich.console import Console
    from rich.table import Table

    console = Console(file=out, highlight=False)
    if not console.is_terminal:  # a pipe or a log: room for every column, nothing cut short
        console.width = 140
    console.print(
        f"{result.model} · {result.weights} weights · "
        f"{parameters_text(result.parameters)} parameters\n"
        f"engine {result.engine} · device {result.device or '–'} · ctx {result.ctx} · "
        f"{result.steps} decode steps, {result.sampler}, median of {result.repeats} runs\n"
        f"a decode step reads {_bytes(result.weight_bytes_per_step)} of "
        f"{result.weight_format} weights{_bf16_beside(result)} + "
        f"{_bytes(result.kv_bytes_per_position)} of {result.kv_format} KV cache per cached "
        "position\n"
        f"copy bandwidth {_bandwidth(result.copy_bandwidth_bytes_s)} · peak GPU memory "
        f"{_bytes(result.peak_memory_bytes)}", markup=False, soft_wrap=True)

    notes = []
    prefill = Table(title="prefill", title_justify="left")
    hf_prefill = {p.tokens: p for t in result.transformers for p in t.prefill if p.tok_s}
    columns = ["system", "tokens", "tok/s", "time", "TTFT"]
    attention = any(p.attention_s is not None for p in result.prefill)
    if attention:  # the attention's time (prefill with it less prefill without) and rate
        columns += ["attention", "attn TFLOP/s"]
    if hf_prefill:
        columns.append("× hf")  # our rate over transformers' at the same prompt size
    for column in columns:
        prefill.add_column(column, justify="left" if column == "system" else "right")
    for p in result.prefill:
        if p.skipped:
            notes.append(f"prefill of {p.tokens} tokens skipped: {p.skipped}")
        tokens = f"{p.tokens} after {p.after:,}" if p.after else str(p.tokens)
        cells = ["qwenchat", tokens, _num(p.tok_s, ",.0f", "skipped"), _ms(p.seconds),
                 _ms(p.ttft_s)]
        if attention:
            cells += [_ms(p.attention_s), _num(p.attention_tflop_s, ",.0f")]
        if hf_prefill:
            theirs = hf_prefill.get(p.tokens)
            ratio = p.tok_s / theirs.tok_s if p.tok_s and theirs else None
            cells.append(_num(ratio, ".2f"))
        prefill.add_row(*cells)
    for t in result.transformers:
        for p in t.prefill:
            if p.skipped:
                notes.append(f"hf {t.variant} prefill of {p.tokens} tokens skipped: {p.skipped}")
            cells = [f"hf {t.variant}", str(p.tokens), _num(p.tok_s, ",.0f", "skipped"),
                     _ms(p.seconds), "–", *(["–", "–"] if attention else [])]
            prefill.add_row(*cells, *(["–"] if hf_prefill else []))
    console.print(prefill)

    decode = Table(title="decode", title_justify="left")
    columns = ["system", "position", "tok/s", "ms/token", "bytes/step", "GB/s", "of copy",
               "floor"]
    quantized = result.weight_format != "bf16"
    if quantized:  # what the same step would reach at best with bf16 weights
        columns.append("bf16 floor")
    for column in columns:
        decode.add_column(column, justify="left" if column == "system" else "right")
    systems = [("qwenchat", result.decode, None)]
    systems += [(f"hf {t.variant}", t.decode, t.unavailable)
                for t in result.transformers]
    for system, rows, unavailable in systems:
        if unavailable:
            notes.append(f"{system} unavailable: {unavailable}")
            decode.add_row(system, "–", "unavailable", *["–"] * (len(columns) - 3))
        for d in rows:
            if d.skipped:
                notes.append(f"{system} at position {d.position} skipped: {d.skipped}")
            cells = [system, str(d.position), _num(d.tok_s, ",.1f", "skipped"),
                     _ms(1 / d.tok_s if d.tok_s else None), _bytes(d.bytes_per_step),
                     _num(d.gb_s, ",.1f"), _num(d.copy_fraction, ".0%"),
                     _num(d.floor_tok_s, ",.0f")]
            if quantized:
                cells.append(_num(d.bf16_floor_tok_s, ",.0f"))
            decode.add_row(*cells)
    console.print(decode)
    if result.speculation:
        _render_speculation(result, console)
    for t in result.transformers:
        if t.unavailable is None:
            notes.append(f"hf {t.variant}: {t.device}, {t.dtype}, copy bandwidth "
                         f"{_bandwidth(t.copy_bandwidth_bytes_s)}, peak GPU memory "
                         f"{_bytes(t.peak_memory_bytes)}")
    for note in notes:
        console.print(note, markup=False, soft_wrap=True)


def _proposer_name(r: SpeculationResult) -> str:
    return f"oracle, {r.corrupt:.0%} made wrong" if r.corrupt is not None else "random draft"


def _render_speculation(result: BenchResult, console: Any) -> None:
    from rich.table import Table

    first = result.speculation[0]
    table = Table(title=f"speculative decoding, greedy, at position {first.position} (plain: "
                        f"{first.plain_tok_s:,.1f} tok/s)", title_justify="left")
    for column in ("proposer", "kept / proposed", "tokens a pass", "tok/s", "× plain",
                   "pass / plain step"):
        table.add_column(column, justify="left" if column == "proposer" else "right")
    for r in result.speculation:
        name = _proposer_name(r)
        per_pass = (r.accepted + r.passes) / r.passes if r.passes else None
        table.add_row(name, f"{r.accepted:,} / {r.proposed:,} ({_num(r.acceptance, '.0%')})",
                      _num(per_pass, ".2f"), f"{r.tok_s:,.1f}", f"{r.speedup:.2f}",
                      _num(r.pass_cost, ".2f"))
    console.print(table)
    if first.experts_a_layer is not None:  # (a mixture of experts: its passes' bytes)
        config, step = result.config, result.weight_bytes_per_step
        read = pass_weight_bytes(config, result.weight_format, first.experts_a_layer)
        console.print(f"a pass ({_proposer_name(first)}) read {first.experts_a_layer:.1f} "
                      f"experts a layer, {config.num_experts_per_tok} a plain step: "
                      f"{_bytes(read)} of weights against a plain step's {_bytes(step)}, "
                      f"{read / step:.2f}x its bytes", markup=False, soft_wrap=True)
    console.print("(the oracle proposes the model's own greedy continuation from a plain run: "
                  "random weights give a real draft nothing to agree with, so the oracle "
                  "measures what a pass costs and what a given acceptance gives)",
                  markup=False, soft_wrap=True)


def _bf16_beside(result: BenchResult) -> str:
    if result.weight_format == "bf16":
        return ""
    return f" (bf16: {_bytes(weight_bytes_per_step(result.config))})"


def _num(value: float | None, spec: str, missing: str = "–") -> str:
    return missing if value is None else format(value, spec)


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1000:,.2f} ms"


def _bytes(n: int | None) -> str:
    if n is None:
        return "–"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _bandwidth(bytes_s: float | None) -> str:
    return "–" if bytes_s is None else f"{bytes_s / 1e9:,.0f} GB/s (measured)"
