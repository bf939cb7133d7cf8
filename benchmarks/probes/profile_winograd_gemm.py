"""Where a non-fused Winograd plan's time goes (kernels.winograd_gemm): the GPU time of each of its launches --
filter transform, input transform, cuBLAS's batched SGEMM, inverse transform -- from torch.profiler, per tile
size, next to cuDNN's total, on the AlexNet 3x3 layers. Also the GEMM's achieved TFLOP/s (its real FLOPs:
2 * E * K * C * T) and the transforms' achieved bandwidth (the words iobound counts for them).

    python benchmarks/probes/profile_winograd_gemm.py --out benchmarks/results [--problems alexnet_conv4_n128,...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch


from bagf_torch.bench import gpu_tag  # noqa: E402
from bagf_torch import iobound  # noqa: E402
from bagf_torch.cache import Cache  # noqa: E402
from bagf_torch.jit.compiler import KernelCompiler  # noqa: E402
from bagf_torch.kernels import winograd_gemm as wgf  # noqa: E402
from bagf_torch.ops import ATEN  # noqa: E402
from bagf_torch.tuning.measure import CudaBenchmarker, CudaChecker, Workspace  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from record_space import MORE_PROBLEMS, PROBLEMS  # noqa: E402


def stage_times(fn, reps: int = 20) -> dict[str, float]:
    """Mean GPU microseconds per call of each kernel ``fn`` launches, by kernel name; the transform kernel's
    launches (one kernel for every stage) are told apart by their order in a call: "transforms in" (filters and
    input, the first) and "inverse transform" (the last)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    kernels = [ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA
               and ev.time_range.elapsed_us() > 0]
    kernels.sort(key=lambda ev: ev.time_range.start)
    out: dict[str, float] = {}
    per_call = len(kernels) // reps if reps else 0
    for i, ev in enumerate(kernels):
        name = ev.name[:90]
        if "winograd_gemm_stage" in name and per_call:
            name = "transforms in" if i % per_call == 0 else "inverse transform"
        out[name] = out.get(name, 0.0) + ev.time_range.elapsed_us() / reps
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--problems", default="alexnet_conv3_n32,alexnet_conv4_n128,alexnet_conv5_n128,"
                                          "conv3x3_256_56_n32")
    ap.add_argument("--tiles", default="2,4,5,6")
    ap.add_argument("--tag", default=None)
    ap.add_argument("--ge", type=int, default=wgf.DEFAULT["GE"], help="the GEMM knob (0 cuBLAS, 1-5 mma.sync, "
                    "6-7 wgmma)")
    args = ap.parse_args()
    args.tag = gpu_tag() if args.tag is None else args.tag  # (the GPU this runs on)
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
            cfg = dict(wgf.DEFAULT, MT=mt, GE=args.ge)
            built = compiler.compile(wgf, [cfg])[0]
            if not hasattr(built, "handle"):
                rows.append({"problem": name, "config": wgf.name(cfg), "error": built.detail[:300]})
                continue
            bad = checker.check(ws, built.handle)
            total = bench.measure(ws, built.handle).time_us
            stages = stage_times(ws.op_call(built.handle))
            e, t = wgf.points(cfg), wgf.tiles(cfg, p)
            gemm_us = sum(v for k, v in stages.items() if k not in ("transforms in", "inverse transform"))
            row = {"problem": name, "config": wgf.name(cfg), "check": None if bad is None else bad.detail,
                   "total_us": total, "cudnn_us": cudnn, "speedup": cudnn / total, "stages_us": stages,
                   "gemm_us": gemm_us, "gemm_tflops": 2 * e * p.k * p.c * t / gemm_us / 1e6 if gemm_us else None,
                   "workspace_mb": {k: 4 * v / 2**20 for k, v in wgf.workspace_words(cfg, p).items()}}
            # the transforms' compulsory bytes (iobound's words for them): in = weights + input read, U and V
            # written; inverse = M read (+ bias), output written
            tr = iobound.winograd_gemm_traffic(p, cfg)
            ws_w = dict(tr.workspace_written)
            row["mb_in"] = 4e-6 * (tr.words_read_weight + tr.words_read_input + ws_w["U"] + ws_w["V"])
            row["mb_inverse"] = 4e-6 * (ws_w["M"] + tr.words_read_bias + tr.words_written)
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
             "", "| problem | config | total us | cuDNN us | speedup | GEMM us | GEMM TFLOP/s | transforms in us | "
             "inverse us | transforms MB (in / inverse) | GB/s (in / inverse) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['problem']} | `{r['config']}` | {r['error'][:60]} | | | | | |")
            continue
        t_in, t_inv = r["stages_us"].get("transforms in", 0.0), r["stages_us"].get("inverse transform", 0.0)
        mb_in, mb_inv = r["mb_in"], r["mb_inverse"]
        lines.append(f"| {r['problem']} | `{r['config']}` | {r['total_us']:.1f} | {r['cudnn_us']:.1f} | "
                     f"{r['speedup']:.2f}x | {r['gemm_us']:.1f} | {r['gemm_tflops'] or 0:.1f} | {t_in:.1f} | "
                     f"{t_inv:.1f} | {mb_in:.0f} / {mb_inv:.0f} | {mb_in * 1e3 / max(t_in, 1e-9):.0f} / "
                     f"{mb_inv * 1e3 / max(t_inv, 1e-9):.0f} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
