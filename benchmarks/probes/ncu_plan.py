"""Run named plans a few times each on their layer, for a profiler to capture (``ncu ... python
benchmarks/probes/ncu_plan.py PLAN@LAYER:N ...``), and print each one's CUDA-event time.

A plan is ``<family name>@<layer>:<N>`` as in host_floor.py. Each plan is checked against float64 first, then
launched ``--launches`` times (ncu: ``--launch-skip``/``--launch-count`` pick among them). A family that computes
TF32 mode only (e.g. implicit_gemm_wgmma) runs its layer as a TF32-mode problem, checked against cuDNN's TF32 error.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from host_floor import parse_plan  # noqa: E402

from bagf_torch import runtime  # noqa: E402
from bagf_torch.tuning.measure import CudaBenchmarker, CudaChecker, Workspace  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plans", nargs="+", help="<family name>@<layer>:<N>")
    ap.add_argument("--launches", type=int, default=3)
    args = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = runtime.get().device(0)
    checker = CudaChecker(dev.compiler.ext)
    for spec in args.plans:
        fam, cfg, p = parse_plan(spec)
        applies = getattr(fam, "applies", None)
        if applies is not None and applies(p) is not None and applies(dataclasses.replace(p, tf32=True)) is None:
            p = dataclasses.replace(p, tf32=True)
        name = fam.name(cfg)
        handle = dev.compiler.compile(fam, [cfg])[0].handle
        ws = Workspace(p, torch.device("cuda", 0))  # (a TF32 problem's bound follows cuDNN's TF32 error)
        bad = checker.check(ws, handle)
        assert bad is None, (name, bad)
        call = ws.op_call(handle)
        for _ in range(args.launches):
            call()
        torch.cuda.synchronize()
        print(f"{spec}: {CudaBenchmarker().timing(call).median_us:.1f} us", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
