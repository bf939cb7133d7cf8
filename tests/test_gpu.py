"""GPU tests (run on the device with ``pytest -m cuda``): kernels against float64 references on odd shapes,
the op (opcheck, autograd, torch.compile), and the first-call tuning / cache / fresh-process contract."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import fault_helpers as fh  # tests/ is on sys.path (pytest's default prepend import mode)

pytestmark = pytest.mark.cuda

# Where the bagf_torch under test lives (site-packages when installed, the checkout in a development run): the
# child processes below import the same copy.
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__import__("bagf_torch").__file__)))

# Odd shapes: non-square, stride 1-4, padding, dilation, C and K not multiples of any tile, N=1, no bias.
ODD_SHAPES = [
    # n, c, h, w, k, r, s, stride, padding, dilation, bias
    (1, 3, 17, 23, 5, 3, 3, (1, 1), (1, 1), (1, 1), True),
    (2, 7, 31, 29, 13, 5, 5, (2, 2), (2, 2), (1, 1), True),
    (3, 3, 50, 45, 19, 11, 11, (4, 4), (2, 2), (1, 1), True),
    (1, 16, 13, 11, 33, 3, 3, (3, 2), (0, 1), (2, 2), False),
    (2, 5, 9, 9, 70, 1, 1, (1, 1), (0, 0), (1, 1), True),
    (1, 64, 27, 27, 192, 5, 5, (1, 1), (2, 2), (1, 1), True),
    (2, 12, 20, 17, 129, 3, 5, (2, 1), (1, 2), (1, 3), True),
]


def _assert_within_check(out: torch.Tensor, ref: torch.Tensor) -> None:
    """``out`` passes the check every candidate passes before it is cached (``measure.judge_output``: error norm
    within REL_TOL of the float64 reference's norm, worst element within 10 x REL_TOL of its largest magnitude).
    Element by element with a fixed atol is stricter than that contract: a correct 3xTF32 Winograd kernel is off by
    1.2e-4 on an element whose float64 value is 0.08, within fp32's accumulation error for 72 products of N(0,1)
    terms."""
    from bagf_torch.tuning.measure import judge_output

    why = judge_output(out, ref, float(ref.norm()), float(ref.abs().max()))
    assert why is None, why


def _problem(shape, tf32: bool = False, fmt: tuple[str, str] = ("float32", "nchw")):
    from bagf_torch.problem import ConvProblem

    n, c, h, w, k, r, s, st, pd, dl, bias = shape
    return ConvProblem(n=n, c=c, h=h, w=w, k=k, r=r, s=s, stride=st, padding=pd, dilation=dl, bias=bias, tf32=tf32,
                       dtype=fmt[0], layout=fmt[1])


def _formats(fam):
    """The (dtype, layout) pairs a family computes (kernels.formats): each is tested."""
    from bagf_torch.kernels import formats

    return formats(fam)


def _tf32_only(fam) -> bool:
    """A family that computes TF32 mode only (implicit_gemm_tf32, implicit_gemm_tma_tf32): one TF32 product per
    multiply; it takes some odd shape in TF32 mode and refuses it in strict fp32."""
    applies = getattr(fam, "applies", None)
    fmt = _formats(fam)[0]
    return applies is not None and any(applies(_problem(s, fmt=fmt)) is not None
                                       and applies(_problem(s, tf32=True, fmt=fmt)) is None for s in ODD_SHAPES)


def _tf32_reference(ws, x=None, w=None, b=None):
    """Make ``ws``'s float64 reference the convolution of its operands rounded to TF32 as the tensor cores round
    them (``winograd_math.tf32_round``: cvt.rna.tf32.f32), computed in float64: what a kernel of one TF32 product
    per multiply and fp32 sums computes up to fp32 summation error, which the fp32 check's tolerance bounds. This
    tests such a kernel on any shape, whatever cuDNN's own algorithm there (without TF32 on C = 3, its error sets
    the tuner's TF32 bound to fp32's), and shows that its operands are rounded, not truncated (a bias of 2^-11 per
    product: far outside)."""
    from bagf_torch.winograd_math import tf32_operands_conv2d

    p = ws.problem
    x, w, b = (ws.x, ws.w, ws.b) if x is None else (x, w, b)
    ws.ref = tf32_operands_conv2d(x, w, b, p.stride, p.padding, p.dilation)
    ws.ref_norm = float(ws.ref.norm())
    ws.ref_max = float(ws.ref.abs().max()) if ws.ref.numel() else 0.0
    return ws


def _winograd_tf32_m(fam) -> int | None:
    """F(m x m) of a TF32-mode Winograd family (winograd_tf32), else None. Its TF32 products take the transformed
    tiles, not the inputs, so ``_tf32_reference`` (the inputs rounded) does not describe its arithmetic;
    ``_winograd_tf32_reference`` does."""
    if not (fam.FAMILY.startswith("winograd") and _tf32_only(fam)):
        return None
    (m,) = fam.PARAMS["MT"]  # one tile size per such family: one reference per shape
    return m


def _winograd_tf32_reference(ws, m: int, x=None, w=None, b=None):
    """Make ``ws``'s reference the CPU emulation of F(m x m) with TF32 products (``winograd_math.conv2d``: transforms
    in fp32, each Winograd-domain operand rounded to TF32 to nearest, ties away, fp32 sums), which a correct kernel
    matches up to fp32 summation order, well inside the fp32 check; a kernel that truncates, skips a rounding or
    mixes up a tile is off by TF32's error or more. (Against float64 the family is bounded by twice cuDNN's TF32
    error, ``test_winograd_tf32_stays_within_cudnns_tf32_bound_and_fails_the_strict_one``.)"""
    from bagf_torch import winograd_math

    p = ws.problem
    x, w, b = (ws.x, ws.w, ws.b) if x is None else (x, w, b)
    y = winograd_math.conv2d(x.float().cpu(), w.float().cpu(), None if b is None else b.float().cpu(),
                             tuple(p.padding), m, tf32=True)
    ws.ref = y.double().to(x.device)
    ws.ref_norm = float(ws.ref.norm())
    ws.ref_max = float(ws.ref.abs().max()) if ws.ref.numel() else 0.0
    return ws


@pytest.fixture
def compiler(cache_dir):
    from bagf_torch.cache import Cache
    from bagf_torch.jit.compiler import KernelCompiler

    return KernelCompiler(Cache.for_dir(cache_dir), 0, workers=8)


def _family(name):
    from bagf_torch.kernels import FAMILIES

    return FAMILIES[name]


def _family_names():
    from bagf_torch.kernels import FAMILIES

    return [n for n, f in FAMILIES.items() if not getattr(f, "LIBRARY", "")]


# every kernel family: a new one is tested on the odd shapes without editing this file (a library family, which
# takes 1x1 convolutions only, has its own test: test_cublaslt_1x1_plans_in_every_dtype_format_and_mode)
FAMILY_NAMES = _family_names()

# 3x3 stride-1 odd shapes for the Winograd family: P, Q not multiples of 2 or 4, C and K off every tile,
# paddings 0-2, a 1x1 output, N up to 3.
WINO_SHAPES = [
    (1, 3, 17, 23, 5, 3, 3, (1, 1), (1, 1), (1, 1), True),
    (2, 7, 9, 14, 13, 3, 3, (1, 1), (0, 0), (1, 1), False),
    (1, 19, 6, 5, 33, 3, 3, (1, 1), (2, 1), (1, 1), True),
    (3, 37, 13, 13, 70, 3, 3, (1, 1), (1, 1), (1, 1), True),
    # a 1x1 output with C = 1, over K = 7 channels: over a single output value (K = 1) the relative check is
    # ill-conditioned, nine products can nearly cancel, and F(4x4)/F(5x5) can fail it (1.4-1.6e-4 on the H200
    # with fresh random data)
    (1, 1, 3, 3, 7, 3, 3, (1, 1), (0, 0), (1, 1), True),
    (2, 130, 11, 7, 9, 3, 3, (1, 1), (1, 0), (1, 1), True),
    (1, 2, 4, 1100, 3, 3, 3, (1, 1), (1, 1), (1, 1), True),  # more tiles per row than threads per block
    # strided, for winograd_gemm's polyphase form (ODD_SHAPES adds 11x11 at stride 4 and 5x5 at stride 2):
    # AlexNet's conv1 at N = 2, 7x6 at stride 3 (C' = 9 C: the GEMM's 4-byte path), padding above the stride
    (2, 3, 224, 224, 64, 11, 11, (4, 4), (2, 2), (1, 1), True),
    (2, 1, 40, 37, 10, 7, 6, (3, 3), (1, 2), (1, 1), False),
    (1, 2, 26, 19, 5, 4, 6, (2, 2), (3, 0), (1, 1), True),
]


# 16-bit NHWC's 16-byte path needs C % 8 == 0: channel counts of 8, 24 and 64 (ODD_SHAPES has 16 and 64) with K
# off every tile, stride 2 and a 1x1; ODD_SHAPES' C = 3, 5, 7, 12 take the 2-byte path
H16_SHAPES = [
    (2, 24, 15, 13, 40, 3, 3, (1, 1), (1, 1), (1, 1), True),
    (1, 8, 33, 31, 70, 3, 3, (2, 2), (1, 1), (1, 1), False),
    (3, 64, 7, 9, 129, 1, 1, (1, 1), (0, 0), (1, 1), True),
]


def _runs(fam, config, shape, fmt=("float32", "nchw")) -> bool:
    """Whether the tuner would run ``config`` on ``shape`` in ``fmt`` (a direct kernel specialised to another filter
    geometry is not: the host refuses it, tested in test_direct_specialised_plan_refuses_other_geometries; nor a
    16-bit kernel compiled for another dtype or memory format)."""
    rule = getattr(fam, "problem_rule", None)
    return rule is None or rule(config, _problem(shape, fmt=fmt)) is None


def _shapes_for(fam):
    applies = getattr(fam, "applies", None)
    if applies is None:
        return ODD_SHAPES
    tf32, fmt = _tf32_only(fam), _formats(fam)[0]
    extra = H16_SHAPES if fmt[0] != "float32" else []
    return [s for s in ODD_SHAPES + WINO_SHAPES + extra if applies(_problem(s, tf32=tf32, fmt=fmt)) is None]


def _sample_configs(fam, n: int, seed: int):
    valid = fam.space().valid_configs()
    rng = random.Random(seed)
    picked = rng.sample(valid, min(n, len(valid)))  # a space smaller than n is tested whole
    # extremes: smallest/largest tiles and thread counts, scalar and vector loads, both buffering modes
    by_threads = sorted(valid, key=fam.threads)
    by_smem = sorted(valid, key=fam.smem_bytes)
    return [fam.DEFAULT, by_threads[0], by_threads[-1], by_smem[0], by_smem[-1]] + picked


def _compile_and_check(compiler, fam, configs, shapes, fmts=None):
    """Compile ``configs`` (every one must build), then run each on every shape the tuner would run it on, fresh
    random data per shape, NaN-poisoned output against float64 (tuning.measure.CudaChecker), in each of ``fmts``
    (default: every format the family computes, each of which must run); returns the builds."""
    from bagf_torch.tuning.measure import CudaChecker, Workspace

    built = compiler.compile(fam, configs)
    failures = [(fam.name(c), b.status, b.detail[:300]) for c, b in zip(configs, built) if not hasattr(b, "handle")]
    assert not failures, failures
    checker = CudaChecker(compiler.ext)
    bad = []
    ran = set()
    for fmt in fmts or _formats(fam):  # a 16-bit family: each dtype and memory format, against twice cuDNN's error
        for shape in shapes:
            if fmt[1] == "nhwc" and (shape[1] == 1 or shape[2] * shape[3] == 1):
                continue  # contiguous as well as channels_last: an NCHW problem (ConvProblem.from_call)
            ws = Workspace(_problem(shape, fmt=fmt), torch.device("cuda", 0))
            if _winograd_tf32_m(fam) is not None:
                _winograd_tf32_reference(ws, _winograd_tf32_m(fam))
            elif _tf32_only(fam):
                _tf32_reference(ws)
            for c, b in zip(configs, built):
                if not _runs(fam, c, shape, fmt):
                    continue
                ran.add((fam.name(c), fmt))
                out = checker.check(ws, b.handle)
                if out is not None:
                    bad.append((shape, fmt, fam.name(c), out.detail))
    assert not bad, bad[:10]
    assert {fmt for _, fmt in ran} == set(fmts or _formats(fam)), "every format asked for ran"
    return built


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_sampled_configs_correct_on_odd_shapes(compiler, family):
    fam = _family(family)
    configs = _sample_configs(fam, 40, seed=int(os.environ.get("BAGF_TEST_SEED", "1234")))
    _compile_and_check(compiler, fam, configs, _shapes_for(fam))


@pytest.mark.parametrize("shape", [(2, 192, 13, 13, 384, 3, 3, (1, 1), (1, 1), (1, 1), True),
                                   (2, 64, 27, 27, 192, 5, 5, (1, 1), (2, 2), (1, 1), True),
                                   (2, 1024, 14, 14, 256, 1, 1, (1, 1), (0, 0), (1, 1), False)])
@pytest.mark.parametrize("family", ["implicit_gemm_tf32", "implicit_gemm_wgmma", "implicit_gemm_tma_tf32"])
def test_tf32_mode_check_follows_cudnns_tf32_error(compiler, shape, family):
    """In TF32 mode the tuner's check bounds a candidate by twice cuDNN's own TF32 error on the same data: each TF32
    family passes it there and fails the strict-fp32 check of the same problem, which is how a TF32 plan never
    reaches a strict caller's cache; the 3xTF32 family passes both. (AlexNet conv3 and conv2 and a ResNet 1x1
    layer at N = 2, where cuDNN does use TF32.)"""
    from bagf_torch.tuning.measure import REL_TOL, TF32_ERROR_FACTOR, CudaChecker, Workspace, output_error

    tf32_fam, strict_fam = _family(family), _family("implicit_gemm_tc")
    built = {f.FAMILY: compiler.compile(f, [f.DEFAULT])[0] for f in (tf32_fam, strict_fam)}
    checker = CudaChecker(compiler.ext)
    tf32_ws = Workspace(_problem(shape, tf32=True), torch.device("cuda", 0))
    strict_ws = Workspace(_problem(shape), torch.device("cuda", 0))
    theirs = tf32_ws.cudnn_error
    assert theirs is not None and theirs[0] > 10 * 1e-6, theirs  # cuDNN computed it with TF32 products
    assert tf32_ws.rel_tol == pytest.approx(max(REL_TOL, TF32_ERROR_FACTOR * theirs[0]))
    assert strict_ws.cudnn_error is None and strict_ws.rel_tol == REL_TOL
    ours = output_error(tf32_ws.op_call(built[tf32_fam.FAMILY].handle)(), tf32_ws.ref, tf32_ws.ref_norm,
                        tf32_ws.ref_max)
    print(f"{_problem(shape).short()}: cuDNN TF32 error {theirs[0]:.2e} (max {theirs[1]:.2e}), "
          f"{family} {ours[0]:.2e} (max {ours[1]:.2e})")
    assert checker.check(tf32_ws, built[tf32_fam.FAMILY].handle) is None
    wrong = checker.check(strict_ws, built[tf32_fam.FAMILY].handle)
    assert wrong is not None and "relative error" in wrong.detail, wrong
    for ws in (tf32_ws, strict_ws):
        assert checker.check(ws, built[strict_fam.FAMILY].handle) is None


@pytest.mark.parametrize("family", ["implicit_gemm_tf32", "implicit_gemm_tma_tf32", "cublaslt_1x1"])
def test_a_tf32_plan_called_with_cudnns_tf32_off_answers_in_strict_fp32(compiler, family):
    """A graph torch.compile'd in TF32 mode keeps its plans after the program turns cuDNN's TF32 off: the op sends a
    call of a TF32-product plan made with the flag off to ATen, which computes it in strict fp32 as the caller now
    asks, through the dispatcher, the dispatcher-free entry and a torch.compile'd graph traced with the flag on.
    With the flag on the plan answers with its own TF32 products: not cuDNN's bits, outside the strict check. A
    strict plan keeps answering with the flag off. (A captured CUDA graph replays what it captured, as one of cuDNN's
    TF32 kernels does.)"""
    from bagf_torch.problem import cudnn_conv_mode
    from bagf_torch.tuning.measure import REL_TOL, judge_output

    fam = _family(family)
    one = family == "cublaslt_1x1"
    cfg = dict(fam.DEFAULT, TF=1, DT=0, NHWC=0) if one else dict(fam.DEFAULT, NHWC=0) if "NHWC" in fam.PARAMS \
        else dict(fam.DEFAULT)
    handle = compiler.compile(fam, [cfg])[0].handle
    strict_handle = compiler.compile(_family("implicit_gemm_tc"), [_family("implicit_gemm_tc").DEFAULT])[0].handle
    torch.manual_seed(0)
    c, r = (256, 1) if one else (192, 3)
    x = torch.randn(2, c, 13, 13, device="cuda")
    w = torch.randn(384, c, r, r, device="cuda")
    b = torch.randn(384, device="cuda")
    args = ([1, 1], [r // 2] * 2, [1, 1])
    ref = F.conv2d(x.double(), w.double(), b.double(), 1, r // 2)
    norm, top = float(ref.norm()), float(ref.abs().max())
    op, ext = torch.ops.bagf.conv2d.default, compiler.ext

    def strict(out):
        return judge_output(out, ref, norm, top, REL_TOL, 10 * REL_TOL)

    def traced(a):
        return op(a, w, b, *args, handle)

    torch._dynamo.reset()
    try:
        with torch.no_grad():
            with cudnn_conv_mode(tf32=True):
                on = op(x, w, b, *args, handle)
                if not one:  # the plan's bits, not cuDNN's TF32 ones (cuDNN's TF32 1x1 conv runs the GEMM cuBLASLt
                    # does: the same bits on the H200)
                    assert not torch.equal(on, F.conv2d(x, w, b, 1, r // 2))
                assert torch.equal(ext.conv2d_inference(x, w, b, *args, handle), on)
                compiled = torch.compile(traced, fullgraph=True, backend="eager")
                assert torch.equal(compiled(x), on)
            assert strict(on) is not None  # TF32 products: outside the strict check (else this test shows nothing)
            with cudnn_conv_mode(tf32=False):
                aten = F.conv2d(x, w, b, 1, r // 2)
                for out in (op(x, w, b, *args, handle), ext.conv2d_inference(x, w, b, *args, handle),
                            compiled(x)):
                    assert strict(out) is None and torch.allclose(out, aten, rtol=1e-5, atol=1e-4)
                if not one:
                    kept = op(x, w, b, *args, strict_handle)  # a strict plan (3xTF32) answers itself: not ATen's
                    assert strict(kept) is None and not torch.equal(kept, aten)
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("shape, layout", [((2, 3, 224, 224, 64, 11, 11, (4, 4), (2, 2), (1, 1), True), "nchw"),
                                           ((2, 192, 13, 13, 384, 3, 3, (1, 1), (1, 1), (1, 1), True), "nchw"),
                                           ((2, 192, 13, 13, 384, 3, 3, (1, 1), (1, 1), (1, 1), True), "nhwc")])
def test_tf32_product_families_left_out_exactly_where_their_start_points_fail(compiler, shape, layout):
    """The tuner leaves a TF32_PRODUCTS family out of a TF32-mode problem when the operands rounded to TF32 alone
    clearly miss the check's bounds (Tuner._within_reach): on AlexNet conv1 (C = 3, where cuDNN's TF32 mode computes
    at fp32 accuracy on the H200) every such family that computes the layer is left out and its start point fails
    the check; on conv3 (where cuDNN uses TF32) none is, and each start point passes, in NCHW and channels_last (no
    TF32-product family computes a channels_last C = 3 layer)."""
    from bagf_torch.kernels import FAMILIES, format_refuses
    from bagf_torch.tuning.measure import CudaChecker, Workspace
    from bagf_torch.tuning.tuner import Tuner

    problem = _problem(shape, tf32=True, fmt=("float32", layout))
    ws = Workspace(problem, torch.device("cuda", 0))
    fams = [f for f in FAMILIES.values() if getattr(f, "TF32_PRODUCTS", False) and format_refuses(f, problem) is None
            and (getattr(f, "applies", None) is None or f.applies(problem) is None)]
    assert fams
    kept, left_out = Tuner._within_reach(fams, ws, problem)
    print(f"{problem.short()}: cuDNN TF32-mode error {ws.cudnn_error[0]:.2e}, TF32-rounded operands "
          f"{ws.tf32_operand_error()[0]:.2e}, bound {ws.rel_tol:.2e}; left out {sorted(left_out)}")
    if shape[1] == 3:
        assert ws.cudnn_error[0] < 1e-5 and set(left_out) == {f.FAMILY for f in fams}, (ws.cudnn_error, left_out)
    else:
        assert left_out == {} and kept == fams
    checker = CudaChecker(compiler.ext)
    for fam in fams:
        cfg = fam.default_for(problem) if hasattr(fam, "default_for") else fam.DEFAULT
        built = compiler.compile(fam, [cfg])[0]
        assert hasattr(built, "handle"), (fam.name(cfg), built)  # (a failed compile is an Outcome)
        out = checker.check(ws, built.handle)
        if fam.FAMILY in left_out:
            assert out is not None and out.status == "wrong" and "relative error" in out.detail, (fam.FAMILY, out)
        else:
            assert out is None, (fam.FAMILY, out)


@pytest.mark.parametrize("shape", [(2, 192, 13, 13, 384, 3, 3, (1, 1), (1, 1), (1, 1), True),
                                   (2, 128, 28, 28, 128, 3, 3, (1, 1), (1, 1), (1, 1), False),
                                   (1, 256, 56, 56, 256, 3, 3, (1, 1), (1, 1), (1, 1), True)])
def test_winograd_tf32_stays_within_cudnns_tf32_bound_and_fails_the_strict_one(compiler, shape):
    """winograd_tf32 (F(2x2) with one TF32 product per Winograd-domain multiply) on AlexNet's conv3 and two ResNet
    3x3 layers in TF32 mode: within twice cuDNN's own TF32 error on the same data (the tuner's check), and past the
    strict-fp32 check of the same problem, so a TF32 plan never reaches a strict caller; its error against the
    float64 convolution is printed beside cuDNN's (the CPU emulation, winograd_error_tf32_cpu.md, has F(2x2) at
    1.62-1.98x a TF32 direct convolution's)."""
    from bagf_torch.tuning.measure import CudaChecker, Workspace, output_error

    fam = _family("winograd_tf32")
    cfg = fam.default_for(_problem(shape, tf32=True))
    handle = compiler.compile(fam, [cfg])[0].handle
    checker = CudaChecker(compiler.ext)
    tf32_ws = Workspace(_problem(shape, tf32=True), torch.device("cuda", 0))
    theirs = tf32_ws.cudnn_error
    assert theirs is not None and theirs[0] > 1e-5, theirs  # cuDNN computed it with TF32 products
    ours = output_error(tf32_ws.op_call(handle)(), tf32_ws.ref, tf32_ws.ref_norm, tf32_ws.ref_max)
    print(f"{_problem(shape).short()} {fam.name(cfg)}: cuDNN TF32 error {theirs[0]:.2e} (max {theirs[1]:.2e}), "
          f"ours {ours[0]:.2e} (max {ours[1]:.2e}), {ours[0] / theirs[0]:.2f}x")
    assert checker.check(tf32_ws, handle) is None
    wrong = checker.check(Workspace(_problem(shape), torch.device("cuda", 0)), handle)
    assert wrong is not None and "relative error" in wrong.detail, wrong


@pytest.mark.parametrize("family", ["implicit_gemm_tc", "implicit_gemm_tf32", "implicit_gemm_wgmma"])
def test_a_nan_input_reaches_the_outputs_it_reaches_in_cudnn(compiler, family):
    """A NaN in the input (GPU arithmetic's 0x7fffffff, whose rounding carry would make it a zero) and in the
    weights reaches exactly the outputs whose windows hold it, as in torch's own conv."""
    fam = _family(family)
    handle = compiler.compile(fam, [fam.DEFAULT])[0].handle
    x = torch.randn(2, 5, 11, 13, device="cuda")
    x.view(torch.int32)[0, 1, 3, 4] = 0x7FFFFFFF
    w = torch.randn(7, 5, 3, 3, device="cuda")
    w.view(torch.int32)[3, 2, 1, 1] = -1  # 0xffffffff: a NaN the carry would make +0
    out = compiler.ext.conv2d_inference(x, w, None, [1, 1], [1, 1], [1, 1], handle)
    ref = F.conv2d(x, w, None, 1, 1)
    assert int(torch.isnan(ref).sum()) > 0 and torch.equal(torch.isnan(out), torch.isnan(ref))


def test_3xtf32_has_fp32_accuracy(compiler):
    """The tensor-core family's split-TF32 products are far more accurate than TF32: on AlexNet conv3's shape
    (N=2) its error against float64 is at least 5x below cuDNN's with TF32 on, and inside the checker's
    tolerance. (Measured on the H200: 9.8e-6 max relative, cuDNN strict fp32 1.2e-6, TF32 about 2e-4: the
    tensor cores' fp32 accumulation is a few bits short of FFMA's.)"""
    from bagf_torch.tuning.measure import REL_TOL, Workspace

    fam = _family("implicit_gemm_tc")
    built = compiler.compile(fam, [fam.DEFAULT, dict(fam.DEFAULT, SPLIT=16)])
    ws = Workspace(_problem((2, 192, 13, 13, 384, 3, 3, (1, 1), (1, 1), (1, 1), True)), torch.device("cuda", 0))
    errs = {}
    for tf32 in (False, True):
        with torch.backends.cudnn.flags(enabled=True, allow_tf32=tf32):
            ref = F.conv2d(ws.x, ws.w, ws.b, 1, 1).double()
        errs[f"cudnn_tf32={tf32}"] = float((ref - ws.ref).abs().max()) / ws.ref_max
    for b in built:
        out = ws.op_call(b.handle)().double()
        err = float((out - ws.ref).abs().max()) / ws.ref_max
        print(f"{b.spec.name}: max relative error {err:.2e} ({errs})")
        assert err < errs["cudnn_tf32=True"] / 5 and err < REL_TOL, (err, errs)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_misaligned_weight_uses_scalar_path(compiler, family):
    fam = _family(family)
    if _formats(fam)[0][0] != "float32":
        return _misaligned_16bit(compiler, fam)
    handle = compiler.compile(fam, [fam.DEFAULT])[0].handle
    x = torch.randn(2, 8, 15, 15, device="cuda")
    storage = torch.randn(16 * 8 * 9 + 1, device="cuda")
    w = storage[1:].view(16, 8, 3, 3)  # 4-byte offset: float4 loads would be misaligned
    assert w.data_ptr() % 16 != 0 and w.is_contiguous()
    b = torch.randn(16, device="cuda")
    out = torch.ops.bagf.conv2d(x, w, b, [1, 1], [1, 1], [1, 1], handle)
    if _winograd_tf32_m(fam) is not None:
        from bagf_torch import winograd_math

        ref = winograd_math.conv2d(x.cpu(), w.cpu(), b.cpu(), (1, 1), _winograd_tf32_m(fam), tf32=True).double()
        return _assert_within_check(out.cpu(), ref)
    if _tf32_only(fam):
        from bagf_torch.winograd_math import tf32_operands_conv2d

        ref = tf32_operands_conv2d(x, w, b, 1, 1)
    else:
        ref = F.conv2d(x.double(), w.double(), b.double(), 1, 1)
    _assert_within_check(out, ref)


def _shifted(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values one element past a 16-byte boundary, with its strides (its memory format)."""
    flat = torch.empty(t.numel() + 1, device=t.device, dtype=t.dtype)
    out = flat[1:].as_strided(t.shape, t.stride())
    out.copy_(t)
    return out


def _misaligned_16bit(compiler, fam):
    """A 16-bit family in each of its formats: input and weight 2 bytes off 16-byte alignment (the 2-byte loads)
    give exactly the aligned copies' outputs (the 16-byte loads; same sums in the same order), within twice
    cuDNN's error against float64 on the same data."""
    for dtype, layout in _formats(fam):
        dt = getattr(torch, dtype)
        shape = (2, 8, 15, 15, 16, 3, 3, (1, 1), (1, 1), (1, 1), True)
        handle = compiler.compile(fam, [fam.default_for(_problem(shape, fmt=(dtype, layout)))])[0].handle
        fmt = torch.channels_last if layout == "nhwc" else torch.contiguous_format
        x = torch.randn(2, 8, 15, 15, device="cuda").to(dt).contiguous(memory_format=fmt)
        w = (torch.randn(16, 8, 3, 3, device="cuda") / 8).to(dt).contiguous(memory_format=fmt)
        b = torch.randn(16, device="cuda").to(dt)

        xm, wm = _shifted(x), _shifted(w)
        assert xm.data_ptr() % 16 and wm.data_ptr() % 16 and xm.is_contiguous(memory_format=fmt)
        aligned = torch.ops.bagf.conv2d(x, w, b, [1, 1], [1, 1], [1, 1], handle)
        off = torch.ops.bagf.conv2d(xm, wm, b, [1, 1], [1, 1], [1, 1], handle)
        assert aligned.dtype is dt and aligned.is_contiguous(memory_format=fmt)
        if fam.launch(fam.DEFAULT).tma and layout == "nhwc":
            # the TMA maps need 16-byte bases: a channels_last plan sends the call to ATen (correct, and launching it
            # strictly is refused); an NCHW plan copies both tensors to channels_last first and runs
            _assert_within_cudnn(off, F.conv2d(x.double(), w.double(), b.double(), 1, 1), F.conv2d(x, w, b, 1, 1))
            assert off.dtype is dt and off.is_contiguous(memory_format=fmt)
            with pytest.raises(RuntimeError, match="16-byte aligned"):
                compiler.ext.conv2d_inference(xm, wm, b, [1, 1], [1, 1], [1, 1], handle, out=torch.empty_like(aligned))
        else:
            assert torch.equal(aligned, off), (dtype, layout)
        ref = F.conv2d(x.double(), w.double(), b.double(), 1, 1)
        _assert_within_cudnn(aligned, ref, F.conv2d(x, w, b, 1, 1), (dtype, layout))


def _assert_within_cudnn(out, ref, cudnn_out, what=""):
    """``out``'s error against the float64 ``ref`` (norm and worst element, as the tuner's check measures) is at
    most twice cuDNN's (``cudnn_out``) on the same data: the 16-bit check's bound (tuning.measure.Workspace)."""
    from bagf_torch.tuning.measure import CUDNN_ERROR_FACTOR, REL_TOL, judge_output, output_error

    norm, top = float(ref.detach().norm()), float(ref.detach().abs().max())
    theirs = output_error(cudnn_out, ref, norm, top)
    why = judge_output(out, ref, norm, top, max(REL_TOL, CUDNN_ERROR_FACTOR * theirs[0]),
                       max(10 * REL_TOL, CUDNN_ERROR_FACTOR * theirs[1]))
    assert why is None, (what, why, "cuDNN", theirs)


@pytest.mark.parametrize("family,split", [("implicit_gemm", None), ("implicit_gemm_tc", 4)])
def test_opcheck_and_autograd(compiler, family, split):
    fam = _family(family)
    cfg = dict(fam.DEFAULT) if split is None else dict(fam.DEFAULT, SPLIT=split)
    handle = compiler.compile(fam, [cfg])[0].handle
    x = torch.randn(2, 5, 11, 13, device="cuda", requires_grad=True)
    w = torch.randn(7, 5, 3, 3, device="cuda", requires_grad=True)
    b = torch.randn(7, device="cuda", requires_grad=True)
    for plan in (handle, -1):
        torch.library.opcheck(torch.ops.bagf.conv2d.default, (x, w, b, [2, 1], [1, 0], [1, 2], plan))
        torch.library.opcheck(torch.ops.bagf.conv2d.default, (x, w, None, [1, 1], [0, 0], [1, 1], plan))
    out = torch.ops.bagf.conv2d(x, w, b, [2, 1], [1, 0], [1, 2], handle)
    ref = F.conv2d(x, w, b, (2, 1), (1, 0), (1, 2))
    g = torch.randn_like(ref)
    got = torch.autograd.grad(out, (x, w, b), g)
    want = torch.autograd.grad(ref, (x, w, b), g)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4)


def test_inference_calls_skip_the_autograd_node(compiler):
    """Without a gradient to compute (no_grad, or no input that requires one) the op goes straight to the
    kernel; the output is the same and carries no graph; with one it records the node."""
    fam = _family("implicit_gemm_tc")
    handle = compiler.compile(fam, [fam.DEFAULT])[0].handle
    x = torch.randn(2, 5, 11, 13, device="cuda")
    w = torch.randn(7, 5, 3, 3, device="cuda")
    b = torch.randn(7, device="cuda")
    ref = F.conv2d(x, w, b, 1, 1)
    plain = torch.ops.bagf.conv2d(x, w, b, [1, 1], [1, 1], [1, 1], handle)
    with torch.no_grad():
        nograd = torch.ops.bagf.conv2d(x, w.requires_grad_(), b, [1, 1], [1, 1], [1, 1], handle)
    graph = torch.ops.bagf.conv2d(x, w, b, [1, 1], [1, 1], [1, 1], handle)
    direct = compiler.ext.conv2d_inference(x, w.detach(), b, [1, 1], [1, 1], [1, 1], handle)  # no dispatcher
    for out in (plain, nograd, graph, direct):
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert plain.grad_fn is None and nograd.grad_fn is None and not nograd.requires_grad
    assert graph.grad_fn is not None and graph.requires_grad


def test_a_layer_with_a_kernel_plan_answers_transforms_modes_and_traces_as_nn_conv2d(compiler):
    """A CUDA layer whose plan is our kernel: a plain no-grad call runs the kernel; under vmap, jvp, a forward-AD
    level, FlopCounterMode and torch.jit.trace the layer gives nn.Conv2d's answer (batched outputs, tangents, the
    flop count, a trace of torch's conv), where the dispatcher-free kernel call used to take them."""
    import torch.autograd.forward_ad as fwAD
    from torch.utils.flop_counter import FlopCounterMode

    import bagf_torch

    fam = _family("implicit_gemm_tc")
    handle = compiler.compile(fam, [fam.DEFAULT])[0].handle
    conv = bagf_torch.TunedConv2d(5, 7, 3, padding=1).cuda().requires_grad_(False)
    stock = torch.nn.Conv2d(5, 7, 3, padding=1).cuda().requires_grad_(False)
    stock.load_state_dict(conv.state_dict())
    x, t = torch.randn(2, 5, 11, 13, device="cuda"), torch.randn(2, 5, 11, 13, device="cuda")
    conv._remember(x, conv._kernel_entry(handle, (1, 1)))
    with torch.no_grad():
        torch.testing.assert_close(conv(x), compiler.ext.conv2d_inference(x, conv.weight, conv.bias, [1, 1], [1, 1],
                                                                          [1, 1], handle), rtol=0, atol=0)
    close = dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.func.vmap(conv)(torch.stack([x, t])), torch.func.vmap(stock)(torch.stack([x, t])),
                               **close)
    (out, tangent), (want, want_tangent) = torch.func.jvp(conv, (x,), (t,)), torch.func.jvp(stock, (x,), (t,))
    torch.testing.assert_close(out, want, **close)
    torch.testing.assert_close(tangent, want_tangent, **close)
    with fwAD.dual_level():
        torch.testing.assert_close(fwAD.unpack_dual(conv(fwAD.make_dual(x, t))).tangent, want_tangent, **close)
    with torch.no_grad():
        with FlopCounterMode(display=False) as counted:
            conv(x)
        assert counted.get_total_flops() == 2 * 2 * 7 * 11 * 13 * 5 * 9
        traced = torch.jit.trace(conv, x, check_trace=False)
        assert "bagf::" not in str(traced.graph)
        torch.testing.assert_close(traced(x), stock(x), **close)
    # jvp inside a compiled graph reaches the op itself (the layer's eager check does not run there): the op's
    # autograd kernel gives forward-mode AD to ATen's convolution instead of dropping the tangent
    torch._dynamo.reset()
    tangent = torch.compile(lambda a, b: torch.func.jvp(conv, (a,), (b,))[1], fullgraph=True)(x, t)
    torch.testing.assert_close(tangent, want_tangent, **close)


def test_frozen_layers_keep_a_krsc_weight_for_a_krsc_plan_in_eager_calls_and_graphs(compiler):
    """A layer whose plan reads the weight KRSC (an NCHW TMA plan): without freezing, every call converts the weight
    and a CUDA graph replay reads the weight as it is then (an in-place update after the capture is seen, as with
    nn.Conv2d). With ``freeze_weights``: inference calls pass a channels_last copy made once, with the same output as
    the op converting the weight itself; an in-place update makes a new copy; a graph captured after freezing reads
    the copy (an update after the capture is not seen, and the copy outlives the eager calls' newer ones) until the
    weights are frozen again and the graph captured again."""
    if torch.cuda.get_device_capability(0) < (9, 0):
        pytest.skip("TMA plans need sm_90")
    import bagf_torch

    fam = _family("implicit_gemm_tma_tf32")
    tma = compiler.compile(fam, [dict(fam.DEFAULT, NHWC=0, SPLIT=1)])[0].handle
    tc = _family("implicit_gemm_tc")
    plain = compiler.compile(tc, [tc.DEFAULT])[0].handle
    assert compiler.ext.plan_reads_krsc(tma) and not compiler.ext.plan_reads_krsc(plain)
    conv = bagf_torch.TunedConv2d(64, 96, 3, padding=1).cuda()
    x = torch.randn(2, 64, 15, 17, device="cuda")
    conv._remember(x, conv._kernel_entry(tma, (1, 1)))

    def want():  # the plan with the op converting the weight itself
        return compiler.ext.conv2d_inference(x, conv.weight.detach(), conv.bias.detach(), [1, 1], [1, 1], [1, 1],
                                             tma)

    def captured():
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = conv(x)
        return graph, static

    with torch.no_grad():
        assert torch.equal(conv(x), want()) and conv._bagf_krsc is None
        graph, static = captured()
        conv.weight.mul_(-0.5)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static, want())  # not frozen: the replay converts the updated weight

        bagf_torch.freeze_weights(conv)
        assert torch.equal(conv(x), want())
        kept = conv._bagf_krsc[3]
        assert kept.is_contiguous(memory_format=torch.channels_last) and torch.equal(kept, conv.weight)
        assert torch.equal(conv(x), want()) and conv._bagf_krsc[3] is kept
        conv.weight.mul_(2.0)
        assert torch.equal(conv(x), want()) and conv._bagf_krsc[3] is not kept
        before = want()
        graph, static = captured()
        conv.weight.mul_(3.0)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static, before) and not torch.equal(static, want())  # frozen: the capture's copy
        assert torch.equal(conv(x), want())  # an eager call sees the update (a new copy) ...
        torch.randn(64 << 20, device="cuda")  # (allocations that would take a freed copy's memory)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static, before)  # ... and the graph still reads its own copy, kept alive (pinned)
        bagf_torch.freeze_weights(conv)  # the documented way after an update: freeze again, run once, capture again
        conv(x)
        graph, static = captured()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static, want())


CUBLASLT_SHAPES = [
    (1, 1024, 14, 14, 256, 1, 1, (1, 1), (0, 0), (1, 1), True),  # ResNet's 1x1 1024 -> 256 at N = 1
    (3, 64, 7, 9, 40, 1, 1, (1, 1), (0, 0), (1, 1), False),      # no bias
    (2, 24, 5, 5, 16, 1, 1, (1, 1), (0, 0), (2, 3), True),       # a dilation (a 1x1 filter ignores it)
    (2, 5, 9, 9, 70, 1, 1, (1, 1), (0, 0), (1, 1), True),        # C = 5, K = 70: 2- and 4-byte alignments only
]


def test_cublaslt_1x1_plans_in_every_dtype_format_and_mode(compiler):
    """cuBLASLt plans of every dtype, memory format and TF32 mode on 1x1 shapes (with and without bias, odd C and K,
    a dilation, N = 1 and batches; input and weight also one element off 16-byte alignment), NaN-poisoned output
    within the tuner's bound (fp32's, or twice cuDNN's error in the problem's mode and dtype; in TF32 mode only where
    cuDNN itself computes in TF32, as the tuner's bound is fp32's elsewhere): the heuristic's first entry with and
    without workspace always runs; a later entry either runs correctly or the shape has no such entry (a launch
    failure that says so, nothing written). Through the op: the same output as the checked launch, in a CUDA graph
    too; a 3x3 call and a plan's missing entry are ATen's. NCHW's bias also through the fallback (the output filled
    with it first, C = D), forced by BAGF_TEST_CUBLASLT_FILLED_BIAS."""
    from bagf_torch.kernels import cublaslt_1x1 as lt
    from bagf_torch.tuning.measure import CudaChecker, Workspace

    fam = _family("cublaslt_1x1")
    checker = CudaChecker(compiler.ext)
    modes = [(fmt, tf32) for fmt in _formats(fam) for tf32 in ((False, True) if fmt[0] == "float32" else (False,))]
    missing, ran = [], 0
    for fmt, tf32 in modes:
        p0 = _problem(CUBLASLT_SHAPES[0], tf32=tf32, fmt=fmt)
        configs = [c for c in fam.space().valid_configs() if fam.problem_rule(c, p0) is None]
        assert len(configs) == 16
        built = compiler.compile(fam, configs)
        assert all(hasattr(b, "handle") for b in built), [b.detail for b in built if not hasattr(b, "handle")]
        assert not any(compiler.ext.plan_reads_krsc(b.handle) for b in built)  # (a 1x1 filter: KCRS is KRSC)
        for shape, shifted in [(s, False) for s in CUBLASLT_SHAPES] + [(CUBLASLT_SHAPES[1], True)]:
            ws = Workspace(_problem(shape, tf32=tf32, fmt=fmt), torch.device("cuda", 0))
            if tf32 and ws.cudnn_error[0] < 1e-5:
                assert shape != CUBLASLT_SHAPES[0], "cuDNN computes ResNet's 1x1 layer in TF32"
                continue  # cuDNN's own fp32 here: the tuner's bound is fp32's, which TF32 products miss
            if shifted:
                ws.x, ws.w = _shifted(ws.x), _shifted(ws.w)
                assert ws.x.data_ptr() % 16 and ws.w.data_ptr() % 16
            for c, b in zip(configs, built):
                out = checker.check(ws, b.handle)
                if out is not None and c["ALG"] > 0 and out.status == "launch" and "offers" in out.detail:
                    missing.append((fmt, tf32, shape, lt.name(c), shifted))
                    assert torch.isnan(ws.out).all(), "a refused call wrote nothing"
                    continue
                assert out is None, (fmt, tf32, shape, lt.name(c), out.detail)
                ran += 1
        for b in built:
            compiler.unload(b.handle)
    print(f"cuBLASLt plans: {ran} ran correctly, {len(missing)} asked for an entry the heuristic did not list")
    assert ran >= len(modes) * 2 * 2  # (at least the ResNet shape and the shifted one, entry 0, both workspaces)

    # through the op, eager and in a CUDA graph: NCHW with a bias (the batch's C) at N = 2, strict fp32 (the bound
    # without cuDNN's TF32 choice on this shape in it)
    p = _problem((2, 256, 12, 10, 48, 1, 1, (1, 1), (0, 0), (1, 1), True))
    handle = compiler.compile(fam, [lt.default_for(p)])[0].handle
    ws = Workspace(p, torch.device("cuda", 0))
    assert checker.check(ws, handle) is None
    want = ws.out.clone()
    got = torch.ops.bagf.conv2d(ws.x, ws.w, ws.b, [1, 1], [0, 0], [1, 1], handle)
    assert torch.equal(got, want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = compiler.ext.conv2d_inference(ws.x, ws.w, ws.b, [1, 1], [0, 0], [1, 1], handle)
    ws.x.mul_(-1)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static, torch.ops.bagf.conv2d(ws.x, ws.w, ws.b, [1, 1], [0, 0], [1, 1], handle))
    w3 = torch.randn(48, 256, 3, 3, device="cuda")
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        torch.testing.assert_close(torch.ops.bagf.conv2d(ws.x, w3, None, [1, 1], [1, 1], [1, 1], handle),
                                   F.conv2d(ws.x, w3, None, 1, 1))
    with pytest.raises(RuntimeError, match="1x1"):
        compiler.ext.conv2d_inference(ws.x, w3, None, [1, 1], [1, 1], [1, 1], handle,
                                      out=torch.empty(2, 48, 12, 10, device="cuda"))
    # the output filled with the bias first and C = D: the path taken where cuBLASLt refuses the broadcast C, forced
    os.environ["BAGF_TEST_CUBLASLT_FILLED_BIAS"] = "1"
    try:
        for tf32 in (False, True):
            p = _problem((3, 256, 7, 9, 40, 1, 1, (1, 1), (0, 0), (1, 1), True), tf32=tf32)
            ws = Workspace(p, torch.device("cuda", 0))
            handle = compiler.compile(fam, [lt.default_for(p)])[0].handle
            judge = checker
            if tf32 and ws.cudnn_error[0] < 1e-5:  # cuDNN's own fp32 on this shape (its choice varies from run to
                # run): the bound of TF32 products themselves, twice the error of the operands rounded to TF32
                judge = CudaChecker(compiler.ext, rel_tol=2 * ws.tf32_operand_error()[0])
            assert judge.check(ws, handle) is None, ("filled D", tf32)
            compiler.unload(handle)
    finally:
        del os.environ["BAGF_TEST_CUBLASLT_FILLED_BIAS"]
    aligned = [m[:4] for m in missing if not m[4]]
    if aligned:  # a plan whose entry this shape lacks (with fresh, aligned tensors): ATen's answer through the op
        fmt, tf32, shape, name = aligned[0]
        c = next(c for c in fam.space().valid_configs() if lt.name(c) == name)
        h = compiler.compile(fam, [c])[0].handle
        wsm = Workspace(_problem(shape, tf32=tf32, fmt=fmt), torch.device("cuda", 0))
        ref = F.conv2d(wsm.x, wsm.w, wsm.b, 1, 0, shape[9])
        torch.testing.assert_close(torch.ops.bagf.conv2d(wsm.x, wsm.w, wsm.b, [1, 1], [0, 0], list(shape[9]), h), ref)


def test_bad_geometry_and_bad_outputs_raise_never_crash(compiler):
    """A loaded plan handed a stride or dilation of 0 or a negative padding: ATen's own error through the op (the
    output-size formula divides by the stride: a SIGFPE had taken the process down); the strict launch into out=
    says what is wrong, also for an out on another device or of another shape."""
    fam = _family("implicit_gemm_tc")
    handle = compiler.compile(fam, [fam.DEFAULT])[0].handle
    x = torch.randn(2, 5, 11, 13, device="cuda")
    w = torch.randn(7, 5, 3, 3, device="cuda")
    for stride, padding, dilation in (([0, 1], [1, 1], [1, 1]), ([1, 1], [-1, 1], [1, 1]), ([1, 1], [1, 1], [1, 0])):
        with pytest.raises(RuntimeError):
            torch.ops.bagf.conv2d(x, w, None, stride, padding, dilation, handle)
        with pytest.raises(RuntimeError):
            compiler.ext.conv2d_inference(x, w, None, stride, padding, dilation, handle)
        with pytest.raises(RuntimeError, match="at least"):
            compiler.ext.conv2d_inference(x, w, None, stride, padding, dilation, handle,
                                          out=torch.empty(2, 7, 11, 13, device="cuda"))
    with pytest.raises(RuntimeError, match="device"):
        compiler.ext.conv2d_inference(x, w, None, [1, 1], [1, 1], [1, 1], handle, out=torch.empty(2, 7, 11, 13))
    with pytest.raises(RuntimeError, match="NKPQ shape"):
        compiler.ext.conv2d_inference(x, w, None, [1, 1], [1, 1], [1, 1], handle,
                                      out=torch.empty(2, 7, 11, 12, device="cuda"))
    out = torch.full((2, 7, 11, 13), float("nan"), device="cuda")
    compiler.ext.conv2d_inference(x, w, None, [1, 1], [1, 1], [1, 1], handle, out=out)
    torch.testing.assert_close(out, F.conv2d(x, w, None, 1, 1), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family,mt,split", [("winograd", 2, 1), ("winograd", 4, 4), ("winograd_tc", 2, 1),
                                             ("winograd_tc", 4, 4)])
def test_winograd_opcheck_autograd_and_fallback_for_other_problems(compiler, family, mt, split):
    """A Winograd plan on a 3x3 stride-1 call runs the kernel (opcheck, gradients through ATen's backward);
    the same plan handed a 5x5, strided or dilated call returns ATen's answer instead of a wrong one."""
    fam = _family(family)
    cfg = dict(fam.DEFAULT if fam.DEFAULT["MT"] == mt else fam.START, SPLIT=split)  # one of each tile size
    assert cfg["MT"] == mt and fam.space().is_valid(cfg), fam.space().invalid_reason(cfg)
    handle = compiler.compile(fam, [cfg])[0].handle
    x = torch.randn(2, 5, 11, 13, device="cuda", requires_grad=True)
    w = torch.randn(7, 5, 3, 3, device="cuda", requires_grad=True)
    b = torch.randn(7, device="cuda", requires_grad=True)
    torch.library.opcheck(torch.ops.bagf.conv2d.default, (x, w, b, [1, 1], [1, 0], [1, 1], handle))
    torch.library.opcheck(torch.ops.bagf.conv2d.default, (x, w, None, [1, 1], [0, 2], [1, 1], handle))
    out = torch.ops.bagf.conv2d(x, w, b, [1, 1], [1, 0], [1, 1], handle)
    ref = F.conv2d(x, w, b, 1, (1, 0))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    g = torch.randn_like(ref)
    for a, e in zip(torch.autograd.grad(out, (x, w, b), g), torch.autograd.grad(ref, (x, w, b), g)):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        w5 = torch.randn(7, 5, 5, 5, device="cuda")
        for args, want in (((w5, b, [1, 1], [2, 2], [1, 1]), F.conv2d(x, w5, b, 1, 2)),
                           ((w, b, [2, 1], [1, 1], [1, 1]), F.conv2d(x, w, b, (2, 1), 1)),
                           ((w, b, [1, 1], [1, 1], [2, 2]), F.conv2d(x, w, b, 1, 1, (2, 2)))):
            got = torch.ops.bagf.conv2d(x, *args, handle)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def _op_and_gradients_match_aten(handle, x, w, b, stride, padding):
    """opcheck of the plan's call, then its output and the gradients (through ATen's backward) against
    F.conv2d with TF32 off, at 1e-4."""
    torch.library.opcheck(torch.ops.bagf.conv2d.default, (x, w, b, stride, padding, [1, 1], handle))
    out = torch.ops.bagf.conv2d(x, w, b, stride, padding, [1, 1], handle)
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        ref = F.conv2d(x, w, b, stride, padding)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
        g = torch.randn_like(ref)
        for a, e in zip(torch.autograd.grad(out, (x, w, b), g), torch.autograd.grad(ref, (x, w, b), g)):
            torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4)


def test_winograd_gemm_products_through_at_bmm_out_where_cublaslt_is_not_used(compiler, monkeypatch):
    """The non-fused Winograd plan without its own GEMM runs its products through cuBLASLt; where cuBLASLt cannot be
    used (forced here with BAGF_TEST_WINOGRAD_BMM when the plan is loaded) at::bmm_out computes them, in views of the
    same one workspace: every layout of V and M, float32 and bfloat16 channels_last, within the check's bound on odd
    shapes (stride 4 polyphase too), and the cuBLASLt plan's values to fp32's rounding. Such a plan refuses calls
    while torch's matmuls run in TF32 (at::bmm_out would multiply in TF32), which the cuBLASLt plan takes."""
    from bagf_torch.tuning.measure import CudaChecker, Workspace

    fam = _family("winograd_gemm")
    checker = CudaChecker(compiler.ext)
    shapes = [(2, 5, 11, 13, 7, 3, 3, (1, 1), (1, 0), (1, 1), True),
              (1, 3, 37, 41, 16, 11, 11, (4, 4), (2, 2), (1, 1), True)]
    fmts = [("float32", "nchw"), ("bfloat16", "nhwc")]
    configs = [dict(fam.DEFAULT, MT=4, VL=vl, ML=ml, GE=0, SO=0, DT=fam.DTYPES[d], NHWC=int(l == "nhwc"))
               for vl in (0, 1) for ml in (0, 1) for d, l in fmts]
    assert all(fam.space().is_valid(c) for c in configs)
    monkeypatch.setenv("BAGF_TEST_WINOGRAD_BMM", "1")
    bmm = compiler.compile(fam, configs)
    monkeypatch.delenv("BAGF_TEST_WINOGRAD_BMM")
    lt = compiler.compile(fam, configs)
    assert all(hasattr(b, "handle") for b in bmm + lt), [b.detail[:200] for b in bmm + lt if not hasattr(b, "handle")]
    compared = 0
    try:
        for fmt in fmts:
            for shape in shapes:
                ws = Workspace(_problem(shape, fmt=fmt), torch.device("cuda", 0))
                for c, b, a in zip(configs, bmm, lt):
                    if not _runs(fam, c, shape, fmt):
                        continue
                    assert checker.check(ws, b.handle) is None, (fam.name(c), shape, fmt)
                    with torch.no_grad():
                        got = compiler.ext.conv2d_inference(ws.x, ws.w, ws.b, *ws.args, b.handle,
                                                            out=torch.full_like(ws.out, float("nan")))
                        want = compiler.ext.conv2d_inference(ws.x, ws.w, ws.b, *ws.args, a.handle,
                                                             out=torch.full_like(ws.out, float("nan")))
                    # (two SGEMMs' sums in other orders through the inverse transform: fp32's rounding, as the other
                    # Winograd tests bound it on unit-variance outputs, then at most a step of the output's dtype)
                    rtol = 2.0 ** -7 if got.dtype == torch.bfloat16 else 1e-4
                    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=1e-4)
                    if fmt[0] == "float32":  # the switch took: under TF32 matmul flags only the cuBLASLt plan runs
                        with monkeypatch.context() as m:
                            m.setattr(torch.backends.cuda.matmul, "allow_tf32", True)
                            refused = checker.check(ws, b.handle)
                            assert refused is not None and refused.status == "launch" and "not available" in (
                                refused.detail), refused
                            assert checker.check(ws, a.handle) is None
                    compared += 1
    finally:
        for b in bmm + lt:
            compiler.unload(b.handle)
    assert compared == 8 * len(shapes)


@pytest.mark.parametrize("mt", [2, 4, 5, 6])
def test_winograd_gemm_opcheck_autograd_fallback_and_fp32_under_tf32_matmul_flags(compiler, mt, monkeypatch):
    """The non-fused Winograd plan (three stages around cuBLASLt's batched SGEMM): opcheck, gradients through
    ATen's backward, ATen's answer for a problem it cannot compute; and, while torch lets its fp32 matmuls use
    TF32 (matmul.allow_tf32, or set_float32_matmul_precision below 'highest', as many programs set), still the
    plan's fp32 arithmetic (its products through cuBLASLt in fp32 with the flags on or off, never at::bmm_out's
    TF32): within fp32's error of what it computes with the flags off, and nowhere near TF32's. It used to hand
    such calls to ATen, so a plan tuned in a default process ran cuDNN wherever a program had set the flags."""
    fam = _family("winograd_gemm")
    handle = compiler.compile(fam, [dict(fam.DEFAULT, MT=mt, VL=1, ML=1, GE=0)])[0].handle
    x = torch.randn(2, 5, 11, 13, device="cuda", requires_grad=True)
    # weights scaled to unit-variance outputs (as the tuner's check data) so that 1e-4 is relative: unscaled 3x3
    # weights over 5 channels give outputs of about 7, where F(6x6)'s fp32 error (about 2e-5 of the output's
    # scale) exceeded an absolute 1e-4
    w = (torch.randn(7, 5, 3, 3, device="cuda") / 45 ** 0.5).requires_grad_()
    b = torch.randn(7, device="cuda", requires_grad=True)
    torch.library.opcheck(torch.ops.bagf.conv2d.default, (x, w, None, [1, 1], [0, 2], [1, 1], handle))
    _op_and_gradients_match_aten(handle, x, w, b, [1, 1], [1, 0])
    # the same plan at stride 4 with an 11x10 filter (the polyphase form over 80 channels); weights scaled to
    # unit-variance outputs (as the tuner's check data) so that 1e-4 is relative
    w11 = (torch.randn(7, 5, 11, 10, device="cuda") / 550 ** 0.5).requires_grad_()
    _op_and_gradients_match_aten(handle, torch.randn(2, 5, 37, 41, device="cuda", requires_grad=True), w11, b,
                                 [4, 4], [2, 1])
    with torch.no_grad(), torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True,
                                                     allow_tf32=False):
        w5 = torch.randn(7, 5, 5, 5, device="cuda") / 125 ** 0.5  # unit-variance outputs here too
        torch.testing.assert_close(torch.ops.bagf.conv2d(x, w5, b, [1, 1], [2, 2], [1, 1], handle),
                                   F.conv2d(x, w5, b, 1, 2), rtol=1e-4, atol=1e-4)
        w3 = w.detach()  # 3x3 at stride 2: the host computes it in the polyphase form (the tuner does not
        # offer it there, winograd_math.polyphase_applies); at unequal strides ATen answers
        for st in ([2, 2], [2, 1]):
            torch.testing.assert_close(torch.ops.bagf.conv2d(x, w3, b, st, [1, 1], [1, 1], handle),
                                       F.conv2d(x, w3, b, st, 1), rtol=1e-4, atol=1e-4)
        mine = torch.ops.bagf.conv2d(x, w, b, [1, 1], [1, 1], [1, 1], handle)
        aten = F.conv2d(x, w, b, 1, 1)
        assert not torch.equal(mine, aten)  # the plan's own arithmetic (else the checks below show nothing)
        ref = F.conv2d(x.double(), w.double(), b.double(), 1, 1)
        for flags in ({"allow_tf32": True}, {"precision": "high"}):
            if "allow_tf32" in flags:
                monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", True)
            else:
                monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
                previous = torch.get_float32_matmul_precision()
                torch.set_float32_matmul_precision("high")
            try:
                got = torch.ops.bagf.conv2d(x, w, b, [1, 1], [1, 1], [1, 1], handle)
            finally:
                if "precision" in flags:
                    torch.set_float32_matmul_precision(previous)
            assert not torch.equal(got, aten), flags  # the plan ran, not ATen
            error = float((got.double() - ref).norm() / ref.norm())
            assert error < 1e-5, (flags, error)  # fp32 products (TF32's are ~1e-4 here)
            torch.testing.assert_close(got, mine, rtol=1e-5, atol=1e-5)
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


# Shapes where the plan's own GEMM takes its 16-byte path (C and T multiples of 4) and where it does not
OWN_GEMM_SHAPES = [
    (4, 64, 13, 13, 96, 3, 3, (1, 1), (1, 1), (1, 1), True),  # T = 4 * 9 (F5, F6) or 4 * 16 (F4): vector path
    (8, 32, 12, 12, 130, 3, 3, (1, 1), (1, 1), (1, 1), False),  # K off every BM
    (2, 37, 13, 13, 70, 3, 3, (1, 1), (1, 1), (1, 1), True),  # C % 4 != 0: scalar path
    (1, 200, 7, 9, 33, 3, 3, (1, 1), (0, 1), (1, 1), True),  # T small and odd
    (2, 8, 50, 47, 12, 3, 3, (1, 1), (1, 1), (1, 1), True),  # more tiles per image than TB: SO=1 runs per tile
    (4, 3, 224, 224, 64, 11, 11, (4, 4), (2, 2), (1, 1), True),  # conv1, polyphase: C' = 48
    (2, 1, 40, 37, 10, 7, 6, (3, 3), (1, 2), (1, 1), False),  # polyphase C' = 9: scalar path
]


def test_winograd_gemm_own_gemm_every_tile_correct_and_indifferent_to_tf32(compiler, monkeypatch):
    """winograd_gemm with its own 3xTF32 GEMM (GE > 0), every tile of GEMMS (and of WGMMA_GEMMS on sm_90, whose
    plans also make stage 0 write U's small parts into a workspace twice U's size), every MT, with stage 2 per
    tile and staged (SO = 1: whole images per block, partial last blocks, and per tile when an image has more
    tiles than the block threads), the first and last GEMM in each 16-bit dtype and in channels_last too, checked
    like every candidate (NaN-poisoned output against float64, tuning.measure.CudaChecker) on shapes that take the
    GEMM's 16-byte and 4-byte paths; and, unlike the cuBLAS plan, not refused while torch allows TF32 matmuls (its
    arithmetic does not depend on that flag): the output is the same bits either way."""
    fam = _family("winograd_gemm")
    ges = list(fam.GEMMS) + (list(fam.WGMMA_GEMMS) if torch.cuda.get_device_capability() == (9, 0) else [])
    configs = [dict(fam.DEFAULT, MT=mt, GE=ge, TB=128, SO=so) for ge in ges for mt in fam.PARAMS["MT"]
               for so in (0, 1)]
    # the GEMM is fp32 in every format the family computes: in the others, the first and last GEMM at F(4x4), F(5x5)
    # (staged outputs where the format has them: NCHW)
    configs += [dict(fam.DEFAULT, MT=mt, GE=ge, TB=128, SO=int(l == "nchw"), DT=fam.DTYPES[d], NHWC=fam.LAYOUTS[l])
                for d, l in fam.FORMATS if (d, l) != ("float32", "nchw") for ge in (ges[0], ges[-1]) for mt in (4, 5)]
    assert all(fam.space().is_valid(c) for c in configs)
    built = _compile_and_check(compiler, fam, configs, OWN_GEMM_SHAPES)
    x = torch.randn(2, 5, 11, 13, device="cuda", requires_grad=True)
    w = torch.randn(7, 5, 3, 3, device="cuda", requires_grad=True)
    b = torch.randn(7, device="cuda", requires_grad=True)
    for ge in {ges[0], ges[-1]}:  # a gemm_tf32x3 plan and (on sm_90) a gemm_wgmma one
        handle = built[configs.index(dict(fam.DEFAULT, MT=fam.PARAMS["MT"][0], GE=ge, TB=128, SO=1))].handle
        torch.library.opcheck(torch.ops.bagf.conv2d.default, (x, w, b, [1, 1], [1, 0], [1, 1], handle))
        with torch.no_grad(), torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True,
                                                         allow_tf32=False):
            mine = torch.ops.bagf.conv2d(x, w, b, [1, 1], [1, 1], [1, 1], handle)
            aten = F.conv2d(x, w, b, 1, 1)
            assert not torch.equal(mine, aten)
            monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", True)
            assert torch.equal(torch.ops.bagf.conv2d(x, w, b, [1, 1], [1, 1], [1, 1], handle), mine)
            monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


# Shapes for the direct family: AlexNet conv1 and odd ones -- strides 1, 2, 4 and mixed,
# padding, dilation, 1x1, 11x11, C=3, K off every BK, P and Q off every tile, N up to 3, bias or not.
DIRECT_SHAPES = [
    (2, 3, 224, 224, 64, 11, 11, (4, 4), (2, 2), (1, 1), True),
    (1, 3, 57, 61, 37, 11, 11, (4, 4), (2, 2), (1, 1), False),
    (3, 5, 19, 23, 70, 3, 3, (2, 2), (1, 1), (1, 1), True),
    (1, 7, 21, 17, 17, 3, 5, (1, 2), (2, 0), (2, 3), True),
    (2, 33, 9, 11, 65, 1, 1, (1, 1), (0, 0), (1, 1), True),
    (1, 9, 30, 31, 19, 5, 5, (3, 1), (0, 2), (1, 1), False),
    (2, 3, 37, 41, 24, 7, 7, (2, 2), (3, 3), (1, 1), True),
    (1, 6, 15, 14, 10, 3, 3, (1, 1), (1, 1), (1, 1), True),
    (1, 4, 20, 18, 9, 3, 3, (2, 1), (1, 0), (2, 1), False),
    (3, 2, 45, 50, 67, 11, 11, (3, 4), (0, 5), (1, 1), True),
]
"""Every specialised geometry of the direct family (G = 1-4: 11 wide at column stride 4, 7 at 2, 5 at 1, 3 at
1) has at least one shape here, with row stride, row dilation and padding different from the column's."""


def test_direct_configs_correct_on_conv1_and_odd_shapes(compiler):
    """Sampled direct configurations (the start points of the shapes included) into a NaN-poisoned output,
    against float64 F.conv2d on fresh random data (tuning.measure.CudaChecker)."""
    fam = _family("direct")
    seed = int(os.environ.get("BAGF_TEST_SEED", "4321"))
    configs = _sample_configs(fam, 24, seed=seed)
    configs += [fam.default_for(_problem(s)) for s in DIRECT_SHAPES]
    valid = fam.space().valid_configs()
    for g in fam.GEOMETRIES:  # six more of each geometry, the largest register window among them
        of_g = [c for c in valid if c["G"] == g]
        configs += random.Random(seed + g).sample(of_g, 6) + [max(of_g, key=fam.estimated_registers)]
    configs = list({fam.name(c): c for c in configs}.values())
    geometries = {fam.geometry_for(_problem(s)) for s in DIRECT_SHAPES}
    assert geometries == set(fam.GEOMETRIES)  # every specialisation runs on some shape (and G=0 on all)
    assert all(sum(c["G"] == g for c in configs) >= 7 for g in geometries)
    _compile_and_check(compiler, fam, configs, DIRECT_SHAPES)


def test_direct_specialised_plan_refuses_other_geometries(compiler):
    """A direct plan compiled for 11-wide filters at column stride 4 (G=1) computes such a call with its own
    arithmetic, and hands a call of another filter width, column stride or column dilation to ATen (the same
    answer as F.conv2d) instead of running a kernel that would read the wrong taps."""
    fam = _family("direct")
    cfg = fam.default_for(_problem(DIRECT_SHAPES[1]))
    assert cfg["G"] == 1
    handle = compiler.compile(fam, [cfg])[0].handle
    x = torch.randn(1, 3, 57, 61, device="cuda")
    w = torch.randn(5, 3, 11, 11, device="cuda")
    with torch.no_grad():
        mine = torch.ops.bagf.conv2d(x, w, None, [4, 4], [2, 2], [1, 1], handle)
        with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True, allow_tf32=False):
            torch.testing.assert_close(mine, F.conv2d(x, w, None, 4, 2), rtol=1e-4, atol=1e-4)
            for wt, st, dl in ((torch.randn(5, 3, 11, 9, device="cuda"), [4, 4], [1, 1]),
                               (w, [4, 2], [1, 1]), (w, [4, 4], [1, 2])):
                got = torch.ops.bagf.conv2d(x, wt, None, st, [2, 2], dl, handle)
                assert torch.equal(got, F.conv2d(x, wt, None, st, 2, dl))


def test_direct_opcheck_autograd_and_refusal_of_a_patch_too_large(compiler):
    """A direct plan runs any geometry it fits (opcheck, gradients through ATen), sizing shared memory per call;
    a call whose input patch and filters exceed the device's shared memory gets ATen's answer, not a launch."""
    fam = _family("direct")
    handle = compiler.compile(fam, [dict(fam.DEFAULT, SPLIT=2)])[0].handle
    x = torch.randn(2, 5, 11, 13, device="cuda", requires_grad=True)
    w = torch.randn(7, 5, 3, 3, device="cuda", requires_grad=True)
    b = torch.randn(7, device="cuda", requires_grad=True)
    torch.library.opcheck(torch.ops.bagf.conv2d.default, (x, w, b, [2, 1], [1, 0], [1, 2], handle))
    torch.library.opcheck(torch.ops.bagf.conv2d.default, (x, w, None, [1, 1], [0, 0], [1, 1], handle))
    out = torch.ops.bagf.conv2d(x, w, b, [2, 1], [1, 0], [1, 2], handle)
    ref = F.conv2d(x, w, b, (2, 1), (1, 0), (1, 2))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    g = torch.randn_like(ref)
    for a, e in zip(torch.autograd.grad(out, (x, w, b), g), torch.autograd.grad(ref, (x, w, b), g)):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4)
    with torch.no_grad():  # 8 x 16 tile, 31x31 filter, stride 8: (7*8+31) x (15*8+31) patch, 2 stages x 961 taps
        xb = torch.randn(1, 2, 300, 300, device="cuda")
        wb = torch.randn(3, 2, 31, 31, device="cuda")
        got = torch.ops.bagf.conv2d(xb, wb, None, [8, 8], [0, 0], [1, 1], handle)  # 628 KB: refused (a warning)
        torch.testing.assert_close(got, F.conv2d(xb, wb, None, 8), rtol=1e-4, atol=1e-4)


def _conv_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 16, 5, stride=2, padding=2), torch.nn.ReLU(),
                               torch.nn.Conv2d(16, 24, 3, padding=1)).cuda()


def test_first_call_tunes_then_cache_hit(monkeypatch):
    import bagf_torch
    from bagf_torch import runtime
    from bagf_torch.jit.compiler import STATS

    monkeypatch.setenv("BAGF_STRATEGY", "random")
    monkeypatch.setenv("BAGF_BUDGET", "6")
    model = _conv_model()
    ref_model = _conv_model()
    tuned = bagf_torch.convert(model)
    x = torch.randn(2, 3, 33, 31, device="cuda")
    with torch.no_grad():
        out = tuned(x)
        torch.testing.assert_close(out, ref_model(x), rtol=1e-4, atol=1e-4)
        rt = runtime.get()
        assert rt.stats["tuned"] == 2
        assert all(r.evaluations <= 6 for r in rt.results)
        out2 = tuned(x)  # same process: memo, no tuning
        assert rt.stats["tuned"] == 2
        torch.testing.assert_close(out2, out)
        # a new runtime over the same disk cache (a new process, minus the build): no tuning, no NVRTC
        runtime.reset()
        compiles = STATS.nvrtc_compiles
        fresh = bagf_torch.convert(_conv_model())
        torch.testing.assert_close(fresh(x), out, rtol=1e-5, atol=1e-5)
        rt2 = runtime.get()
        assert rt2.stats["tuned"] == 0 and rt2.stats["cache_hits"] == 2
        assert STATS.nvrtc_compiles == compiles


def test_fresh_process_tunes_nothing_compiles_nothing(monkeypatch):
    import bagf_torch
    from bagf_torch import runtime

    monkeypatch.setenv("BAGF_STRATEGY", "random")
    monkeypatch.setenv("BAGF_BUDGET", "4")
    x = torch.randn(1, 3, 40, 40, device="cuda")
    with torch.no_grad():
        expected = bagf_torch.convert(_conv_model())(x)
    assert runtime.get().stats["tuned"] == 2
    torch.save(x.cpu(), os.path.join(os.environ["BAGF_CACHE_DIR"], "x.pt"))
    torch.save(expected.cpu(), os.path.join(os.environ["BAGF_CACHE_DIR"], "y.pt"))
    script = textwrap.dedent(f"""
        import json, os, sys, time
        t0 = time.perf_counter()
        sys.path.insert(0, {_PACKAGE_ROOT!r})
        import torch, bagf_torch
        from bagf_torch import runtime
        from bagf_torch.jit.compiler import STATS
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 5, stride=2, padding=2), torch.nn.ReLU(),
                                torch.nn.Conv2d(16, 24, 3, padding=1)).cuda()
        m = bagf_torch.convert(m)
        d = os.environ["BAGF_CACHE_DIR"]
        x = torch.load(os.path.join(d, "x.pt")).cuda()
        with torch.no_grad():
            y = m(x)
        torch.cuda.synchronize()
        err = (y.cpu() - torch.load(os.path.join(d, "y.pt"))).abs().max().item()
        print(json.dumps(dict(tuned=runtime.get().stats["tuned"], hits=runtime.get().stats["cache_hits"],
                              nvrtc=STATS.nvrtc_compiles, err=err, seconds=time.perf_counter() - t0)))
    """)
    env = dict(os.environ, BAGF_TUNE="0")
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    stats = json.loads(res.stdout.strip().splitlines()[-1])
    assert stats["tuned"] == 0 and stats["nvrtc"] == 0 and stats["hits"] == 2, stats
    assert stats["err"] < 1e-5, stats


def test_process_ends_cleanly_with_compiles_still_running(tmp_path):
    """A compile the tuner stopped waiting for goes on in a daemon thread of the compiler's pool; a process whose
    interpreter finalizes while such compiles return must end with its own exit status, not abort (a thread taking
    the GIL back through pybind11's RAII guard during shutdown was ended by std::terminate: SIGABRT after a
    successful ``tune``). The child's shutdown is kept going (an object of a module that is torn down sleeps in its
    destructor) until NVRTC has returned every compile (tests/test_shutdown.py does the same against a stand-in
    NVRTC on the CPU)."""
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {_PACKAGE_ROOT!r})
        import torch
        from bagf_torch import runtime
        from bagf_torch.kernels import winograd_gemm as fam
        compiler = runtime.get().device(0).compiler
        ext = compiler.ext
        before = ext.nvrtc_returned()[0]
        configs = [c for c in fam.space().valid_configs() if c["MT"] in (5, 6) and c["DT"] == 0 and c["NHWC"] == 0]
        configs = configs[:compiler.workers]
        got = compiler.compile_within(fam, configs, 0.3)
        print("unfinished", sum(g is None for g in got), flush=True)
        want = before + len(configs)
    """) + fh.teardown_waiter("ext.nvrtc_returned", "want", 60) + "\nsys.exit(3)\n"
    env = dict(os.environ, BAGF_CACHE_DIR=str(tmp_path / "cache"))
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert "terminate called" not in res.stderr, res.stderr[-3000:]
    assert res.returncode == 3, (res.returncode, res.stderr[-3000:])
    unfinished = int(res.stdout.split("unfinished")[-1].split()[0])
    assert unfinished > 0, "every compile ended within 0.3 s: the exit did not race a running compile"
    counts = fh.teardown_counts(res.stderr)
    assert counts is not None, res.stderr[-3000:]  # the teardown ran
    returned, want, parked = counts
    assert returned == want and parked >= 1, res.stderr[-3000:]  # every compile returned, some while finalizing


def _compile_recording(model, x):
    """``torch.compile(model, fullgraph=True)(x)`` without grad, dynamo reset first, through a backend that keeps
    each traced GraphModule and runs it as traced: (output, the graph modules)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        return torch.compile(model, fullgraph=True, backend=backend)(x), graphs


def test_torch_compile_fullgraph_uses_tuned_op(monkeypatch):
    import bagf_torch

    monkeypatch.setenv("BAGF_STRATEGY", "random")
    monkeypatch.setenv("BAGF_BUDGET", "4")
    model = bagf_torch.convert(_conv_model())
    x = torch.randn(2, 3, 24, 24, device="cuda")
    with torch.no_grad():
        eager = model(x)  # pre-tune
    out, graphs = _compile_recording(model, x)
    torch.testing.assert_close(out, eager)
    from bagf_torch import runtime

    uses_op = any("bagf.conv2d" in gm.code for gm in graphs)
    tuned_any = any(r.family != "aten" for r in runtime.get().results)
    assert uses_op or not tuned_any, [gm.code for gm in graphs]
    torch._dynamo.reset()
    with torch.no_grad():
        out2 = torch.compile(model, fullgraph=True)(x)  # inductor
    torch.testing.assert_close(out2, eager, rtol=1e-4, atol=1e-4)


def test_compiling_a_converted_model_tunes_it_while_compiling(monkeypatch):
    """``torch.compile(convert(model))(x)`` with an empty cache and no eager call: each layer's plan is tuned while
    dynamo traces (NVRTC, the timing and Ax's search run for real inside the trace), the graph calls the op with it
    and answers as the stock model; compiled again in a fresh runtime (a new process), the plans come from the
    cache and nothing is tuned, through inductor too."""
    import bagf_torch
    from bagf_torch import runtime
    from bagf_torch.tuning.measure import output_error

    monkeypatch.setenv("BAGF_BUDGET", "6")  # (the default strategy, Ax)
    stock = _conv_model()
    model = bagf_torch.convert(_conv_model())
    x = torch.randn(2, 3, 24, 24, device="cuda")
    with torch.no_grad():
        want = stock(x)  # (PyTorch's default: cuDNN in TF32, as the plans were tuned for)
        ref = stock.double()(x.double())
    norm, top = float(ref.norm()), float(ref.abs().max())

    def within(got):  # no further from float64 than twice the stock model in this mode, or fp32's check
        rel, worst = output_error(got, ref, norm, top)
        theirs = output_error(want, ref, norm, top)
        assert rel <= max(2 * theirs[0], 1e-4) and worst <= max(2 * theirs[1], 1e-3), (rel, worst, theirs)

    out, graphs = _compile_recording(model, x)
    rt = runtime.get()
    within(out)
    assert rt.stats["tuned"] == 2, rt.stats
    tuned_any = any(r.family != "aten" for r in rt.results)
    assert any("bagf.conv2d" in gm.code for gm in graphs) == tuned_any, [gm.code for gm in graphs]
    runtime.reset()
    torch._dynamo.reset()
    with torch.no_grad():
        again = torch.compile(model, fullgraph=True)(x)  # inductor
    within(again)
    assert runtime.get().stats["tuned"] == 0 and runtime.get().stats["cache_hits"] == 2, runtime.get().stats
    torch._dynamo.reset()


# ---- float16 and bfloat16, NCHW and channels_last -------------------------------------------------------

_H16_FORMATS = [("bfloat16", "nhwc"), ("float16", "nchw"), ("bfloat16", "nchw"), ("float16", "nhwc")]


def _memory_format(layout: str):
    return torch.channels_last if layout == "nhwc" else torch.contiguous_format


@pytest.mark.parametrize("fmt", _H16_FORMATS, ids=lambda f: "_".join(f))
def test_h16_op_opcheck_autograd_weight_format_and_other_dtypes(compiler, fmt):
    """The 16-bit op in each dtype and memory format: opcheck (the fake's dtype and strides are the kernel's) with
    the plan and with ATen, output in the input's dtype and format within twice cuDNN's error, gradients through
    ATen's backward; a weight in the other memory format is converted for a channels_last plan (the same output)
    and sent to ATen by an NCHW one; a float32 call of a 16-bit plan is ATen's."""
    dtype, layout = fmt
    dt, mf = getattr(torch, dtype), _memory_format(layout)
    fam = _family("implicit_gemm_h16")
    shape = (2, 5, 11, 13, 7, 3, 3, (2, 1), (1, 0), (1, 2), True)
    handle = compiler.compile(fam, [fam.default_for(_problem(shape, fmt=fmt))])[0].handle
    x = torch.randn(2, 5, 11, 13, device="cuda").to(dt).contiguous(memory_format=mf).requires_grad_()
    w = (torch.randn(7, 5, 3, 3, device="cuda") / 4).to(dt).contiguous(memory_format=mf).requires_grad_()
    b = torch.randn(7, device="cuda").to(dt).requires_grad_()
    args = ([2, 1], [1, 0], [1, 2])
    op = torch.ops.bagf.conv2d.default
    for plan in (handle, -1):
        torch.library.opcheck(op, (x, w, b, *args, plan))
        torch.library.opcheck(op, (x, w, None, [1, 1], [0, 0], [1, 1], plan))
    out = op(x, w, b, *args, handle)
    assert out.dtype is dt and out.is_contiguous(memory_format=mf)
    stock = F.conv2d(x, w, b, (2, 1), (1, 0), (1, 2))
    ref = F.conv2d(x.double(), w.double(), b.double(), (2, 1), (1, 0), (1, 2))
    _assert_within_cudnn(out, ref, stock, fmt)
    g = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, (x, w, b), g), torch.autograd.grad(stock, (x, w, b), g)):
        torch.testing.assert_close(got, want)
    with torch.no_grad():
        other = w.detach().contiguous(memory_format=torch.contiguous_format if layout == "nhwc" else torch.channels_last)
        converted = op(x.detach(), other, b.detach(), *args, handle)
        if layout == "nhwc":
            assert torch.equal(converted, out.detach())  # the same values, converted to KRSC by the host
        else:
            # ATen's answer (another cuDNN algorithm for the other weight format: cuDNN's accuracy, not its bits)
            _assert_within_cudnn(converted, ref.detach(), stock.detach(), fmt)
        assert converted.is_contiguous(memory_format=mf)
        xf, wf, bf = x.detach().float(), w.detach().float(), b.detach().float()
        torch.testing.assert_close(op(xf, wf, bf, *args, handle), F.conv2d(xf, wf, bf, (2, 1), (1, 0), (1, 2)),
                                   rtol=1e-6, atol=1e-6)
        if layout == "nhwc":  # an input both contiguous and channels_last (C = 1) is NCHW: ATen's, contiguous out
            x1 = torch.randn(2, 1, 9, 9, device="cuda").to(dt).contiguous(memory_format=torch.channels_last)
            w1 = torch.randn(7, 1, 3, 3, device="cuda").to(dt)
            assert x1.is_contiguous()
            y1 = op(x1, w1, b.detach(), [1, 1], [1, 1], [1, 1], handle)
            assert y1.is_contiguous() and torch.equal(y1, F.conv2d(x1, w1, b.detach(), 1, 1).contiguous())


def _same_bits_eager_and_in_a_graph(call, first, times: int = 20) -> None:
    """``call()`` (without grad) returns ``first``'s bits on each of ``times`` eager calls and on each replay of a CUDA
    graph of one call (warmed up on a side stream, its output NaN-poisoned before each replay)."""
    assert all(torch.equal(call(), first) for _ in range(times))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()  # warm-up off the capture
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = call()
    for _ in range(times):
        y.fill_(float("nan"))
        g.replay()
        assert torch.equal(y, first)


SPLIT_SHAPES = [
    (1, 192, 13, 13, 384, 3, 3, (1, 1), (1, 1), (1, 1), True),  # AlexNet conv3 at batch 1: C*R*S = 1728
    (1, 37, 9, 11, 70, 3, 3, (1, 1), (1, 1), (1, 1), True),  # 333: 21 K-steps of 16, 8 slices of 3: the last empty
    (1, 3, 57, 61, 37, 11, 11, (4, 4), (2, 2), (1, 1), False),  # C = 3, stride 4: 2-byte loads
    (2, 64, 7, 9, 129, 1, 1, (1, 1), (0, 0), (1, 1), True),  # K off every BM, 1x1
    (1, 24, 12, 10, 40, 3, 3, (2, 1), (1, 0), (2, 1), False),  # stride and dilation, 216
]


def test_h16_split_k_every_slice_count_correct_in_every_format_and_schedule_independent(compiler):
    """Split-K (SPLIT 2-16) in each dtype and memory format, three block tiles, on shapes with C = 3, odd K and
    slices left empty, NaN-poisoned output against float64 within twice cuDNN's error (CudaChecker); and the
    output is the same bits on every call, eager and replayed in a CUDA graph, whichever slice finishes last."""
    fam = _family("implicit_gemm_h16")
    tiles = [dict(BM=64, BN=64, BK=32, WM=2, WN=2), dict(BM=32, BN=32, BK=16, WM=1, WN=1),
             dict(BM=128, BN=32, BK=64, WM=4, WN=1)]
    configs = [dict(fam.DEFAULT, **t, SPLIT=sp, DT=fam.DTYPES[d], NHWC=fam.LAYOUTS[l])
               for d, l in _H16_FORMATS for t in tiles for sp in (2, 4, 8, 16)]
    assert all(fam.space().is_valid(c) for c in configs)
    for sp in (2, 4, 8, 16):  # every slice count runs somewhere
        assert any(_runs(fam, c, sh, fmt) for c in configs if c["SPLIT"] == sp for sh in SPLIT_SHAPES
                   for fmt in _H16_FORMATS)
    built = _compile_and_check(compiler, fam, configs, SPLIT_SHAPES)
    x = torch.randn(1, 192, 13, 13, device="cuda").to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
    w = (torch.randn(384, 192, 3, 3, device="cuda") / 16).to(torch.bfloat16)
    w = w.contiguous(memory_format=torch.channels_last)
    b = torch.randn(384, device="cuda").to(torch.bfloat16)
    handle = built[configs.index(dict(fam.DEFAULT, **tiles[1], SPLIT=16, DT=1, NHWC=1))].handle
    op = torch.ops.bagf.conv2d.default
    with torch.no_grad():
        first = op(x, w, b, [1, 1], [1, 1], [1, 1], handle)
        _assert_within_cudnn(first, F.conv2d(x.double(), w.double(), b.double(), 1, 1), F.conv2d(x, w, b, 1, 1))
        _same_bits_eager_and_in_a_graph(lambda: op(x, w, b, [1, 1], [1, 1], [1, 1], handle), first)
        # the finalists' re-timing captures such a plan (workspace, memset and all) in a graph of its own
        from bagf_torch.tuning.measure import CudaBenchmarker, _graph_pool

        captured = CudaBenchmarker._capture(lambda: op(x, w, b, [1, 1], [1, 1], [1, 1], handle), 10, _graph_pool())
        assert captured is not None and 0.0 < CudaBenchmarker._replay(*captured) < 1000.0
        captured[0].reset()


# NHWC shapes with C % 8 == 0 for the cp.async pipeline (ST 3-4): K and N*P*Q off every tile, stride 2 and 4,
# dilation 2, padding, C*R*S from 40 (one K-step of 64) to 1728 (108 of 16), uneven split-K shares (576 = 36 steps
# of 16: 8 slices of 4-5; 18 of 32: 8 slices of 2-3; 9 of 64: 2 slices of 4-5)
PIPE_SHAPES = [
    (2, 24, 15, 13, 40, 3, 3, (2, 2), (1, 1), (1, 1), True),
    (1, 16, 37, 41, 70, 5, 5, (4, 4), (2, 2), (1, 1), False),
    (3, 8, 17, 19, 33, 3, 3, (1, 1), (2, 2), (2, 2), True),
    (2, 64, 9, 7, 129, 3, 3, (1, 2), (1, 0), (1, 1), True),
    (1, 192, 13, 13, 97, 3, 3, (1, 1), (1, 1), (1, 1), True),
    (1, 40, 6, 5, 20, 1, 1, (1, 1), (0, 0), (1, 1), False),
]
_PIPE_TILES = [dict(BM=64, BN=64, BK=32, WM=2, WN=2), dict(BM=32, BN=32, BK=16, WM=1, WN=1),
               dict(BM=128, BN=32, BK=64, WM=4, WN=1)]


def test_h16_pipeline_stages_match_the_register_path_on_odd_nhwc_shapes(compiler):
    """ST 3 and 4 (the cp.async pipeline) in bf16 and fp16 channels_last, three block tiles, split-K 1, 2 and 8, on
    odd NHWC shapes with C % 8 == 0: NaN-poisoned output within twice cuDNN's error against float64 wherever the
    tuner would run them (CudaChecker), and bit for bit the output of ST = 2 (the register path: the same shared
    memory contents, products in the same order). Then outside the problem rule: split-K 8 on 1-5 K-steps (empty
    slices, slices shorter than the pipeline's prologue), also against ST = 2's bits."""
    from bagf_torch.tuning.measure import CudaChecker, Workspace

    fam = _family("implicit_gemm_h16")
    fmts = [("bfloat16", "nhwc"), ("float16", "nhwc")]
    configs = [dict(fam.DEFAULT, **t, ST=st, SPLIT=sp, DT=fam.DTYPES[d], NHWC=1)
               for d, _ in fmts for t in _PIPE_TILES for st in (2, 3, 4) for sp in (1, 2, 8)]
    assert all(fam.space().is_valid(c) for c in configs)
    for st in (3, 4):  # every ST and SPLIT runs somewhere under the problem rule
        for sp in (1, 2, 8):
            assert any(_runs(fam, c, sh, f) for c in configs if (c["ST"], c["SPLIT"]) == (st, sp)
                       for sh in PIPE_SHAPES for f in fmts)
    built = dict(zip(map(fam.name, configs), _compile_and_check(compiler, fam, configs, PIPE_SHAPES, fmts)))
    checker = CudaChecker(compiler.ext)
    op = compiler.ext.conv2d_inference
    few = [(1, 8, 9, 11, 21, 1, 1, (1, 1), (0, 0), (1, 1), True),  # C*R*S = 8: 1 K-step, 7 of 8 slices empty
           (2, 16, 7, 6, 40, 3, 3, (2, 1), (1, 1), (1, 1), False)]  # 144: 3 K-steps of 64, 5 of 16
    differ = []
    for fmt in fmts:
        for shape in PIPE_SHAPES + few:
            ws = Workspace(_problem(shape, fmt=fmt), torch.device("cuda", 0))
            for c in configs:
                if c["ST"] == 2 or c["DT"] != fam.DTYPES[fmt[0]]:
                    continue
                if shape in few:  # off the rule: run and checked here only
                    out = checker.check(ws, built[fam.name(c)].handle)
                    assert out is None, (shape, fmt, fam.name(c), out.detail)
                elif not _runs(fam, c, shape, fmt):
                    continue
                with torch.no_grad():
                    got = op(ws.x, ws.w, ws.b, *ws.args, built[fam.name(c)].handle)
                    want = op(ws.x, ws.w, ws.b, *ws.args, built[fam.name(dict(c, ST=2))].handle)
                if not torch.equal(got, want):
                    differ.append((shape, fmt, fam.name(c), float((got.float() - want.float()).abs().max())))
    assert not differ, differ[:10]


def test_h16_pipeline_plan_on_a_misaligned_input_takes_the_register_path(compiler):
    """An ST >= 3 plan handed channels_last tensors one element (2 bytes) off 16-byte alignment, input or weight or
    both: the kernel's run-time check sends the launch down the register path (2-byte loads), so the output is
    the aligned call's (the cp.async path's) bit for bit and within twice cuDNN's error, never a misaligned copy.
    With C % 8 != 0 a pipelined plan also runs the register path (the problem rule never offers it there; a direct
    caller can still hand it such a call)."""
    fam = _family("implicit_gemm_h16")
    for dtype in ("bfloat16", "float16"):
        dt = getattr(torch, dtype)
        cfgs = [dict(fam.DEFAULT, BM=64, BN=64, ST=st, SPLIT=sp, DT=fam.DTYPES[dtype], NHWC=1)
                for st in (3, 4) for sp in (1, 2)]
        handles = [b.handle for b in compiler.compile(fam, cfgs)]
        for c_in, k in ((16, 24), (12, 20)):  # C % 8 == 0 (the pipeline where aligned), C = 12 (never)
            x = torch.randn(2, c_in, 15, 13, device="cuda").to(dt).contiguous(memory_format=torch.channels_last)
            w = (torch.randn(k, c_in, 3, 3, device="cuda") / (3 * c_in ** 0.5)).to(dt)
            w = w.contiguous(memory_format=torch.channels_last)
            b = torch.randn(k, device="cuda").to(dt)

            xm, wm = _shifted(x), _shifted(w)
            assert xm.data_ptr() % 16 and wm.data_ptr() % 16
            assert xm.is_contiguous(memory_format=torch.channels_last) and not xm.is_contiguous()
            ref = F.conv2d(x.double(), w.double(), b.double(), (2, 1), (1, 2), (1, 2))
            stock = F.conv2d(x, w, b, (2, 1), (1, 2), (1, 2))
            for c, h in zip(cfgs, handles):
                with torch.no_grad():
                    aligned = torch.ops.bagf.conv2d(x, w, b, [2, 1], [1, 2], [1, 2], h)
                    _assert_within_cudnn(aligned, ref, stock, (dtype, fam.name(c)))
                    for xi, wi in ((xm, w), (x, wm), (xm, wm)):
                        off = torch.ops.bagf.conv2d(xi, wi, b, [2, 1], [1, 2], [1, 2], h)
                        assert off.is_contiguous(memory_format=torch.channels_last)
                        assert torch.equal(off, aligned), (dtype, c_in, fam.name(c), xi is xm, wi is wm)


def _wgmma_h16_schedule_and_op_checks(compiler, fam, split_handle, fmt=("bfloat16", "nhwc")):
    """The start point of a wgmma family on a grid of many waves (AlexNet conv3 at N = 128) gives the same bits on
    every call (a stage overwritten while a warpgroup still reads it would show as a call that differs); the split-K
    plan ``split_handle`` (of ``fmt``: dtype, layout) is within twice cuDNN's error (TF32 on, torch's default, for
    float32) and gives the same bits eager and in a CUDA graph, passes opcheck, and gives the eager bits under
    torch.compile(fullgraph=True)."""
    from bagf_torch.problem import cudnn_conv_mode
    from bagf_torch.tuning.measure import CudaChecker, Workspace

    dtype, mf = getattr(torch, fmt[0]), _memory_format(fmt[1])
    tf32 = dtype is torch.float32
    checker = CudaChecker(compiler.ext)
    big = _problem((128, 192, 13, 13, 384, 3, 3, (1, 1), (1, 1), (1, 1), True), tf32=tf32, fmt=fmt)
    ws = Workspace(big, torch.device("cuda", 0))
    start = fam.default_for(big)
    h = compiler.compile(fam, [start])[0].handle
    assert checker.check(ws, h) is None
    with torch.no_grad():
        first = compiler.ext.conv2d_inference(ws.x, ws.w, ws.b, *ws.args, h)
        assert all(torch.equal(compiler.ext.conv2d_inference(ws.x, ws.w, ws.b, *ws.args, h), first)
                   for _ in range(50)), fam.name(start)
    x = torch.randn(1, 192, 13, 13, device="cuda").to(dtype).contiguous(memory_format=mf)
    w = (torch.randn(384, 192, 3, 3, device="cuda") / 16).to(dtype)
    w = w.contiguous(memory_format=mf)
    b = torch.randn(384, device="cuda").to(dtype)
    op = torch.ops.bagf.conv2d.default
    with torch.no_grad(), cudnn_conv_mode(tf32=True):
        first = op(x, w, b, [1, 1], [1, 1], [1, 1], split_handle)
        assert first.dtype is dtype and first.is_contiguous(memory_format=mf)
        _assert_within_cudnn(first, F.conv2d(x.double(), w.double(), b.double(), 1, 1), F.conv2d(x, w, b, 1, 1))
        _same_bits_eager_and_in_a_graph(lambda: op(x, w, b, [1, 1], [1, 1], [1, 1], split_handle), first)
    torch.library.opcheck(op, (x, w, b, [1, 1], [1, 1], [1, 1], split_handle))
    torch.library.opcheck(op, (x, w, None, [2, 2], [0, 0], [1, 1], split_handle))

    def compiled_fn(a):
        return op(a, w, b, [1, 1], [1, 1], [1, 1], split_handle)

    torch._dynamo.reset()  # (each call of this helper is a new closure of one code object: dynamo's recompile limit)
    with torch.no_grad():
        got = torch.compile(compiled_fn, fullgraph=True)(x)
    assert torch.equal(got, first), float((got.float() - first.float()).abs().max())  # the op's bits, not cuDNN's


def _stream_k_checks(compiler, fam, fmt):
    """A TMA family's stream-K start (SK = 1) in ``fmt`` on AlexNet's conv4 at N = 32 (86 tiles of 108 or 54 k tiles
    shared among 132 blocks: every tile in two or three parts) and conv3 at N = 128 (many tiles per block): within the
    bound, and the same bits on every call (each shared tile summed in k order, whoever finishes it); then the op
    checks of _wgmma_h16_schedule_and_op_checks on it (N = 1: tiles in many parts, CUDA graphs, opcheck,
    torch.compile)."""
    from bagf_torch.tuning.measure import CudaChecker, Workspace

    checker = CudaChecker(compiler.ext)
    tf32 = fmt[0] == "float32"
    handle = None
    for shape in [(32, 384, 13, 13, 256, 3, 3, (1, 1), (1, 1), (1, 1), True),
                  (128, 192, 13, 13, 384, 3, 3, (1, 1), (1, 1), (1, 1), True)]:
        p = _problem(shape, tf32=tf32, fmt=fmt)
        c = dict(fam.default_for(p), SK=1, SPLIT=1)
        assert fam.space().is_valid(c) and fam.problem_rule(c, p) is None, fam.name(c)
        h = compiler.compile(fam, [c])[0].handle
        handle = h if handle is None else handle
        ws = Workspace(p, torch.device("cuda", 0))
        assert checker.check(ws, h) is None, fam.name(c)
        with torch.no_grad():
            first = compiler.ext.conv2d_inference(ws.x, ws.w, ws.b, *ws.args, h)
            assert all(torch.equal(compiler.ext.conv2d_inference(ws.x, ws.w, ws.b, *ws.args, h), first)
                       for _ in range(20)), fam.name(c)
    _wgmma_h16_schedule_and_op_checks(compiler, fam, handle, fmt=fmt)


# implicit_gemm_wgmma_h16's tiles: every WN, MI, WG and KS and the shallowest and deepest rings
_WGMMA_H16_TILES = [dict(WN=64, MI=1, WG=1, STAGES=3, KS=2), dict(WN=128, MI=2, WG=2, STAGES=4, KS=1),
                    dict(WN=192, MI=1, WG=2, STAGES=5, KS=1), dict(WN=256, MI=1, WG=1, STAGES=5, KS=1),
                    dict(WN=64, MI=2, WG=1, STAGES=6, KS=1), dict(WN=128, MI=1, WG=2, STAGES=3, KS=2)]


def test_wgmma_h16_tiles_and_splits_correct_on_odd_shapes_and_schedule_independent(compiler):
    """implicit_gemm_wgmma_h16 in bf16 and fp16 channels_last: six tiles (every WN, MI, WG and KS, rings of 3-6) with
    split-K 1, 2 and 8 on odd NHWC shapes with C % 8 == 0 (K and N*P*Q off every tile, strides 2 and 4, dilation,
    C*R*S from 40 to 1728), NaN-poisoned output within twice cuDNN's error against float64 wherever the tuner would
    run them (CudaChecker); off the problem rule, slices left empty and C % 8 != 0 (the 2-byte path) are checked
    too; tensors off 16-byte alignment (the 2-byte path) give the aligned call's bits for every tile and split. The
    start point on a grid of many waves and a split-K plan give the same bits on every call, the latter eager and
    replayed in a CUDA graph; opcheck passes with the plan; under torch.compile(fullgraph=True) the output is the
    eager call's, bit for bit."""
    from bagf_torch.tuning.measure import CudaChecker, Workspace

    fam = _family("implicit_gemm_wgmma_h16")
    fmts = [("bfloat16", "nhwc"), ("float16", "nhwc")]
    configs = [dict(fam.DEFAULT, **t, SPLIT=sp, DT=fam.DTYPES[d]) for d, _ in fmts for t in _WGMMA_H16_TILES
               for sp in (1, 2, 8)]
    assert all(fam.space().is_valid(c) for c in configs), [fam.name(c) for c in configs
                                                           if not fam.space().is_valid(c)]
    for sp in (1, 2, 8):
        assert any(_runs(fam, c, sh, f) for c in configs if c["SPLIT"] == sp for sh in PIPE_SHAPES for f in fmts)
    built = dict(zip(map(fam.name, configs), _compile_and_check(compiler, fam, configs, PIPE_SHAPES, fmts)))
    checker = CudaChecker(compiler.ext)
    off_rule = [(1, 8, 9, 11, 21, 1, 1, (1, 1), (0, 0), (1, 1), True),  # one k tile: 7 of 8 slices empty
                (2, 12, 7, 6, 40, 3, 3, (2, 1), (1, 1), (1, 1), False),  # C = 12: the 2-byte path
                (1, 5, 13, 11, 9, 3, 3, (1, 1), (1, 1), (2, 2), True)]  # C = 5, dilation 2
    for fmt in fmts:
        for shape in off_rule:
            ws = Workspace(_problem(shape, fmt=fmt), torch.device("cuda", 0))
            for c in configs:
                if c["DT"] == fam.DTYPES[fmt[0]]:
                    out = checker.check(ws, built[fam.name(c)].handle)
                    assert out is None, (shape, fmt, fam.name(c), out.detail)
    # the 2-byte path (tensors one element off 16-byte alignment) fills the same shared memory as the cp.async path:
    # the same products in the same order, so the same bits, for every tile and split

    differ = []
    for fmt in fmts:
        for shape in PIPE_SHAPES[:4]:
            ws = Workspace(_problem(shape, fmt=fmt), torch.device("cuda", 0))
            xm, wm = _shifted(ws.x), _shifted(ws.w)
            assert xm.data_ptr() % 16 and wm.data_ptr() % 16
            for c in configs:
                if c["DT"] != fam.DTYPES[fmt[0]] or not _runs(fam, c, shape, fmt):
                    continue
                h = built[fam.name(c)].handle
                with torch.no_grad():
                    got = compiler.ext.conv2d_inference(xm, wm, ws.b, *ws.args, h)
                    want = compiler.ext.conv2d_inference(ws.x, ws.w, ws.b, *ws.args, h)
                if not torch.equal(got, want):
                    differ.append((shape, fmt, fam.name(c)))
    assert not differ, differ[:10]
    _wgmma_h16_schedule_and_op_checks(
        compiler, fam, built[fam.name(dict(fam.DEFAULT, **_WGMMA_H16_TILES[1], SPLIT=8, DT=1))].handle)


# both TMA families' tiles (every WN, MI and WG, rings of 3-6)
_TMA_TILES = [dict(WN=64, MI=1, WG=1, STAGES=3), dict(WN=128, MI=2, WG=2, STAGES=4),
              dict(WN=192, MI=1, WG=2, STAGES=5), dict(WN=256, MI=1, WG=1, STAGES=4),
              dict(WN=128, MI=1, WG=2, STAGES=6), dict(WN=256, MI=1, WG=2, STAGES=3)]


def test_tma_h16_tiles_and_splits_correct_and_equal_to_the_gathering_twin(compiler):
    """implicit_gemm_tma_h16 in bf16 and fp16, channels_last and NCHW: six tiles (every WN, MI and WG, rings of 3-6) with
    split-K 1, 2 and 8 on odd shapes with C % 8 == 0 (non-square images, unequal strides, padding and dilation, K and
    N*P*Q off every tile, C not a multiple of 64: the maps' zero fill), NaN-poisoned output within twice cuDNN's error
    against float64 wherever the tuner would run them. Where C % 64 == 0 its k tiles are implicit_gemm_wgmma_h16's
    (a tap's 64 channels): the same products in the same order, so the same bits as that family's twin tile (KS = 1);
    an NCHW plan gives its channels_last twin's bits in NCHW. Then _wgmma_h16_schedule_and_op_checks: many waves,
    CUDA graphs, opcheck, torch.compile."""
    from bagf_torch.tuning.measure import Workspace

    fam = _family("implicit_gemm_tma_h16")
    twin_fam = _family("implicit_gemm_wgmma_h16")
    fmts = [("bfloat16", "nhwc"), ("float16", "nhwc")]
    configs = [dict(fam.DEFAULT, **t, SPLIT=sp, DT=fam.DTYPES[d]) for d, _ in fmts for t in _TMA_TILES
               for sp in (1, 2, 8)]
    configs += [dict(fam.DEFAULT, **t, SK=1, DT=fam.DTYPES[d]) for d, _ in fmts for t in _TMA_TILES]
    assert all(fam.space().is_valid(c) for c in configs), [fam.name(c) for c in configs
                                                           if not fam.space().is_valid(c)]
    shapes = PIPE_SHAPES + H16_SHAPES + [
        (1, 16, 13, 11, 33, 3, 3, (3, 2), (0, 1), (2, 2), False),   # unequal stride, padding; dilation 2
        (2, 128, 9, 12, 70, 3, 3, (1, 1), (2, 1), (1, 1), True),    # C = 2 x 64, padding above the filter's half
        (3, 64, 11, 10, 20, 5, 3, (2, 1), (2, 1), (1, 2), True)]    # 5 x 3 filter, unequal dilation
    for sp in (1, 2, 8):
        assert any(_runs(fam, c, sh, f) for c in configs if c["SPLIT"] == sp for sh in shapes for f in fmts)
    built = dict(zip(map(fam.name, configs), _compile_and_check(compiler, fam, configs, shapes, fmts)))
    # (stream-K sums a shared tile's parts from several blocks: not the twin's one chain of products)
    twins = {fam.name(c): dict(twin_fam.DEFAULT, **{k: c[k] for k in ("DT", "WN", "MI", "WG", "STAGES", "SPLIT")},
                               KS=1) for c in configs if not c["SK"]}
    twin_cfgs = [t for t in twins.values() if twin_fam.space().is_valid(t)]
    twin_built = dict(zip(map(twin_fam.name, twin_cfgs), compiler.compile(twin_fam, twin_cfgs)))
    differ, compared = [], 0
    for fmt in fmts:
        for shape in shapes:
            if shape[1] % 64:
                continue
            ws = Workspace(_problem(shape, fmt=fmt), torch.device("cuda", 0))
            for c in configs:
                t = twins.get(fam.name(c))
                if (t is None or c["DT"] != fam.DTYPES[fmt[0]] or not _runs(fam, c, shape, fmt) or not _runs(twin_fam, t, shape, fmt)
                        or twin_fam.name(t) not in twin_built):
                    continue
                with torch.no_grad():  # launched into ``out``: a plan that cannot take the call raises, never ATen
                    got = compiler.ext.conv2d_inference(ws.x, ws.w, ws.b, *ws.args, built[fam.name(c)].handle,
                                                        out=torch.full_like(ws.out, float("nan")))
                    want = compiler.ext.conv2d_inference(ws.x, ws.w, ws.b, *ws.args, twin_built[twin_fam.name(t)].handle,
                                                         out=torch.full_like(ws.out, float("nan")))
                compared += 1
                if not torch.equal(got, want):
                    differ.append((shape, fmt, fam.name(c), float((got.float() - want.float()).abs().max())))
    assert compared > 0 and not differ, (compared, differ[:10])
    # NCHW: the same kernels on a channels_last copy of the input, writing NCHW; correct on the odd shapes, and the
    # channels_last plan's values, bit for bit, in the other layout
    nchw_fmts = [("bfloat16", "nchw"), ("float16", "nchw")]
    nchw_cfgs = [dict(c, NHWC=0) for c in configs if c["SPLIT"] != 2]
    nchw_built = dict(zip(map(fam.name, nchw_cfgs), _compile_and_check(compiler, fam, nchw_cfgs, shapes, nchw_fmts)))
    differ, compared = [], 0
    for fmt in nchw_fmts:
        for shape in shapes:
            ws = Workspace(_problem(shape, fmt=fmt), torch.device("cuda", 0))
            x_cl, w_cl = ws.x.contiguous(memory_format=torch.channels_last), ws.w.contiguous(
                memory_format=torch.channels_last)
            for c in nchw_cfgs:
                if c["DT"] != fam.DTYPES[fmt[0]] or not _runs(fam, c, shape, fmt):
                    continue
                with torch.no_grad():  # (strict, as above)
                    got = compiler.ext.conv2d_inference(ws.x, ws.w, ws.b, *ws.args, nchw_built[fam.name(c)].handle,
                                                        out=torch.full_like(ws.out, float("nan")))
                    want = compiler.ext.conv2d_inference(
                        x_cl, w_cl, ws.b, *ws.args, built[fam.name(dict(c, NHWC=1))].handle,
                        out=torch.full_like(ws.out, float("nan")).contiguous(memory_format=torch.channels_last))
                assert got.is_contiguous() and want.is_contiguous(memory_format=torch.channels_last)
                compared += 1
                if not torch.equal(got, want.contiguous()):
                    differ.append((shape, fmt, fam.name(c)))
    assert compared > 0 and not differ, (compared, differ[:10])
    _wgmma_h16_schedule_and_op_checks(
        compiler, fam, built[fam.name(dict(fam.DEFAULT, **_TMA_TILES[1], SPLIT=8, DT=1))].handle)
    _stream_k_checks(compiler, fam, ("bfloat16", "nhwc"))


POLYPHASE_SHAPES = [
    (2, 3, 224, 224, 64, 11, 11, (4, 4), (2, 2), (1, 1), True),   # AlexNet's conv1 (torchvision's)
    (3, 5, 31, 29, 24, 7, 5, (2, 3), (3, 1), (1, 1), False),      # unequal strides and padding: 30 -> 32 channels
    (2, 3, 33, 35, 20, 7, 7, (2, 2), (3, 3), (1, 1), True),       # a ResNet stem's geometry: 12 -> 16 channels
    (1, 6, 9, 9, 70, 5, 5, (3, 3), (2, 2), (1, 1), True),         # K = 70 off every tile, P = Q = 3
    (2, 16, 20, 20, 40, 3, 3, (2, 2), (0, 1), (1, 1), True),      # C % 8 == 0: either plan
    (1, 7, 13, 40, 9, 4, 2, (1, 2), (2, 0), (1, 1), True),        # stride 1 one way: one row phase
    (2, 1, 7, 9, 8, 2, 3, (3, 4), (3, 3), (1, 1), True),          # C = 1, padding >= the filter, one tap each way
    (1, 3, 5, 5, 16, 5, 5, (4, 4), (0, 0), (1, 1), False),        # P = Q = 1
]


def test_tma_h16_polyphase_plans_correct_on_strided_shapes_of_few_channels(compiler):
    """implicit_gemm_tma_h16's polyphase plans (PP = 1) in bf16 and fp16, channels_last and NCHW, on strided shapes of
    few channels (AlexNet's conv1, unequal strides and padding, channels rounded up to 8, K off every tile; the
    gather's and the weight's zeros): NaN-poisoned output within twice cuDNN's error against float64, with tiles of
    every WN, split-K (in a workspace and in clusters), stream-K and persistent blocks. An NCHW plan gives its
    channels_last twin's bits (the same form, the same products) wherever an input can be channels_last only (not at
    C = 1, which every rule takes as NCHW); the weight gives the same bits in any format; the
    plan gives the same bits eager and in a CUDA graph, passes opcheck and gives them under
    torch.compile(fullgraph=True)."""
    from bagf_torch.tuning.measure import Workspace

    fam = _family("implicit_gemm_tma_h16")
    fmts = [("bfloat16", "nhwc"), ("float16", "nhwc"), ("bfloat16", "nchw"), ("float16", "nchw")]
    tiles = [dict(t, SPLIT=1, SK=0, CR=0) for t in _TMA_TILES[:4]] + [
        dict(_TMA_TILES[0], SPLIT=2, SK=0, CR=0), dict(_TMA_TILES[0], SPLIT=4, SK=0, CR=1),
        dict(_TMA_TILES[1], SPLIT=1, SK=1, CR=0), dict(_TMA_TILES[4], SPLIT=1, SK=2, CR=0)]
    configs = [dict(fam.DEFAULT, **t, PP=1, DT=fam.DTYPES[d], NHWC=fam.LAYOUTS[f]) for d, f in fmts for t in tiles]
    assert all(fam.space().is_valid(c) for c in configs), [fam.name(c) for c in configs
                                                           if not fam.space().is_valid(c)]
    for shape in POLYPHASE_SHAPES:
        for f in fmts:
            assert fam.applies(_problem(shape, fmt=f)) is None, (shape, f)
            assert any(_runs(fam, c, shape, f) for c in configs), (shape, f)
    built = dict(zip(map(fam.name, configs), _compile_and_check(compiler, fam, configs, POLYPHASE_SHAPES, fmts)))
    differ, compared = [], 0
    for dtype in ("bfloat16", "float16"):
        for shape in POLYPHASE_SHAPES:
            ws = Workspace(_problem(shape, fmt=(dtype, "nchw")), torch.device("cuda", 0))
            x_cl = ws.x.contiguous(memory_format=torch.channels_last)
            if x_cl.is_contiguous():
                continue  # C = 1 or H = W = 1: no input is channels_last only, so no channels_last plan runs
            w_forms = [ws.w, ws.w.contiguous(memory_format=torch.channels_last), ws.w.transpose(2, 3).contiguous()
                       .transpose(2, 3)]  # KCRS, KRSC, and a KCSR layout read through its strides
            for c in configs:
                if c["NHWC"] or c["DT"] != fam.DTYPES[dtype] or not _runs(fam, c, shape, (dtype, "nchw")):
                    continue
                twin = built[fam.name(dict(c, NHWC=1))].handle
                with torch.no_grad():  # launched into ``out``: a plan that cannot take the call raises, never ATen
                    got = compiler.ext.conv2d_inference(ws.x, ws.w, ws.b, *ws.args, built[fam.name(c)].handle,
                                                        out=torch.full_like(ws.out, float("nan")))
                    for w in w_forms:
                        want = compiler.ext.conv2d_inference(
                            x_cl, w, ws.b, *ws.args, twin,
                            out=torch.full_like(ws.out, float("nan")).contiguous(memory_format=torch.channels_last))
                        compared += 1
                        if not torch.equal(got, want.contiguous()):
                            differ.append((shape, dtype, fam.name(c), w.stride()))
    assert compared > 0 and not differ, (compared, differ[:10])
    # AlexNet's conv1 at N = 1 through the op: graphs, opcheck, torch.compile
    conv1 = POLYPHASE_SHAPES[0]
    handle = built[fam.name(configs[4])].handle  # (bf16 channels_last, split-K of 2)
    x = torch.randn(1, 3, 224, 224, device="cuda").to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
    w = (torch.randn(64, 3, 11, 11, device="cuda") / 16).to(torch.bfloat16).contiguous(
        memory_format=torch.channels_last)
    b = torch.randn(64, device="cuda").to(torch.bfloat16)
    op = torch.ops.bagf.conv2d.default
    args = ([4, 4], [2, 2], [1, 1], handle)
    assert _runs(fam, configs[4], (1,) + conv1[1:], ("bfloat16", "nhwc"))
    with torch.no_grad():
        first = op(x, w, b, *args)
        assert first.dtype is torch.bfloat16 and first.is_contiguous(memory_format=torch.channels_last)
        # (the plan's bits, not ATen's: launched into ``out``, a plan that cannot take the call raises)
        strict = compiler.ext.conv2d_inference(x, w, b, *args, out=torch.full_like(first, float("nan")))
        assert torch.equal(first, strict)
        _assert_within_cudnn(first, F.conv2d(x.double(), w.double(), b.double(), 4, 2), F.conv2d(x, w, b, 4, 2))
        _same_bits_eager_and_in_a_graph(lambda: op(x, w, b, *args), first)
    torch.library.opcheck(op, (x, w, b) + args)

    def compiled_fn(a):
        return op(a, w, b, *args)

    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(compiled_fn, fullgraph=True)(x)
    assert torch.equal(got, first), float((got.float() - first.float()).abs().max())


def test_tma_tf32_tiles_and_splits_round_to_nearest_on_odd_shapes(compiler):
    """implicit_gemm_tma_tf32, NCHW and channels_last: six tiles (every WN, MI and WG, rings of 3-6) with split-K 1,
    2 and 8 on odd shapes with C % 4 == 0 (non-square images, unequal strides, padding and dilation, K and N*P*Q
    off every tile, C not a multiple of 32: the maps' zero fill), NaN-poisoned output against the float64
    convolution of the operands rounded to TF32 to nearest (cvt.rna) within fp32's bound: the operands are rounded
    as cuDNN's TF32 rounds them (the TMA unit rounds as it copies a TF32 map), not truncated; on AlexNet-like layers
    within twice cuDNN's TF32 error, and far closer to the rounded operands' convolution than to the truncated ones'.
    A NaN reaches the outputs it reaches in cuDNN. Then _wgmma_h16_schedule_and_op_checks in float32 NCHW: many
    waves, CUDA graphs, opcheck, torch.compile."""
    from bagf_torch.tuning.measure import CudaChecker, Workspace, output_error

    fam = _family("implicit_gemm_tma_tf32")
    fmts = [("float32", "nchw"), ("float32", "nhwc")]
    configs = [dict(fam.DEFAULT, **t, SPLIT=sp, NHWC=nh) for nh in (0, 1) for t in _TMA_TILES for sp in (1, 2, 8)]
    configs += [dict(fam.DEFAULT, **t, SK=1, NHWC=nh) for nh in (0, 1) for t in _TMA_TILES]
    assert all(fam.space().is_valid(c) for c in configs), [fam.name(c) for c in configs
                                                           if not fam.space().is_valid(c)]
    shapes = [s for s in PIPE_SHAPES + H16_SHAPES if s[1] % 4 == 0] + [
        (1, 16, 13, 11, 33, 3, 3, (3, 2), (0, 1), (2, 2), False),   # unequal stride, padding; dilation 2
        (2, 12, 20, 17, 129, 3, 5, (2, 1), (1, 2), (1, 3), True),   # C = 12, 3 x 5 filter, unequal dilation
        (2, 96, 9, 12, 70, 3, 3, (1, 1), (2, 1), (1, 1), True),     # C = 3 x 32, padding above the filter's half
        (1, 4, 30, 29, 9, 11, 11, (4, 4), (2, 2), (1, 1), True)]    # C = 4 (one 16-byte copy), 11 x 11 at stride 4
    for sp in (1, 2, 8):
        assert any(_runs(fam, c, sh, f) for c in configs if c["SPLIT"] == sp for sh in shapes for f in fmts)
    built = dict(zip(map(fam.name, configs), _compile_and_check(compiler, fam, configs, shapes, fmts)))
    # AlexNet-like layers in TF32 mode: within twice cuDNN's TF32 error (the tuner's bound), and the convolution of the
    # operands rounded to nearest, not truncated (the TMA unit rounds as it copies a TF32 map)
    handle = compiler.compile(fam, [fam.DEFAULT])[0].handle
    checker = CudaChecker(compiler.ext)
    for shape in [(2, 192, 13, 13, 384, 3, 3, (1, 1), (1, 1), (1, 1), True),
                  (2, 64, 27, 27, 192, 5, 5, (1, 1), (2, 2), (1, 1), True),
                  (2, 1024, 14, 14, 256, 1, 1, (1, 1), (0, 0), (1, 1), False)]:
        ws = Workspace(_problem(shape, tf32=True), torch.device("cuda", 0))
        assert ws.cudnn_error is not None and ws.cudnn_error[0] > 1e-5, ws.cudnn_error  # cuDNN used TF32 here
        assert checker.check(ws, handle) is None
        out = ws.out.clone()
        ours = output_error(out, ws.ref, ws.ref_norm, ws.ref_max)
        p = ws.problem
        trunc = [(t.view(torch.int32) & ~0x1FFF).view(torch.float32) for t in (ws.x, ws.w)]
        ref_rz = F.conv2d(trunc[0].double(), trunc[1].double(), None if ws.b is None else ws.b.double(), p.stride,
                          p.padding, p.dilation)
        rz = output_error(out, ref_rz, float(ref_rz.norm()), float(ref_rz.abs().max()))
        rn = output_error(out, *(lambda r: (r.ref, r.ref_norm, r.ref_max))(_tf32_reference(ws)))
        print(f"{p.short()}: cuDNN TF32 {ws.cudnn_error[0]:.2e} (max {ws.cudnn_error[1]:.2e}), ours {ours[0]:.2e} (max "
              f"{ours[1]:.2e}); against the operands rounded to TF32 {rn[0]:.2e}, truncated {rz[0]:.2e}")
        assert rz[0] > 10 * rn[0], (rn, rz)
    # more images than grid.z holds (65535): the NCHW plan's input copy walks the rest with its stride loop
    ws = Workspace(_problem((65537, 8, 1, 2, 16, 1, 1, (1, 1), (0, 0), (1, 1), True), tf32=True),
                   torch.device("cuda", 0))
    assert not ws.x.is_contiguous(memory_format=torch.channels_last)
    # (against the operands rounded to TF32: cuDNN does not use TF32 on this 8-channel reduction, so its error would
    # bound ours at fp32's)
    _tf32_reference(ws)
    assert checker.check(ws, compiler.compile(fam, [dict(fam.DEFAULT, WN=64, WG=1)])[0].handle) is None
    # NaNs (GPU arithmetic's 0x7fffffff, whose rounding carry would end it) reach exactly cuDNN's outputs
    x = torch.randn(2, 8, 11, 13, device="cuda")
    x.view(torch.int32)[0, 1, 3, 4] = 0x7FFFFFFF
    w = torch.randn(7, 8, 3, 3, device="cuda")
    w.view(torch.int32)[3, 2, 1, 1] = -1
    out = torch.zeros(2, 7, 11, 13, device="cuda")
    compiler.ext.conv2d_inference(x, w, None, [1, 1], [1, 1], [1, 1], handle, out=out)  # strict: never ATen
    ref = F.conv2d(x, w, None, 1, 1)
    assert int(torch.isnan(ref).sum()) > 0 and torch.equal(torch.isnan(out), torch.isnan(ref))
    # what the maps cannot take: a strict launch raises, the op answers through ATen (C % 4 != 0; a channels_last
    # input read in place 4 bytes off 16-byte alignment)
    h = built[fam.name(dict(fam.DEFAULT, **_TMA_TILES[0], SPLIT=1, NHWC=1))].handle
    cl = torch.channels_last
    x6, w6 = torch.randn(2, 6, 9, 9, device="cuda").contiguous(memory_format=cl), torch.randn(8, 6, 3, 3, device="cuda")
    with pytest.raises(RuntimeError, match="multiple of"):
        compiler.ext.conv2d_inference(x6, w6, None, [1, 1], [1, 1], [1, 1], h,
                                      out=torch.empty(2, 8, 9, 9, device="cuda").contiguous(memory_format=cl))
    x8, w8 = torch.randn(2, 8, 9, 9, device="cuda").contiguous(memory_format=cl), torch.randn(8, 8, 3, 3, device="cuda")
    xm = _shifted(x8)
    assert xm.data_ptr() % 16 and xm.is_contiguous(memory_format=cl)
    with pytest.raises(RuntimeError, match="16-byte aligned"):
        compiler.ext.conv2d_inference(xm, w8, None, [1, 1], [1, 1], [1, 1], h,
                                      out=torch.empty(2, 8, 9, 9, device="cuda").contiguous(memory_format=cl))
    for xi, wi in ((x6, w6), (xm, w8)):
        torch.testing.assert_close(torch.ops.bagf.conv2d(xi, wi, None, [1, 1], [1, 1], [1, 1], h),
                                   F.conv2d(xi, wi, None, 1, 1))
    _wgmma_h16_schedule_and_op_checks(compiler, fam, built[fam.name(dict(fam.DEFAULT, **_TMA_TILES[1], SPLIT=8))]
                                      .handle, fmt=("float32", "nchw"))
    _stream_k_checks(compiler, fam, ("float32", "nchw"))


def _tma_twin_bits(compiler, name, variant, twin, shapes, op_cfg):
    """Family ``name``'s configurations ``variant`` (every format, DT and NHWC set), compiled and checked on ``shapes``
    (NaN-poisoned output within the check's bound wherever the tuner would run them), then bit for bit against
    ``twin(config)`` on every shape and format; then the op checks (CUDA graph, opcheck, torch.compile) on ``op_cfg``
    of them."""
    from bagf_torch.tuning.measure import Workspace

    fam = _family(name)
    fmts = _formats(fam)
    tf32 = not name.endswith("h16")
    fam_shapes = [s for s in shapes if s[1] % (4 if tf32 else 8) == 0]
    assert all(fam.space().is_valid(c) for c in variant), [fam.name(c) for c in variant if not fam.space().is_valid(c)]
    built = dict(zip(map(fam.name, variant), _compile_and_check(compiler, fam, variant, fam_shapes, fmts)))
    twins = [twin(c) for c in variant]
    assert all(fam.space().is_valid(t) for t in twins)
    twin_built = dict(zip(map(fam.name, twins), compiler.compile(fam, twins)))
    differ, compared = [], 0
    for fmt in fmts:
        for shape in fam_shapes:
            ws = Workspace(_problem(shape, tf32=tf32, fmt=fmt), torch.device("cuda", 0))
            for c in variant:
                if not _runs(fam, c, shape, fmt):
                    continue
                with torch.no_grad():  # (strict: a plan that cannot take the call raises, never ATen)
                    got = compiler.ext.conv2d_inference(ws.x, ws.w, ws.b, *ws.args, built[fam.name(c)].handle,
                                                        out=torch.full_like(ws.out, float("nan")))
                    want = compiler.ext.conv2d_inference(ws.x, ws.w, ws.b, *ws.args,
                                                         twin_built[fam.name(twin(c))].handle,
                                                         out=torch.full_like(ws.out, float("nan")))
                compared += 1
                if not torch.equal(got, want):
                    differ.append((shape, fmt, fam.name(c), float((got.float() - want.float()).abs().max())))
    assert compared > 0 and not differ, (name, compared, differ[:10])
    fmt = ("float32", "nchw") if tf32 else ("bfloat16", "nhwc")
    _wgmma_h16_schedule_and_op_checks(compiler, fam, built[fam.name(op_cfg)].handle, fmt=fmt)


_TMA_VARIANT_TILES = [dict(WN=64, MI=1, WG=1, STAGES=3), dict(WN=128, MI=1, WG=2, STAGES=6),
                      dict(WN=256, MI=1, WG=2, STAGES=3), dict(WN=128, MI=2, WG=2, STAGES=4)]
_TMA_VARIANT_SHAPES = PIPE_SHAPES + H16_SHAPES + [(1, 192, 13, 13, 384, 3, 3, (1, 1), (1, 1), (1, 1), True),
                                                  (1, 256, 14, 14, 256, 3, 3, (1, 1), (1, 1), (1, 1), False)]


def _tma_dts(fam):
    return sorted({fam.DTYPES[d] for d, _ in _formats(fam)}) if fam.FAMILY.endswith("h16") else [2]


@pytest.mark.parametrize("name", ["implicit_gemm_tma_h16", "implicit_gemm_tma_tf32"])
def test_tma_split_k_in_clusters_gives_the_workspace_plans_bits(compiler, name):
    """Split-K in clusters (CR = 1: a tile's slices launched as one thread block cluster, each reducing and storing
    its share of the tile's channels from every slice's shared memory) in every format: tiles of one and two
    consumer warpgroups, the deepest and shallowest rings, 2, 4 and 8 slices, on odd shapes and AlexNet's conv3 and a
    ResNet 3x3 layer at N = 1: within the check's bound wherever the tuner would run them, and bit for bit the output
    of the same configuration handing over through the workspace (CR = 0: the same sums added in the same order)."""
    fam = _family(name)
    configs = [dict(fam.DEFAULT, **t, DT=dt, NHWC=nh, SPLIT=sp, CR=1) for dt in _tma_dts(fam) for nh in (0, 1)
               for t in _TMA_VARIANT_TILES for sp in (2, 4, 8)]
    for sp in (2, 4, 8):
        assert any(_runs(fam, c, sh, f) for c in configs if c["SPLIT"] == sp for sh in _TMA_VARIANT_SHAPES
                   for f in _formats(fam))
    op_cfg = dict(fam.DEFAULT, **_TMA_VARIANT_TILES[0], DT=_tma_dts(fam)[-1], NHWC=int(name.endswith("h16")), SPLIT=8,
                  CR=1)
    _tma_twin_bits(compiler, name, configs, lambda c: dict(c, CR=0), _TMA_VARIANT_SHAPES, op_cfg)


@pytest.mark.parametrize("name", ["implicit_gemm_tma_h16", "implicit_gemm_tma_tf32"])
def test_tma_persistent_blocks_give_the_one_tile_per_block_bits(compiler, name):
    """Persistent blocks (SK = 2: the blocks the device holds at once, each taking whole tiles in turn while its
    producer fills the ring with the next tile) in every format and the tiles above, on the odd shapes and on AlexNet's
    conv3 at N = 128 (hundreds of tiles over at most 132 blocks: each block several, the ring carried across them):
    within the check's bound, and bit for bit the one-tile-per-block plan's output (SK = 0, the same products in the
    same order), however many tiles each block takes."""
    fam = _family(name)
    configs = [dict(fam.DEFAULT, **t, DT=dt, NHWC=nh, SPLIT=1, SK=2) for dt in _tma_dts(fam) for nh in (0, 1)
               for t in _TMA_VARIANT_TILES]
    shapes = _TMA_VARIANT_SHAPES + [(128, 192, 13, 13, 384, 3, 3, (1, 1), (1, 1), (1, 1), True)]
    op_cfg = dict(configs[-1], DT=_tma_dts(fam)[-1], NHWC=int(name.endswith("h16")))
    _tma_twin_bits(compiler, name, configs, lambda c: dict(c, SK=0), shapes, op_cfg)


@pytest.mark.parametrize("name", ["implicit_gemm_tma_h16", "implicit_gemm_tma_tf32"])
def test_tma_relu_epilogue_is_torchs_relu_of_the_plans_output_to_the_bit(compiler, name):
    """A TMA plan's ReLU epilogue (conv2d_relu_inference, FusedSequential's conv -> ReLU pairs) in every dtype and
    format of the family and on every store path (one tile per block, split-K through the workspace and in clusters,
    stream-K, persistent blocks; NCHW staged and from the registers): bit for bit torch's ReLU of the same plan's
    unfused output, with -0.0 kept (relu = 2) or made +0.0 (1) and NaN kept, on odd shapes with an image of tiny
    values (sums that round to zero, of either sign) and zero biases; the device's own ReLU is the mode
    nn._relu_mode picks. A plan that is not TMA, or a call the plan does not take, gives None."""
    from bagf_torch import nn as bnn
    from bagf_torch.tuning.measure import Workspace

    fam = _family(name)
    tf32 = not name.endswith("h16")
    variants = [dict(SPLIT=1), dict(SPLIT=4), dict(SPLIT=4, CR=1), dict(SPLIT=1, SK=1), dict(SPLIT=1, SK=2)]
    configs = [dict(fam.DEFAULT, **_TMA_VARIANT_TILES[0], DT=dt, NHWC=nh, **v) for dt in _tma_dts(fam)
               for nh in (0, 1) for v in variants]
    configs = [c for c in configs if fam.space().is_valid(c)]
    assert len(configs) >= 4 * len(_tma_dts(fam)), [fam.name(c) for c in configs]
    built = compiler.compile(fam, configs)
    assert all(hasattr(b, "handle") for b in built), [(fam.name(c), b.detail[:200]) for c, b in zip(configs, built)
                                                      if not hasattr(b, "handle")]
    shapes = [(2, 64, 9, 7, 129, 3, 3, (1, 2), (1, 0), (1, 1), True),
              (3, 24, 15, 13, 40, 3, 3, (1, 1), (1, 1), (1, 1), True),
              (1, 192, 13, 13, 384, 3, 3, (1, 1), (1, 1), (1, 1), False)]
    bits = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
    tiny = {torch.float32: 1e-42, torch.float16: 1e-7, torch.bfloat16: 1e-39}
    compared = {}
    for c, b in zip(configs, built):
        for fmt in _formats(fam):
            for shape in shapes:
                if not _runs(fam, c, shape, fmt):
                    continue
                ws = Workspace(_problem(shape, tf32=tf32, fmt=fmt), torch.device("cuda", 0))
                x = ws.x.clone()
                x[0] = (x[0].float() * tiny[x.dtype]).to(x.dtype)  # (sums of either sign that round to zero)
                x[-1, 0, 0, 0] = float("nan")
                bias = None if ws.b is None else ws.b.clone()
                if bias is not None:
                    bias[::2] = 0
                with torch.no_grad():  # (into ``out``: a plan that cannot take the call raises, never ATen)
                    y = compiler.ext.conv2d_inference(x, ws.w, bias, *ws.args, b.handle,
                                                      out=torch.full_like(ws.out, float("nan")))
                    if y.dtype == torch.float16:  # (the tiny image's sums that round to -0.0: mode 2 keeps them)
                        assert ((y == 0) & torch.signbit(y)).any()
                    for mode in (1, 2):
                        got = compiler.ext.conv2d_relu_inference(x, ws.w, bias, *ws.args, b.handle, mode)
                        keep = (y > 0) | torch.isnan(y)
                        if mode == 2:
                            keep |= (y == 0) & torch.signbit(y)
                        want = torch.where(keep, y, torch.zeros_like(y))
                        assert got is not None and got.stride() == y.stride() and got.dtype == y.dtype
                        assert torch.equal(got.view(bits[y.dtype]), want.view(bits[y.dtype])), (fam.name(c), fmt,
                                                                                               shape, mode)
                        compared[fam.name(c)] = compared.get(fam.name(c), 0) + 1
                    device_mode = bnn._relu_mode(y.device, y.dtype)
                    mine = compiler.ext.conv2d_relu_inference(x, ws.w, bias, *ws.args, b.handle, device_mode)
                    assert torch.equal(mine.view(bits[y.dtype]), torch.relu(y).view(bits[y.dtype]))
                    assert bool(compiler.ext.plan_fuses_relu(b.handle))
                    # (a call the plan does not take: another dtype)
                    assert compiler.ext.conv2d_relu_inference(x.double(), ws.w.double(), None, *ws.args, b.handle,
                                                              1) is None
    assert sorted(compared) == sorted(map(fam.name, configs)), "every configuration (every store path) compared"
    other = _family("implicit_gemm_wgmma_h16")
    handle = compiler.compile(other, [dict(other.DEFAULT)])[0].handle
    assert not compiler.ext.plan_fuses_relu(handle)
    ws = Workspace(_problem(shapes[0], fmt=("float16", "nhwc")), torch.device("cuda", 0))
    assert compiler.ext.conv2d_relu_inference(ws.x, ws.w, ws.b, *ws.args, handle, 1) is None
    with pytest.raises(RuntimeError, match="relu must be 1"):
        compiler.ext.conv2d_relu_inference(ws.x, ws.w, ws.b, *ws.args, handle, 0)


def test_fused_sequential_runs_a_tma_plans_relu_in_its_epilogue(compiler, monkeypatch):
    """FusedSequential's conv -> ReLU pairs (in-place and not) whose convs run TMA plans, bf16 channels_last: the
    ReLU modules are not called and the output is, to the bit, what calling the modules one by one gives (the same
    plans, then ATen's ReLU), also in a CUDA graph whose capture makes the pair's first call (once the sign rule was
    asked), the layers' plans remembered or not yet; with a gradient to record, or a hook on the ReLU, the modules
    are called."""
    import bagf_torch
    from bagf_torch.nn import _reads_krsc

    torch.manual_seed(0)
    seq = bagf_torch.convert(torch.nn.Sequential(torch.nn.Conv2d(64, 136, 3, padding=1), torch.nn.ReLU(inplace=True),
                                                 torch.nn.Conv2d(136, 64, 3, padding=(1, 0)), torch.nn.ReLU()))
    assert type(seq).__name__ == "FusedSequential"
    seq = seq.cuda().to(torch.bfloat16).to(memory_format=torch.channels_last).eval()
    fam = _family("implicit_gemm_tma_h16")
    x = torch.randn(2, 64, 11, 9, device="cuda").to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
    cfg = dict(fam.DEFAULT, DT=fam.DTYPES["bfloat16"], NHWC=1)
    h = x
    entries, inputs = {}, {}
    for i in (0, 2):  # each conv's plan for its input, as its first call would have remembered it
        conv = seq[i]
        shape = (*h.shape, conv.out_channels, *conv.kernel_size, conv.stride, conv.padding, conv.dilation, True)
        assert _runs(fam, cfg, shape, ("bfloat16", "nhwc")), shape
        handle = compiler.compile(fam, [cfg])[0].handle
        entries[i] = ("kernel", handle, list(conv.stride), list(conv.padding), list(conv.dilation),
                      _reads_krsc(handle))
        seq[i]._remember(h, entries[i])
        inputs[i] = h
        h = seq[i + 1](conv(h))
    calls = []
    relu_forward = torch.nn.ReLU.forward  # (counted on the class: a forward set on an instance is not fused)
    monkeypatch.setattr(torch.nn.ReLU, "forward", lambda self, t: calls.append(1) or relu_forward(self, t))
    with torch.no_grad():
        want = seq[3](seq[2](seq[1](seq[0](x))))
        calls.clear()
        got = seq(x)
    assert calls == [] and torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert got.is_contiguous(memory_format=torch.channels_last)
    # the pair's first call inside a CUDA graph capture: fused where the ReLU's sign rule was asked up front
    # (tune_model's prepare_relu), else the modules are called (a capture cannot synchronise to ask); same bits. Also
    # where the layers' plan tables are empty (a pre-tuned model's first call): each plan from the runtime's lookup
    # (the plans above put in the runtime's memo, as tune_model leaves them loaded: all a capture's lookup takes)
    from bagf_torch import epilogue, nn as bnn, runtime
    from bagf_torch.problem import ConvProblem

    for asked, tables in ((False, True), (True, True), (True, False)):
        monkeypatch.setattr(bnn, "_RELU_MODES", {})
        if asked:
            assert epilogue.prepare_relu(seq, x.device.index, {torch.bfloat16})
        if not tables:
            for i in (0, 2):
                conv = seq[i]
                conv.__dict__.pop("_bagf_plans", None)
                conv.__dict__.pop("_bagf_last", None)
                problem = ConvProblem.from_call(inputs[i], conv.weight, conv.bias, conv.stride,
                                                bnn._numeric_padding(conv), conv.dilation, 1)
                monkeypatch.setitem(runtime.get()._memo, (problem, x.device.index), entries[i][1])
        calls.clear()
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(graph):
            out = seq(x)
        out.fill_(float("nan"))  # (poisoned: the replay writes it)
        graph.replay()
        torch.cuda.synchronize()
        assert calls == ([] if asked else [1, 1]), (asked, tables, calls)
        assert torch.equal(out.view(torch.int16), want.view(torch.int16))
    assert [seq[i]._plan_entry(inputs[i]) for i in (0, 2)] == [entries[0], entries[2]]  # (looked up in the capture)
    handle = seq[1].register_forward_hook(lambda *a: None)
    with torch.no_grad():
        torch.testing.assert_close(seq(x), want, rtol=0, atol=0)
    assert calls == [1]  # (the hooked ReLU called; the other pair fused)
    handle.remove()
    calls.clear()
    xg = x.clone().requires_grad_()
    seq(xg).float().sum().backward()  # (a gradient to record: every module called, ATen's backward)
    assert calls == [1, 1] and xg.grad is not None


def _h16_model(dtype, layout):
    return _conv_model().to(getattr(torch, dtype)).to(memory_format=_memory_format(layout)).eval()


@pytest.mark.parametrize("fmt,context", [(("bfloat16", "nhwc"), "inference_mode"), (("float16", "nchw"), "no_grad")],
                         ids=["bf16_channels_last_inference_mode", "fp16_nchw_no_grad"])
def test_h16_first_call_tunes_then_cache_hit_compile_and_cuda_graph(monkeypatch, fmt, context):
    """A converted model in bfloat16 channels_last (under inference_mode) and in float16 NCHW (under no_grad): the
    first forward tunes both layers in that dtype and format, trying implicit_gemm_h16's kernels (every candidate
    within twice cuDNN's error, or it is not kept), the output has the input's dtype and format and cuDNN's accuracy;
    a fresh runtime over the same cache tunes nothing and gives the same output; torch.compile(fullgraph=True) and a
    CUDA graph run the same plans."""
    import bagf_torch
    from bagf_torch import bench, runtime
    from bagf_torch.kernels import FAMILIES

    monkeypatch.setenv("BAGF_STRATEGY", "random")
    monkeypatch.setenv("BAGF_BUDGET", "6")
    dtype, layout = fmt
    dt, mf = getattr(torch, dtype), _memory_format(layout)
    stock = _h16_model(dtype, layout)
    tuned = bagf_torch.convert(_h16_model(dtype, layout))
    x = torch.randn(2, 3, 33, 31, device="cuda").to(dt).contiguous(memory_format=mf)
    ctx = torch.inference_mode if context == "inference_mode" else torch.no_grad
    with ctx():
        out = tuned(x)
        rt = runtime.get()
        assert rt.stats["tuned"] == 2
        assert all((r.problem.dtype, r.problem.layout) == fmt for r in rt.results)
        ran = [t for r in rt.results for t in r.trials if t.family == "implicit_gemm_h16" and t.outcome.ok]
        # the plan: cuDNN or a family with 16-bit kernels (implicit_gemm_h16, winograd_gemm's DT knob)
        sixteen = {"aten", *(n for n, f in FAMILIES.items() if "DT" in f.space().names)}
        assert ran and all(r.family in sixteen for r in rt.results), rt.results
        # the cp.async pipeline (ST >= 3) only where every copy is a whole 16-byte run: never on the C = 3 layer
        # nor in NCHW (the C = 16 channels_last layer may take it)
        for r in rt.results:
            tried = {t.config["ST"] for t in r.trials if t.family == "implicit_gemm_h16"}
            if r.problem.c % 8 or layout == "nchw":
                assert tried <= {2}, (r.problem.short(), tried)
        assert out.dtype is dt and out.is_contiguous(memory_format=mf)
        ref = _conv_model().to(dt).double()(x.double())  # the same weights (seed 0), rounded as the model holds them
        _assert_within_cudnn(out, ref, stock(x), fmt)
        runtime.reset()
        fresh = bagf_torch.convert(_h16_model(dtype, layout))
        assert torch.equal(fresh(x), out)
        assert runtime.get().stats["tuned"] == 0 and runtime.get().stats["cache_hits"] == 2
        replay, static = bench.graphed(fresh, x)
        replay()
        torch.cuda.synchronize()
        assert torch.equal(static, out)
    compiled, graphs = _compile_recording(fresh, x)
    assert torch.equal(compiled, out)
    uses_op = any("bagf.conv2d" in gm.code for gm in graphs)
    # the op exactly where a kernel won
    assert uses_op == any(r.family != "aten" for r in rt.results), [gm.code for gm in graphs]
    torch._dynamo.reset()


def test_autocast_first_call_tunes_autocasts_dtype(monkeypatch):
    """A float32 model called with a channels_last input under torch.autocast(bfloat16): the layers tune the bfloat16
    channels_last problems (input, weight and bias cast as nn.Conv2d casts them) and return what nn.Conv2d returns
    there, bfloat16 channels_last, with cuDNN's accuracy."""
    import bagf_torch
    from bagf_torch import runtime

    monkeypatch.setenv("BAGF_STRATEGY", "random")
    monkeypatch.setenv("BAGF_BUDGET", "4")
    stock = _conv_model().eval()
    tuned = bagf_torch.convert(_conv_model().eval())
    x = torch.randn(2, 3, 33, 31, device="cuda").contiguous(memory_format=torch.channels_last)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        out, want = tuned(x), stock(x)
        again = tuned(x)
    assert out.dtype is want.dtype is torch.bfloat16 and out.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(again, out)
    rt = runtime.get()
    assert rt.stats["tuned"] == 2 and all((r.problem.dtype, r.problem.layout) == ("bfloat16", "nhwc")
                                          for r in rt.results)
    ref = _conv_model().to(torch.bfloat16).double()(x.to(torch.bfloat16).double())
    _assert_within_cudnn(out, ref, want, "autocast")


@pytest.mark.parametrize("case", ["half_strided", "strided", "groups", "reflect", "same_even", "empty", "double"])
def test_fallbacks_are_correct_on_gpu(case, caplog):
    import bagf_torch

    kw = dict(in_channels=4, out_channels=6, kernel_size=3, padding=1)
    x = torch.randn(2, 4, 10, 12, device="cuda")
    if case == "groups":
        kw["groups"] = 2
    if case == "reflect":
        kw["padding_mode"] = "reflect"
    if case == "same_even":
        kw.update(kernel_size=4, padding="same")
    if case == "empty":
        x = x[:0]
    conv = torch.nn.Conv2d(**kw).cuda()
    if case == "half_strided":  # float16 is tuned in NCHW and channels_last, not in other strides
        conv, x = conv.half(), x.half().transpose(2, 3).contiguous().transpose(2, 3)
    if case == "double":
        conv, x = conv.double(), x.double()
    if case == "strided":  # neither NCHW nor channels_last
        x = x.transpose(2, 3).contiguous().transpose(2, 3)
    tuned = bagf_torch.TunedConv2d.from_conv(conv)
    with caplog.at_level("WARNING", logger="bagf_torch"):
        got = tuned(x)
        tuned(x)
    torch.testing.assert_close(got, conv(x))
    assert len([r for r in caplog.records if "TunedConv2d" in r.getMessage()]) == 1


# ---- whole models: tune_model, torch.compile, CUDA graphs, a warm second process ------------------------

def _small_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 32, 5, stride=2, padding=2), torch.nn.ReLU(),
                               torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(),
                               torch.nn.Conv2d(64, 64, 3, padding=1)).cuda().eval()


def _stock_graph_us(p, calls: int = 20, rounds: int = 7) -> float:
    """torch's conv on ``p`` in its cuDNN mode: GPU microseconds per call of ``calls`` calls in one CUDA graph
    (``bench.graphed``), the median of ``rounds`` replays (``bench.time_forward``)."""
    from bagf_torch import bench
    from bagf_torch.problem import cudnn_conv_mode

    x = torch.randn(p.n, p.c, p.h, p.w, device="cuda")
    w = torch.randn(p.k, p.c, p.r, p.s, device="cuda")
    b = torch.randn(p.k, device="cuda")
    with torch.no_grad(), cudnn_conv_mode(benchmark=True, tf32=p.tf32):
        replay, _ = bench.graphed(lambda x: [F.conv2d(x, w, b, p.stride, p.padding, p.dilation)
                                             for _ in range(calls)], x)
        return bench.time_forward(replay, runs=rounds, warmup=1).median_us / calls


def test_time_stock_times_each_problems_stock_conv_and_allots_by_it():
    """torch's conv on every discovered problem, timed apart from the model (GPU time, the host's launch cost
    kept out), which allot_seconds shares the budget by: at N=32 the 3x3 layer gets it in full, the small 1x1
    less, whichever runs first in the forward."""
    import bagf_torch
    from bagf_torch import pretune

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.small = torch.nn.Conv2d(128, 128, 1, stride=4)
            self.big = torch.nn.Conv2d(128, 128, 3, padding=1)

        def forward(self, x):
            return self.big(x) + self.small(x).sum()

    model = bagf_torch.convert(Net()).cuda()
    found = pretune.discover(model, [torch.randn(n, 128, 56, 56, device="cuda") for n in (1, 32)])
    assert len(found.problems) == 4 and found.calls == 4
    found.stock_us = pretune.time_stock(found)
    assert set(found.stock_us) == set(found.problems) and all(t > 0 for t in found.stock_us.values())
    big = {p.n: p for p in found.problems if p.r == 3}
    small = {p.n: p for p in found.problems if p.r == 1}
    # GPU time, as a CUDA graph of the same calls measures it: at N=1 the host's launch cost (about 10 us a call)
    # is as long as a small conv's GPU time. (How far apart cuDNN puts the two layers is cuDNN's business: in
    # TF32 mode its 1x1 stride-4 conv took 11-23 us at N=1 and 32 alike, against 22 and 199 us for the 3x3.)
    assert found.stock_us[big[32]] > found.stock_us[small[32]] and found.stock_us[big[32]] > found.stock_us[big[1]]
    for p in found.problems:
        graph = _stock_graph_us(p)
        assert 0.6 * graph < found.stock_us[p] < 1.5 * graph, (p.short(), found.stock_us[p], graph)
    got = pretune.allot_seconds(found, 7.0)  # the N=32 pass: the 3x3 has most of it, in full; the 1x1 less
    assert got[big[32]] == 7.0 and pretune.MIN_SHARE_SECONDS <= got[small[32]] < 7.0, got
    assert model.big._bagf_plans == {} and model.small._bagf_plans == {}  # discovery left nothing behind


def test_tune_model_then_compile_fullgraph_and_cuda_graph(monkeypatch):
    import bagf_torch
    from bagf_torch import runtime
    from bagf_torch.jit.compiler import STATS

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    stock = _small_model()
    model = bagf_torch.convert(_small_model())
    xs = [torch.randn(n, 3, 32, 32, device="cuda") for n in (1, 8)]
    report = bagf_torch.tune_model(model, xs, budget=6, strategy="random", progress=False)
    assert len(report.rows) == 6 and report.tuned == 6
    assert runtime.get().stats["tuned"] == 6
    tuned, compiles = runtime.get().stats["tuned"], STATS.nvrtc_compiles
    x = xs[1]
    with torch.no_grad():
        eager = model(x)
        torch.testing.assert_close(eager, stock(x), rtol=1e-4, atol=1e-4)
        compiled, graphs = _compile_recording(model, x)  # fullgraph: a break would raise
        torch.testing.assert_close(compiled, eager)
        assert len(graphs) == 1
        ops = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
        kernels = [r for r in report.rows if r.family != "aten" and r.problem.n == 8]
        assert sum(1 for t in ops if "bagf" in str(t)) == len(kernels), ops  # each tuned layer runs our op
        # CUDA graph: capture once, replay on new data, equal to eager
        static_x = x.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            model(static_x)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            static_y = model(static_x)
        for _ in range(2):
            new = torch.randn_like(x)
            static_x.copy_(new)
            g.replay()
            torch.testing.assert_close(static_y, model(new))
    assert runtime.get().stats["tuned"] == tuned and STATS.nvrtc_compiles == compiles  # nothing re-tuned
    torch._dynamo.reset()


def test_cli_tune_then_second_process_has_no_tuning_and_no_compiles(tmp_path):
    env = dict(os.environ, BAGF_CACHE_DIR=str(tmp_path / "cache"))
    tune = subprocess.run([sys.executable, "-m", "bagf_torch", "tune", "--model", "alexnet", "--batch", "1,4",
                           "--tf32", "off", "--budget", "4", "--strategy", "random", "--no-progress", "--json",
                           str(tmp_path / "r.json")], capture_output=True, text=True, env=env, timeout=900)
    assert tune.returncode == 0, tune.stderr[-3000:]
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert len(rows) == 10 and not any(r["cached"] for r in rows)
    script = textwrap.dedent(f"""
        import json, sys, time
        t0 = time.perf_counter()
        sys.path.insert(0, {_PACKAGE_ROOT!r})
        import torch, bagf_torch
        from bagf_torch import runtime
        from bagf_torch.jit.compiler import STATS
        torch.backends.cudnn.allow_tf32 = False
        model = bagf_torch.models.alexnet().cuda().eval()
        with torch.no_grad():
            for n in (1, 4):
                model(torch.randn(n, 3, 224, 224, device="cuda"))
        torch.cuda.synchronize()
        print(json.dumps(dict(tuned=runtime.get().stats["tuned"], hits=runtime.get().stats["cache_hits"],
                              nvrtc=STATS.nvrtc_compiles, seconds=time.perf_counter() - t0)))
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    stats = json.loads(res.stdout.strip().splitlines()[-1])
    assert stats["tuned"] == 0 and stats["nvrtc"] == 0 and stats["hits"] == 10, stats
    print(f"warm second process: {stats}")  # setup seconds (imports, extension load, cubin loads) for the record


def test_bench_times_the_served_model_with_the_tuned_models_plans(monkeypatch):
    """``bench``'s served variant: a fresh process with BAGF_TUNE=0 runs every conv of AlexNet as the tuning process
    does (``run_variants`` stops the run otherwise), tunes nothing and never imports Ax; its CUDA-graph time is
    within a factor of the tuning process's graph of the same plans. Each served child times a stock copy beside the
    served model; the copy's graph is stock's graph within a factor."""
    import bagf_torch
    from bagf_torch import bench

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    stock, tuned = bench.stock_and_tuned(lambda: bagf_torch.models.alexnet(tuned=False))
    x = torch.randn(1, 3, 224, 224, device="cuda")
    bagf_torch.tune_model(tuned, [x], budget=4, strategy="random", progress=False)
    row = bench.run_variants(stock, tuned, x, runs=10, graphs=True, stock_model="alexnet", channels_last=False,
                             children=2)
    served = row["bagf_served"]
    assert len(served["children_us"]) == 2 and served["median_us"] == min(served["children_us"])
    assert served["tuned"] == 0 and not served["ax_imported"], served
    assert len(served["layer_kinds"]) == 5 and served["layer_kinds"].items() <= bench.layer_kinds(tuned).items()
    assert 0.5 < row["bagf_served_graph"]["median_us"] / row["bagf_graph"]["median_us"] < 2.0, row
    for name, beside in bench.PAIRED.items():
        ratios = row[name]["same_process_ratios"]
        assert len(ratios) == 2 and row[name]["same_process_ratio"] == sum(ratios) / 2, row
        assert len(row[beside]["children_us"]) == 2 and "layer_kinds" not in row[beside], row
    assert 0.5 < row["stock_in_served_graph"]["median_us"] / row["stock_graph"]["median_us"] < 2.0, row
    assert served["max_rel_diff"] < 1e-3, served  # fp32 here: the served logits as the stock copy's in its process
    if "kernel" in served["layer_kinds"].values():  # and the copy is stock's: our kernels sum in another order
        assert served["max_rel_diff"] > 0, served
    print({k: round(v["median_us"], 1) for k, v in row.items()})


def test_a_call_that_cannot_be_captured_is_left_to_queued_timing_with_the_current_stream_kept():
    """The finalists' graphs: a call that breaks a capture (a host sync) gives None and leaves the caller's current
    stream as it was; the process can still capture (a later re-timing's graphs, in a pool of their own, and the
    user's), and a replay of a captured call times its GPU work."""
    from bagf_torch.tuning.measure import CudaBenchmarker, _graph_pool

    x = torch.randn(1 << 20, device="cuda")
    before = torch.cuda.current_stream()

    def syncs():
        (x * 2).sum().item()  # a device-to-host copy: not allowed while the stream captures

    assert CudaBenchmarker._capture(syncs, 5, _graph_pool()) is None
    assert torch.cuda.current_stream() == before
    captured = CudaBenchmarker._capture(lambda: x * 2, 5, _graph_pool())
    assert captured is not None and 0.0 < CudaBenchmarker._replay(*captured) < 1000.0
    captured[0].reset()
    assert torch.cuda.current_stream() == before
    g = torch.cuda.CUDAGraph()  # a plain capture as a user makes one
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        x * 2
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        y = x * 3
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, x * 3)


def test_finalists_are_timed_by_gpu_time_whatever_the_host_does():
    """The finalists' re-timing (``CudaBenchmarker.remeasure``, which picks the winner against cuDNN) measures GPU
    time: with a Python thread taking the GIL in turns with it (as compiles and a search step left running on other
    threads do), cuDNN's conv at N = 1 still times as its CUDA-graph replay does. Call by call between events, a
    span holds the host's pace; at Python's 5 ms switch interval the calls of a timing loop come an interval apart
    (``QUEUED_SWITCH_S``)."""
    import threading

    from bagf_torch.ops import ATEN
    from bagf_torch.tuning.measure import CudaBenchmarker, Workspace

    ws = Workspace(_problem((1, 256, 14, 14, 256, 3, 3, (1, 1), (1, 1), (1, 1), True)), torch.device("cuda", 0))
    bench = CudaBenchmarker()
    call = bench._call(ws, ATEN)
    with torch.backends.cudnn.flags(enabled=True, benchmark=True, deterministic=False, allow_tf32=False):
        call()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            call()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(20):
                call()
        graph_us = bench.timing(g.replay).median_us / 20
    stop = threading.Event()

    def busy():
        while not stop.is_set():
            sum(i * i for i in range(20000))  # pure Python: holds the GIL for each switch interval

    t = threading.Thread(target=busy, daemon=True)
    t.start()
    try:
        queued = bench.remeasure(ws, [ATEN], rounds=3)[0]
    finally:
        stop.set()
        t.join()
    print(f"cuDNN: CUDA graph {graph_us:.1f} us per call, remeasure with a busy host thread {queued:.1f} us")
    assert 0.7 * graph_us < queued < 1.3 * graph_us, (queued, graph_us)
