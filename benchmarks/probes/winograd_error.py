"""fp32 error of Winograd F(2x2,3x3) to F(6x6,3x3) against float64, next to direct fp32, on real layer shapes
(AlexNet's conv1 through its polyphase components: 3x3 over 48 channels, as winograd_gemm computes it).

Runs anywhere (the arithmetic is bagf_torch.winograd_math's plain-torch reference, in float32 on the CPU), so the
numbers are the algorithm's rounding, not any GPU kernel's; a GPU kernel that sums in another order lands
near them. Writes JSON and a Markdown table.

    python benchmarks/probes/winograd_error.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

import torch


from bagf_torch import winograd_math as winograd  # noqa: E402
from bagf_torch.problem import ConvProblem  # noqa: E402
from bagf_torch.tuning.measure import REL_TOL  # noqa: E402

LAYERS = {  # name: (C, H=W, K, R=S, stride, padding); the strided one through its polyphase components
    "alexnet_conv1": (3, 224, 64, 11, 4, 2),
    "alexnet_conv3": (192, 13, 384, 3, 1, 1),
    "alexnet_conv4": (384, 13, 256, 3, 1, 1),
    "alexnet_conv5": (256, 13, 256, 3, 1, 1),
    "r3x3_128_28": (128, 28, 128, 3, 1, 1),
    "r3x3_256_56": (256, 56, 256, 3, 1, 1),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seeds", type=int, default=3, help="fresh data per seed; the worst is reported")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = []
    for name, (c, hw, k, r, st, pd) in LAYERS.items():
        p = ConvProblem(n=args.batch, c=c, h=hw, w=hw, k=k, r=r, s=r, stride=(st, st), padding=(pd, pd))
        for m in winograd.TILES:
            errs = [winograd.fp32_error(p, m, seed) for seed in range(args.seeds)]
            worst = {key: max(e[key] for e in errs) for key in errs[0]}
            rows.append({"layer": name, "n": args.batch, "m": m, **worst,
                         "multiply_reduction": p.macs / winograd.multiplies(p, m)})
            print(f"{name} F({m}x{m},3x3): max {worst['winograd_max']:.2e} norm {worst['winograd_norm']:.2e}  "
                  f"(direct fp32 max {worst['direct_max']:.2e})", flush=True)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "python": platform.python_version(), "device": "cpu",
            "seeds": args.seeds, "check_tolerance_norm": REL_TOL, "check_tolerance_max": 10 * REL_TOL}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "winograd_error_cpu.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = ["# Winograd fp32 error against float64 (CPU reference arithmetic)", "",
             f"{meta['date']}; torch {meta['torch']}; N={args.batch}, worst of {args.seeds} seeds of unit-normal "
             "input and 1/sqrt(fan-in) weights. `max` = max|err| / max|ref|, `norm` = ||err|| / ||ref|| (what "
             f"the tuner's check bounds by {REL_TOL:.0e}, and max by {10 * REL_TOL:.0e}). alexnet_conv1 (11x11, "
             "stride 4) is computed through its 4 x 4 polyphase components (3x3 filters over 48 channels, "
             "`winograd_math.polyphase`); its multiplies saved count the padded filter's zeros as products.", "",
             "| layer | F(m,3) | multiplies saved | Winograd max | Winograd norm | direct fp32 max | direct fp32 norm |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['layer']} | F({r['m']}x{r['m']}) | {r['multiply_reduction']:.2f}x | {r['winograd_max']:.2e} | "
                     f"{r['winograd_norm']:.2e} | {r['direct_max']:.2e} | {r['direct_norm']:.2e} |")
    (out / "winograd_error_cpu.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
