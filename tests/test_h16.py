"""float16 and bfloat16, NCHW and channels_last, on the CPU: the 16-bit family's space and problem rules, which families
the tuner offers per dtype and memory format, TunedConv2d's routing of such calls to the runtime (and of those no family
computes to ATen), and the tune command's --dtype / --channels-last. The kernels themselves run in tests/test_gpu.py."""

from __future__ import annotations

import argparse

import pytest
import torch

import bagf_torch
from bagf_torch import nn as bnn
from bagf_torch import runtime
from bagf_torch.kernels import (FAMILIES, family_refuses, format_refuses, formats, implicit_gemm_h16 as h16,
                                implicit_gemm_tc, supported_formats, winograd_gemm)
from bagf_torch.ops import ATEN
from bagf_torch.problem import ConvProblem

CONV3 = dict(n=32, c=192, h=13, w=13, k=384, r=3, s=3, padding=(1, 1))


def _p(dtype="bfloat16", layout="nhwc", **kw):
    return ConvProblem(**{**CONV3, **kw}, dtype=dtype, layout=layout)


def test_formats_the_families_compute():
    assert formats(implicit_gemm_tc) == (("float32", "nchw"),)
    assert set(formats(h16)) == {("float16", "nchw"), ("float16", "nhwc"), ("bfloat16", "nchw"), ("bfloat16", "nhwc")}
    assert set(formats(winograd_gemm)) == {(d, l) for d in ("float32", "float16", "bfloat16") for l in ("nchw", "nhwc")}
    assert supported_formats() == set(formats(winograd_gemm))
    assert format_refuses(h16, _p()) is None
    assert "float32 nchw" in format_refuses(h16, _p("float32", "nchw"))
    assert "bfloat16 nhwc" in format_refuses(implicit_gemm_tc, _p())
    # an imported plan is held to it: a 16-bit plan never serves a float32 problem, nor an fp32 plan a 16-bit one
    assert family_refuses("implicit_gemm_tc", implicit_gemm_tc.DEFAULT, _p()) is not None
    assert family_refuses("implicit_gemm_h16", h16.DEFAULT, _p("float32", "nchw")) is not None
    assert family_refuses("implicit_gemm_h16", h16.DEFAULT, _p("bfloat16", "nhwc")) is None
    assert family_refuses("implicit_gemm_h16", h16.DEFAULT, _p("float16", "nhwc")) is not None  # compiled for bf16


@pytest.mark.parametrize("dtype,layout", [("float16", "nchw"), ("float16", "nhwc"), ("bfloat16", "nchw"),
                                          ("bfloat16", "nhwc")])
def test_the_start_point_and_the_searched_space_are_the_problems_dtype_and_format(dtype, layout):
    p = _p(dtype, layout, n=128)  # a grid that fills the GPU: DEFAULT's block
    start = h16.default_for(p)
    assert (start["DT"], start["NHWC"]) == (h16.DTYPES[dtype], h16.LAYOUTS[layout])
    assert start["ST"] == (3 if layout == "nhwc" else 2)  # C = 192: the NHWC problem takes the cp.async pipeline
    assert h16.space().invalid_reason(start) is None and h16.problem_rule(start, p) is None
    valid = h16.space().valid_configs()
    searched = [c for c in valid if h16.problem_rule(c, p) is None]
    # this grid fills the GPU: split-K's partial sums would pass the workspace limit, so it is searched without;
    # every tile and (in NHWC, C % 8 == 0) every ST of the problem's dtype and format
    assert searched == [c for c in valid if c["SPLIT"] == 1 and (c["DT"], c["NHWC"]) == (start["DT"], start["NHWC"])]
    assert {c["ST"] for c in searched} == ({2, 3, 4} if layout == "nhwc" else {2})
    assert len(searched) == 192 * len({c["ST"] for c in searched})
    geo = h16.launch(start)
    assert (geo.dtype, geo.nhwc) == (1 + h16.DTYPES[dtype], h16.LAYOUTS[layout]) and geo.split == 1 and geo.gemm == 0
    # a small grid (batch 1) gets the smaller block, twice the blocks, and split-K within 2 blocks per SM
    p1 = _p(dtype, layout, n=1)
    one = h16.default_for(p1)
    assert one["BM"] * one["BN"] < start["BM"] * start["BN"]
    assert one["SPLIT"] == 8 and h16.tiles(one, p1) * one["SPLIT"] <= 2 * h16.H200_SMS
    assert h16.problem_rule(one, p1) is None and h16.launch(one).split == 8


def test_split_k_is_searched_where_the_reduction_and_the_workspace_allow_it():
    """The problem rule gives every slice at least 2 K-steps and keeps the partial sums within the workspace
    limit; within those, every SPLIT value is searched on a batch-1 layer."""
    conv3 = _p(n=1)  # C*R*S = 1728: 108 K-steps of 16, 27 of 64
    searched = [c for c in h16.space().valid_configs() if h16.problem_rule(c, conv3) is None]
    assert {c["SPLIT"] for c in searched} == set(h16.PARAMS["SPLIT"])
    assert {c["SPLIT"] for c in searched if c["BK"] == 64} == {1, 2, 4, 8}  # 16 slices of 27 K-steps: too thin
    tiny = _p(n=1, c=3, r=3, s=3)  # C*R*S = 27: 1 or 2 K-steps, no split
    assert {c["SPLIT"] for c in h16.space().valid_configs() if h16.problem_rule(c, tiny) is None} == {1}
    big = dict(h16.DEFAULT, DT=1, NHWC=1, BM=128, BN=256, WM=2, WN=4, SPLIT=2)
    why = h16.problem_rule(big, _p(n=128))
    assert why is not None and "MiB of partial sums" in why
    assert h16.workspace_bytes(big, _p(n=128)) > h16.SPLIT_WORKSPACE_LIMIT
    assert h16.workspace_bytes(dict(big, SPLIT=1), _p(n=128)) == 0
    assert h16.name(dict(big, BK=32)).endswith("_bk32_wm2_wn4_st2_s2_sm90")
    # one cubin for every SPLIT: it is the launch's grid.z, not a template parameter
    assert h16.name_expression(dict(big, BK=32)) == "bagf::implicit_gemm_h16_conv2d<1, 1, 128, 256, 32, 2, 4, 2>"
    assert h16.name_expression(dict(big, BK=32, SPLIT=1)) == h16.name_expression(dict(big, BK=32))


def test_the_spaces_rules_hold_for_every_valid_configuration():
    limit = h16.SM90_SMEM_LIMIT
    for c in h16.space().valid_configs():
        assert (c["BM"] // c["WM"]) % 16 == 0 and (c["BN"] // c["WN"]) % 8 == 0
        assert h16.smem_bytes(c) == c["ST"] * 2 * (c["BM"] + c["BN"]) * (c["BK"] + 8)
        assert h16.smem_bytes(c) <= limit and h16.estimated_registers(c) <= 255
        assert h16.name(c).startswith("implicit_gemm_h16_" + ("bf16" if c["DT"] else "fp16"))
        assert f"_st{c['ST']}_s{c['SPLIT']}_" in h16.name(c)
        assert h16.name_expression(c).endswith(f", {c['ST']}>")
        assert c["ST"] == 2 or c["NHWC"] == 1  # the cp.async pipeline is the channels_last path


def test_the_pipeline_is_searched_only_where_every_copy_is_a_whole_16_byte_run():
    """ST >= 3 (cp.async of 8 contiguous 16-bit values) is refused for NCHW, for C % 8 != 0 and for an odd C*R*S,
    by the problem rule (and NCHW by the space); ST = 2 runs all of them."""
    pipe = dict(h16.DEFAULT, DT=1, NHWC=1, ST=3)
    assert h16.problem_rule(pipe, _p()) is None and h16.problem_rule(dict(pipe, ST=4), _p()) is None
    for kw, says in ((dict(c=12, r=2, s=2), "C = 12"), (dict(c=3, r=11, s=11), "C = 3"),
                     (dict(c=7, r=3, s=3), "C = 7"), (dict(c=100, r=1, s=1), "C = 100")):
        p = _p(**kw)
        for st in (3, 4):
            why = h16.problem_rule(dict(pipe, ST=st), p)
            assert why is not None and says in why, (kw, why)
        assert h16.problem_rule(dict(pipe, ST=2), p) is None
        assert h16.pipeline_refuses(p) is not None
        assert h16.default_for(p)["ST"] == 2
        assert {c["ST"] for c in h16.space().valid_configs() if h16.problem_rule(c, p) is None} == {2}
    odd = _p(c=5, r=3, s=3)  # C*R*S = 45
    assert (odd.c * odd.r * odd.s) % 2 and h16.problem_rule(dict(pipe, ST=3), odd) is not None
    # NCHW: not in the space, and refused on an NCHW problem whatever the configuration says
    nchw = dict(pipe, NHWC=0)
    assert "NCHW takes ST = 2" in h16.space().invalid_reason(nchw)
    assert "channels_last" in h16.problem_rule(nchw, _p(layout="nchw"))
    assert "channels_last" in h16.pipeline_refuses(_p(layout="nchw"))
    assert h16.problem_rule(dict(nchw, ST=2), _p(layout="nchw")) is None
    assert {c["ST"] for c in h16.space().valid_configs() if h16.problem_rule(c, _p(layout="nchw")) is None} == {2}
    # an imported plan is held to it too
    assert family_refuses("implicit_gemm_h16", dict(pipe, ST=4), _p(c=12, r=2, s=2)) is not None
    assert family_refuses("implicit_gemm_h16", dict(pipe, ST=4), _p()) is None


def test_shared_memory_grows_with_the_stages_and_the_rule_holds_it_to_the_limit():
    c = dict(h16.DEFAULT, ST=2)  # 128 x 64, BK 32: 2 * 192 * 40 = 15360 bytes a stage
    assert [h16.smem_bytes(dict(c, ST=st)) for st in (2, 3, 4)] == [30720, 46080, 61440]
    assert [h16.launch(dict(c, ST=st)).smem for st in (2, 3, 4)] == [30720, 46080, 61440]
    small = h16.space(smem_limit=48 * 1024)
    assert small.invalid_reason(dict(c, ST=3)) is None
    assert small.invalid_reason(dict(c, ST=4)) is not None and "61440" in small.invalid_reason(dict(c, ST=4))
    # the largest configuration (4 stages of 128 x 256 x 64: 221184 bytes) fits the H200's opt-in limit but not the
    # register rule; the largest valid one is within the limit
    big = dict(c, BM=128, BN=256, BK=64, WM=2, WN=4, ST=4)
    assert h16.smem_bytes(big) == 221184 <= h16.SM90_SMEM_LIMIT
    assert max(h16.smem_bytes(v) for v in h16.space().valid_configs()) <= h16.SM90_SMEM_LIMIT


def test_a_configuration_recorded_without_st_is_the_register_double_buffer():
    """ST was added after plans were cached: a recorded configuration without it completes to ST = 2 (LEGACY), the
    kernel it was measured as, and is named, compiled and checked as that."""
    from bagf_torch.cache_schema import check_config
    from bagf_torch.kernels import complete_config

    old = {k: v for k, v in h16.DEFAULT.items() if k != "ST"}
    older = {k: v for k, v in old.items() if k != "SPLIT"}  # before SPLIT as well
    assert h16.LEGACY == {"SPLIT": 1, "ST": 2}
    for rec in (old, older):
        full = complete_config("implicit_gemm_h16", rec)
        assert full == dict(h16.DEFAULT, ST=2, SPLIT=1)
        assert h16.name(rec) == h16.name(full) == "implicit_gemm_h16_bf16_nhwc_bm128_bn64_bk32_wm2_wn2_st2_s1_sm90"
        assert h16.name_expression(rec) == "bagf::implicit_gemm_h16_conv2d<1, 1, 128, 64, 32, 2, 2, 2>"
        assert h16.smem_bytes(rec) == 30720
        assert check_config("implicit_gemm_h16", rec, rules=True) == full  # (what the cache stores: the kernel it runs)
        assert family_refuses("implicit_gemm_h16", rec, _p(c=12)) is None  # ST = 2 runs C % 8 != 0


@pytest.mark.parametrize("split", [1, 2, 3, 4, 5, 7, 8, 16])
def test_split_k_slices_cover_every_k_step_once_and_evenly(split):
    """The even split: slice z reduces [z*steps//S, (z+1)*steps//S); the slices cover every step exactly once, in
    order, their sizes differ by at most one, and the problem rule's 2 K-steps per slice is floor(steps/S) >= 2,
    i.e. the smallest slice's size."""
    for steps in list(range(0, 300)) + [1000, 1001, 4095, 123457]:
        slices = [h16.split_range(z, steps, split) for z in range(split)]
        covered = [t for r in slices for t in r]
        assert covered == list(range(steps)), (steps, split)
        sizes = [len(r) for r in slices]
        assert max(sizes) - min(sizes) <= (1 if steps else 0) and min(sizes) == steps // split
        if split > 1 and steps:
            p = _p(n=1, c=16 * steps, r=1, s=1)  # a 1x1 conv over 16 * steps channels: `steps` K-steps of 16
            c = dict(h16.DEFAULT, BK=16, BM=32, BN=32, WM=1, WN=1, SPLIT=split)
            if split in h16.PARAMS["SPLIT"] and steps < 300:
                assert (h16.problem_rule(c, p) is None) == (min(sizes) >= 2), (steps, split)


def test_the_tuner_offers_a_16bit_problem_only_the_16bit_family():
    from bagf_torch.tuning.tuner import Tuner

    tuner = Tuner.__new__(Tuner)  # families_for reads only these
    tuner.families = list(FAMILIES.values())
    tuner.compiler = type("C", (), {"arch": "sm_90"})()
    assert [f.FAMILY for f in tuner.families_for(_p())] == ["winograd_gemm", "implicit_gemm_h16",
                                                            "implicit_gemm_wgmma_h16", "implicit_gemm_tma_h16"]
    assert [f.FAMILY for f in tuner.families_for(_p("float16", "nchw"))] == ["winograd_gemm", "implicit_gemm_h16",
                                                                           "implicit_gemm_tma_h16"]
    assert [f.FAMILY for f in tuner.families_for(_p("bfloat16", "nhwc", r=1, s=1, padding=(0, 0)))] == [
        "implicit_gemm_h16", "implicit_gemm_wgmma_h16", "implicit_gemm_tma_h16",
        "cublaslt_1x1"]  # (a 1x1 conv: no Winograd; cuBLASLt's GEMMs, unless BAGF_CUBLASLT=0 leaves them out)
    # the wgmma families' copies are 8 channels: C = 12 is implicit_gemm_h16's alone; on an sm_80 GPU too
    assert [f.FAMILY for f in tuner.families_for(_p("bfloat16", "nhwc", c=12))] == ["winograd_gemm",
                                                                                 "implicit_gemm_h16"]
    tuner.compiler = type("C", (), {"arch": "sm_80"})()
    assert {"implicit_gemm_wgmma_h16", "implicit_gemm_tma_h16"}.isdisjoint(f.FAMILY for f in tuner.families_for(_p()))
    tuner.compiler = type("C", (), {"arch": "sm_90"})()
    fp32 = [f.FAMILY for f in tuner.families_for(_p("float32", "nchw"))]
    assert "implicit_gemm_h16" not in fp32 and "implicit_gemm_wgmma_h16" not in fp32 and "implicit_gemm_tc" in fp32
    assert "implicit_gemm_tma_h16" not in fp32
    assert [f.FAMILY for f in tuner.families_for(_p("float32", "nhwc"))] == ["winograd_gemm"]


def test_short_names_say_dtype_and_format_when_not_float32_nchw():
    assert _p("float32", "nchw").short() == "N32 C192 13x13 -> K384 13x13 k3x3 s1 p1"
    assert _p().short().endswith(" bf16 nhwc") and _p("float16", "nchw").short().endswith(" fp16 nchw")
    x = torch.randn(2, 3, 9, 9).to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
    w = torch.randn(4, 3, 3, 3).to(torch.bfloat16)
    p = ConvProblem.from_call(x, w, None, 1, 1, 1, 1)
    assert (p.dtype, p.layout, p.tf32) == ("bfloat16", "nhwc", False)


class _Recording:
    def __init__(self):
        self.problems = []

    def lookup(self, problem, device):
        self.problems.append(problem)
        return ATEN, True


@pytest.fixture
def cuda_looking(monkeypatch):
    rt = _Recording()
    monkeypatch.setattr(bnn.TunedConv2d, "_device_reason", staticmethod(lambda x: None))
    monkeypatch.setattr(runtime, "get", lambda: rt)
    return rt


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16bit_calls_in_both_formats_reach_the_runtime_under_their_own_keys(cuda_looking, dtype):
    """Each (dtype, memory format) asks the runtime once, as its own problem; the layer's plan table keeps them apart
    (a float32 plan of the same shape is never served to a bfloat16 call)."""
    conv = bagf_torch.TunedConv2d(8, 4, 3, padding=1).to(dtype)
    x = torch.randn(2, 8, 9, 9).to(dtype)
    xl = x.contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(conv(x), torch.nn.functional.conv2d(x, conv.weight, conv.bias, 1, 1))
            conv(xl)
    name = str(dtype).replace("torch.", "")
    assert [(p.dtype, p.layout) for p in cuda_looking.problems] == [(name, "nchw"), (name, "nhwc")]
    conv32 = conv.float()
    with torch.no_grad():
        conv32(x.float())
    assert [(p.dtype, p.layout) for p in cuda_looking.problems][-1] == ("float32", "nchw")


def test_calls_no_family_computes_go_to_aten_with_one_line(cuda_looking, caplog):
    conv = bagf_torch.TunedConv2d(8, 4, 3, padding=1)
    x = torch.randn(2, 8, 9, 9)
    with caplog.at_level("WARNING", logger="bagf_torch"):
        conv(x.contiguous(memory_format=torch.channels_last))  # float32 channels_last: tuned (winograd_gemm)
        conv(x.transpose(2, 3))  # float32, neither NCHW nor channels_last
        conv.double()
        conv(x.double())  # float64: no family
        conv.half()
        conv(x.half().transpose(2, 3))  # float16, neither NCHW nor channels_last
        conv(x.half())  # float16 NCHW: tuned
    assert [(p.dtype, p.layout) for p in cuda_looking.problems] == [("float32", "nhwc"), ("float16", "nchw")]
    lines = [r.getMessage() for r in caplog.records]
    assert any("float64" in m for m in lines) and any("non-contiguous" in m for m in lines)


def test_a_weight_of_another_dtype_is_atens(cuda_looking):
    conv = bagf_torch.TunedConv2d(8, 4, 3, padding=1)  # float32 weight
    x = torch.randn(2, 8, 9, 9).to(torch.bfloat16)
    assert "weight dtype torch.float32" in conv._unsupported(x)
    assert cuda_looking.problems == []


def test_the_tune_command_takes_dtype_and_channels_last(monkeypatch):
    from bagf_torch import cli

    args = cli.build_parser().parse_args(["tune", "--dtype", "bf16", "--channels-last"])
    assert (args.dtype, args.channels_last) == ("bf16", True)
    cli._check_format(args)  # bfloat16 channels_last is tuned
    cli._check_format(cli.build_parser().parse_args(["tune", "--channels-last"]))  # float32 channels_last too
    monkeypatch.setattr(cli, "DTYPES", {**cli.DTYPES, "float64": "float64"})
    args64 = argparse.Namespace(dtype="float64", channels_last=False)
    with pytest.raises(SystemExit, match="float64 NCHW is not tuned"):
        cli._check_format(args64)


def test_the_traced_forward_under_autocast_is_torchs_conv(cuda_looking, monkeypatch):
    """torch.compile traces ``_traced_forward``: under autocast it is nn.Conv2d's forward (autocast's casts in the
    graph), never a float32 plan the layer learnt outside autocast."""
    monkeypatch.setattr(bnn, "_op", lambda: pytest.fail("a float32 plan ran under autocast"))
    conv = bagf_torch.TunedConv2d(8, 4, 3, padding=1)
    x = torch.randn(2, 8, 9, 9)
    conv._remember(x, conv._kernel_entry(7, (1, 1)))  # a float32 plan for this shape
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        y = conv._traced_forward(x, conv.weight, conv.bias)
        want = torch.nn.functional.conv2d(x, conv.weight, conv.bias, 1, 1)
    assert y.dtype == torch.bfloat16 and torch.equal(y, want)


def test_the_report_counts_16bit_bytes_and_keeps_16bit_plans_off_the_fp32_roofline():
    from bagf_torch import report

    p32 = ConvProblem(n=1, c=1, h=3, w=3, k=1, r=3, s=3, padding=(1, 1))
    p16 = ConvProblem(n=1, c=1, h=3, w=3, k=1, r=3, s=3, padding=(1, 1), dtype="bfloat16", layout="nhwc")
    assert report.compulsory_bytes(p32) == 4 * (9 + 9 + 1 + 9) and report.compulsory_bytes(p16) == 2 * (9 + 9 + 1 + 9)
    plans = [{"problem": p.as_dict(), "family": "aten", "config": None, "time_us": 5.0, "aten_us": 5.0}
             for p in (p32, p16)]
    assert [pt.problem.dtype for pt in report.points_from_plans(plans)] == ["float32"]
    assert "bf16 nhwc" in report.plans_table(plans)


def test_the_bench_command_takes_dtype_and_channels_last_too():
    from bagf_torch import cli

    args = cli.build_parser().parse_args(["bench", "--dtype", "fp16", "--channels-last", "--batch", "1"])
    assert (args.dtype, args.channels_last, args.batch) == ("fp16", True, [1])
    cli._check_format(args)


def test_winograd_gemms_bfloat16_plans_need_sm80():
    """cvt.rn.bf16.f32 needs sm_80: on an older GPU bfloat16 configurations are not searched (fp16 and fp32 are)."""
    bf16 = dict(winograd_gemm.DEFAULT, DT=2)
    assert winograd_gemm.arch_rule(bf16, "sm_75") is not None and winograd_gemm.arch_rule(bf16, "sm_80") is None
    assert winograd_gemm.arch_rule(dict(winograd_gemm.DEFAULT, DT=1), "sm_70") is None
    assert winograd_gemm.arch_rule(winograd_gemm.DEFAULT, "sm_70") is None
