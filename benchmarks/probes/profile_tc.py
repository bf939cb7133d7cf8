"""Where does the tensor-core family lose time at large N? Times a fixed set of implicit_gemm_tc
configurations in several builds of the kernel (needs a GPU).

The builds differ only in one A/B macro of csrc/kernels/implicit_gemm_tc.cuh (``--macro``, ``--values``; the
first value is what the tuner compiles): BAGF_TC_MMA_PASSES (0: each tile's three TF32 products back to back
on one accumulator; 1: three passes over the warp's tiles) or BAGF_TC_SPLIT (0: cvt.rna.tf32 for both parts
of the split; 1: integer rounding and a mask; 2: integer rounding, small part unmasked). Every build of every
configuration passes the tuner's correctness check (float64 reference, NaN-poisoned output) before it is
timed; the times are CUDA-event medians, interleaved over the variants, next to cuDNN (benchmark mode, TF32
off). "TMAC/s" is direct-convolution MACs / time.

    python benchmarks/probes/profile_tc.py --out /tmp/prof            # JSON + Markdown
    python benchmarks/probes/profile_tc.py --macro BAGF_TC_SPLIT --values 0,1,2 --configs 3 --out /tmp/prof
    ncu --clock-control none --kernel-name regex:implicit_gemm_tc --section SpeedOfLight ... \\
        python benchmarks/probes/profile_tc.py --ncu alexnet_conv3_n128   # one launch per build and configuration
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for record_space
from record_space import _ALEXNET, _conv  # noqa: E402


PROBLEMS = {
    **{f"alexnet_{name}_n128": _conv(128, *d) for name, d in _ALEXNET.items()},
    "alexnet_conv3_n32": _conv(32, *_ALEXNET["conv3"]),
    "conv3x3_256_56_n32": _conv(32, 256, 56, 256, 3, 1, 1),
    "conv3x3_128_28_n32": _conv(32, 128, 28, 128, 3, 1, 1),
}

# BM BN BK WM WN STAGES SPLIT: the family default and larger block tiles (the N=128 recordings stopped before
# reaching any of the 128-wide ones); the first three: the best at conv1 and at conv3-5 in that A/B, the default
CONFIGS = [
    (64, 128, 16, 2, 4, 3, 1),
    (128, 64, 32, 4, 2, 3, 1),
    (64, 64, 16, 2, 2, 3, 1),
    (128, 128, 16, 2, 4, 3, 1),
    (128, 128, 32, 2, 4, 3, 1),
    (128, 128, 16, 4, 2, 3, 1),
    (128, 64, 16, 2, 2, 4, 1),
    (64, 128, 8, 1, 4, 4, 1),
]


def build(compiler, family, config: dict, macro: str, value: int):
    """Compile one configuration with ``#define macro value`` (not through the cubin cache: the variant is
    not part of the cache's digest) and load it; a Loaded or a typed Outcome."""
    from bagf_torch.jit.compiler import KernelSpec
    from bagf_torch.tuning.common import Outcome

    spec = KernelSpec(family, dict(config), compiler.arch)
    src = f"#define {macro} {value}\n" + spec.source()
    t0 = time.perf_counter()
    ok, cubin, lowered, log = compiler.ext.nvrtc_compile(src, spec.name_expression, spec.options())
    if not ok:
        return Outcome("compile", detail=log)
    return compiler._load(spec, cubin, lowered, time.perf_counter() - t0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problems", default=",".join(PROBLEMS))
    ap.add_argument("--out", default=None, help="directory for profile_tc_<gpu>.{json,md}")
    ap.add_argument("--ncu", metavar="PROBLEM",
                    help="launch each build of the first two configurations once on PROBLEM (for ncu)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--macro", default="BAGF_TC_MMA_PASSES", help="the A/B macro of implicit_gemm_tc.cuh")
    ap.add_argument("--values", default="0,1", help="its values; the first is the tuner's build")
    ap.add_argument("--configs", type=int, default=len(CONFIGS), help="the first N of CONFIGS")
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("profile_tc.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from bagf_torch import runtime
    from bagf_torch.kernels import implicit_gemm_tc as fam
    from bagf_torch.ops import ATEN
    from bagf_torch.tuning.measure import CudaBenchmarker, CudaChecker, Workspace

    torch.backends.cudnn.allow_tf32 = False
    dev = runtime.get().device(0)
    compiler = dev.compiler
    space = fam.space(compiler.limits["shared_memory_per_block_optin"])
    values = [int(v) for v in args.values.split(",")]
    tag = {"BAGF_TC_MMA_PASSES": "passes", "BAGF_TC_SPLIT": "split"}.get(args.macro, args.macro.lower())
    configs = [dict(zip(fam.TEMPLATE_ORDER, c)) for c in (CONFIGS[:2] if args.ncu else CONFIGS[:args.configs])]
    configs = [c for c in configs if space.is_valid(c)]
    loaded = {}
    for c in configs:
        for v in values:
            b = build(compiler, fam, c, args.macro, v)
            if hasattr(b, "handle"):
                loaded[(fam.name(c), v)] = (c, b)
                print(f"{fam.name(c)} {tag}={v}: {b.registers} registers, {b.local_bytes} B local", flush=True)
            else:
                print(f"{fam.name(c)} {tag}={v}: {b.status}: {b.detail[:300]}", flush=True)
    checker = CudaChecker(compiler.ext)

    if args.ncu:
        ws = Workspace(PROBLEMS[args.ncu], torch.device("cuda", 0), seed=0)
        for (name, v), (c, b) in loaded.items():
            bad = checker.check(ws, b.handle)  # the one launch ncu profiles (into a poisoned output)
            print(f"ncu launch {name} {tag}={v}: {'ok' if bad is None else bad.detail}", flush=True)
        return 0

    bench = CudaBenchmarker(warmup_ms=2.0, rep_ms=10.0)
    rows = []
    for pname in [p for p in args.problems.split(",") if p]:
        problem = PROBLEMS[pname]
        ws = Workspace(problem, torch.device("cuda", 0), seed=0)
        keys, handles = [], []
        for key, (c, b) in loaded.items():
            bad = checker.check(ws, b.handle)
            if bad is not None:
                rows.append({"problem": pname, "config": key[0], tag: key[1], "status": bad.status,
                             "detail": bad.detail})
                print(f"{pname} {key[0]} {tag}={key[1]}: {bad.detail}", flush=True)
                continue
            keys.append(key)
            handles.append(b.handle)
        times = bench.remeasure(ws, [ATEN] + handles, rounds=args.rounds)
        cudnn = times[0]
        print(f"{pname}: cuDNN {cudnn:.1f} us ({problem.macs / cudnn / 1e6:.1f} TMAC/s-equivalent)", flush=True)
        for key, t in zip(keys, times[1:]):
            rows.append({"problem": pname, "config": key[0], tag: key[1], "status": "ok", "median_us": t,
                         "tmacs": problem.macs / t / 1e6, "vs_cudnn": cudnn / t, "cudnn_us": cudnn})
            print(f"  {key[0]:44s} {tag}={key[1]}: {t:9.1f} us {problem.macs / t / 1e6:6.1f} TMAC/s "
                  f"{cudnn / t:5.2f}x cuDNN", flush=True)
        del ws
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(), "tf32": False,
            "macro": args.macro, "values": values,
            "registers": {f"{k[0]} {tag}={k[1]}": b.registers for k, (c, b) in loaded.items()}}
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        from bagf_torch.bench import gpu_tag

        stem = f"profile_tc_{gpu_tag()}" if tag == "passes" else f"profile_tc_{tag}_{gpu_tag()}"
        (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        base, others = values[0], values[1:]
        lines = [f"# implicit_gemm_tc: {args.macro} A/B ({meta['gpu']}, {meta['date']})", "",
                 f"torch {meta['torch']}, CUDA {meta['cuda']}, cuDNN {meta['cudnn']}; fp32, TF32 off; median us "
                 f"(interleaved rounds); {tag}={base} is the tuner's build.", "",
                 "| problem | config | " + " | ".join(f"{tag}={v} us" for v in values) + " | "
                 + " | ".join(f"{v} vs {base}" for v in others) + " | best TMAC/s | cuDNN us | best vs cuDNN |",
                 "|---|---|" + "---|" * (2 * len(values) + 2)]
        ok = {(r["problem"], r["config"], r[tag]): r for r in rows if r["status"] == "ok"}
        for pname, cname in sorted({(r["problem"], r["config"]) for r in ok.values()}):
            got = [ok.get((pname, cname, v)) for v in values]
            if not all(got):
                continue
            best = min(r["median_us"] for r in got)
            lines.append(f"| {pname} | {cname} | " + " | ".join(f"{r['median_us']:.1f}" for r in got) + " | "
                         + " | ".join(f"{got[0]['median_us'] / r['median_us']:.3f}x" for r in got[1:])
                         + f" | {PROBLEMS[pname].macs / best / 1e6:.1f} | {got[0]['cudnn_us']:.1f} | "
                         f"{got[0]['cudnn_us'] / best:.2f}x |")
        (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    for (name, v), (c, b) in loaded.items():
        compiler.unload(b.handle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
