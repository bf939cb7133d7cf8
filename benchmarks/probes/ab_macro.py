"""A/B of one compile-time macro of a kernel source on named plans (needs a GPU): each plan is compiled once per
value with ``#define MACRO value`` in front of its source (not through the cubin cache, whose digest does not
see the define), checked against float64 like every tuner candidate, and timed with CUDA events in interleaved
rounds next to cuDNN (benchmark mode, TF32 off) on its layer.

    python benchmarks/probes/ab_macro.py --macro BAGF_TC_SPLIT --values 1,0 \\
        --plans implicit_gemm_tc_bm64_bn128_bk16_wm2_wn4_st2_s1_sm90@conv1:128 ... --out benchmarks/results

A plan is ``<family name>@<layer>:<N>`` (host_floor.py). The first value is the one the tuner compiles.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from host_floor import parse_plan  # noqa: E402

from bagf_torch.bench import gpu_tag  # noqa: E402
from bagf_torch import runtime  # noqa: E402
from bagf_torch.jit.compiler import KernelSpec  # noqa: E402
from bagf_torch.ops import ATEN  # noqa: E402
from bagf_torch.tuning.measure import CudaBenchmarker, CudaChecker, Workspace  # noqa: E402


def build(compiler, family, config, macro: str, value: int):
    spec = KernelSpec(family, dict(config), compiler.arch)
    t0 = time.perf_counter()
    ok, cubin, lowered, log = compiler.ext.nvrtc_compile(f"#define {macro} {value}\n" + spec.source(),
                                                         spec.name_expression, spec.options())
    if not ok:
        raise SystemExit(f"{spec.name} with {macro}={value}: NVRTC failed:\n{log}")
    return compiler._load(spec, cubin, lowered, time.perf_counter() - t0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--macro", required=True)
    ap.add_argument("--values", default="1,0")
    ap.add_argument("--plans", nargs="+", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--tag", default=None)
    args = ap.parse_args(argv)
    args.tag = gpu_tag() if args.tag is None else args.tag  # (the GPU this runs on)
    if not torch.cuda.is_available():
        print("ab_macro: no CUDA GPU here")
        return 2
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    values = [int(v) for v in args.values.split(",")]
    dev = runtime.get().device(0)
    checker = CudaChecker(dev.compiler.ext)
    bench = CudaBenchmarker()
    rows = []
    for spec in args.plans:
        name, layer, n = spec.replace(":", "@").split("@")
        fam, cfg, p = parse_plan(spec)
        ws = Workspace(p, torch.device("cuda", 0))
        handles = []
        for v in values:
            b = build(dev.compiler, fam, cfg, args.macro, v)
            assert hasattr(b, "handle"), (name, v, b)
            bad = checker.check(ws, b.handle)
            assert bad is None, (name, v, bad.detail)
            handles.append(b.handle)
        times = bench.remeasure(ws, [ATEN] + handles, rounds=args.rounds)
        row = {"layer": layer, "n": int(n), "plan": name, "format": f"{p.dtype} {p.layout}", "cudnn_us": times[0],
               "us": {str(v): t for v, t in zip(values, times[1:])}}
        rows.append(row)
        print(json.dumps(row), flush=True)
        for h in handles:
            dev.compiler.unload(h)
    if args.out:
        meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
                "cudnn": torch.backends.cudnn.version(), "macro": args.macro, "values": values,
                "rounds": args.rounds}
        stem = Path(args.out) / f"ab_{args.macro.lower()}_{args.tag}"
        stem.parent.mkdir(parents=True, exist_ok=True)
        stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        head = " | ".join(f"{args.macro}={v} us" for v in values)
        lines = [f"# {args.macro} A/B ({meta['gpu']}, {meta['date']})", "",
                 f"torch {meta['torch']}, CUDA {meta['cuda']}, cuDNN {meta['cudnn']}; each layer in its plan's "
                 "dtype and memory format (format; cuDNN in the same), TF32 off; CUDA-event medians over "
                 f"{args.rounds} interleaved rounds; every variant passed the float64 check first. "
                 f"The first value is the tuner's build.", "",
                 f"| layer | N | format | plan | cuDNN us | {head} | {values[0]} vs {values[1]} |",
                 "|---|---|---|---|---|" + "---|" * len(values) + "---|"]
        for r in rows:
            ts = [r["us"][str(v)] for v in values]
            lines.append(f"| {r['layer']} | {r['n']} | {r['format']} | `{r['plan']}` | {r['cudnn_us']:.1f} | "
                         + " | ".join(f"{t:.1f}" for t in ts) + f" | {ts[1] / ts[0]:.3f}x |")
        stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
