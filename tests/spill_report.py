"""The megakernel's register spills, function by function: a compile aid (NVRTC only, no GPU).

ptxas's allocation at 128 registers a thread is chaotic: code added to one phase can make
another spill, and spills cost more than most changes gain (docs/perf.md, 2026-11-27). Before
spending device time on a megakernel change, compare its report with main's:

    python tests/spill_report.py                                # the default configurations
    python tests/spill_report.py --define QW_MK_TAGMERGE=1      # a variant behind a define
    python tests/spill_report.py --json > spills.json

Each line: a configuration (model, weight format, ring depth as the layout picks it on an H100),
the functions that spill, with the bytes stored and loaded, and the size of the kernel's code
(its cubin's .text sections: 180-280 KB since one sampler instance; cutting 90 KB of it left
decode speed the same, so the instruction cache is not the step's limit: docs/perf.md).
"""

from __future__ import annotations

import argparse
import json
import re
import struct

from consumer_compare import parse_defines

from qwenchat.engine.cuda import compiler
from qwenchat.engine.cuda.megakernel import EXPERIMENT_DEFINES, megakernel_build, megakernel_layout
from qwenchat.model.presets import PRESETS

H100 = (232_448, 132, 3.35e12)  # shared memory a block, SMs, bandwidth: the layout's inputs
CONFIGS = ("qwen3-0.6b:bf16", "qwen3-0.6b:int4", "qwen3-0.6b:fp8", "qwen3-4b:int4",
           "qwen3-8b:bf16", "qwen3-8b:fp8", "qwen3-8b:int4", "qwen3-32b:fp8",
           "qwen3-30b-a3b:fp8", "qwen3-30b-a3b:int4")
FUNCTION = re.compile(r"Function properties for (\S+)")
SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def short_name(symbol: str) -> str:
    """decode_megakernel, or a device function's name out of its mangled symbol."""
    found = re.findall(r"_cu_[0-9a-f]+\d+([a-z_]+)", symbol)  # (the last: the function's)
    return found[-1] if found else symbol


def text_bytes(cubin: bytes) -> int:
    """The bytes of code in an ELF64 cubin: the sizes of its .text sections."""
    table, = struct.unpack_from("<Q", cubin, 0x28)
    entry, count, names = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, table + i * entry) for i in range(count)]
    strings = sections[names][4]  # (sh_offset of the section names)

    def name(at: int) -> bytes:
        start = strings + at
        return cubin[start:cubin.index(b"\0", start)]

    return sum(s[5] for s in sections if name(s[0]).startswith(b".text"))


def spills(name: str, weights: str, arch: str) -> tuple[dict[str, list[int]], int]:
    """({function: [bytes stored, bytes loaded]} of the functions that spill, the kernel's
    bytes of code)."""
    from cuda.bindings import nvrtc

    config = PRESETS[name]
    layout = megakernel_layout(config, H100[0], H100[1], weights, f8_mma=True,
                               bandwidth=H100[2])
    if isinstance(layout, str):
        raise SystemExit(f"{name} {weights}: {layout}")
    _, build = megakernel_build(config, arch, weights, layout)
    options = compiler.compile_options(arch, dict(build.defines), ["--ptxas-options=-v"])
    sources = compiler._read_sources()
    headers = [n for n in sources if n != build.source]
    _, program = nvrtc.nvrtcCreateProgram(sources[build.source].encode(), build.source.encode(),
                                          len(headers), [sources[n].encode() for n in headers],
                                          [n.encode() for n in headers])
    (result,) = nvrtc.nvrtcCompileProgram(program, len(options), [o.encode() for o in options])
    _, size = nvrtc.nvrtcGetProgramLogSize(program)
    log = b" " * size
    nvrtc.nvrtcGetProgramLog(program, log)
    if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise SystemExit(f"{name} {weights}: the megakernel does not compile\n"
                         f"{log.decode(errors='replace')}")
    _, size = nvrtc.nvrtcGetCUBINSize(program)
    cubin = b" " * size
    nvrtc.nvrtcGetCUBIN(program, cubin)
    found: dict[str, list[int]] = {}
    function = None
    for line in log.decode(errors="replace").splitlines():
        if match := FUNCTION.search(line):
            function = short_name(match.group(1))
        elif (match := SPILLS.search(line)) and function is not None:
            stored, loaded = int(match.group(1)), int(match.group(2))
            if stored or loaded:
                total = found.setdefault(function, [0, 0])
                total[0] += stored
                total[1] += loaded
    return found, text_bytes(cubin)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help="MODEL:FORMAT pairs, comma-separated")
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--define", action="append", default=[],
                        help="QW_MK_NAME=VALUE (repeatable): a variant behind a define")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    EXPERIMENT_DEFINES.update(parse_defines(args.define))
    report = {}
    for pair in args.configs.split(","):
        name, _, weights = pair.partition(":")
        found, code = spills(name, weights or "bf16", args.arch)
        report[pair] = {"spills": found, "code_bytes": code}
        if not args.json:
            shown = ", ".join(f"{f} {s}/{ld} B" for f, (s, ld) in found.items())
            print(f"{pair:>18}: {shown or 'no spills'}; code {code / 1024:.0f} KB", flush=True)
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
