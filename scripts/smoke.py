"""One launch of a family's start point before a device call's long stages: a kernel that hangs or faults costs this
script's time limit, not the whole call. Compiles the family's ``default_for`` on one small problem in the family's
first format (TF32 mode for a TF32-only family), runs it once into a NaN-poisoned output and prints its error
against float64 next to cuDNN's.

    timeout 90 python3 scripts/smoke.py implicit_gemm_tma_tf32 [--shape N,C,H,K,R] [--set SK=1,SPLIT=1]
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("family")
    ap.add_argument("--shape", default="2,64,13,96,3", help="N,C,H(=W),K,R(=S), stride 1, padding R // 2")
    ap.add_argument("--set", default="", help="knobs set over the start point, e.g. SK=1,SPLIT=1 (a new variant's)")
    args = ap.parse_args()
    from bagf_torch.cache import Cache
    from bagf_torch.jit.compiler import KernelCompiler
    from bagf_torch.kernels import FAMILIES, formats
    from bagf_torch.problem import ConvProblem
    from bagf_torch.tuning.measure import CudaChecker, Workspace, output_error

    fam = FAMILIES[args.family]
    n, c, h, k, r = map(int, args.shape.split(","))
    dtype, layout = formats(fam)[0]
    strict = ConvProblem(n=n, c=c, h=h, w=h, k=k, r=r, s=r, padding=(r // 2, r // 2), dtype=dtype, layout=layout)
    applies = getattr(fam, "applies", None)
    tf32 = applies is not None and applies(strict) is not None
    p = ConvProblem(n=n, c=c, h=h, w=h, k=k, r=r, s=r, padding=(r // 2, r // 2), dtype=dtype, layout=layout, tf32=tf32)
    start = dict(fam.default_for(p) if hasattr(fam, "default_for") else fam.DEFAULT)
    start.update((kv.split("=")[0], int(kv.split("=")[1])) for kv in filter(None, args.set.split(",")))
    if not fam.space().is_valid(start):
        print(f"smoke: {start} is not in {fam.FAMILY}'s space: {fam.space().invalid_reason(start)}")
        return 1
    with tempfile.TemporaryDirectory() as d:
        compiler = KernelCompiler(Cache.for_dir(d), 0, workers=2)
        built = compiler.compile(fam, [start])[0]
        if not hasattr(built, "handle"):
            print(f"smoke: {fam.name(start)} did not build: {built.detail[:2000]}")
            return 1
        ws = Workspace(p, torch.device("cuda", 0))
        why = CudaChecker(compiler.ext).check(ws, built.handle)
        ours = output_error(ws.out, ws.ref, ws.ref_norm, ws.ref_max)
    print(f"smoke: {fam.name(start)} on {p.short()}{' (TF32 mode)' if tf32 else ''}: error {ours[0]:.2e} "
          f"(max {ours[1]:.2e}), cuDNN {ws.cudnn_error}; {'ok' if why is None else why.detail}")
    return 0 if why is None else 1


if __name__ == "__main__":
    sys.exit(main())
