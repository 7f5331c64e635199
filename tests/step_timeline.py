"""A megakernel decode step as a picture: when each block's phases had their input vector,
their first weights in shared memory, and were done (a benchmark aid run by hand on a GPU, not
by pytest).

The megakernel is built with QW_MK_TIMELINE (cuda_src/mk_timeline.cuh), which stamps every
phase of every block with globaltimer; one launch decodes `--steps` greedy steps after a
prompt of `--position` tokens, and the last whole step is drawn: a row per block, a bar per
phase (pale from its start until its input had arrived, then solid until it was done), a tick
where its first stage of weights (or keys) was ready, and the critical path in red (each
phase's last block to finish, which the next phase's input waits for). An SVG is always
written; a PNG as well where matplotlib is installed. A table of where the step's time goes,
per kind of phase, is printed, and one of the stage pipeline: per kind, the stages a block's
producer warp issued, the SM cycles each took it to issue, and the shares of the phases' time
that the producer spent issuing and waiting for free stages and that warp 0 spent waiting for
full ones (cycles at `--clock-ghz`, the SM clock under load).

    python tests/step_timeline.py --config qwen3-0.6b --position 1 --zoom 10 --out tl-0.6b

`--define QW_MK_TL_AT=K` moves the attention phase's "weights" mark to its probe point K
(cuda_src/mk_attention.cuh numbers them: the keys done, the fence, the merge, the outputs
written), so that the table's weights-input column times the attention's own chain piece by
piece; `--probes 0,2,3,4,5,6` records one step for each probe point in one process and prints
the attention's row of each, drawing nothing (a 30B-A3B timeline and its picture take about two
minutes a run); `--define` takes any megakernel define (QW_MK_...) for an experiment, and
`--no-draw` skips the SVG and PNG. `--mv-probes 0,1,2,3,5,6,7` does the same for the matrix
phases' probe points (cuda_src/mk_matvec.cuh: the input's barriers, warp 0's share of the input,
the first stage's rows, warp 0's end, the producer's last refill) and prints, per kind, when the
median block reached each point from its own start of the phase; with `--define QW_MK_SKIP=5`
(no waits, no weights) that is a block's own path through a phase.
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
from consumer_compare import parse_defines, parse_ring

from qwenchat.engine.base import GenerateRequest
from qwenchat.engine.cuda.engine import CudaEngine
from qwenchat.engine.cuda.megakernel import EXPERIMENT_DEFINES, TIMELINE_KINDS
from qwenchat.model.kv_cache import KV_CACHE_CHOICES
from qwenchat.model.presets import PRESETS
from qwenchat.model.random_weights import RandomWeights
from qwenchat.sampling.params import LiveParams, SamplingParams

COLOURS = {"qkv": "#4e79a7", "attention": "#f28e2b", "o_proj": "#59a14f", "gate_up": "#b07aa1",
           "down": "#76b7b2", "lm_head": "#edc948", "sample": "#9c755f", "router": "#e15759"}
SAMPLE = TIMELINE_KINDS.index("sample")


def layer_phases(config) -> int:
    """A layer's phases in the timeline: qkv, attention, o_proj, (a mixture of experts: the
    router,) gate_up, down."""
    return 6 if config.is_moe else 5


def record_step(config_name: str, quantize: str, position: int, steps: int,
                rows: str = "auto", stages: int | tuple[int, int] | None = None,
                kv_cache: str = "bf16") -> tuple:
    """(the records of the last whole step [phase][block], the engine's description)."""
    config = PRESETS[config_name]
    weights = RandomWeights(config, weight_format="bf16" if quantize == "none" else quantize)
    per_step = layer_phases(config) * config.num_hidden_layers + 2
    engine = CudaEngine(config, weights, ctx=position + steps + 64, decode="megakernel",
                        megakernel_timeline=per_step * steps + 1, megakernel_rows=rows,
                        megakernel_stages=stages, kv_cache=kv_cache)
    try:
        rng = np.random.default_rng(0)
        engine.prefill([int(i) for i in rng.integers(0, config.vocab_size, max(1, position))])
        engine.steps_per_launch, engine.launches_ahead = steps, 0  # one launch, all steps
        request = GenerateRequest(LiveParams(SamplingParams(temperature=0.0, max_tokens=steps)),
                                  frozenset(), seed=0)
        list(engine.generate(request))
        records = engine.megakernel_timeline()
        layout = engine.mk_layout
        described = (f"{config_name} {engine.weight_format}, position {position}, "
                     f"{engine.mk_blocks} blocks, {layout.stages} x {layout.stage_bytes} B "
                     f"stages{', parts of rows' if layout.split else ''}, {engine.device_name}")
    finally:
        engine.close()
    used = records[(records["start"] > 0).any(axis=1)]
    ends = [i for i, kind in enumerate(used["kind"].max(axis=1)) if kind == SAMPLE]
    whole = [(a + 1, b + 1) for a, b in itertools.pairwise(ends) if b - a == per_step]
    if not whole:
        raise SystemExit(f"no whole step recorded (phases seen: {len(used)}); raise --steps")
    first, last = whole[-1]
    return used[first:last], described


def analyse(step: np.ndarray) -> dict:
    """Per phase: its kind, its straggler block and end, its blocks' median input arrival
    and weights-ready times (ns from the step's first start)."""
    t0 = int(step["start"][step["start"] > 0].min())
    phases = []
    for row in step:
        def rel(name: str, row: np.ndarray = row) -> np.ndarray:
            values = row[name].astype(np.int64)
            return np.where(values > 0, values - t0, -1)

        end, inp, wts = rel("end"), rel("input"), rel("weights")
        phases.append({"kind": TIMELINE_KINDS[int(row["kind"].max())],
                       "straggler": int(np.argmax(end)), "end": int(end.max()),
                       "input": float(np.median(inp[inp >= 0])) if (inp >= 0).any() else None,
                       "weights": float(np.median(wts[wts >= 0])) if (wts >= 0).any() else None})
    return {"t0": t0, "phases": phases, "step_ns": phases[-1]["end"]}


def summary(analysis: dict) -> list[dict]:
    """Where the step's time goes, per kind of phase: its span on the critical path (from the
    previous phase's last end to its own), split into the wait for its input (until the
    median block had it) and the rest; and how long after the input its weights were ready."""
    spans = defaultdict(list)
    previous_end = 0
    for phase in analysis["phases"]:
        span = phase["end"] - previous_end
        to_input = None if phase["input"] is None else max(0.0, phase["input"] - previous_end)
        weights_after = (None if phase["weights"] is None or phase["input"] is None
                         else phase["weights"] - phase["input"])
        spans[phase["kind"]].append((span, to_input, weights_after))
        previous_end = phase["end"]
    rows = []
    for kind in TIMELINE_KINDS:
        if kind not in spans:
            continue
        values = spans[kind]
        total = sum(v[0] for v in values)

        def median(i: int, values: list = values) -> float | None:
            present = [v[i] for v in values if v[i] is not None]
            return float(np.median(present)) / 1000 if present else None

        rows.append({"phase": kind, "count": len(values), "share": total / analysis["step_ns"],
                     "span_us": median(0), "input_wait_us": median(1),
                     "weights_after_input_us": median(2)})
    return rows


def pipeline(step: np.ndarray, clock_ghz: float) -> list[dict]:
    """The stage pipeline per kind of phase, over every block: stages issued a phase (mean),
    producer cycles a stage issued (median over the blocks' phases that issued any), and the
    shares of the phases' time (start to end) spent issuing, waiting for a free stage (the
    producer) and waiting for a full one (warp 0)."""
    rows = []
    kinds = step["kind"].max(axis=1)
    for k, kind in enumerate(TIMELINE_KINDS):
        sel = step[kinds == k]
        if not len(sel):
            continue
        done = (sel["start"] > 0) & (sel["end"] > sel["start"])
        cycles = (sel["end"].astype(np.float64) - sel["start"]) * clock_ghz
        spent = cycles[done].sum()
        issued = sel["stages"][done]
        per = sel["issue"][done][issued > 0] / issued[issued > 0]
        rows.append({"phase": kind, "stages": float(issued.mean()),
                     "issue_cycles_per_stage": float(np.median(per)) if len(per) else None,
                     "issuing": float(sel["issue"][done].sum() / spent) if spent else None,
                     "free_wait": float(sel["free_wait"][done].sum() / spent) if spent else None,
                     "full_wait": float(sel["full_wait"][done].sum() / spent) if spent else None})
    return rows


def write_svg(step: np.ndarray, analysis: dict, title: str, path: Path) -> None:
    blocks, width, row_h, left, top = step.shape[1], 1600.0, 4.0, 60.0, 40.0
    scale = width / analysis["step_ns"]
    t0 = analysis["t0"]
    paths: dict[str, list[str]] = defaultdict(list)
    pale: dict[str, list[str]] = defaultdict(list)
    ticks = []
    for row in step:
        kind = TIMELINE_KINDS[int(row["kind"].max())]
        for b in range(blocks):
            start, inp, wts, end = (int(row[f][b]) for f in ("start", "input", "weights", "end"))
            if not start or not end:
                continue
            y = top + b * row_h
            x0, x1 = left + (start - t0) * scale, left + (end - t0) * scale
            xi = left + (inp - t0) * scale if inp else x0
            if xi > x0:
                pale[kind].append(f"M{x0:.1f} {y:.0f}h{xi - x0:.1f}v{row_h - 1:.0f}"
                                  f"h{x0 - xi:.1f}z")
            paths[kind].append(f"M{xi:.1f} {y:.0f}h{max(x1 - xi, 0.3):.1f}v{row_h - 1:.0f}"
                               f"h{-max(x1 - xi, 0.3):.1f}z")
            if wts:
                ticks.append(f"M{left + (wts - t0) * scale:.1f} {y:.0f}v{row_h - 1:.0f}")
    height = top + blocks * row_h + 40
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 20:.0f}" '
           f'height="{height:.0f}" font-family="sans-serif" font-size="11">',
           '<rect width="100%" height="100%" fill="white"/>',
           f'<text x="{left}" y="16">{title}: one decode step, '
           f'{analysis["step_ns"] / 1000:.1f} µs; a row per block</text>']
    for kind in COLOURS:
        colour = COLOURS[kind]
        if pale[kind]:
            out.append(f'<path fill="{colour}" fill-opacity="0.3" d="{"".join(pale[kind])}"/>')
        if paths[kind]:
            out.append(f'<path fill="{colour}" d="{"".join(paths[kind])}"/>')
    out.append(f'<path stroke="black" stroke-width="0.6" d="{"".join(ticks)}"/>')
    critical = " ".join(f"{left + p['end'] * scale:.1f},{top + p['straggler'] * row_h + 2:.0f}"
                        for p in analysis["phases"])
    out.append(f'<polyline fill="none" stroke="red" stroke-width="1" points="{critical}"/>')
    for us in range(0, int(analysis["step_ns"] / 1000) + 1, 50):
        x = left + us * 1000 * scale
        out.append(f'<text x="{x:.0f}" y="{height - 20:.0f}">{us} µs</text>')
    for i, (kind, colour) in enumerate(COLOURS.items()):
        x = left + 110 * i
        out.append(f'<rect x="{x}" y="{height - 12}" width="10" height="8" fill="{colour}"/>'
                   f'<text x="{x + 14}" y="{height - 4}">{kind}</text>')
    out.append("</svg>")
    path.write_text("\n".join(out))


def write_png(step: np.ndarray, analysis: dict, title: str, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    t0 = analysis["t0"]
    fig, ax = plt.subplots(figsize=(16, 7), dpi=110)
    for row in step:
        kind = TIMELINE_KINDS[int(row["kind"].max())]
        ok = (row["start"] > 0) & (row["end"] > 0)
        b = np.nonzero(ok)[0]
        start = (row["start"][ok].astype(np.int64) - t0) / 1000
        end = (row["end"][ok].astype(np.int64) - t0) / 1000
        inp = np.where(row["input"][ok] > 0, (row["input"][ok].astype(np.int64) - t0) / 1000,
                       start)
        ax.barh(b, inp - start, left=start, height=1.0, color=COLOURS[kind], alpha=0.3,
                linewidth=0)
        ax.barh(b, np.maximum(end - inp, 0.05), left=inp, height=1.0, color=COLOURS[kind],
                linewidth=0)
        w = row["weights"][ok] > 0
        ax.scatter((row["weights"][ok][w].astype(np.int64) - t0) / 1000, b[w], s=0.4,
                   c="black", marker="|", linewidths=0.4)
    ax.plot([p["end"] / 1000 for p in analysis["phases"]],
            [p["straggler"] for p in analysis["phases"]], color="red", linewidth=0.8)
    ax.set_xlabel("µs from the step's first phase start")
    ax.set_ylabel("block")
    ax.set_ylim(step.shape[1], -1)
    ax.set_title(f"{title}: one decode step, {analysis['step_ns'] / 1000:.1f} µs")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()]
    ax.legend(handles, list(COLOURS), loc="upper right", ncols=7, fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def fmt(v: float | None) -> str:
    """A table's µs, or a dash where there is none."""
    return "–" if v is None else f"{v:.2f}"


def steps_at(define: str, probes: list[int], args: argparse.Namespace, stages):
    """(K, the recorded step, its description) for each probe point K of `define` (QW_MK_TL_AT
    or QW_MK_TL_MV), a launch each, one after another; the define is gone afterwards."""
    try:
        for k in probes:
            EXPERIMENT_DEFINES[define] = k
            yield (k, *record_step(args.config, args.quantize, args.position, args.steps,
                                   args.rows, stages, args.kv_cache))
    finally:
        EXPERIMENT_DEFINES.pop(define, None)


def print_probes(probes: list[int], args: argparse.Namespace, stages) -> None:
    """The attention's row of the summary at each probe point (mk_attention.cuh's QW_TL_AT):
    its weights-input column is the median block's time from its q/k/v to that point."""
    print(f"{'probe':>5} {'span µs':>8} {'input wait':>11} {'probe-input µs':>15} {'step µs':>9}")
    for k, step, _ in steps_at("QW_MK_TL_AT", probes, args, stages):
        analysis = analyse(step)
        (row,) = [r for r in summary(analysis) if r["phase"] == "attention"]
        print(f"{k:>5} {fmt(row['span_us']):>8} {fmt(row['input_wait_us']):>11} "
              f"{fmt(row['weights_after_input_us']):>15} {analysis['step_ns'] / 1000:>9.1f}",
              flush=True)


MATRIX_KINDS = ("qkv", "o_proj", "router", "gate_up", "down", "lm_head")


def block_times(step: np.ndarray) -> dict[str, dict[str, float]]:
    """Per matrix kind: the median block's input, weights (or probe) and end times, each from
    that block's own start of the phase (µs; the median over the kind's phases), so blocks
    that drift apart (a build with no waits) still give their own path through a phase."""
    out: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for row in step:
        kind = TIMELINE_KINDS[int(row["kind"].max())]
        if kind not in MATRIX_KINDS:
            continue
        start = row["start"].astype(np.int64)
        for mark in ("input", "weights", "end"):
            values = row[mark].astype(np.int64)
            ok = (start > 0) & (values > 0)
            if ok.any():
                out[kind][mark].append(float(np.median(values[ok] - start[ok])) / 1000)
    return {kind: {mark: float(np.median(v)) for mark, v in marks.items()}
            for kind, marks in out.items()}


def print_mv_probes(probes: list[int], args: argparse.Namespace, stages) -> None:
    """The matrix phases' probe points (mk_matvec.cuh's QW_TL_MV), a step recorded at each:
    per kind, when the median block reached each point, from its own start of the phase."""
    table: dict[str, dict[str, float]] = defaultdict(dict)
    title = ""
    for k, step, described in steps_at("QW_MK_TL_MV", probes, args, stages):
        title = described
        for kind, marks in block_times(step).items():
            table[kind].setdefault("input", marks.get("input", float("nan")))
            table[kind].setdefault("end", marks.get("end", float("nan")))
            table[kind][f"p{k}"] = marks.get("weights", float("nan"))
    columns = [f"p{k}" for k in probes] + ["input", "end"]
    print(f"{title}: µs from each block's start of the phase (median block, median phase)")
    print(f"{'phase':>8} " + " ".join(f"{c:>7}" for c in columns))
    for kind in MATRIX_KINDS:
        if kind in table:
            print(f"{kind:>8} " + " ".join(f"{table[kind].get(c, float('nan')):>7.2f}"
                                            for c in columns), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="qwen3-0.6b", choices=sorted(PRESETS))
    parser.add_argument("--quantize", default="none", choices=("none", "fp8", "int4"))
    parser.add_argument("--position", type=int, default=1)
    parser.add_argument("--kv-cache", default="bf16", choices=KV_CACHE_CHOICES)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--zoom", type=int, default=None, metavar="LAYER",
                        help="also draw this layer's phases alone (NAME-layerN.png/svg)")
    parser.add_argument("--clock-ghz", type=float, default=1.98,
                        help="the SM clock the pipeline table converts cycles at (H100 SXM: "
                             "1.98)")
    parser.add_argument("--rows", default="auto", choices=("auto", "whole", "parts"),
                        help="what the stages hold (default: as the layout chooses)")
    parser.add_argument("--stages", help="the stage ring's depth, or DEPTHxBYTES its depth and "
                                          "stage size (default: the layout's)")
    parser.add_argument("--define", action="append", default=[], metavar="NAME=VALUE",
                        help="a megakernel define for this run (experiments), e.g. "
                             "QW_MK_TL_AT=3: the attention's probe point (mk_attention.cuh)")
    parser.add_argument("--out", type=Path, default=Path("step-timeline"),
                        help="file name without suffix: .svg, .png and .json are written")
    parser.add_argument("--no-draw", action="store_true", help="write no SVG or PNG")
    parser.add_argument("--probes", metavar="K,K,...",
                        help="the attention's probe points (QW_MK_TL_AT) to record a step for, "
                             "one after another; prints the attention's row of each")
    parser.add_argument("--mv-probes", metavar="K,K,...",
                        help="the matrix phases' probe points (QW_MK_TL_MV, mk_matvec.cuh) to "
                             "record a step for, one after another; prints when the median "
                             "block reached each, from its own start of the phase")
    args = parser.parse_args()
    EXPERIMENT_DEFINES.update(parse_defines(args.define))
    stages = parse_ring(args.stages) if args.stages else None
    if args.mv_probes:
        print_mv_probes([int(k) for k in args.mv_probes.split(",")], args, stages)
        return
    if args.probes:
        print_probes([int(k) for k in args.probes.split(",")], args, stages)
        return
    step, described = record_step(args.config, args.quantize, args.position, args.steps,
                                  args.rows, stages, args.kv_cache)
    analysis = analyse(step)
    rows = summary(analysis)
    ring = pipeline(step, args.clock_ghz)
    stragglers = Counter(p["straggler"] for p in analysis["phases"]).most_common(5)
    def named(suffix: str) -> Path:  # (with_suffix would eat "0.6b" in a name)
        return args.out.parent / (args.out.name + suffix)

    png = False
    if not args.no_draw:
        write_svg(step, analysis, described, named(".svg"))
        png = write_png(step, analysis, described, named(".png"))
    named(".json").write_text(json.dumps(
        {"described": described, "summary": rows, "pipeline": ring, "stragglers": stragglers,
         "phases": analysis["phases"]}, indent=1))
    if args.zoom is not None and not args.no_draw:
        n = layer_phases(PRESETS[args.config])
        layer = step[n * args.zoom : n * (args.zoom + 1)]
        zoomed = analyse(layer)
        title = f"{described}, layer {args.zoom}"
        write_svg(layer, zoomed, title, named(f"-layer{args.zoom}.svg"))
        write_png(layer, zoomed, title, named(f"-layer{args.zoom}.png"))
    drawn = " (not drawn)" if args.no_draw else "" if png else " (no matplotlib: SVG only)"
    print(f"{described}: step {analysis['step_ns'] / 1000:.1f} µs{drawn}")
    print(f"{'phase':>10} {'n':>4} {'share':>6} {'span µs':>8} {'input wait':>11} "
          f"{'weights-input':>14}")
    for r in rows:
        print(f"{r['phase']:>10} {r['count']:>4} {r['share']:>6.1%} {fmt(r['span_us']):>8} "
              f"{fmt(r['input_wait_us']):>11} {fmt(r['weights_after_input_us']):>14}")
    print("most frequent last blocks (block, phases):", stragglers)
    print(f"{'phase':>10} {'stages':>7} {'cycles/issue':>13} {'issuing':>8} {'free wait':>10} "
          f"{'full wait':>10}   (producer; warp 0)")
    for r in ring:
        def pct(v: float | None) -> str:
            return "–" if v is None else f"{v:.1%}"

        per = r["issue_cycles_per_stage"]
        print(f"{r['phase']:>10} {r['stages']:>7.1f} {'–' if per is None else f'{per:.0f}':>13} "
              f"{pct(r['issuing']):>8} {pct(r['free_wait']):>10} {pct(r['full_wait']):>10}")


if __name__ == "__main__":
    main()
