"""The `qwenchat` command line (Typer). Heavy modules load inside the commands that need them."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from qwenchat import __version__
from qwenchat.errors import QwenchatError, UsageError


class _ChatByDefault(TyperGroup):
    """`qwenchat` alone, or followed only by options, opens the chat: `qwenchat -m DIR`."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if not args or (args[0].startswith("-") and args[0] not in _ROOT_OPTIONS):
            args = ["chat", *args]
        return super().parse_args(ctx, args)


_ROOT_OPTIONS = ("-h", "--help", "--version")

app = typer.Typer(
    cls=_ChatByDefault,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Plain help: Rich's tables leave the descriptions 20 columns of an 80-column terminal and
    # show a <bool> type beside flags that take no value.
    rich_markup_mode=None,
    help="Chat with Qwen3 models in the terminal, on your own NVIDIA GPU or on the CPU. "
    "With no command, opens the chat.",
    context_settings={"help_option_names": ["-h", "--help"]},
)

ModelOpt = Annotated[str, typer.Option("--model", "-m", help="Model directory or Hugging Face "
                                       "hub id.", envvar="QWENCHAT_MODEL", metavar="MODEL")]
BackendOpt = Annotated[str, typer.Option("--backend", "-b", metavar="auto|cuda|cpu",
                                         help="auto (GPU if usable, else CPU), cuda or cpu.")]
ClientBackendOpt = Annotated[str, typer.Option(
    "--backend", "-b", metavar="auto|cuda|cpu|openai",
    help="auto (GPU if usable, else CPU), cuda, cpu, or openai: the model -m names on the "
    "OpenAI-compatible server at --url.")]
UrlOpt = Annotated[str | None, typer.Option(
    "--url", metavar="URL", help="With --backend openai: the server's address, e.g. "
    "http://127.0.0.1:8000 (qwenchat serve, vLLM, llama-server...).")]
ApiKeyEnvOpt = Annotated[str | None, typer.Option(
    "--api-key-env", metavar="VAR", help="With --url: the environment variable that holds "
    "the server's API key.")]
# Defaults that are not values go through show_default, which help shows in parentheses.
CtxOpt = Annotated[int | None, typer.Option("--ctx", metavar="TOKENS",
                                            help="KV-cache size in tokens.",
                                            show_default="the model's maximum")]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")]
DeviceOpt = Annotated[int, typer.Option("--device", metavar="N",
                                        help="GPU index (see qwenchat info).")]
DecodeOpt = Annotated[str, typer.Option(
    "--decode", metavar="auto|megakernel|layered",
    help="CUDA decode path: auto (the megakernel where the GPU and model allow "
    "it, else layered), megakernel (many whole steps per cooperative launch) or layered "
    "(a CUDA graph of per-op kernels).")]
QuantizeOpt = Annotated[str, typer.Option(
    "--quantize", metavar="none|fp8|int4",
    help="none, fp8 or int4: quantize the linear layers at load time, to FP8 "
    "(Qwen's 128 x 128-block recipe), halving the bytes a decode step reads, or to 4 bits "
    "(round to nearest, groups of 128, zero points: about a third of bf16's bytes). FP8 "
    "and AWQ checkpoints always run in their own format.")]
KvCacheOpt = Annotated[str, typer.Option(
    "--kv-cache", metavar="bf16|int8",
    help="bf16 or int8: how keys and values are cached; int8 keeps 8-bit codes "
    "and a scale a head and token: about half the bytes, so nearly twice the context in the "
    "same memory and faster decode deep into a long conversation.")]
RopeScalingOpt = Annotated[str | None, typer.Option(
    "--rope-scaling", metavar="yarn[:F[:ORIG]]|none",
    help="yarn, yarn:FACTOR or yarn:FACTOR:ORIGINAL: YaRN, Qwen's recipe for "
    "contexts past the 32,768 positions the models were trained on (factor 4 reaches 131,072; "
    "the default --ctx rises to factor x original); none turns a config.json's scaling off.",
    show_default="as config.json says")]
SpeculateOpt = Annotated[str | None, typer.Option(
    "--speculate", metavar="off|ngram",
    help="off, or ngram: propose the tokens that followed the context's tail "
    "where it occurred before (prompt lookup) and verify several a step; the reply is the "
    "same, faster where it repeats its context at length (see the README for when it pays).",
    show_default="off")]
DraftOpt = Annotated[str | None, typer.Option(
    "--draft", metavar="MODEL",
    help="A smaller model of the same family (directory or hub id, e.g. "
    "Qwen/Qwen3-0.6B) that proposes tokens for the model to verify several a step "
    "(speculative decoding); not with --speculate.")]
SystemOpt = Annotated[str | None, typer.Option("--system", "-s", metavar="TEXT",
                                               help="System prompt.")]
ThinkOpt = Annotated[bool, typer.Option("--think/--no-think", help="Let the model think first.")]

# Sampling flags, shared by `ask` and `chat`; None means "the mode's recommended value".
TemperatureOpt = Annotated[float | None, typer.Option(help="0 to 2; 0 = greedy.")]
TopPOpt = Annotated[float | None, typer.Option(help="Nucleus mass, (0, 1].")]
TopKOpt = Annotated[int | None, typer.Option(help="Keep the k most likely; 0 = off.")]
MinPOpt = Annotated[float | None, typer.Option(help="Drop below min-p × the top probability; "
                                               "0 = off.")]
RepetitionOpt = Annotated[float | None, typer.Option(help="(0, 2]; 1 = off.")]
PresenceOpt = Annotated[float | None, typer.Option(help="-2 to 2; 0 = off.")]
FrequencyOpt = Annotated[float | None, typer.Option(help="-2 to 2; 0 = off.")]
SeedOpt = Annotated[int | None, typer.Option(help="Seed for reproducible sampling.")]
MaxTokensOpt = Annotated[int | None, typer.Option(help="Most tokens in the reply.")]


def engine_flags(backend: str, ctx: int | None, device: int, decode: str, quantize: str,
                 kv_cache: str, rope_scaling: str | None) -> dict[str, Any]:
    """The engine's flags as the keyword arguments of a command's options (EngineFlags)."""
    from qwenchat.engine import EngineFlags  # (imported as a command runs: --help stays quick)

    return vars(EngineFlags(backend=backend, ctx=ctx, device=device, decode=decode,
                            quantize=quantize, kv_cache=kv_cache, rope_scaling=rope_scaling))


def sampling_overrides(**flags: Any) -> dict[str, Any]:
    """The sampling flags the user gave, by parameter name."""
    return {name: value for name, value in flags.items() if value is not None}


def fail(message: str, code: int) -> None:
    sys.stderr.write(f"qwenchat: error: {message}\n")
    sys.stderr.flush()
    raise typer.Exit(code)


def run_guarded(action: Callable[[], int | None], debug: bool) -> None:
    """Run a command body: user errors become one line and an exit code, never a traceback."""
    try:
        code = action() or 0
    except QwenchatError as exc:
        if debug:
            raise
        fail(str(exc), exc.exit_code)
    except KeyboardInterrupt:
        sys.stdout.flush()
        sys.stderr.write("\nqwenchat: interrupted\n")
        raise typer.Exit(130) from None
    except BrokenPipeError:
        _silence_stdout()
        raise typer.Exit(141) from None
    except Exception as exc:
        if debug:
            raise
        fail(f"{type(exc).__name__}: {exc} (rerun with --debug for the traceback)", 1)
    raise typer.Exit(code)


def _silence_stdout() -> None:
    """After the reader of a pipe went away, stop Python's final flush from failing again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"qwenchat {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[bool, typer.Option("--version", callback=_version_callback,
                                          is_eager=True, help="Print the version.")] = False,
) -> None:
    """Options before the command apply to qwenchat itself."""


@app.command()
def chat(
    model: ModelOpt = "Qwen/Qwen3-0.6B",
    backend: ClientBackendOpt = "auto",
    url: UrlOpt = None,
    api_key_env: ApiKeyEnvOpt = None,
    system: SystemOpt = None,
    temperature: TemperatureOpt = None,
    top_p: TopPOpt = None,
    top_k: TopKOpt = None,
    min_p: MinPOpt = None,
    repetition_penalty: RepetitionOpt = None,
    presence_penalty: PresenceOpt = None,
    frequency_penalty: FrequencyOpt = None,
    seed: SeedOpt = None,
    max_tokens: MaxTokensOpt = None,
    think: ThinkOpt = False,
    ctx: CtxOpt = None,
    device: DeviceOpt = 0,
    decode: DecodeOpt = "auto",
    quantize: QuantizeOpt = "none",
    kv_cache: KvCacheOpt = "bf16",
    rope_scaling: RopeScalingOpt = None,
    speculate: SpeculateOpt = None,
    draft: DraftOpt = None,
    no_history: Annotated[bool, typer.Option("--no-history", help="Keep nothing: the chat "
                                             "lives in memory only.")] = False,
    debug: DebugOpt = False,
) -> None:
    """Chat in the terminal (the default command). Replies stream in; the sampler can be
    changed while they do; chats are kept."""
    overrides = sampling_overrides(
        temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
        repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty, seed=seed, max_tokens=max_tokens)

    def action() -> int:
        from qwenchat.engine.speculate import speculate_flag
        from qwenchat.tui.options import ChatOptions, check_chat_options, require_terminal

        mode = speculate_flag(speculate, draft)
        engine = engine_flags(backend, ctx, device, decode, quantize, kv_cache, rope_scaling)
        options = ChatOptions(model, system, think, overrides, mode, draft,
                              history=not no_history, debug=debug, url=url,
                              api_key_env=api_key_env, **engine)
        check_chat_options(options)
        require_terminal()
        from qwenchat.tui.app import run_chat  # Textual loads only once the flags are good

        return run_chat(options)

    run_guarded(action, debug)


@app.command()
def ask(
    prompt: Annotated[str | None, typer.Argument(metavar="[PROMPT]",
                                                 help="The question. Read from stdin too "
                                                      "(stdin first, then this).")] = None,
    model: ModelOpt = "Qwen/Qwen3-0.6B",
    backend: ClientBackendOpt = "auto",
    url: UrlOpt = None,
    api_key_env: ApiKeyEnvOpt = None,
    system: SystemOpt = None,
    temperature: TemperatureOpt = None,
    top_p: TopPOpt = None,
    top_k: TopKOpt = None,
    min_p: MinPOpt = None,
    repetition_penalty: RepetitionOpt = None,
    presence_penalty: PresenceOpt = None,
    frequency_penalty: FrequencyOpt = None,
    seed: SeedOpt = None,
    max_tokens: MaxTokensOpt = None,
    think: ThinkOpt = False,
    show_thinking: Annotated[bool, typer.Option(help="Print the thinking, in <think> tags, "
                                                     "before the answer.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object with text, "
                                          "thinking, token counts and timings.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Stats on stderr.")] = False,
    ctx: CtxOpt = None,
    device: DeviceOpt = 0,
    decode: DecodeOpt = "auto",
    quantize: QuantizeOpt = "none",
    kv_cache: KvCacheOpt = "bf16",
    rope_scaling: RopeScalingOpt = None,
    speculate: SpeculateOpt = None,
    draft: DraftOpt = None,
    debug: DebugOpt = False,
) -> None:
    """Answer one prompt on stdout, streaming; pipe-friendly."""
    overrides = sampling_overrides(
        temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
        repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty, seed=seed, max_tokens=max_tokens)

    def action() -> int:
        from qwenchat.ask import AskOptions, check_overrides, combine_prompt, run_ask
        from qwenchat.engine.speculate import speculate_flag

        check_overrides(overrides)
        mode = speculate_flag(speculate, draft)
        text = combine_prompt(prompt, _read_stdin())
        engine = engine_flags(backend, ctx, device, decode, quantize, kv_cache, rope_scaling)
        options = AskOptions(text, model, system, think, show_thinking, as_json, verbose,
                             overrides, mode, draft, url=url, api_key_env=api_key_env,
                             **engine)
        return run_ask(options)

    run_guarded(action, debug)


@app.command()
def serve(
    model: ModelOpt = "Qwen/Qwen3-0.6B",
    backend: BackendOpt = "auto",
    ctx: CtxOpt = None,
    device: DeviceOpt = 0,
    decode: DecodeOpt = "auto",
    quantize: QuantizeOpt = "none",
    kv_cache: KvCacheOpt = "bf16",
    rope_scaling: RopeScalingOpt = None,
    host: Annotated[str, typer.Option("--host", metavar="ADDRESS",
                                      help="Address to listen on (0.0.0.0: every "
                                      "interface).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", "-p", metavar="PORT",
                                      help="TCP port to listen on.")] = 8000,
    api_key: Annotated[str | None, typer.Option(
        "--api-key", metavar="KEY", envvar="QWENCHAT_API_KEY",
        help="Require 'Authorization: Bearer KEY' on every request but /health.",
        show_default="none: no key needed")] = None,
    speculate: SpeculateOpt = None,
    draft: DraftOpt = None,
    debug: DebugOpt = False,
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API. Chat and plain completions,
    streamed or not, one reply at a time: other requests queue."""

    def action() -> int:
        from qwenchat.engine.speculate import speculate_flag
        from qwenchat.serve import ServeOptions, run_serve

        mode = speculate_flag(speculate, draft)
        engine = engine_flags(backend, ctx, device, decode, quantize, kv_cache, rope_scaling)
        return run_serve(ServeOptions(model, host, port, api_key or None, mode, draft,
                                      **engine))

    run_guarded(action, debug)


@app.command()
def info(
    compile_: Annotated[bool, typer.Option(
        "--compile", help="Compile the GPU kernels of a model (--model, or --config) into the "
        "cache now, so its first run starts without compiling.")] = False,
    model: Annotated[str | None, typer.Option(
        "--model", "-m", metavar="MODEL", help="With --compile: model directory or hub id.",
        show_default="$QWENCHAT_MODEL, else Qwen/Qwen3-0.6B")] = None,
    config: Annotated[str | None, typer.Option(
        "--config", metavar="SIZE|FILE",
        help="With --compile: a known size (qwen3-0.6b ... qwen3-32b) or a "
        "config.json file, instead of a model.")] = None,
    quantize: QuantizeOpt = "none",
    device: DeviceOpt = 0,
    decode: DecodeOpt = "auto",
    url: Annotated[str | None, typer.Option(
        "--url", metavar="URL", help="List the models the OpenAI-compatible server at URL "
        "serves instead.")] = None,
    api_key_env: ApiKeyEnvOpt = None,
    debug: DebugOpt = False,
) -> None:
    """Show versions, the GPU, driver and NVRTC, and where files live. With --compile, fill
    the kernel cache for a model instead; with --url, list a server's models."""

    def action() -> int:
        if url is not None or api_key_env is not None:
            if compile_:
                raise UsageError("--url lists a server's models; --compile fills the local "
                                 "kernel cache: use one of them")
            return _served_models(url, api_key_env)
        if compile_:
            return _precompile(model, config, quantize, device, decode)
        if model is not None or config is not None:
            raise UsageError("--model and --config choose what --compile compiles for: add "
                             "--compile")
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text

        from qwenchat.info import gather

        console = Console()
        for title, rows in gather():
            table = Table(title=title, title_justify="left", show_header=False, box=None)
            table.add_column(style="bold")
            table.add_column(overflow="fold")
            for key, value in rows:  # as Text: Rich would take "[cu13]" for markup and drop it
                table.add_row(Text(key), Text(value))
            console.print(table)
            console.print()
        return 0

    run_guarded(action, debug)


def _served_models(url: str | None, api_key_env: str | None) -> int:
    from qwenchat.remote import BACKEND, RemoteServer, check_remote_flags

    check_remote_flags(BACKEND, url, api_key_env)
    server = RemoteServer(url or "", api_key_env)
    try:
        models = server.models()
    finally:
        server.close()
    for name in models:  # verbatim: plain lines, no markup
        sys.stdout.write(f"{name}\n")
    return 0


def _precompile(model: str | None, config: str | None, quantize: str, device: int,
                decode: str) -> int:
    from qwenchat.info import CompileOptions, precompile

    def say(message: str) -> None:
        sys.stderr.write(f"qwenchat: {message}\n")
        sys.stderr.flush()

    if model is None and config is None:
        model = os.environ.get("QWENCHAT_MODEL") or None
    summary = precompile(CompileOptions(model, config, quantize, device, decode), say)
    typer.echo(summary)
    return 0


@app.command(name="eval")
def eval_(
    file: Annotated[Path, typer.Argument(
        metavar="FILE", help="A text file, or a .jsonl of chats ({\"messages\": [...]} a line).")],
    model: ModelOpt = "Qwen/Qwen3-0.6B",
    backend: BackendOpt = "auto",
    device: DeviceOpt = 0,
    decode: DecodeOpt = "auto",
    quantize: QuantizeOpt = "none",
    kv_cache: KvCacheOpt = "bf16",
    rope_scaling: RopeScalingOpt = None,
    fp8_activations: Annotated[str, typer.Option(
        "--fp8-activations", metavar="auto|e4m3|bf16",
        help="FP8 weights' prefill on e4m3 activations (auto: where the GPU has FP8 tensor "
        "cores; e4m3 also has the CPU engine round them so) or on bf16 ones.")] = "auto",
    window: Annotated[int, typer.Option(
        "--window", metavar="TOKENS", help="Tokens a window holds.")] = 512,
    stride: Annotated[int | None, typer.Option(
        "--stride", metavar="TOKENS", help="Tokens between windows' starts; each token is "
        "scored once.", show_default="half the window")] = None,
    ctx: Annotated[int | None, typer.Option(
        "--ctx", metavar="TOKENS", help="KV-cache size in tokens.",
        show_default="the window")] = None,
    path: Annotated[str, typer.Option(
        "--path", metavar="prefill|decode", help="Score each window in one prefill, or token "
        "by token through the decode step (reference engine).")] = "prefill",
    base: Annotated[str | None, typer.Option(
        "--base", metavar="bf16|cpu|FILE", help="Compare with the same model unquantized "
        "(bf16), the CPU reference engine (cpu) or logits saved by --save-logits: KL "
        "divergence, top-1 agreement, change in perplexity.")] = None,
    save_logits: Annotated[Path | None, typer.Option(
        "--save-logits", metavar="FILE", help="Save this run's top-k log probabilities (an "
        ".npz), to be a later run's --base.")] = None,
    top_k: Annotated[int, typer.Option(
        "--top-k", metavar="K", help="Ids a saved position keeps.")] = 32,
    limit: Annotated[int | None, typer.Option(
        "--limit", metavar="TOKENS", help="Score at most this many tokens.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    debug: DebugOpt = False,
) -> None:
    """Score a text: perplexity, and KL divergence against a base."""

    def action() -> int:
        from qwenchat.eval import EvalOptions, run_eval

        engine = engine_flags(backend, ctx, device, decode, quantize, kv_cache, rope_scaling)
        return run_eval(EvalOptions(file, model, fp8_activations, window, stride, path, base,
                                    save_logits, top_k, limit, as_json, **engine))

    run_guarded(action, debug)


@app.command()
def quantize(
    model: Annotated[str, typer.Argument(
        metavar="MODEL", help="Model directory or Hugging Face hub id (bf16, f16 or f32).")],
    out: Annotated[Path, typer.Argument(
        metavar="OUT", help="A new directory for the quantized checkpoint.")],
    to: Annotated[str, typer.Option(
        "--to", metavar="int4|fp8", help="int4: 4-bit groups of 128 in AutoAWQ's layout (as "
        "--quantize int4 makes them); fp8: Qwen's FP8 blocks (as --quantize fp8).")] = "int4",
    calibrate: Annotated[Path | None, typer.Option(
        "--calibrate", metavar="FILE", help="With --to int4: choose activation-aware scales "
        "(AWQ's recipe) from this text (or .jsonl of chats), run through the model on the "
        "CPU.")] = None,
    calibrate_tokens: Annotated[int, typer.Option(
        "--calibrate-tokens", metavar="N", help="Tokens of the calibration text used.")] = 512,
    debug: DebugOpt = False,
) -> None:
    """Write a checkpoint's linear layers in 4 bits or FP8, once."""

    def action() -> int:
        from qwenchat.quantize import run_quantize

        return run_quantize(model, out, to, calibrate_file=calibrate,
                            calibrate_tokens=calibrate_tokens)

    run_guarded(action, debug)


@app.command()
def bench(
    config: Annotated[str | None, typer.Option(
        "--config", metavar="SIZE|FILE",
        help="Random weights of a known size (qwen3-0.6b, qwen3-1.7b, qwen3-4b, "
        "qwen3-8b, qwen3-14b, qwen3-32b) or of a config.json file.",
        show_default="qwen3-0.6b")] = None,
    model: Annotated[str | None, typer.Option(
        "--model", "-m", metavar="MODEL",
        help="Bench a real checkpoint: model directory or hub id.")] = None,
    backend: BackendOpt = "auto",
    device: DeviceOpt = 0,
    decode: DecodeOpt = "auto",
    quantize: QuantizeOpt = "none",
    kv_cache: KvCacheOpt = "bf16",
    rope_scaling: RopeScalingOpt = None,
    ctx: Annotated[int | None, typer.Option(
        "--ctx", metavar="TOKENS", help="KV-cache size in tokens.",
        show_default="room for the largest position and prompt, within the model's maximum")
    ] = None,
    positions: Annotated[str, typer.Option(
        metavar="N,N,...",
        help="Decode at these cache positions (comma-separated).")] = "1,1024,4096,16384,32768",
    prompts: Annotated[str, typer.Option(
        metavar="N,N,...",
        help="Prefill prompts of these lengths (comma-separated).")] = "512,4096",
    after: Annotated[int, typer.Option(
        "--after", help="Prefill each prompt after this many cached tokens, as a chat's later "
        "turn does (ours only: transformers' prefill starts from an empty cache).")] = 0,
    steps: Annotated[int, typer.Option(help="Decode steps timed per position.")] = 64,
    repeats: Annotated[int, typer.Option(help="Runs per measurement; the median counts.")] = 3,
    sampled: Annotated[bool, typer.Option(
        "--sampled", help="Decode with Qwen3's non-thinking sampler (temperature 0.7, top-p "
        "0.8, top-k 20), as a chat does, instead of greedy.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of "
                                          "tables.")] = False,
    compare_hf: Annotated[bool, typer.Option(
        "--compare-hf", help="Also time transformers (eager, and StaticCache + torch.compile) "
        "on the same weights.")] = False,
    speculation: Annotated[bool, typer.Option(
        "--speculation", help="Also time speculative decoding at the first position: an "
        "oracle proposer with a chosen share of wrong proposals, and a random Qwen3-0.6B "
        "draft.")] = False,
    debug: DebugOpt = False,
) -> None:
    """Measure prefill, time to first token and decode speed. Each decode rate is set beside
    the memory-bandwidth ceiling."""

    def action() -> int:
        from qwenchat.bench import BenchOptions, BenchSettings, parse_sizes, run_bench

        settings = BenchSettings(parse_sizes(prompts, "--prompts"),
                                 parse_sizes(positions, "--positions"), steps, repeats,
                                 sampled=sampled, speculation=speculation, after=after)
        engine = engine_flags(backend, ctx, device, decode, quantize, kv_cache, rope_scaling)
        return run_bench(BenchOptions(config, model, settings, as_json, compare_hf,
                                      **engine))

    run_guarded(action, debug)


def _read_stdin() -> str | None:
    """Standard input's text when it is a pipe or file (never waits on a terminal)."""
    stream = sys.stdin
    if stream is None or stream.closed:
        return None
    try:
        if stream.isatty():
            return None
        data = stream.buffer.read() if hasattr(stream, "buffer") else stream.read()
    except (OSError, ValueError):
        return None
    from qwenchat.ask import decode_stdin

    return decode_stdin(data) if isinstance(data, bytes) else data


def main() -> None:
    try:
        code = app(standalone_mode=False)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as exc:
        # Typer raises click's exception types, or those of its own vendored copy of click.
        if type(exc).__name__ == "Abort":
            sys.stderr.write("qwenchat: interrupted\n")
            sys.exit(130)
        if not hasattr(exc, "format_message"):
            raise
        context = getattr(exc, "ctx", None)
        hint = f" (see {context.command_path} --help)" if context is not None else ""
        sys.stderr.write(f"qwenchat: error: {exc.format_message()}{hint}\n")
        sys.exit(getattr(exc, "exit_code", 2))
    sys.exit(code if isinstance(code, int) else 0)
