"""Where a non-fused Winograd plan's time goes (kernels.winograd_gemm): the GPU time of each of its launches --
filter transform, input transform, cuBLAS's batched SGEMM, inverse transform -- from torch.profiler, per tile
size, next to cuDNN's total, on the AlexNet 3x3 layers. Also the GEMM's achieved TFLOP/s (its real FLOPs:
2 * E * K * C * T) and the transforms' achieved bandwidth (the words iobound counts for them).

    python benchmarks/profile_winograd_gemm.py --out benchmarks/results [--problems alexnet_conv4_n128,...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bagf_torch.cache import Cache  # noqa: E402
from bagf_torch.jit.compiler import KernelCompiler  # noqa: E402
from bagf_torch.kernels import winograd_gemm as wgf  # noqa: E402
from bagf_torch.tuning.measure import ATEN, CudaBenchmarker, CudaChecker, Workspace  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record_space import MORE_PROBLEMS, PROBLEMS  # noqa: E402


def stage_times(fn, reps: int = 20) -> dict[str, float]:
    """Mean GPU microseconds per call of each kernel ``fn`` launches (grouped by kernel name)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for ev in prof.key_averages():
        if ev.device_type == torch.autograd.DeviceType.CUDA or getattr(ev, "device_time_total", 0) > 0:
            t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
            if t > 0:
                out[ev.key[:90]] = t / reps
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--problems", default="alexnet_conv3_n32,alexnet_conv4_n128,alexnet_conv5_n128,"
                                          "conv3x3_256_56_n32")
    ap.add_argument("--tiles", default="2,4,5,6")
    ap.add_argument("--tag", default="h200")
    args = ap.parse_args()
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = False
    compiler = KernelCompiler(Cache.for_dir(Path.home() / ".cache" / "bagf_profile"), 0, workers=8)
    checker, bench = CudaChecker(compiler.ext), CudaBenchmarker()
    rows = []
    for name in args.problems.split(","):
        p = {**PROBLEMS, **MORE_PROBLEMS}[name]
        ws = Workspace(p, torch.device("cuda", 0))
        cudnn = bench.measure(ws, ATEN).time_us
        for mt in map(int, args.tiles.split(",")):
            cfg = dict(wgf.DEFAULT, MT=mt)
            built = compiler.compile(wgf, [cfg])[0]
            if not hasattr(built, "handle"):
                rows.append({"problem": name, "config": wgf.name(cfg), "error": built.detail[:300]})
                continue
            bad = checker.check(ws, built.handle)
            total = bench.measure(ws, built.handle).time_us
            stages = stage_times(ws.op_call(built.handle))
            e, t = wgf.points(cfg), wgf.tiles(cfg, p)
            gemm_us = sum(v for k, v in stages.items() if "winograd_gemm" not in k)
            row = {"problem": name, "config": wgf.name(cfg), "check": None if bad is None else bad.detail,
                   "total_us": total, "cudnn_us": cudnn, "speedup": cudnn / total, "stages_us": stages,
                   "gemm_us": gemm_us, "gemm_tflops": 2 * e * p.k * p.c * t / gemm_us / 1e6 if gemm_us else None,
                   "workspace_mb": {k: 4 * v / 2**20 for k, v in wgf.workspace_words(cfg, p).items()}}
            rows.append(row)
            print(f"{name} {wgf.name(cfg)}: {total:.1f} us (cuDNN {cudnn:.1f}, x{cudnn / total:.2f}); GEMM "
                  f"{gemm_us:.1f} us = {row['gemm_tflops'] or 0:.1f} TFLOP/s; "
                  + "; ".join(f"{k[:40]} {v:.1f}" for k, v in stages.items()), flush=True)
            compiler.unload(built.handle)
    meta = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"profile_winograd_gemm_{args.tag}"
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# winograd_gemm: time per launch ({meta['gpu']})", "",
             f"{meta['date']}; torch {meta['torch']}, CUDA {meta['cuda']}, cuDNN {meta['cudnn']}; fp32, TF32 off. "
             "Totals: CUDA-event medians of the whole call; stages: torch.profiler GPU time per call, mean of 20.",
             "", "| problem | config | total us | cuDNN us | speedup | GEMM us | GEMM TFLOP/s | transforms us |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['problem']} | `{r['config']}` | {r['error'][:60]} | | | | | |")
            continue
        tr = sum(v for k, v in r["stages_us"].items() if "winograd_gemm" in k)
        lines.append(f"| {r['problem']} | `{r['config']}` | {r['total_us']:.1f} | {r['cudnn_us']:.1f} | "
                     f"{r['speedup']:.2f}x | {r['gemm_us']:.1f} | {r['gemm_tflops'] or 0:.1f} | {tr:.1f} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
