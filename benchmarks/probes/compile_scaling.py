"""How the tuner's NVRTC compiles scale with the compile pool's size on this machine.

    python benchmarks/probes/compile_scaling.py [--workers 4,8,12,16] [--count 32] [--rounds 2]
        [--families winograd_gemm,implicit_gemm_tc] [--out DIR]

Each run compiles ``--count`` configurations of a family through a ``KernelCompiler`` with a pool of one size,
the sizes interleaved over ``--rounds`` rounds, through a cache that never hits and stores nothing. Every run
gets its own kernels (disjoint parts of one seeded sample of the family's distinct kernels): compiling a
configuration a second time in a process took a fraction of its first NVRTC run on the H200 (0.28 s against
2.81 s on average for winograd_gemm), which made sizes timed on a set compiled before look fast. One untimed
compile per family comes first (the process's first NVRTC run loads NVRTC), and the JSON is rewritten after
every run, so a timeout keeps the runs that finished. Reported per family and
size: the wall time of the whole set, compiles per second, and the mean seconds of one NVRTC call (how much
each compile slows when more run at once). The tuner's budget is spent in such waves: a pool that finishes a
wave sooner gives a problem more evaluations in the same seconds (``settings.compile_workers``). Writes
``compile_scaling.json`` under ``--out`` when given.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path


class NoCache:
    """A cubin cache that never hits and keeps nothing: every compile runs NVRTC."""

    def get_cubin(self, digest):
        return None

    def put_cubin(self, digest, name, lowered, cubin):
        pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", default="4,8,12,16", help="pool sizes, comma-separated")
    ap.add_argument("--count", type=int, default=32, help="configurations per family")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--families", default="winograd_gemm,implicit_gemm_tc")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    import torch

    from bagf_torch import settings
    from bagf_torch.jit import compiler as jc
    from bagf_torch.kernels import FAMILIES
    from bagf_torch.outcome import Outcome

    torch.cuda.init()
    sizes = [int(w) for w in args.workers.split(",")]
    rng = random.Random(args.seed)
    runs = args.rounds * len(sizes)
    probe = jc.KernelCompiler(NoCache(), 0, 1)  # names digests; compiles the untimed warm-up
    sets = {}
    for name in args.families.split(","):
        fam = FAMILIES[name]
        # one configuration per kernel: configurations that differ only in a launch parameter share one compile
        kernels = {}
        for c in fam.space().valid_configs():
            kernels.setdefault(probe.digest(fam, c), c)
        picked = rng.sample(list(kernels.values()), min(args.count * runs + 1, len(kernels)))
        # The first NVRTC run of a process pays for loading NVRTC itself: one untimed compile per family first.
        probe._cubins([jc.KernelSpec(fam, dict(picked[0]), probe.arch)])
        sets[name] = (fam, [picked[1 + i::runs] for i in range(runs)])  # a fresh set for every run
    rows: list[dict] = []
    summary: list[dict] = []

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench_overhead import write_probe_json

    def write() -> None:  # after every run: a timeout keeps what has finished
        if args.out is not None:
            write_probe_json(args.out, "probes/compile_scaling.py", argv,
                             {"cpu_count": os.cpu_count(), "usable_cpus": settings.usable_cpus(),
                              "rows": rows, "summary": summary})

    for r in range(args.rounds):
        order = list(enumerate(sizes))
        if r % 2:
            order.reverse()
        for name, (fam, parts) in sets.items():
            for j, w in order:
                configs = parts[r * len(sizes) + j]
                if not configs:
                    print(f"{name}: the space has too few kernels for a run of {w} threads in round {r}", flush=True)
                    continue
                comp = jc.KernelCompiler(NoCache(), 0, w)
                t0 = time.perf_counter()
                got = comp._cubins([jc.KernelSpec(fam, dict(c), comp.arch) for c in configs])
                wall = time.perf_counter() - t0
                times = [g[2] for g in got if not isinstance(g, Outcome) and g[2] > 0]
                failed = sum(1 for g in got if isinstance(g, Outcome))
                row = {"family": name, "workers": w, "round": r, "configs": len(configs), "compiled": len(times),
                       "failed": failed, "wall_s": wall, "per_s": len(configs) / wall,
                       "mean_nvrtc_s": statistics.mean(times) if times else None,
                       "max_nvrtc_s": max(times) if times else None}
                rows.append(row)
                print(json.dumps(row), flush=True)
                write()
    for name in sets:
        for w in dict.fromkeys(sizes):
            # runs with a failed compile are left out: a failure ends sooner than a compile
            mine = [x for x in rows if x["family"] == name and x["workers"] == w and not x["failed"]]
            means = [x["mean_nvrtc_s"] for x in mine if x["mean_nvrtc_s"] is not None]
            if not mine:
                continue
            summary.append({"family": name, "workers": w, "runs": len(mine),
                            "configs": sum(x["configs"] for x in mine),
                            "wall_s_median": statistics.median(x["wall_s"] for x in mine),
                            "per_s_median": statistics.median(x["per_s"] for x in mine),
                            "mean_nvrtc_s_median": statistics.median(means) if means else None})
            print(json.dumps(summary[-1]), flush=True)
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
