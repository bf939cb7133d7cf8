"""fp32 error of Winograd F(2x2,3x3) to F(6x6,3x3) against float64, next to direct fp32, on real layer shapes
(AlexNet's conv1 through its polyphase components: 3x3 over 48 channels, as winograd_gemm computes it).

``--tf32``: the same with TF32 products (operands rounded to TF32 as ``cvt.rna.tf32.f32`` does, sums and transforms
in float32), next to a direct convolution of TF32-rounded input and weights (what a TF32 implicit GEMM computes; on
AlexNet's layers it lands on cuDNN's own TF32 error measured on the H200, benchmarks/results/cudnn_precision_h200.log).
A tile may take TF32 products where its error stays within ``--factor`` (2) x the direct TF32 error on every layer,
both metrics: the rule a TF32 mode's Winograd tiles follow. Writes winograd_error_tf32_cpu.{json,md}.

``--dtype bfloat16`` / ``--dtype float16``: on tensors of that dtype, Winograd with 16-bit products (the transforms in
float32, the Winograd-domain operands rounded to the dtype, products summed in float32, the output rounded once)
and with float32 products, next to the direct convolution summed in float32 and rounded once (what the 16-bit
implicit GEMMs compute; cuDNN's own 16-bit error on the H200 is 1.28-1.30x it). A tile may take 16-bit products
where its error stays within ``--factor`` (2) x that direct error on every layer, both metrics: stricter than the
tuner's check (twice cuDNN's error). Writes winograd_error_{bf16,fp16}_cpu.{json,md}.

Runs anywhere (the arithmetic is bagf_torch.winograd_math's plain-torch reference, in float32 on the CPU), so the
numbers are the algorithm's rounding, not any GPU kernel's; a GPU kernel that sums in another order lands
near them. Writes JSON and a Markdown table.

    python benchmarks/probes/winograd_error.py --out benchmarks/results
    python benchmarks/probes/winograd_error.py --tf32 --out benchmarks/results
    python benchmarks/probes/winograd_error.py --dtype bfloat16 --out benchmarks/results
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
    ap.add_argument("--tf32", action="store_true", help="TF32 products (see the docstring)")
    ap.add_argument("--dtype", choices=("bfloat16", "float16"), help="16-bit tensors (see the docstring)")
    ap.add_argument("--factor", type=float, default=2.0,
                    help="--tf32, --dtype: allowed error over the direct convolution's in the same mode (2)")
    args = ap.parse_args(argv)
    if args.dtype:
        return h16_main(args)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = []
    for name, (c, hw, k, r, st, pd) in LAYERS.items():
        p = ConvProblem(n=args.batch, c=c, h=hw, w=hw, k=k, r=r, s=r, stride=(st, st), padding=(pd, pd))
        for m in winograd.TILES:
            errs = [winograd.fp32_error(p, m, seed, tf32=args.tf32) for seed in range(args.seeds)]
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
    if args.tf32:
        return write_tf32(out, meta, rows, args)
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


def tf32_verdicts(rows: list[dict], factor: float) -> dict[int, bool]:
    """Per tile m: whether its TF32 error is within ``factor`` x the direct TF32 error on every layer, max and norm."""
    ok: dict[int, bool] = {}
    for r in rows:
        within = r["winograd_max"] <= factor * r["direct_max"] and r["winograd_norm"] <= factor * r["direct_norm"]
        ok[r["m"]] = ok.get(r["m"], True) and within
    return ok


def write_tf32(out: Path, meta: dict, rows: list[dict], args) -> int:
    verdicts = tf32_verdicts(rows, args.factor)
    meta.update(tf32=True, factor=args.factor, command=" ".join(["python", "benchmarks/probes/winograd_error.py",
                                                                 *(sys.argv[1:])]))
    (out / "winograd_error_tf32_cpu.json").write_text(json.dumps({"meta": meta, "verdicts": verdicts, "rows": rows},
                                                                indent=1))
    lines = ["# Winograd error with TF32 products against float64 (CPU emulation)", "",
             f"{meta['date']}; torch {meta['torch']}, Python {meta['python']}; N={args.batch}, worst of {args.seeds} "
             "seeds of unit-normal input and 1/sqrt(fan-in) weights.", "", f"Command: `{meta['command']}`", "",
             "Winograd TF32: the transforms in float32, the Winograd-domain operands rounded to TF32 (to nearest, ties "
             "away: `cvt.rna.tf32.f32`), their products summed in float32. Direct TF32: input and weights rounded "
             "the same way, a float32 convolution of them, what a TF32 implicit GEMM computes; on AlexNet's layers "
             "its max error (2.1e-4 to 2.4e-4 here) lands on cuDNN's own TF32 error measured on the H200 (1.9e-4 to "
             "2.4e-4, `cudnn_precision_h200.log`). `max` = max|err| / max|ref|, `norm` = ||err|| / ||ref||. x direct "
             f"= Winograd's over direct's, the larger of the two metrics; a tile may take TF32 products where that stays "
             f"within {args.factor:g} on every layer.", "",
             "| layer | F(m,3) | Winograd TF32 max | Winograd TF32 norm | direct TF32 max | direct TF32 norm | x direct |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        x = max(r["winograd_max"] / r["direct_max"], r["winograd_norm"] / r["direct_norm"])
        lines.append(f"| {r['layer']} | F({r['m']}x{r['m']}) | {r['winograd_max']:.2e} | {r['winograd_norm']:.2e} | "
                     f"{r['direct_max']:.2e} | {r['direct_norm']:.2e} | {x:.2f} |")
    lines += ["", "Within the rule on every layer: " + ", ".join(
        f"F({m}x{m}) {'yes' if ok else 'no'}" for m, ok in sorted(verdicts.items())) + "."]
    (out / "winograd_error_tf32_cpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


H16_SHORT = {"bfloat16": "bf16", "float16": "fp16"}


def h16_verdicts(rows: list[dict], factor: float) -> dict[int, bool]:
    """Per tile m: whether its 16-bit-product error is within ``factor`` x the direct 16-bit error on every layer,
    max and norm."""
    ok: dict[int, bool] = {}
    for r in rows:
        within = r["winograd16_max"] <= factor * r["direct_max"] and r["winograd16_norm"] <= factor * r["direct_norm"]
        ok[r["m"]] = ok.get(r["m"], True) and within
    return ok


def h16_main(args) -> int:
    dtype = getattr(torch, args.dtype)
    rows = []
    for name, (c, hw, k, r, st, pd) in LAYERS.items():
        p = ConvProblem(n=args.batch, c=c, h=hw, w=hw, k=k, r=r, s=r, stride=(st, st), padding=(pd, pd))
        for m in winograd.TILES:
            errs = [winograd.h16_error(p, m, dtype, seed) for seed in range(args.seeds)]
            worst = {key: max(e[key] for e in errs) for key in errs[0]}
            rows.append({"layer": name, "n": args.batch, "m": m, **worst})
            print(f"{name} F({m}x{m}): 16-bit products norm {worst['winograd16_norm']:.2e}, direct "
                  f"{worst['direct_norm']:.2e}", flush=True)
    verdicts = h16_verdicts(rows, args.factor)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "python": platform.python_version(), "device": "cpu", "dtype": args.dtype,
            "seeds": args.seeds, "factor": args.factor,
            "command": " ".join(["python", "benchmarks/probes/winograd_error.py", *(sys.argv[1:])])}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"winograd_error_{H16_SHORT[args.dtype]}_cpu"
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "verdicts": verdicts, "rows": rows}, indent=1))
    lines = [f"# Winograd error on {args.dtype} tensors against float64 (CPU emulation)", "",
             f"{meta['date']}; torch {meta['torch']}, Python {meta['python']}; N={args.batch}, worst of {args.seeds} "
             f"seeds of unit-normal input and 1/sqrt(fan-in) weights, rounded to {args.dtype}; the reference is the "
             "float64 convolution of those 16-bit values.", "", f"Command: `{meta['command']}`", "",
             f"Winograd 16-bit: the transforms in float32, the Winograd-domain operands rounded to {args.dtype} (to "
             "nearest even), their products summed in float32, the bias added in float32, the output rounded once. "
             "Winograd fp32: float32 products (what winograd_gemm computes on 16-bit tensors). Direct: float32 sums "
             "rounded once, what the 16-bit implicit GEMMs compute (on the H200 their error on AlexNet's layers is "
             "1.65-1.66e-3 / 2.07e-4 of the output's norm in bf16 / fp16, cuDNN's 1.28-1.30x that: "
             "`bench_layers_h200_{bf16,fp16}_nhwc.md`). `max` = max|err| / max|ref|, `norm` = ||err|| / ||ref||. "
             f"x direct = Winograd 16-bit's over direct's, the larger of the two metrics; a tile may take 16-bit "
             f"products where that stays within {args.factor:g} on every layer (twice the direct error: stricter "
             "than the tuner's check, twice cuDNN's).", "",
             "| layer | F(m,3) | Winograd 16-bit max | Winograd 16-bit norm | Winograd fp32 norm | direct max | "
             "direct norm | x direct |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        x = max(r["winograd16_max"] / r["direct_max"], r["winograd16_norm"] / r["direct_norm"])
        lines.append(f"| {r['layer']} | F({r['m']}x{r['m']}) | {r['winograd16_max']:.2e} | "
                     f"{r['winograd16_norm']:.2e} | {r['winograd32_norm']:.2e} | {r['direct_max']:.2e} | "
                     f"{r['direct_norm']:.2e} | {x:.2f} |")
    lines += ["", "Within the rule on every layer: " + ", ".join(
        f"F({m}x{m}) {'yes' if ok else 'no'}" for m, ok in sorted(verdicts.items())) + "."]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
