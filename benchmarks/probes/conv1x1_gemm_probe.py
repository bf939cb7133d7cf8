"""A 1x1 NCHW convolution is a batched GEMM, Y[n] (K x HW) = W (K x C) X[n] (C x HW): how fast is cuBLAS's TF32 GEMM
on it against cuDNN's TF32 convolution (needs a GPU)? Each call is captured 20 times in one CUDA graph per variant;
each round times one replay of each variant in a fixed order (CUDA events), median of 15 rounds. cuDNN in benchmark
mode with allow_tf32 (PyTorch's default for convolutions), the GEMM with matmul TF32 allowed for the probe only.

    python benchmarks/probes/conv1x1_gemm_probe.py --shapes 32x1024x14x256,128x1024x14x256
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from host_floor import capture_graph  # noqa: E402


def graph_time(fn, reps=20):
    """A timer of one replay of ``reps`` calls of ``fn`` in one CUDA graph, per call in us."""
    g = capture_graph(fn, reps)
    g.replay()
    torch.cuda.synchronize()

    def once():
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) * 1000 / reps
    return once


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="32x1024x14x256,128x1024x14x256,1x1024x14x256,32x256x56x64,32x512x28x128")
    args = ap.parse_args()
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = True
    for spec in args.shapes.split(","):
        n, c, h, k = map(int, spec.split("x"))
        x = torch.randn(n, c, h, h, device="cuda")
        w = torch.randn(k, c, 1, 1, device="cuda") / c ** 0.5
        b = torch.randn(k, device="cuda")
        w2 = w.view(k, c)
        xv = x.view(n, c, h * h)
        torch.backends.cuda.matmul.allow_tf32 = True
        ref = F.conv2d(x.double(), w.double(), b.double())
        y_conv = F.conv2d(x, w, b)
        y_mm = (torch.addmm(b[:, None], w2, xv[0]) if n == 1 else torch.matmul(w2, xv) + b[:, None]).view(n, k, h, h)
        err = lambda y: float((y.double() - ref).norm() / ref.norm())
        out_mm = torch.empty(n, k, h * h, device="cuda")
        conv_t = graph_time(lambda: F.conv2d(x, w, b))
        mm_t = graph_time(lambda: torch.matmul(w2, xv, out=out_mm))
        mmb_t = graph_time(lambda: torch.baddbmm(b[None, :, None].expand(n, k, h * h), w2.expand(n, k, c), xv,
                                                 out=out_mm))
        ts = {"cudnn": [], "matmul": [], "baddbmm": []}
        for _ in range(15):
            ts["cudnn"].append(conv_t())
            ts["matmul"].append(mm_t())
            ts["baddbmm"].append(mmb_t())
        med = {k_: statistics.median(v) for k_, v in ts.items()}
        torch.backends.cuda.matmul.allow_tf32 = False
        print(f"N{n} C{c} {h}x{h} K{k}: cuDNN TF32 {med['cudnn']:.1f} us (err {err(y_conv):.2e}), "
              f"cuBLAS TF32 matmul {med['matmul']:.1f} us (err {err(y_mm):.2e}), "
              f"baddbmm with bias {med['baddbmm']:.1f} us; cuDNN / matmul {med['cudnn'] / med['matmul']:.2f}x",
              flush=True)


if __name__ == "__main__":
    main()
