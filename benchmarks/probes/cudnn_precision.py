"""What cuDNN really runs for fp32 convs on this GPU: time and error against float64 under each precision knob.

torch 2.9+ has two ways to forbid TF32 in cuDNN convs: the legacy ``torch.backends.cudnn.allow_tf32 = False``
and ``torch.backends.cudnn.conv.fp32_precision = "ieee"``. This measures AlexNet's conv layers under the
legacy switch, the new switch and TF32 on, and reports each one's median time and its error against a float64
reference. TF32 (10-bit mantissa) shows as a relative error near 1e-3; strict fp32 (direct, FFT or Winograd)
stays near 1e-6. That tells whether "TF32 off" baselines are strict fp32.

    python benchmarks/probes/cudnn_precision.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for bench_layers
from bagf_torch.bench import gpu_tag, time_forward  # noqa: E402
from bench_layers import ALEXNET  # noqa: E402


def set_mode(mode: str) -> None:
    conv = getattr(torch.backends.cudnn, "conv", None)
    if mode == "legacy_off":
        torch.backends.cudnn.allow_tf32 = False
    elif mode == "ieee":
        torch.backends.cudnn.allow_tf32 = False
        if conv is not None:
            conv.fp32_precision = "ieee"
    elif mode == "tf32":
        torch.backends.cudnn.allow_tf32 = True
        if conv is not None:
            conv.fp32_precision = "tf32"


def reset() -> None:
    conv = getattr(torch.backends.cudnn, "conv", None)
    if conv is not None:
        conv.fp32_precision = "none"
    torch.backends.cudnn.allow_tf32 = True


def time_us(fn, reps: int = 50) -> float:
    return time_forward(fn, runs=reps, warmup=5).median_us


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="1,32,128")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("cudnn_precision: no CUDA GPU here")
        return 2
    torch.backends.cudnn.benchmark = True
    rows = []
    for n in [int(b) for b in args.batch.split(",")]:
        for name, c, hw, k, ks, st, pd in ALEXNET:
            g = torch.Generator(device="cuda").manual_seed(n * 100 + k)
            x = torch.randn(n, c, hw, hw, device="cuda", generator=g)
            w = torch.randn(k, c, ks, ks, device="cuda", generator=g) / (c * ks * ks) ** 0.5
            b = torch.randn(k, device="cuda", generator=g)
            ref = F.conv2d(x.double(), w.double(), b.double(), st, pd)
            scale = ref.abs().max().item()
            row = {"layer": name, "n": n}
            for mode in ("legacy_off", "ieee", "tf32"):
                reset()
                set_mode(mode)
                y = F.conv2d(x, w, b, st, pd)
                err = (y.double() - ref).abs().max().item() / scale
                us = time_us(lambda: F.conv2d(x, w, b, st, pd))
                flops = 2.0 * n * k * ref.shape[2] * ref.shape[3] * c * ks * ks
                row[mode] = {"us": us, "rel_err": err, "tflops": flops / us / 1e6}
            reset()
            rows.append(row)
            print(f"{name} N={n:<4} " + "  ".join(
                f"{m}: {row[m]['us']:8.1f} us err {row[m]['rel_err']:.1e} ({row[m]['tflops']:.0f} TF/s)"
                for m in ("legacy_off", "ieee", "tf32")), flush=True)
    meta = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "cudnn": torch.backends.cudnn.version(), "cuda": torch.version.cuda}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"cudnn_precision_{gpu_tag()}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
