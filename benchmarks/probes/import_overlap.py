"""Whether the search strategy's import (Ax) overlaps a model library's import (torchvision) when it runs on a
second thread: each mode in a fresh process, the first run on a cold page cache where the machine is fresh.

    python benchmarks/probes/import_overlap.py [--rounds 2] [--out DIR]

Modes: ``seq`` imports torchvision, then ``ax.api.client`` (what ``from ax import Client`` loads), on the main
thread; ``par`` starts the Ax import on a daemon thread first (as ``strategies.preload`` does), then imports
torchvision on the main thread and waits for both. Per mode: seconds until torchvision is imported (what the tune
command's model check waits for) and until both are. Writes ``import_overlap.json`` under ``--out`` when given.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, sys, threading, time
import torch
t0 = time.perf_counter()
if sys.argv[1] == "par":
    def load():
        import ax.api.client  # noqa: F401
    th = threading.Thread(target=load, daemon=True)
    th.start()
    import torchvision  # noqa: F401
    t1 = time.perf_counter()
    th.join()
else:
    import torchvision  # noqa: F401
    t1 = time.perf_counter()
    import ax.api.client  # noqa: F401
t2 = time.perf_counter()
print(json.dumps({"mode": sys.argv[1], "torchvision_s": t1 - t0, "both_s": t2 - t0}))
"""



def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    runs = []
    for r in range(args.rounds):
        for mode in ("par", "seq"):
            out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            row["round"] = r
            runs.append(row)
            print(json.dumps(row), flush=True)
    if args.out is not None:  # (torch imported only now: first, it would warm what the children import)
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from bench_overhead import write_probe_json

        write_probe_json(args.out, "probes/import_overlap.py", argv, {"runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
