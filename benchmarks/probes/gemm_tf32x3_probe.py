"""csrc/kernels/gemm_tf32x3.cuh on its own: time and float64 error of each tile configuration against torch.bmm
(cuBLAS SGEMM, TF32 off) on winograd_gemm's products for AlexNet's 3x3 layers, plus odd shapes for correctness.

Compiled with cupy's NVRTC (the same compiler the extension uses), launched on torch's tensors. Outputs are
poisoned with NaN before each checked run, so an unwritten element shows as an error.

    python benchmarks/probes/gemm_tf32x3_probe.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from bagf_torch.bench import gpu_tag  # noqa: E402
from bagf_torch.kernels import winograd_gemm as wgg  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder, for cublas_emulation (also when imported)
from cublas_emulation import median_us, shapes  # noqa: E402

KERNELS = Path(__file__).resolve().parents[2] / "csrc" / "kernels"
CONFIGS = [  # BM, BN, BK, WM, WN, STAGES, MINB
    (128, 128, 32, 2, 4, 3, 1),
    (64, 128, 32, 1, 4, 4, 1),
    (64, 128, 32, 1, 4, 2, 1),
    (64, 128, 16, 1, 4, 3, 1),
    (64, 128, 32, 1, 4, 2, 4),
    (64, 128, 16, 1, 4, 3, 4),
    (64, 64, 32, 2, 2, 4, 1),
    (64, 64, 32, 2, 2, 3, 4),
    (64, 64, 32, 2, 2, 2, 4),
    (64, 64, 16, 2, 2, 4, 1),
    (128, 64, 32, 2, 2, 3, 2),
    (32, 128, 32, 1, 4, 3, 4),
]


def expr(cfg) -> str:
    return "bagf::gemm_tf32x3<" + ",".join(map(str, cfg)) + ">"


def smem_bytes(cfg) -> int:
    return wgg.tile_smem_bytes(cfg)


def launcher(fn, cfg, a, b, c):
    """A no-argument call of the kernel on (a, b, c), its arguments converted once (the timing is GPU time)."""
    import cupy as cp

    bm, bn, _, wm, wn, _, _ = cfg
    e, m, k = a.shape
    n = b.shape[2]
    grid = ((n + bn - 1) // bn, (m + bm - 1) // bm, e)
    kargs = (cp.from_dlpack(a), cp.from_dlpack(b), cp.from_dlpack(c), cp.int32(m), cp.int32(n), cp.int32(k),
             cp.int64(m * k), cp.int64(k * n), cp.int64(m * n))
    block, smem = (32 * wm * wn,), smem_bytes(cfg)
    return lambda: fn(grid, block, kargs, shared_mem=smem)


def run(fn, cfg, a, b, c):
    launcher(fn, cfg, a, b, c)()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default=None)
    ap.add_argument("--ncu", metavar="TILE@LAYER:N:MT",
                    help="run one tile (e.g. 64x128x32x1x4x4) on one product a few times and exit, for ncu")
    ap.add_argument("--define", action="append", default=[], help="-D options for the kernel (A/B of a macro)")
    args = ap.parse_args(argv)
    args.tag = gpu_tag() if args.tag is None else args.tag  # (the GPU this runs on)
    import cupy as cp  # on the GPU machine only (CI imports this module for its tile arithmetic)

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    src = '#include "gemm_tf32x3.cuh"\n'
    if args.ncu:
        tile, where = args.ncu.split("@")
        CONFIGS[:] = [tuple(int(v) for v in tile.split("x"))]
    mod = cp.RawModule(code=src, options=("-std=c++17", f"-I{KERNELS}", "-arch=sm_90", *(f"-D{d}" for d in args.define)),
                       name_expressions=[expr(c) for c in CONFIGS])
    fns = {}
    for cfg in CONFIGS:
        fn = mod.get_function(expr(cfg))
        fn.max_dynamic_shared_size_bytes = smem_bytes(cfg)
        fns[cfg] = fn
    if args.ncu:
        layer, n, mt = where.split(":")
        (s,) = [r for r in shapes([int(n)]) if r["layer"] == layer and r["MT"] == int(mt)]
        a = torch.randn(s["E"], s["K"], s["C"], device="cuda")
        b = torch.randn(s["E"], s["C"], s["T"], device="cuda")
        c = torch.empty(s["E"], s["K"], s["T"], device="cuda")
        call = launcher(fns[CONFIGS[0]], CONFIGS[0], a, b, c)
        for _ in range(4):
            call()
        torch.cuda.synchronize()
        return 0
    bad = []
    # correctness on odd shapes (scalar path: K or N not a multiple of 4; tails in every dimension)
    for (e, m, k, n) in [(3, 37, 29, 53), (2, 130, 64, 9), (5, 384, 192, 288), (1, 7, 5, 3), (2, 65, 100, 131),
                         (4, 129, 33, 260)]:
        a = torch.randn(e, m, k, device="cuda")
        b = torch.randn(e, k, n, device="cuda")
        ref = torch.bmm(a.double(), b.double())
        for cfg in CONFIGS:
            c = torch.full((e, m, n), float("nan"), device="cuda")
            run(fns[cfg], cfg, a, b, c)
            torch.cuda.synchronize()
            err = float(((c.double() - ref).norm() / ref.norm()).item())
            if not err < 1e-5:
                bad.append({"shape": [e, m, k, n], "config": list(cfg), "err": err})
    print("odd-shape failures:", bad, flush=True)
    rows = []
    for s in shapes([32, 128]):
        a = torch.randn(s["E"], s["K"], s["C"], device="cuda")
        b = torch.randn(s["E"], s["C"], s["T"], device="cuda")
        ref = torch.bmm(a.double(), b.double())
        c = torch.empty(s["E"], s["K"], s["T"], device="cuda")
        flop = 2.0 * s["E"] * s["K"] * s["C"] * s["T"]
        row = dict(s, bmm_us=median_us(lambda: torch.bmm(a, b, out=c), args.reps, batch=10))
        row["bmm_err"] = float(((c.double() - ref).norm() / ref.norm()).item())
        best = None
        for cfg in CONFIGS:
            c.fill_(float("nan"))
            run(fns[cfg], cfg, a, b, c)
            torch.cuda.synchronize()
            err = float(((c.double() - ref).norm() / ref.norm()).item())
            us = median_us(launcher(fns[cfg], cfg, a, b, c), args.reps, batch=10)
            row["x".join(map(str, cfg))] = {"us": us, "err": err}
            if err < 1e-5 and (best is None or us < best[1]):
                best = (cfg, us)
        if best is None:
            print(json.dumps(row), flush=True)
            continue
        row["best"] = list(best[0])
        row["best_us"] = best[1]
        row["best_tflops"] = flop / best[1] / 1e6
        row["bmm_tflops"] = flop / row["bmm_us"] / 1e6
        row["speedup"] = row["bmm_us"] / best[1]
        print(json.dumps(row), flush=True)
        rows.append(row)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "date": __import__("datetime").date.today().isoformat(), "reps": args.reps, "odd_shape_failures": bad}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"gemm_tf32x3_probe_{args.tag}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# 3xTF32 mma.sync batched GEMM vs torch.bmm (cuBLAS SGEMM, TF32 off) -- {meta['gpu']}", "",
             f"torch {meta['torch']}, CUDA {meta['cuda']}, {meta['date']}; median of {args.reps} CUDA-event timings; "
             f"odd-shape failures: {len(bad)}.", "",
             "| layer | N | MT | E x K x C x T | bmm us (TF/s) | ours us (TF/s) | speedup | best tile | err ours / bmm |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        key = "x".join(map(str, r["best"]))
        lines.append(f"| {r['layer']} | {r['N']} | {r['MT']} | {r['E']}x{r['K']}x{r['C']}x{r['T']} | "
                     f"{r['bmm_us']:.1f} ({r['bmm_tflops']:.1f}) | {r['best_us']:.1f} ({r['best_tflops']:.1f}) | "
                     f"{r['speedup']:.2f}x | {key} | {r[key]['err']:.1e} / {r['bmm_err']:.1e} |")
    (out / f"gemm_tf32x3_probe_{args.tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
