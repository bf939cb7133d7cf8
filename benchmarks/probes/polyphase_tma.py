"""Does a strided conv with few channels pay as a stride-1 3x3 implicit GEMM over its polyphase form (needs a GPU)?

AlexNet's conv1 (C = 3, 11x11, stride 4) in bfloat16 and float16: its polyphase form (48 channels, 3x3) is an
ordinary 3x3 stride-1 problem with C s^2 = 48 channels (a multiple of 8), which the 16-bit TMA family takes. Its
polyphase plans (``implicit_gemm_tma_h16`` PP = 1) run that form with a gather kernel of their own;
``winograd_gemm``'s fp32 Winograd of the same form also takes it, at the same speed in both dtypes. This probe measures
the route around the library's plan of the original problem (``plan``, whatever the tuner picks: a polyphase plan, or
another family's): the input rearranged by ATen (``F.pad``, a fill and a copy, then one permuting copy to the
polyphase channels_last layout: three kernels), the 3x3 problem tuned as any other
(``tune_model`` on a TunedConv2d over the rearranged input), and, in CUDA graphs interleaved, per batch size:

* ``cudnn``          torch's conv on the original problem, cuDNN in benchmark mode
* ``plan``           the library's plan for the original problem (tuned here, as ``tune`` would)
* ``rearrange``      the ATen rearrangement alone (a custom kernel would replace it: the bound is one read of the
                     input and one write of the rearranged copy)
* ``copy``           a plain copy of the rearranged input (``clone``): about what one custom rearranging kernel,
                     which moves the same bytes, would cost
* ``inner``          the tuned 3x3 plan on the rearranged input alone
* ``inner_cudnn``    cuDNN on the rearranged 3x3 problem (benchmark mode)
* ``polyphase``      rearrange + inner: the whole route as ATen's copy would run it
* ``rearrange_triton`` / ``polyphase_triton``  the same with the rearrangement as one Triton kernel
                     (``triton_rearrange``; its copy checked equal to ATen's first), where Triton is installed

The route's output is checked against float64 ``F.conv2d`` of the original problem on fresh data, beside cuDNN's
error in the same dtype. Writes ``polyphase_tma_<gpu>_<mode>_nhwc.{json,md}`` under ``--out``, again after each
batch size (a run cut short keeps the sizes it finished).

Reading it: the memory-bound rows (rearrange, copy, the Triton gather) of back-to-back replays run from L2 where
input and copy fit its 50 MB (N <= 32 here), so they are cheaper than from HBM; ``(copy + inner)`` adds two graphs'
medians and so counts a graph launch's latency twice (a few us, which matters at N = 1 only); the TMA family
reduces each tap in blocks of 64 channels, so over 48 channels a quarter of its products are zeros, which a
dedicated kernel could skip.

    python benchmarks/probes/polyphase_tma.py --dtype bfloat16 --batch 1,32,128 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import copy
import datetime
import functools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_overhead import command_line, git_commit  # noqa: E402

from bagf_torch.bench import fp32, gpu_tag, graphed, time_interleaved  # noqa: E402
from bagf_torch.nn import TunedConv2d  # noqa: E402
from bagf_torch.pretune import tune_model  # noqa: E402
from bagf_torch.tuning.measure import output_error  # noqa: E402


def rearrange(x: torch.Tensor, s: int, padding: tuple[int, int], p: int, q: int) -> torch.Tensor:
    """The s x s polyphase components of channels_last ``x`` (N, C, H, W) padded by ``padding``, as a channels_last
    (N, s*s*C, p + 2, q + 2) tensor whose channel ``(ph*s + pw)*C + c`` holds ``x_padded[c][s*u + ph][s*v + pw]``
    (channels innermost: each output pixel's 48 values come from s runs of s*C contiguous input values).
    ``winograd_math.polyphase`` computes the same form in the order ``(c*s + ph)*s + pw`` (winograd_gemm's index
    map, which reads NCHW); over a channels_last input that order scatters each pixel's values, which a rearranging
    kernel would pay for, hence this order and ``rearrange_weight`` to match it."""
    n, c, h, w = x.shape
    hp, wp = s * (p + 2), s * (q + 2)
    nhwc = x.permute(0, 2, 3, 1)  # (N, H, W, C), contiguous for a channels_last x
    padded = F.pad(nhwc, (0, 0, padding[1], wp - w - padding[1], padding[0], hp - h - padding[0]))
    phases = padded.reshape(n, p + 2, s, q + 2, s, c).permute(0, 1, 3, 2, 4, 5).contiguous()
    return phases.reshape(n, p + 2, q + 2, s * s * c).permute(0, 3, 1, 2)


def triton_rearrange():
    """``rearrange`` as one Triton kernel (each program writes BLOCK consecutive elements of the rearranged copy,
    zeros where the padded window falls off the input): the cost a rearranging kernel of ours would have, where ATen
    takes three kernels. The geometry is compile-time (one compile per input shape, before any capture), so that
    the index arithmetic folds to multiplications and the kernel is bound by memory, not by divisions. None without
    Triton (it comes with torch's CUDA wheels on Linux)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def gather(x_ptr, y_ptr, total, C: tl.constexpr, H: tl.constexpr, W: tl.constexpr, U: tl.constexpr,
               V: tl.constexpr, S: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        live = offs < total
        cc = offs % (S * S * C)  # the rearranged channel (ph*S + pw)*C + c
        pix = offs // (S * S * C)  # (n*U + u)*V + v
        v = pix % V
        u = (pix // V) % U
        n = pix // (V * U)
        ph = cc // (S * C)
        pw = (cc // C) % S
        c = cc % C
        h = S * u + ph - PH
        w = S * v + pw - PW
        inside = live & (h >= 0) & (h < H) & (w >= 0) & (w < W)
        val = tl.load(x_ptr + ((n * H + h) * W + w) * C + c, mask=inside, other=0)
        tl.store(y_ptr + offs, val, mask=live)

    def run(x: torch.Tensor, s: int, padding: tuple[int, int], p: int, q: int) -> torch.Tensor:
        if not x.is_contiguous(memory_format=torch.channels_last):
            raise ValueError("the Triton rearrangement reads a channels_last input")
        n, c, h, w = x.shape
        y = torch.empty((n, s * s * c, p + 2, q + 2), dtype=x.dtype, device=x.device,
                        memory_format=torch.channels_last)
        total, block = y.numel(), 1024
        gather[(triton.cdiv(total, block),)](x, y, total, c, h, w, p + 2, q + 2, s, padding[0], padding[1],
                                             BLOCK=block)
        return y

    return run


def rearrange_weight(w: torch.Tensor, s: int) -> torch.Tensor:
    """``w`` (K, C, R, S), R and S at most 3s, as (K, s*s*C, 3, 3) over ``rearrange``'s channels: tap (i, j) of
    channel (ph*s + pw)*C + c is ``w[k][c][s*i + ph][s*j + pw]`` (zero past R and S)."""
    k, c, r, sw = w.shape
    padded = F.pad(w, (0, 3 * s - sw, 0, 3 * s - r)).reshape(k, c, 3, s, 3, s)
    return padded.permute(0, 3, 5, 1, 2, 4).reshape(k, s * s * c, 3, 3)


def table(rows: list[dict]) -> list[str]:
    """The Markdown table of the probe's rows (the Triton columns where the rows have them)."""
    us = lambda k: lambda r: f"{r[k]:.1f}"  # noqa: E731
    x = lambda k: lambda r: f"{r[k]:.2f}x"  # noqa: E731
    cols = [("N", lambda r: str(r["n"])), ("cuDNN us", us("cudnn_us")), ("plan us", us("plan_us")),
            ("plan", lambda r: f"`{r['outer_plan']}`"), ("rearrange us", us("rearrange_us")),
            ("copy us", us("copy_us")), ("inner us", us("inner_us")), ("inner plan", lambda r: f"`{r['inner_plan']}`"),
            ("inner cuDNN us", us("inner_cudnn_us")), ("polyphase us", us("polyphase_us"))]
    triton = all("polyphase_triton_us" in r for r in rows)
    if triton:
        cols += [("rearrange triton us", us("rearrange_triton_us")), ("polyphase triton us", us("polyphase_triton_us"))]
    cols += [("polyphase vs cuDNN", x("polyphase_vs_cudnn"))]
    if triton:
        cols += [("polyphase triton vs cuDNN", x("polyphase_triton_vs_cudnn"))]
    cols += [("(copy + inner) vs cuDNN", x("copy_plus_inner_vs_cudnn")), ("plan vs cuDNN", x("plan_vs_cudnn")),
             ("inner vs cuDNN", x("inner_vs_cudnn")),
             ("error: polyphase / cuDNN / plan", lambda r: " / ".join(
                 f"{r[k + '_err']:.2e} (max {r[k + '_err_max']:.2e})" for k in ("polyphase", "cudnn", "plan")))]
    return (["| " + " | ".join(h for h, _ in cols) + " |", "|---" * len(cols) + "|"]
            + ["| " + " | ".join(f(r) for _, f in cols) + " |" for r in rows])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    ap.add_argument("--batch", default="1,32,128", help="batch sizes, comma-separated")
    ap.add_argument("--c", type=int, default=3, help="input channels of the original problem (AlexNet conv1: 3)")
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--hw", type=int, default=224)
    ap.add_argument("--kernel", type=int, default=11)
    ap.add_argument("--stride", type=int, default=4)
    ap.add_argument("--padding", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=6.0, help="tuning seconds per problem (the library's default)")
    ap.add_argument("--runs", type=int, default=300, help="timed replays per variant, in turns")
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batch.split(",")]
    dt, s, pad = getattr(torch, args.dtype), args.stride, (args.padding, args.padding)
    if args.kernel > 3 * s:
        ap.error(f"a {args.kernel}x{args.kernel} filter does not fit the 3x3 polyphase form at stride {s}")
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(args.c, args.k, args.kernel, stride=s, padding=args.padding).cuda()
    conv = conv.to(dt).to(memory_format=torch.channels_last).eval()
    plan_conv = TunedConv2d.from_conv(copy.deepcopy(conv))  # the same weights, the library's plan
    inner_cudnn = torch.nn.Conv2d(s * s * args.c, args.k, 3, device="cuda", dtype=dt).eval()
    with torch.no_grad():
        inner_cudnn.weight.copy_(rearrange_weight(conv.weight, s))
        inner_cudnn.bias.copy_(conv.bias)
    inner_cudnn = inner_cudnn.to(memory_format=torch.channels_last)
    inner = TunedConv2d.from_conv(copy.deepcopy(inner_cudnn))
    p = (args.hw + 2 * args.padding - args.kernel) // s + 1
    gather = triton_rearrange()
    meta = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(), "commit": git_commit(),
            "command": command_line("probes/polyphase_tma.py", sys.argv[1:] if argv is None else argv),
            "dtype": args.dtype, "problem": dict(c=args.c, k=args.k, hw=args.hw, kernel=args.kernel, stride=s,
                                                 padding=args.padding), "seconds": args.seconds, "runs": args.runs}
    mode = "bf16" if args.dtype == "bfloat16" else "fp16"
    stem = Path(args.out) / f"polyphase_tma_{gpu_tag()}_{mode}_nhwc"

    def write(rows: list[dict]) -> list[str]:
        meta["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        lines = [f"# Strided conv as a 3x3 implicit GEMM over its polyphase form ({meta['gpu']})", "",
                 f"{meta['date']}; torch {meta['torch']}, CUDA {meta['cuda']}, cuDNN {meta['cudnn']}; {args.dtype} "
                 f"channels_last; C={args.c} {args.hw}x{args.hw} -> K={args.k}, {args.kernel}x{args.kernel} stride "
                 f"{s} padding {args.padding}, as {s * s * args.c} channels 3x3 stride 1 over {p + 2}x{p + 2}; "
                 f"{args.seconds:g} s of tuning per problem. GPU us of one call in a CUDA graph, median of "
                 f"{args.runs} replays in interleaved turns, cuDNN in benchmark mode. `rearrange` is ATen's pad (a "
                 "fill and a copy) and permuting copy (what a kernel of ours would replace); `copy` a plain clone of "
                 "the rearranged input (about what one rearranging kernel would cost); `polyphase` = rearrange + "
                 "inner, timed as one; `(copy + inner)` is a sum of two timings, an estimate (a graph launch counted "
                 "twice); the `triton` columns (where Triton ran) take the rearrangement as one Triton kernel. "
                 "Memory-bound rows run from L2 where input and copy fit it (N <= 32).", "",
                 f"Commit `{meta['commit']}`; command: `{meta['command']}`.", "", *table(rows)]
        for r in rows:
            if "triton_error" in r:
                lines.append(f"\nN = {r['n']}: no Triton columns: {r['triton_error']}")
        stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
        return lines

    rows: list[dict] = []
    for n in batches:
        x = torch.randn(n, args.c, args.hw, args.hw, device="cuda").to(dt).contiguous(memory_format=torch.channels_last)
        xr = rearrange(x, s, pad, p, p)
        with fp32(benchmark=True):
            # (a problem the kernels do not take stops here: tune_model raises with the reason)
            outer_report = tune_model(plan_conv, [x], seconds=args.seconds, progress=False)
            inner_report = tune_model(inner, [xr], seconds=args.seconds, progress=False)
        calls = {
            "cudnn": lambda x=x: conv(x),
            "plan": lambda x=x: plan_conv(x),
            "rearrange": lambda x=x: rearrange(x, s, pad, p, p),
            "copy": lambda xr=xr: xr.clone(memory_format=torch.channels_last),
            "inner": lambda xr=xr: inner(xr),
            "inner_cudnn": lambda xr=xr: inner_cudnn(xr),
            "polyphase": lambda x=x: inner(rearrange(x, s, pad, p, p)),
        }
        row: dict = {"n": n, "outer_plan": outer_report.rows[0].plan, "inner_plan": inner_report.rows[0].plan,
                     "inner_cudnn_us_tuner": inner_report.rows[0].aten_us, "inner_plan_us_tuner":
                     inner_report.rows[0].time_us}
        if gather is None:
            row["triton_error"] = "Triton is not installed"
        else:
            try:  # (compiled here, before any capture; a failure loses the Triton columns, not the run)
                same = torch.equal(gather(x, s, pad, p, p), xr)
            except Exception as e:  # noqa: BLE001 - whatever Triton raises, the other variants still run
                same, row["triton_error"] = False, f"{type(e).__name__}: {e}"[:300]
            if same:
                calls["rearrange_triton"] = lambda x=x: gather(x, s, pad, p, p)
                calls["polyphase_triton"] = lambda x=x: inner(gather(x, s, pad, p, p))
            else:
                row.setdefault("triton_error", "its copy differs from ATen's")
        context = functools.partial(fp32, benchmark=True)
        with torch.no_grad(), context():
            # correctness on fresh data: the route and cuDNN against float64
            xf = torch.randn_like(x, dtype=torch.float32).to(dt).contiguous(memory_format=torch.channels_last)
            ref = F.conv2d(xf.double(), conv.weight.double(), conv.bias.double(), stride=s, padding=pad)
            route = inner(rearrange(xf, s, pad, p, p))
            assert route.shape == ref.shape, (route.shape, ref.shape)
            # the correctness check's two measures (error norm / reference norm, largest error / largest magnitude)
            ref_norm, ref_max = float(ref.norm()), float(ref.abs().max())
            for k, y in (("polyphase", route), ("cudnn", conv(xf)), ("plan", plan_conv(xf))):
                row[k + "_err"], row[k + "_err_max"] = output_error(y, ref, ref_norm, ref_max)
            timed = {}
            for name, fn in calls.items():
                replay, _ = graphed(lambda _x, fn=fn: fn(), x)
                timed[name] = (replay, context)
            for name, timing in time_interleaved(timed, args.runs).items():
                row[f"{name}_us"] = timing.median_us
        row["polyphase_vs_cudnn"] = row["cudnn_us"] / row["polyphase_us"]
        row["plan_vs_cudnn"] = row["cudnn_us"] / row["plan_us"]
        row["inner_vs_cudnn"] = row["cudnn_us"] / row["inner_us"]
        # the route with one rearranging kernel at a plain copy's cost in place of ATen's three (an estimate)
        row["copy_plus_inner_vs_cudnn"] = row["cudnn_us"] / (row["copy_us"] + row["inner_us"])
        if "polyphase_triton_us" in row:
            row["polyphase_triton_vs_cudnn"] = row["cudnn_us"] / row["polyphase_triton_us"]
        rows.append(row)
        print(json.dumps(row), flush=True)
        lines = write(rows)  # after each batch size: a run cut short keeps what it finished
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
