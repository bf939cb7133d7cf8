"""Per-layer tables from the cache and the roofline plot.

The roofline: each cached problem is a point at its arithmetic intensity (direct-convolution FLOPs over the
compulsory bytes: input + weights + bias + output, fp32, each moved once) and its achieved FLOP/s, once for
cuDNN and once for the plan, against the device's *measured* ceilings: fp32 FFMA throughput from a large
``torch.mm`` with TF32 off, memory bandwidth from a large device-to-device tensor copy. FLOPs are counted as
direct convolution, so an algorithm that does fewer multiplications (Winograd, FFT: cuDNN picks them) can land
above the compute ceiling; that says "fewer operations", not "faster than the hardware".

matplotlib is an optional extra (``pip install bagf_torch[plot]``); the tables need nothing.
"""

from __future__ import annotations

import contextlib
import logging
import math
import statistics
from dataclasses import dataclass
from typing import Iterator, Sequence

from .kernels import FAMILIES
from .problem import ConvProblem

__all__ = ["Ceilings", "LayerPoint", "layer_analysis", "measure_ceilings", "plot_roofline", "points_from_plans",
           "plans_table"]


@dataclass(frozen=True)
class Ceilings:
    """Measured (or given) ceilings of one device: the arithmetic peak in one precision and the bandwidth."""

    flops: float             # FLOP/s, in ``precision``
    bandwidth: float         # bytes/s
    device: str = ""
    how: str = "measured"
    precision: str = "fp32"  # what ``flops`` is the peak of: one of PRECISIONS

    @property
    def ridge(self) -> float:
        """Arithmetic intensity (FLOP/byte) where the two ceilings meet."""
        return self.flops / self.bandwidth

    def attainable(self, intensity: float) -> float:
        return min(self.flops, self.bandwidth * intensity)


PRECISIONS: dict[str, str] = {
    "fp32": "fp32 with TF32 off (the FFMA pipe)",
    "tf32": "fp32 with TF32 on (the tensor cores' TF32 rate)",
    "float16": "float16",
    "bfloat16": "bfloat16",
}
"""The precisions a ceiling is measured in (``torch.mm`` of that dtype and TF32 mode) and what each is."""


def precision_of(dtype: str, tf32: bool) -> str:
    """The ceiling's precision for convolutions in ``dtype`` (a ConvProblem's name) and TF32 mode ``tf32``: the
    rate their products run at.

    >>> precision_of("float32", False), precision_of("float32", True), precision_of("bfloat16", True)
    ('fp32', 'tf32', 'bfloat16')
    """
    if dtype == "float32":
        return "tf32" if tf32 else "fp32"
    if dtype not in PRECISIONS:
        raise ValueError(f"no ceiling for dtype {dtype!r}; one of float32, float16, bfloat16")
    return dtype


@contextlib.contextmanager
def matmul_tf32(on: bool):
    """cuBLAS's TF32 for fp32 matmuls set to ``on`` inside, restored after, through the API the process uses: the
    legacy ``torch.backends.cuda.matmul.allow_tf32`` while it can be read, else ``matmul.fp32_precision`` (torch
    raises on "a mix of the legacy and new APIs" once a program has set the newer one)."""
    import torch

    mm = torch.backends.cuda.matmul
    try:
        old, legacy = mm.allow_tf32, True
    except RuntimeError:
        old, legacy = mm.fp32_precision, False
    try:
        if legacy:
            mm.allow_tf32 = on
        else:
            mm.fp32_precision = "tf32" if on else "ieee"
        yield
    finally:
        if legacy:
            mm.allow_tf32 = old
        else:
            mm.fp32_precision = old


def measure_ceilings(device: int = 0, mm_size: int = 8192, copy_bytes: int = 1 << 30, reps: int = 10,
                     precision: str = "fp32") -> Ceilings:
    """The arithmetic peak in ``precision`` (``torch.mm`` of two ``mm_size``^2 matrices of its dtype, TF32 on only
    for "tf32": 2 n^3 FLOPs per call) and copy bandwidth (``copy_bytes`` read + written per ``Tensor.copy_``),
    medians of ``reps`` CUDA-event timings. A large cuBLAS GEMM is the best throughput torch reaches in a precision
    (fp32: ~80-90% of the FFMA datasheet peak); a copy the best bandwidth (~90% of the HBM datasheet figure). A
    layer report compares convolutions with the peak of the precision they compute in (``precision_of``)."""
    import torch

    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; one of {', '.join(PRECISIONS)}")
    dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(precision, torch.float32)

    def median_ms(fn) -> float:
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    dev = torch.device("cuda", device)
    with matmul_tf32(precision == "tf32"):
        a = torch.randn(mm_size, mm_size, device=dev).to(dtype)
        b = torch.randn(mm_size, mm_size, device=dev).to(dtype)
        c = torch.empty(mm_size, mm_size, device=dev, dtype=dtype)
        mm_ms = median_ms(lambda: torch.mm(a, b, out=c))
        src = torch.empty(copy_bytes // 4, device=dev)
        dst = torch.empty_like(src)
        copy_ms = median_ms(lambda: dst.copy_(src))
    return Ceilings(flops=2 * mm_size**3 / (mm_ms / 1e3), bandwidth=2 * copy_bytes / (copy_ms / 1e3),
                    device=torch.cuda.get_device_name(dev), precision=precision,
                    how=f"measured: torch.mm {mm_size}^2 in {PRECISIONS[precision]}, copy of {copy_bytes >> 20} MiB")


def compulsory_bytes(p: ConvProblem) -> int:
    """Bytes every algorithm must move at least once: input, weights, bias and output, in the problem's dtype
    (4 bytes for float32, 2 for float16 and bfloat16)."""
    ph, pw = p.out_hw
    elems = p.n * p.c * p.h * p.w + p.k * (p.c // p.groups) * p.r * p.s + (p.k if p.bias else 0) + p.n * p.k * ph * pw
    return _ELEMENT_BYTES.get(p.dtype, 4) * elems


_ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def layer_analysis(problem: ConvProblem, time_us: float, ceilings: Ceilings | None = None, family: str | None = None,
                   config: dict | None = None) -> dict:
    """Where one layer's time stands: achieved FLOP/s (direct-convolution FLOPs over the
    time) against the roofline at the layer's compulsory arithmetic intensity with the device's measured
    ceilings, and, for our kernels, the modelled global-memory traffic of the configuration against the
    I/O lower bound of direct convolution with that configuration's fast memory (and, for the Winograd
    family, also against the Winograd bound of its F(m x m, 3 x 3): fused for winograd and winograd_tc, unfused for
    winograd_gemm).

    >>> p = ConvProblem(n=1, c=256, h=13, w=13, k=256, r=3, s=3, padding=(1, 1))
    >>> from bagf_torch.kernels import implicit_gemm_tc as tc
    >>> a = layer_analysis(p, 25.0, Ceilings(50e12, 4e12), "implicit_gemm_tc", tc.DEFAULT)
    >>> round(a["tflops"], 2), a["traffic_over_bound"] >= 1.0
    (7.97, True)
    """
    from . import iobound

    flops = 2.0 * problem.macs
    out = {"tflops": flops / time_us / 1e6, "intensity": flops / compulsory_bytes(problem)}
    if ceilings is not None:
        attainable = ceilings.attainable(out["intensity"])
        out["roofline_tflops"] = attainable / 1e12
        out["fraction_of_roofline"] = out["tflops"] * 1e12 / attainable
        out["fraction_of_peak"] = out["tflops"] * 1e12 / ceilings.flops
    if family is not None and config is not None and iobound.has_model(family):
        words = iobound.traffic(family, problem, config).total
        fast = iobound.fast_memory_words(family, config)
        bound = iobound.direct_lower_bound(problem, fast)
        out.update(traffic_words=words, fast_memory_words=fast, lower_bound_words=bound,
                   traffic_over_bound=words / bound)
        if family in ("winograd", "winograd_tc", "winograd_tf32", "winograd_gemm"):
            # also against the bound of its own algorithm: the fused form for the fused kernels, the summed
            # (unfused) form for the one that stores its transformed operands (iobound docs); a strided
            # problem's is that of its polyphase form (winograd_gemm computes it so)
            wb = iobound.winograd_lower_bound(problem, config["MT"], 3, fast, fused=family != "winograd_gemm")
            out.update(winograd_bound_words=wb, traffic_over_winograd_bound=words / wb,
                       winograd_bound_form="unfused" if family == "winograd_gemm" else "fused")
    return out


@dataclass
class LayerPoint:
    problem: ConvProblem
    label: str
    plan: str
    intensity: float                # FLOP/byte (compulsory)
    cudnn_flops: float | None       # achieved FLOP/s
    plan_flops: float


def _checked(plans: Sequence[dict]) -> Iterator[tuple[dict, ConvProblem]]:
    """The plans that pass the cache's row schema, each with its problem. ``Cache.plans()`` already skips
    rows that fail it; plans handed in from elsewhere (a JSON report, a hand-made list) get the same check
    here, so one bad row is one log line, not a crashed report."""
    from .cache_schema import PlanRecord, SchemaError

    for n, plan in enumerate(plans):
        try:
            # the fields a table or a point does not show may be left out of a hand-made plan
            entry = {"key": f"row {n}", "env": {}, "default_us": None, "evaluations": 0, "tune_seconds": 0.0,
                     "cubin_digests": [], "created": 0.0, **plan}
            record = PlanRecord.from_mapping(entry)
        except (SchemaError, TypeError, ValueError) as e:
            key = plan.get("key") if isinstance(plan, dict) else None
            logging.getLogger("bagf_torch").warning("report: plan %s skipped (%s)", str(key or f"row {n}")[:64], e)
            continue
        yield record.as_dict(), ConvProblem.from_dict(record.problem)


def plan_name(plan: dict) -> str:
    fam = FAMILIES.get(plan["family"])
    if plan["config"] is None or fam is None:
        return "aten (cuDNN)"
    from .kernels import complete_config

    return fam.name(complete_config(plan["family"], plan["config"]))  # an older plan may lack newer knobs


def points_from_plans(plans: Sequence[dict], precision: str = "fp32") -> list[LayerPoint]:
    """One point per cached plan (cache rows: problem, family, config, time_us, aten_us) whose problem computes in
    ``precision`` (``precision_of`` its dtype and TF32 mode): the roofline's ceilings are measured in one precision,
    and a TF32 or 16-bit plan's point would stand against another's roof."""
    points = []
    for plan, p in _checked(plans):
        if p.dtype not in ("float32", *PRECISIONS) or precision_of(p.dtype, p.tf32) != precision:
            continue  # (a dtype with no ceiling, an imported plan's say, stands against no roof)
        plan_flops = p.flops / plan["time_us"] * 1e6 if plan["time_us"] else math.inf
        if not math.isfinite(plan_flops):
            continue  # a zero (or denormal) time has no FLOP/s to plot
        aten = plan.get("aten_us")
        cudnn_flops = p.flops / aten * 1e6 if aten else None
        points.append(LayerPoint(problem=p, label=f"N{p.n} C{p.c}->K{p.k} {p.r}x{p.s}", plan=plan_name(plan),
                                 intensity=p.flops / compulsory_bytes(p),
                                 cudnn_flops=cudnn_flops if cudnn_flops is None or math.isfinite(cudnn_flops)
                                 else None, plan_flops=plan_flops))
    return points


def plans_table(plans: Sequence[dict]) -> str:
    """The per-problem table: cuDNN and plan time, speedup, achieved TFLOP/s, intensity, trials, tuning s."""
    head = (f"{'gpu':<18} {'problem':<44} {'cuDNN us':>9} {'plan us':>9} {'speedup':>8} {'TFLOP/s':>8} "
            f"{'FLOP/B':>7} {'trials':>6} {'tune s':>7}  plan")
    lines = [head, "-" * len(head)]
    for plan, p in sorted(_checked(plans), key=lambda r: (str(r[0]["env"].get("gpu")), r[1].n, r[0]["created"])):
        aten, t = plan.get("aten_us"), plan["time_us"]
        speed = f"{aten / t:.2f}x" if aten and t else "-"
        lines.append(f"{str(plan['env'].get('gpu', '?'))[:18]:<18} {p.short():<44} "
                     f"{aten if aten else float('nan'):9.1f} {t:9.1f} {speed:>8} "
                     f"{p.flops / t / 1e6 if t else float('nan'):8.2f} {p.flops / compulsory_bytes(p):7.1f} "
                     f"{plan['evaluations']:6d} {plan['tune_seconds']:7.1f}  {plan_name(plan)}")
    return "\n".join(lines)


def plot_roofline(points: Sequence[LayerPoint], ceilings: Ceilings, path, title: str | None = None) -> None:
    """Write the roofline PNG: ceilings as lines, cuDNN (circles) and the plan (triangles) per problem,
    joined by a thin line so each layer's pair reads side by side. Needs matplotlib."""
    try:
        import matplotlib
    except ImportError as e:
        raise RuntimeError("the roofline plot needs matplotlib: pip install matplotlib "
                           "(or pip install 'bagf_torch[plot]')") from e
    matplotlib.use("Agg")  # files only; never opens a window
    import matplotlib.pyplot as plt

    if not points:
        raise ValueError("no plans to plot; run python -m bagf_torch tune first")
    xs = [pt.intensity for pt in points]
    lo, hi = min(xs + [ceilings.ridge]) / 4, max(xs + [ceilings.ridge]) * 4
    fig, ax = plt.subplots(figsize=(9, 6), dpi=120)
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    ax.plot(grid, [ceilings.attainable(x) / 1e12 for x in grid], color="black", lw=2,
            label=f"roofline: {ceilings.flops / 1e12:.1f} TFLOP/s {ceilings.precision}, {ceilings.bandwidth / 1e9:.0f} GB/s")
    ax.axvline(ceilings.ridge, color="grey", ls=":", lw=1)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    batches = sorted({pt.problem.n for pt in points})
    for pt in points:
        colour = colours[batches.index(pt.problem.n) % len(colours)]
        if pt.cudnn_flops is not None:
            ax.plot([pt.intensity, pt.intensity], [pt.cudnn_flops / 1e12, pt.plan_flops / 1e12], color=colour,
                    lw=0.8, alpha=0.6)
            ax.scatter([pt.intensity], [pt.cudnn_flops / 1e12], marker="o", facecolors="none", edgecolors=colour,
                       s=45)
        ax.scatter([pt.intensity], [pt.plan_flops / 1e12], marker="^", color=colour, s=45)
        ax.annotate(pt.label, (pt.intensity, pt.plan_flops / 1e12), fontsize=6, xytext=(4, 3),
                    textcoords="offset points")
    for n in batches:
        ax.scatter([], [], marker="s", color=colours[batches.index(n) % len(colours)], label=f"N={n}")
    ax.scatter([], [], marker="o", facecolors="none", edgecolors="black", label="cuDNN")
    ax.scatter([], [], marker="^", color="black", label="bagf plan (cuDNN when it won)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_xlabel("arithmetic intensity (direct-conv FLOPs / compulsory bytes, FLOP/byte)")
    ax.set_ylabel("achieved TFLOP/s (direct-conv FLOPs / time)")
    ax.set_title(title or f"Roofline: conv layers on {ceilings.device or 'this GPU'}")
    ax.grid(True, which="both", lw=0.3, alpha=0.5)
    ax.legend(fontsize=7, loc="lower right")
    fig.text(0.01, 0.01, f"ceilings {ceilings.how}", fontsize=6, color="grey")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
