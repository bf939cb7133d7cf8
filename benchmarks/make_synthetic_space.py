"""Write a SYNTHETIC recorded-space file for developing strategies before GPU recordings exist.

The times come from ``bagf_torch.tuning.replay.synthetic_times`` (a roofline-style model of implicit_gemm on
an H200-like device, plus seeded noise), for record_space.py's default problems. They are NOT
measurements: the file's meta says ``"synthetic": true`` and it goes under benchmarks/data/synthetic/
(ignored by git), never under a name that looks measured.

    python benchmarks/make_synthetic_space.py            # -> benchmarks/data/synthetic/SYNTHETIC-implicit_gemm-model.json.gz
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from record_space import PROBLEMS  # noqa: E402

from bagf_torch.tuning.replay import synthetic_recording  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "data" / "synthetic" / "SYNTHETIC-implicit_gemm-model.json.gz"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--seed", type=int, default=0, help="landscape seed of the first problem (+1 per problem)")
    ap.add_argument("--problems", default=",".join(PROBLEMS))
    args = ap.parse_args(argv)
    names = [p for p in args.problems.split(",") if p]
    rec = synthetic_recording(args.out, {n: PROBLEMS[n].as_dict() for n in names}, seed=args.seed)
    print(f"wrote SYNTHETIC {args.out}: {len(rec.problems)} problems")
    return 0


if __name__ == "__main__":
    sys.exit(main())
