"""Run kernel configurations under compute-sanitizer (memcheck) on odd shapes: the evidence behind running
tuning candidates in the user's process (docs/architecture.md, "Contracts": the space only holds configurations that are in bounds).

The parent compiles the configurations (into a scratch cache) and then runs itself under
``compute-sanitizer --tool memcheck`` as a child that loads every cubin from that cache and launches it on
shapes chosen to hit every edge (partial tiles in K and N*P*Q, C*R*S not a multiple of BK or 4, padding
reaching outside the input, misaligned weights; for the Winograd family 3x3 stride-1 shapes with output
sizes that are not multiples of its tiles, a 1x1 output and C off every chunk; for winograd_gemm also strided
shapes, which it computes through their polyphase components). Each family is swept on
the shapes it applies to, in each dtype and memory format it computes (kernels.formats: the 16-bit families in
float16 and bfloat16, NCHW and channels_last). Any out-of-bounds access fails the run.

    python scripts/sanitize_space.py --count 256 --out sanitize.json       (on the GPU machine)
    python scripts/sanitize_space.py --families winograd --count 128
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


SHAPES = [  # n, c, h, w, k, r, s, stride, pad, dil
    (1, 3, 9, 7, 5, 3, 3, 1, 1, 1),
    (2, 5, 13, 11, 17, 5, 3, 2, 2, 1),
    (1, 7, 23, 19, 33, 11, 11, 4, 2, 1),
    (3, 9, 6, 10, 130, 3, 3, 1, 3, 2),
    (2, 37, 13, 11, 70, 3, 3, 1, 1, 1),
    (1, 19, 3, 3, 9, 3, 3, 1, 0, 1),
    (2, 130, 7, 6, 33, 3, 3, 1, 2, 1),
    (1, 3, 21, 19, 9, 7, 7, 2, 3, 1),
    (2, 4, 9, 12, 11, 5, 5, 1, 2, 1),
    (2, 3, 26, 22, 10, 5, 5, 2, 2, 1),
    (1, 2, 20, 17, 6, 7, 7, 3, 1, 1),
    (1, 2, 15, 13, 5, 6, 6, 2, 4, 1),
]
"""Every specialised direct geometry (11/4, 7/2, 5/1, 3/1: kernels.direct.GEOMETRIES) has a shape here, and
winograd_gemm's polyphase form (stride s, filters up to 3s x 3s) four: 11x11/4, 5x5/2, 7x7/3 (C' = 18, off the
GEMM's 16-byte path) and 6x6/2 with padding larger than the stride."""


def _problem(shape, tf32: bool = False, fmt: tuple[str, str] = ("float32", "nchw")):
    from bagf_torch.problem import ConvProblem

    n, c, h, w, k, r, s, st, pd, dl = shape
    return ConvProblem(n=n, c=c, h=h, w=w, k=k, r=r, s=s, stride=(st, st), padding=(pd, pd), dilation=(dl, dl),
                       tf32=tf32, dtype=fmt[0], layout=fmt[1])


def _shapes(fam, fmt: tuple[str, str] = ("float32", "nchw")) -> list:
    """The shapes the family computes in ``fmt`` in either precision mode (a TF32-mode family's products are TF32:
    its error stays far inside the sweep's 1e-3). In channels_last, not the shapes whose input would be contiguous
    too (C = 1, or H = W = 1): those are NCHW problems."""
    applies = getattr(fam, "applies", None)
    return [sh for sh in SHAPES
            if (fmt[1] == "nchw" or (sh[1] > 1 and sh[2] * sh[3] > 1))
            and (applies is None or applies(_problem(sh, fmt=fmt)) is None
                 or applies(_problem(sh, tf32=True, fmt=fmt)) is None)]


TOLERANCE = {"float32": 1e-3, "float16": 1e-2, "bfloat16": 3e-2}
"""The sweep's bound on the worst element over the largest reference magnitude, per dtype (a 16-bit output is
rounded once: bfloat16 to 2^-9 of each value). The sweep is after memory errors and unwritten outputs; the tests
hold each dtype to twice cuDNN's error."""


def _configs(fam, count: int, seed: int, only: str = ""):
    """The family's DEFAULT and a seeded sample of its valid configurations; with ``only`` = "KNOB=v1,v2" the
    sample is drawn from the configurations with KNOB in those values (DEFAULT not forced in), e.g. "GE=6,7"
    for winograd_gemm's wgmma GEMM."""
    valid = fam.space().valid_configs()
    first = [fam.DEFAULT]
    if only:
        knob, values = only.split("=")
        valid = [c for c in valid if str(c.get(knob)) in values.split(",")]
        first = []
    if count >= len(valid):
        return valid
    rng = random.Random(seed)
    return first + rng.sample([c for c in valid if c not in first], count - len(first))


def child(cache_dir: str, families: list[str], count: int, seed: int, only: str = "") -> int:
    import torch
    import torch.nn.functional as F

    from bagf_torch.cache import Cache
    from bagf_torch.jit.compiler import STATS, KernelCompiler
    from bagf_torch.kernels import FAMILIES

    from bagf_torch.kernels import formats

    compiler = KernelCompiler(Cache.for_dir(cache_dir), 0, workers=1)
    wrong, launched = [], 0
    for fname in families:
        fam = FAMILIES[fname]
        configs = _configs(fam, count, seed, only)
        built = compiler.compile(fam, configs)
        assert STATS.nvrtc_compiles == 0, "child should only load cached cubins"
        rule = getattr(fam, "problem_rule", None)
        for fmt in formats(fam):  # each dtype and memory format the family computes, its configurations for it
            dtype = getattr(torch, fmt[0])
            mf = torch.channels_last if fmt[1] == "nhwc" else torch.contiguous_format
            for n, c, h, w, k, r, s, st, pd, dl in _shapes(fam, fmt):
                x = torch.randn(n, c, h, w).to(dtype)
                base = torch.randn(k * c * r * s + 1).to(dtype)
                for misaligned in (False, True):
                    # the weight in the format's layout, one element off 16-byte alignment when misaligned
                    flat = base.cuda()[1:] if misaligned else base.cuda()[:-1]
                    wt = base[:-1].view(k, c, r, s).contiguous(memory_format=mf)
                    wg = flat.as_strided(wt.shape, wt.stride())
                    wg.copy_(wt.cuda())
                    b = torch.randn(k).to(dtype)
                    ref = F.conv2d(x.double(), wt.double(), b.double(), st, pd, dl)
                    xg, bg = x.cuda().contiguous(memory_format=mf), b.cuda()
                    problem = _problem((n, c, h, w, k, r, s, st, pd, dl), fmt=fmt)
                    for cfg, b_ in zip(configs, built):
                        if not hasattr(b_, "handle"):
                            continue  # reported by the parent
                        if rule is not None and rule(cfg, problem) is not None:
                            continue  # compiled for another geometry, dtype or format: the host refuses it
                        out = torch.full(ref.shape, float("nan"), device="cuda", dtype=dtype).contiguous(
                            memory_format=mf)
                        compiler.ext.conv2d_inference(xg, wg, bg, [st, st], [pd, pd], [dl, dl], b_.handle, out=out)
                        launched += 1
                        err = (out.double().cpu() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)
                        if not err < TOLERANCE[fmt[0]]:
                            wrong.append((fam.name(cfg), fmt, (n, c, h, w, k, r, s, st, pd, dl), misaligned, err))
    torch.cuda.synchronize()
    print(json.dumps({"families": families, "launches": launched, "wrong": wrong[:20]}))
    return 1 if wrong else 0


def main() -> int:
    from bagf_torch.kernels import FAMILIES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(FAMILIES), help=f"comma-separated, of {sorted(FAMILIES)}")
    ap.add_argument("--count", type=int, default=256,
                    help="configurations to sweep per family (all if >= its space size)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="sanitize.json")
    ap.add_argument("--only", default="", help='sample only configurations with KNOB in values, "KNOB=v1,v2"')
    ap.add_argument("--child", metavar="CACHE_DIR", help=argparse.SUPPRESS)
    args = ap.parse_args()
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        ap.error(f"unknown families {unknown}; known: {sorted(FAMILIES)}")
    if args.child:
        return child(args.child, families, args.count, args.seed, args.only)

    from bagf_torch.cache import Cache
    from bagf_torch.jit.compiler import KernelCompiler

    sanitizer = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    scratch = tempfile.mkdtemp(prefix="bagf_sanitize_")
    t0 = time.perf_counter()
    compiler = KernelCompiler(Cache.for_dir(scratch), 0, workers=os.cpu_count() or 4)
    per_family, failed = {}, []
    for fname in families:
        fam = FAMILIES[fname]
        configs = _configs(fam, args.count, args.seed, args.only)
        built = compiler.compile(fam, configs)
        failed += [(fam.name(c), b.status) for c, b in zip(configs, built) if not hasattr(b, "handle")]
        for b in built:
            if hasattr(b, "handle"):
                compiler.unload(b.handle)
        per_family[fname] = {"configs": len(configs), "space_valid": len(fam.space().valid_configs()),
                             "shapes": 2 * len(_shapes(fam))}
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    cmd = [sanitizer, "--tool", "memcheck", "--error-exitcode", "9", "--print-limit", "20",
           sys.executable, __file__, "--families", ",".join(families), "--count", str(args.count),
           "--seed", str(args.seed), "--only", args.only, "--child", scratch]
    res = subprocess.run(cmd, capture_output=True, text=True)
    import datetime
    import platform

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_overhead import git_commit  # GIT_COMMIT on the device's copy, else HEAD (+dirty)

    report = {
        "meta": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
                 "python": platform.python_version(), "commit": git_commit(),
                 "command": "python scripts/sanitize_space.py " + " ".join(sys.argv[1:])},
        "families": per_family, "compile_failures": failed, "compile_seconds": round(compile_s, 1),
        "sanitizer_seconds": round(time.perf_counter() - t0, 1), "sanitizer_exit": res.returncode,
        "sanitizer_tail": res.stdout[-2000:] + res.stderr[-2000:],
    }
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "sanitizer_tail"}))
    print(report["sanitizer_tail"])
    return 0 if res.returncode == 0 and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
