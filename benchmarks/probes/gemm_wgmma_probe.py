"""csrc/kernels/gemm_wgmma.cuh on its own: float64 error and time of each tile against gemm_tf32x3's five tiles
(winograd_gemm.GEMMS) and torch.bmm (cuBLAS SGEMM, TF32 off), on winograd_gemm's products for AlexNet's 3x3
layers (MT = 4, 5, 6 at N = 32 and 128), plus odd shapes for correctness.

Compiled with cupy's NVRTC (sm_90a; gemm_tf32x3 for sm_90), launched on torch's tensors. The wgmma kernel's A
is U followed by its small parts, as winograd_gemm's stage 0 writes it (:func:`with_small_parts` here). Outputs
are poisoned with NaN before each checked run, so an unwritten element shows as an error. ``--define`` passes
-D options to the wgmma kernel (an A/B of a macro), ``--ncu`` only launches each kernel four times on the first
``--shapes`` product.

    python benchmarks/probes/gemm_wgmma_probe.py --out benchmarks/results --tag h200
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

from bagf_torch.bench import gpu_tag  # noqa: E402
from bagf_torch.kernels import winograd_gemm as wgg  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder, for cublas_emulation (also when imported)
from cublas_emulation import median_us, shapes as _products  # noqa: E402

KERNELS = Path(__file__).resolve().parents[2] / "csrc" / "kernels"
CONFIGS = [  # WN, NB, WG, STAGES
    (128, 1, 2, 4),
    (128, 1, 2, 3),
    (128, 1, 1, 4),
    (64, 2, 2, 4),
    (64, 1, 2, 5),
    (64, 1, 1, 4),
    (64, 1, 1, 3),
]
ODD = [(3, 37, 29, 53), (2, 130, 64, 9), (5, 384, 192, 288), (1, 7, 5, 3), (2, 65, 100, 131), (4, 129, 33, 260),
       (2, 300, 40, 200)]


def expr(cfg) -> str:
    return f"{wgg.WGMMA_GEMM_KERNEL}<" + ",".join(map(str, cfg)) + ">"


def geometry(cfg, m: int, n: int, e: int):
    wn, nb, wg, _ = cfg
    return ((n + 64 * wg - 1) // (64 * wg), (m + wn * nb - 1) // (wn * nb), e), (128 * wg,)


def tf32x3_expr(tile) -> str:
    return f"{wgg.GEMM_KERNEL}<" + ",".join(map(str, tile)) + ">"


def tf32x3_geometry(tile, m: int, n: int, e: int):
    bm, bn, _, wm, wn, _, _ = tile
    return ((n + bn - 1) // bn, (m + bm - 1) // bm, e), (32 * wm * wn,)


def with_small_parts(a: torch.Tensor) -> torch.Tensor:
    """gemm_wgmma's A as stage 0 writes it: the E batches of A, then E batches of A - trunc_tf32(A)."""
    big = (a.view(torch.int32) & -8192).view(torch.float32)
    return torch.stack([a, a - big]).contiguous()


def shapes(ns):
    """winograd_gemm's products E x (K x C) (C x T) for AlexNet's 3x3 layers, F(4x4), F(5x5), F(6x6)."""
    return _products(ns, mts=(4, 5, 6))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default=None)
    ap.add_argument("--define", action="append", default=[], help="-D options for the wgmma kernel")
    ap.add_argument("--configs", help="comma-separated wgmma tiles, e.g. 128x1x2x4 (default: all)")
    ap.add_argument("--shapes", help="comma-separated LAYER:N:MT products to time (default: all 18)")
    ap.add_argument("--ncu", action="store_true", help="launch each kernel 4 times on the first --shapes product")
    args = ap.parse_args(argv)
    args.tag = gpu_tag() if args.tag is None else args.tag  # (the GPU this runs on)
    import cupy as cp  # on the GPU machine only (CI imports this module for its tile arithmetic)

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.configs:
        CONFIGS[:] = [tuple(int(v) for v in c.split("x")) for c in args.configs.split(",")]
    kernels = {}  # name -> (function, geometry(m, n, e), shared memory, takes A with its small parts)
    mod = cp.RawModule(code='#include "gemm_wgmma.cuh"\n',
                       options=("-std=c++17", f"-I{KERNELS}", "-arch=sm_90a", *(f"-D{d}" for d in args.define)),
                       name_expressions=[expr(c) for c in CONFIGS])
    for cfg in CONFIGS:
        fn = mod.get_function(expr(cfg))
        fn.max_dynamic_shared_size_bytes = wgg.wgmma_smem_bytes(cfg)
        kernels["wg" + "x".join(map(str, cfg))] = (fn, lambda m, n, e, cfg=cfg: geometry(cfg, m, n, e),
                                                   wgg.wgmma_smem_bytes(cfg), True)
    mod3 = cp.RawModule(code='#include "gemm_tf32x3.cuh"\n', options=("-std=c++17", f"-I{KERNELS}", "-arch=sm_90"),
                        name_expressions=[tf32x3_expr(t) for t in wgg.GEMMS.values()])
    for ge, tile in wgg.GEMMS.items():
        fn = mod3.get_function(tf32x3_expr(tile))
        fn.max_dynamic_shared_size_bytes = wgg.tile_smem_bytes(tile)
        kernels[f"ge{ge}"] = (fn, lambda m, n, e, tile=tile: tf32x3_geometry(tile, m, n, e),
                              wgg.tile_smem_bytes(tile), False)
    split_cache = {}

    def launcher(key, a, b, c):
        fn, geo, smem, small_parts = kernels[key]
        if small_parts and split_cache.get("src") is not a:
            split_cache.update(src=a, split=with_small_parts(a))
        a_arg = split_cache["split"][0] if small_parts else a
        e, m, k = a.shape
        n = b.shape[2]
        grid, block = geo(m, n, e)
        kargs = (cp.from_dlpack(a_arg), cp.from_dlpack(b), cp.from_dlpack(c), cp.int32(m), cp.int32(n), cp.int32(k),
                 cp.int64(m * k), cp.int64(k * n), cp.int64(m * n))
        return lambda: fn(grid, block, kargs, shared_mem=smem)

    def checked(key, a, b, ref):
        c = torch.full((a.shape[0], a.shape[1], b.shape[2]), float("nan"), device="cuda")
        launcher(key, a, b, c)()
        torch.cuda.synchronize()
        return float(((c.double() - ref).norm() / ref.norm()).item())

    todo = shapes([32, 128])
    if args.shapes:
        want = [tuple(w.split(":")) for w in args.shapes.split(",")]
        todo = [r for w in want for r in todo if (r["layer"], str(r["N"]), str(r["MT"])) == w]
    if args.ncu:
        s = todo[0]
        a = torch.randn(s["E"], s["K"], s["C"], device="cuda")
        b = torch.randn(s["E"], s["C"], s["T"], device="cuda")
        c = torch.empty(s["E"], s["K"], s["T"], device="cuda")
        for key in kernels:
            call = launcher(key, a, b, c)
            for _ in range(4):
                call()
        torch.cuda.synchronize()
        return 0
    odd = {}
    for (e, m, k, n) in ODD:  # the 4-byte copy path (K or N not a multiple of 4) and tails in every dimension
        a = torch.randn(e, m, k, device="cuda")
        b = torch.randn(e, k, n, device="cuda")
        ref = torch.bmm(a.double(), b.double())
        for key in kernels:
            odd.setdefault(key, []).append(checked(key, a, b, ref))
    for key, errs in odd.items():
        print(f"odd shapes {key}: max rel err {max(errs):.2e}", flush=True)
    good = [key for key, errs in odd.items() if max(errs) < 1e-5]
    print("correct:", good, flush=True)

    rows = []
    for s in todo:
        a = torch.randn(s["E"], s["K"], s["C"], device="cuda")
        b = torch.randn(s["E"], s["C"], s["T"], device="cuda")
        ref = torch.bmm(a.double(), b.double())
        c = torch.empty(s["E"], s["K"], s["T"], device="cuda")
        flop = 2.0 * s["E"] * s["K"] * s["C"] * s["T"]
        row = dict(s, bmm_us=median_us(lambda: torch.bmm(a, b, out=c), args.reps, batch=10))
        row["bmm_err"] = float(((c.double() - ref).norm() / ref.norm()).item())
        for key in good:
            row[key] = {"err": checked(key, a, b, ref), "us": median_us(launcher(key, a, b, c), args.reps, batch=10)}
        for fam in ("ge", "wg"):
            cand = [(row[k]["us"], k) for k in good if k.startswith(fam) and row[k]["err"] < 1e-5]
            if cand:
                us, k = min(cand)
                row.update({f"best_{fam}": k, f"best_{fam}_us": us, f"best_{fam}_tflops": flop / us / 1e6})
        print(json.dumps(row), flush=True)
        rows.append(row)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "date": datetime.date.today().isoformat(), "reps": args.reps, "defines": args.define,
            "odd_shape_max_err": {k: max(v) for k, v in odd.items()}}
    (out / f"gemm_wgmma_probe_{args.tag}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# 3xTF32 wgmma GEMM vs gemm_tf32x3 (mma.sync) vs torch.bmm (cuBLAS SGEMM, TF32 off) -- {meta['gpu']}",
             "", f"torch {meta['torch']}, CUDA {meta['cuda']}, {meta['date']}; median of {args.reps} CUDA-event "
             "timings of 10 back-to-back launches; defines: " + (" ".join(args.define) or "none") +
             "; correct on the odd shapes: " + ", ".join(good) + ".", "",
             "| layer | N | MT | E x K x C x T | bmm us (TF/s) | gemm_tf32x3 us (TF/s) | gemm_wgmma us (TF/s) | "
             "wgmma / tf32x3 | err wgmma / bmm |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "best_wg" not in r or "best_ge" not in r:
            continue
        flop = 2.0 * r["E"] * r["K"] * r["C"] * r["T"]
        lines.append(f"| {r['layer']} | {r['N']} | {r['MT']} | {r['E']}x{r['K']}x{r['C']}x{r['T']} | "
                     f"{r['bmm_us']:.1f} ({flop / r['bmm_us'] / 1e6:.1f}) | {r['best_ge_us']:.1f} "
                     f"({r['best_ge_tflops']:.1f}) {r['best_ge']} | {r['best_wg_us']:.1f} ({r['best_wg_tflops']:.1f}) "
                     f"{r['best_wg']} | {r['best_ge_us'] / r['best_wg_us']:.2f}x | "
                     f"{r[r['best_wg']]['err']:.1e} / {r['bmm_err']:.1e} |")
    (out / f"gemm_wgmma_probe_{args.tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
