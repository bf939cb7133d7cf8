"""How long a process takes to end after its last line of output: the tune command's exit, and what it is made of.

    python benchmarks/probes/exit_cost.py [--rounds 2] [--cases torch,+ax,+tv,+bagf,tune] [--out DIR]

Each case runs in a fresh process whose output lines the parent timestamps as they arrive; the exit cost is the
time from the last line to the process's end (interpreter shutdown: atexit handlers, module teardown, CUDA's).
Cases: ``torch`` (CUDA initialised, one tensor on the GPU), ``+ax`` (and ``ax.api.client`` imported), ``+tv`` (and
torchvision), ``+bagf`` (and a bagf_torch compiler with one compile, as a tuning leaves it), and ``tune``, the tune
command itself on AlexNet at N = 1 with 2 s per problem (its last line is the report's path). Writes
``exit_cost.json`` under ``--out`` when given.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import sys
import torch
torch.cuda.init()
x = torch.randn(1024, device="cuda")
torch.cuda.synchronize()
if "ax" in sys.argv[1:]:
    import ax.api.client  # noqa: F401
if "tv" in sys.argv[1:]:
    import torchvision  # noqa: F401
if "bagf" in sys.argv[1:]:
    from bagf_torch import runtime
    from bagf_torch.kernels import implicit_gemm_tc as fam
    dev = runtime.get().device(0)
    dev.compiler.compile(fam, [dict(fam.DEFAULT)])
print("done", flush=True)
"""


def timed_lines(cmd: list[str]) -> tuple[float, float, int]:
    """(seconds to the last output line, seconds from it to the process's end, return code). The child's output is
    unbuffered, so that a line arrives when it is printed, not when the interpreter flushes it on its way out."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=dict(os.environ, PYTHONUNBUFFERED="1"))
    last = t0
    for _ in p.stdout:
        last = time.perf_counter()
    rc = p.wait()
    end = time.perf_counter()
    return last - t0, end - last, rc



def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--cases", default="torch,+ax,+tv,+bagf,tune", help="comma-separated, of the five above")
    args = ap.parse_args(argv)
    wanted = args.cases.split(",")
    cases = {k: v for k, v in {"torch": [], "+ax": ["ax"], "+tv": ["ax", "tv"], "+bagf": ["ax", "tv", "bagf"]}.items()
             if k in wanted}
    rows = []
    for r in range(args.rounds):
        for name, flags in cases.items():
            to_last, exit_s, rc = timed_lines([sys.executable, "-c", CHILD, *flags])
            rows.append({"case": name, "round": r, "to_last_line_s": to_last, "exit_s": exit_s, "rc": rc})
            print(json.dumps(rows[-1]), flush=True)
        if "tune" not in wanted:
            continue
        with tempfile.TemporaryDirectory() as d:
            to_last, exit_s, rc = timed_lines([sys.executable, "-m", "bagf_torch", "tune", "--model", "alexnet",
                                               "--batch", "1", "--seconds", "2", "--tf32", "off", "--no-progress",
                                               "--cache", d, "--json", str(Path(d) / "t.json")])
        rows.append({"case": "tune", "round": r, "to_last_line_s": to_last, "exit_s": exit_s, "rc": rc})
        print(json.dumps(rows[-1]), flush=True)
    if args.out is not None:  # (torch imported only now: first, it would warm what the children import)
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from bench_overhead import write_probe_json

        write_probe_json(args.out, "probes/exit_cost.py", argv, {"rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
