"""Does cuBLAS's fp32 emulation (BF16x9 on tensor cores) run faster than its SIMT SGEMM on this GPU, and is it as
accurate? Measured on the batched products of the non-fused Winograd plans (winograd_gemm) for AlexNet's 3x3
layers, where cuBLAS's SGEMM is 57-77% of the time at N = 32 and 128.

cuBLAS 12.9+ has ``CUBLAS_COMPUTE_32F_EMULATED_16BFX9``: each fp32 operand split into three bf16 parts and the
nine partial products on bf16 tensor cores, fp32 accumulation. The probe calls ``cublasGemmStridedBatchedEx``
through ctypes on torch's own handle and stream with compute types 32F, 32F_EMULATED_16BFX9 (under each
emulation strategy) and 32F_FAST_TF32 (one TF32 pass: a time floor, not an fp32 answer), against ``torch.bmm``
with TF32 off, and reports each one's median time (CUDA events) and its relative error against float64.

    python benchmarks/probes/cublas_emulation.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for bench_layers
from bagf_torch.bench import fp32, gpu_tag, time_forward  # noqa: E402
from bench_layers import ALEXNET  # noqa: E402

COMPUTE = {"32F": 68, "32F_FAST_TF32": 77, "32F_EMULATED_16BFX9": 78}
STRATEGY = {"default": 0, "performant": 1, "eager": 2}
CUDA_R_32F = 0
CUBLAS_GEMM_DEFAULT = -1


def libcublas() -> ctypes.CDLL:
    """The libcublas torch has loaded (its path from /proc/self/maps), so the handle and the library agree."""
    torch.cuda.current_blas_handle()
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if "libcublas.so" in path and "Lt" not in path:
                return ctypes.CDLL(path)
    raise RuntimeError("libcublas is not loaded in this process")


class Gemm:
    """Row-major batched C[b] = A[b] @ B[b] (m x k times k x n) through cublasGemmStridedBatchedEx."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        f = lib.cublasGemmStridedBatchedEx
        i, p, ll = ctypes.c_int, ctypes.c_void_p, ctypes.c_longlong
        f.argtypes = [p, i, i, i, i, i, p, p, i, i, ll, p, i, i, ll, p, p, i, i, ll, i, i, i]
        f.restype = i
        self.fn = f
        self.one = ctypes.c_float(1.0)
        self.zero = ctypes.c_float(0.0)

    def strategy(self, name: str) -> int:
        setter = getattr(self.lib, "cublasSetEmulationStrategy", None)
        if setter is None:
            return -1
        setter.argtypes = [ctypes.c_void_p, ctypes.c_int]
        return setter(ctypes.c_void_p(torch.cuda.current_blas_handle()), STRATEGY[name])

    def __call__(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, compute: int) -> int:
        batch, m, k = a.shape
        n = b.shape[2]
        # column-major view: C^T (n x m) = B^T (n x k) A^T (k x m)
        return self.fn(ctypes.c_void_p(torch.cuda.current_blas_handle()), 0, 0, n, m, k,
                       ctypes.byref(self.one), ctypes.c_void_p(b.data_ptr()), CUDA_R_32F, n, k * n,
                       ctypes.c_void_p(a.data_ptr()), CUDA_R_32F, k, m * k, ctypes.byref(self.zero),
                       ctypes.c_void_p(c.data_ptr()), CUDA_R_32F, n, m * n, batch, compute, CUBLAS_GEMM_DEFAULT)


def median_us(fn, reps: int, batch: int = 1) -> float:
    """Median GPU time of one call (``bagf_torch.bench.time_forward``); with ``batch`` > 1, of ``batch`` calls
    back to back divided by ``batch``, so that a host cost above the GPU time hides behind the GPU work."""
    if batch == 1:
        return time_forward(fn, runs=reps, warmup=5).median_us

    def calls():
        for _ in range(batch):
            fn()

    return time_forward(calls, runs=reps, warmup=1).median_us / batch


def shapes(ns: list[int], mts: tuple[int, ...] = (5, 6)) -> list[dict]:
    """winograd_gemm's products for the AlexNet 3x3 layers: E = (MT+2)^2 batches of K x C by C x T."""
    out = []
    for layer, c, h, k, *_ in ALEXNET[2:]:
        for n in ns:
            for mt in mts:
                t = n * ((h + mt - 1) // mt) ** 2
                out.append({"layer": layer, "N": n, "MT": mt, "E": (mt + 2) ** 2, "K": k, "C": c, "T": t})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default=None)
    args = ap.parse_args(argv)
    args.tag = gpu_tag() if args.tag is None else args.tag  # (the GPU this runs on)
    torch.manual_seed(0)
    lib = libcublas()
    gemm = Gemm(lib)
    version = ctypes.c_int(0)
    lib.cublasGetVersion_v2(ctypes.c_void_p(torch.cuda.current_blas_handle()), ctypes.byref(version))
    rows = []
    with fp32(benchmark=True):
        for s in shapes(args.n):
            a = torch.randn(s["E"], s["K"], s["C"], device="cuda")
            b = torch.randn(s["E"], s["C"], s["T"], device="cuda")
            ref = torch.bmm(a.double(), b.double())
            row = dict(s, flop=2.0 * s["E"] * s["K"] * s["C"] * s["T"])
            c = torch.full_like(ref, float("nan"), dtype=torch.float32)

            def err() -> float:
                return float(((c.double() - ref).norm() / ref.norm()).item())

            row["torch_bmm_us"] = median_us(lambda: torch.bmm(a, b, out=c), args.reps)
            row["torch_bmm_err"] = err()
            for label, compute, strategy in (("cublas_32f", "32F", "default"),
                                             ("bf16x9_default", "32F_EMULATED_16BFX9", "default"),
                                             ("bf16x9_eager", "32F_EMULATED_16BFX9", "eager"),
                                             ("tf32_1pass", "32F_FAST_TF32", "default")):
                row[label + "_strategy_status"] = gemm.strategy(strategy)
                c.fill_(float("nan"))
                status = gemm(a, b, c, COMPUTE[compute])
                torch.cuda.synchronize()
                row[label + "_status"] = status
                if status != 0:
                    continue
                row[label + "_err"] = err()
                row[label + "_us"] = median_us(lambda: gemm(a, b, c, COMPUTE[compute]), args.reps)
            gemm.strategy("default")
            for key in list(row):
                if key.endswith("_us"):
                    row[key.replace("_us", "_tflops")] = row["flop"] / row[key] / 1e6
            print(json.dumps(row), flush=True)
            rows.append(row)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cublas": version.value,
            "date": __import__("datetime").date.today().isoformat(), "reps": args.reps}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"cublas_emulation_{args.tag}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# cuBLAS fp32 emulation (BF16x9) on winograd_gemm's products -- {meta['gpu']}", "",
             f"torch {meta['torch']}, CUDA {meta['cuda']}, cuBLAS {meta['cublas']}, {meta['date']}; median of {args.reps} CUDA-event timings; "
             "error = relative Frobenius norm against float64.", "",
             "| layer | N | MT | E x K x C x T | torch.bmm us (TF/s, err) | 32F | BF16x9 default | BF16x9 eager | TF32 1-pass |",
             "|---|---|---|---|---|---|---|---|---|"]

    def cell(r, label):
        if f"{label}_us" not in r:
            return f"status {r.get(label + '_status')}"
        return f"{r[label + '_us']:.1f} ({r[label + '_tflops']:.1f}, {r[label + '_err']:.1e})"

    for r in rows:
        lines.append(f"| {r['layer']} | {r['N']} | {r['MT']} | {r['E']}x{r['K']}x{r['C']}x{r['T']} | "
                     f"{r['torch_bmm_us']:.1f} ({r['torch_bmm_tflops']:.1f}, {r['torch_bmm_err']:.1e}) | "
                     f"{cell(r, 'cublas_32f')} | {cell(r, 'bf16x9_default')} | {cell(r, 'bf16x9_eager')} | "
                     f"{cell(r, 'tf32_1pass')} |")
    (out / f"cublas_emulation_{args.tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
