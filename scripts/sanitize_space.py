"""Run kernel configurations under compute-sanitizer (memcheck) on odd shapes: the evidence behind running
tuning candidates in the user's process (DESIGN.md: "the space only holds configurations proven in-bounds").

The parent compiles the configurations (into a scratch cache) and then runs itself under
``compute-sanitizer --tool memcheck`` as a child that loads every cubin from that cache and launches it on
shapes chosen to hit every edge (partial tiles in K and N*P*Q, C*R*S not a multiple of BK or 4, padding
reaching outside the input, misaligned weights). Any out-of-bounds access fails the run.

    python scripts/sanitize_space.py --count 256 --out sanitize.json       (on the GPU machine)
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = [  # n, c, h, w, k, r, s, stride, pad, dil
    (1, 3, 9, 7, 5, 3, 3, 1, 1, 1),
    (2, 5, 13, 11, 17, 5, 3, 2, 2, 1),
    (1, 7, 23, 19, 33, 11, 11, 4, 2, 1),
    (3, 9, 6, 10, 130, 3, 3, 1, 3, 2),
]


def _configs(count: int, seed: int):
    from bagf_torch.kernels import implicit_gemm as ig

    valid = ig.space().valid_configs()
    if count >= len(valid):
        return valid
    rng = random.Random(seed)
    return [ig.DEFAULT] + rng.sample(valid, count - 1)


def child(cache_dir: str, configs: list[dict]) -> int:
    import torch
    import torch.nn.functional as F

    from bagf_torch.cache import Cache
    from bagf_torch.jit.compiler import STATS, KernelCompiler
    from bagf_torch.kernels import implicit_gemm as ig

    compiler = KernelCompiler(Cache.for_dir(cache_dir), 0, workers=1)
    built = compiler.compile(ig, configs)
    assert STATS.nvrtc_compiles == 0, "child should only load cached cubins"
    wrong = []
    for n, c, h, w, k, r, s, st, pd, dl in SHAPES:
        x = torch.randn(n, c, h, w)
        base = torch.randn(k * c * r * s + 1)
        for misaligned in (False, True):
            wt = (base[1:] if misaligned else base[:-1]).view(k, c, r, s)
            b = torch.randn(k)
            ref = F.conv2d(x.double(), wt.double(), b.double(), st, pd, dl)
            xg, wg, bg = x.cuda(), wt.cuda() if not misaligned else base.cuda()[1:].view(k, c, r, s), b.cuda()
            for cfg, b_ in zip(configs, built):
                out = torch.full(ref.shape, float("nan"), device="cuda")
                compiler.ext.launch_into(b_.handle, xg, wg, bg, out, [st, st], [pd, pd], [dl, dl])
                err = (out.double().cpu() - ref).abs().max().item()
                if not err < 1e-3:
                    wrong.append((ig.name(cfg), (n, c, h, w, k, r, s, st, pd, dl), misaligned, err))
    torch.cuda.synchronize()
    print(json.dumps({"configs": len(configs), "shapes": len(SHAPES) * 2, "wrong": wrong[:20]}))
    return 1 if wrong else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=256, help="configurations to sweep (all if >= space size)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="sanitize.json")
    ap.add_argument("--child", metavar="CACHE_DIR", help=argparse.SUPPRESS)
    args = ap.parse_args()
    configs = _configs(args.count, args.seed)
    if args.child:
        return child(args.child, configs)

    from bagf_torch.cache import Cache
    from bagf_torch.jit.compiler import KernelCompiler
    from bagf_torch.kernels import implicit_gemm as ig

    sanitizer = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    scratch = tempfile.mkdtemp(prefix="bagf_sanitize_")
    t0 = time.perf_counter()
    built = KernelCompiler(Cache.for_dir(scratch), 0, workers=os.cpu_count() or 4).compile(ig, configs)
    failed = [(ig.name(c), b.status) for c, b in zip(configs, built) if not hasattr(b, "handle")]
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    cmd = [sanitizer, "--tool", "memcheck", "--error-exitcode", "9", "--print-limit", "20",
           sys.executable, __file__, "--count", str(args.count), "--seed", str(args.seed), "--child", scratch]
    res = subprocess.run(cmd, capture_output=True, text=True)
    report = {
        "configs": len(configs), "space_valid": len(ig.space().valid_configs()), "shapes": len(SHAPES) * 2,
        "compile_failures": failed, "compile_seconds": round(compile_s, 1),
        "sanitizer_seconds": round(time.perf_counter() - t0, 1), "sanitizer_exit": res.returncode,
        "sanitizer_tail": res.stdout[-2000:] + res.stderr[-2000:],
    }
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "sanitizer_tail"}))
    print(report["sanitizer_tail"])
    return 0 if res.returncode == 0 and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
