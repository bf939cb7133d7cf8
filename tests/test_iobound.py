"""CPU tests of bagf_torch/iobound.py: the closed-form traffic model equals a brute-force replay of the kernel's
loop nest; the lower bounds never exceed any configuration's modelled traffic; balance; pruning."""

from __future__ import annotations

import math
import dataclasses
import random
import zlib

import pytest

from bagf_torch import iobound
from bagf_torch.kernels import implicit_gemm as ig
from bagf_torch.kernels import implicit_gemm_tc as tc
from bagf_torch.kernels import implicit_gemm_wgmma as wgk
from bagf_torch.kernels import winograd as wg
from bagf_torch.problem import ConvProblem
import iobound_oracles  # tests/ is on sys.path (pytest's default prepend import mode)

VALID = ig.space().valid_configs()
SMALL_T = [c for c in VALID if ig.threads(c) <= 256]

# Small odd shapes: stride 1-4, padding, dilation, partial tiles in both grid dimensions, CRS % 4 != 0 and == 0.
SMALL = [
    ConvProblem(n=2, c=3, h=9, w=7, k=5, r=3, s=3, padding=(1, 1)),
    ConvProblem(n=1, c=2, h=11, w=10, k=7, r=3, s=2, stride=(2, 3), padding=(1, 0)),
    ConvProblem(n=3, c=1, h=13, w=13, k=3, r=5, s=5, stride=(4, 4), padding=(2, 2), bias=False),
    ConvProblem(n=1, c=4, h=10, w=9, k=17, r=3, s=3, padding=(2, 1), dilation=(2, 3)),
    ConvProblem(n=2, c=5, h=6, w=6, k=9, r=1, s=1, stride=(2, 2)),
    ConvProblem(n=1, c=2, h=12, w=12, k=4, r=2, s=2, stride=(3, 3), dilation=(2, 2), padding=(1, 1)),
]

ALEXNET = {  # (c, h, k, r, stride, pad)
    "conv1": (3, 224, 64, 11, 4, 2),
    "conv2": (64, 27, 192, 5, 1, 2),
    "conv3": (192, 13, 384, 3, 1, 1),
    "conv4": (384, 13, 256, 3, 1, 1),
    "conv5": (256, 13, 256, 3, 1, 1),
}


def alexnet(n: int) -> list[ConvProblem]:
    return [ConvProblem(n=n, c=c, h=h, w=h, k=k, r=r, s=r, stride=(u, u), padding=(pd, pd))
            for c, h, k, r, u, pd in ALEXNET.values()]


@pytest.mark.parametrize("problem", SMALL, ids=lambda p: p.short())
def test_model_equals_brute_force(problem):
    rng = random.Random(hash(problem.short()) % 1000)
    configs = [ig.DEFAULT] + rng.sample(SMALL_T, 5)
    # one that over-fetches rows (threads/BN > BK) and one with many rows per thread
    configs += [{"BM": 16, "BN": 16, "BK": 4, "TM": 1, "TN": 1, "DB": 0, "VEC": 4},
                {"BM": 32, "BN": 16, "BK": 32, "TM": 2, "TN": 2, "DB": 1, "VEC": 1}]
    for config in configs:
        assert ig.space().is_valid(config), config
        model = iobound.implicit_gemm_traffic(problem, config, unique=True)
        brute = iobound_oracles.brute_force_traffic(problem, config)
        assert model == brute, (config, model, brute)


def test_over_fetch_is_counted():
    # 256 threads, BN=16: 16 rows gathered per K-step of BK=4 -> rows are requested up to 4 times.
    p = SMALL[0]
    c = {"BM": 64, "BN": 16, "BK": 4, "TM": 4, "TN": 1, "DB": 0, "VEC": 1}
    t = iobound.implicit_gemm_traffic(p, c, unique=True)
    assert t.words_read_input > t.words_read_input_unique


@pytest.mark.parametrize("n", [1, 128])
def test_bound_below_every_config(n):
    rng = random.Random(n)
    sample = [ig.DEFAULT] + rng.sample(VALID, 150)
    for problem in alexnet(n) + SMALL:
        for config in sample:
            t = iobound.implicit_gemm_traffic(problem, config)
            assert iobound.direct_lower_bound(problem, t.fast_memory_words) <= t.total, (problem, config)
            comp = sum(iobound.compulsory_words(problem).values())
            assert comp <= t.total


def test_bound_below_unique_variant_small():
    rng = random.Random(3)
    for problem in SMALL + alexnet(1)[2:]:
        for config in [ig.DEFAULT] + rng.sample(VALID, 10):
            t = iobound.implicit_gemm_traffic(problem, config, unique=True)
            assert iobound.direct_lower_bound(problem, t.fast_memory_words) <= t.total_unique <= t.total


def test_bound_decreases_with_fast_memory():
    p = alexnet(1)[2]
    values = [iobound.direct_lower_bound(p, m) for m in (256, 1024, 4096, 16384)]
    assert all(a >= b for a, b in zip(values, values[1:]))
    assert values[-1] >= sum(iobound.compulsory_words(p).values())


def test_effective_stride():
    assert iobound.effective_stride(1, 1, 3) == 1
    assert iobound.effective_stride(4, 1, 11) == 4
    assert iobound.effective_stride(4, 1, 3) == 3    # a 3-wide window stepping by 4 skips a column
    assert iobound.effective_stride(2, 2, 3) == 1    # only even columns are ever read


@pytest.mark.parametrize("m", [720, 1680, 5040])
@pytest.mark.parametrize("r,u", [(3, 1), (5, 1), (11, 4), (3, 2)])
def test_balance_at_integer_optimum(m, r, u):
    best = min(((x, y, m // (x * y)) for x in range(1, m + 1) if m % x == 0
                for y in range(1, m // x + 1) if (m // x) % y == 0),
               key=lambda t: iobound.direct_tile_reads_per_mac(*t, r, r, u))
    x, y, z = best
    ratio = (x * y * u * u) / (z * r * r)
    assert 1 / 3 <= ratio <= 3, (best, ratio)  # x*y*u^2 = z*R*S up to divisor rounding
    continuous = 2 * u / math.sqrt(r * r * m)
    assert iobound.direct_tile_reads_per_mac(x, y, z, r, r, u) >= continuous * (1 - 1e-12)
    assert iobound.direct_tile_reads_per_mac(x, y, z, r, r, u) <= continuous * 1.2


def test_winograd_sanity():
    p = ConvProblem(n=32, c=256, h=56, w=56, k=256, r=3, s=3, padding=(1, 1))
    ms = (1024, 4096, 16384)
    for m in (2, 4, 6):
        vals = [iobound.winograd_lower_bound(p, m, 3, mm) for mm in ms]
        assert all(v > 0 for v in vals)
        assert all(a > b for a, b in zip(vals, vals[1:]))
    direct = iobound.direct_lower_bound(p, 4096)
    # F(4x4,3x3): (6/4)^2/3 = 0.75 of the direct core; F(2x2,3x3): (4/2)^2/3 = 1.33 of it
    assert iobound.winograd_lower_bound(p, 4, 3, 4096) < direct < iobound.winograd_lower_bound(p, 2, 3, 4096)
    with pytest.raises(ValueError, match="at stride 1"):  # conv2: 5x5 at stride 1
        iobound.winograd_lower_bound(alexnet(1)[1], 2, 3, 4096)
    with pytest.raises(ValueError, match="equal strides"):
        iobound.winograd_lower_bound(ConvProblem(n=1, c=4, h=9, w=9, k=4, r=3, s=3, stride=(2, 1)), 2, 3, 4096)


def test_prune_keeps_best_and_reports_cut():
    p = alexnet(128)[2]
    kept, pruned = iobound.prune(ig, VALID, p, factor=4.0)
    totals = {tuple(sorted(c.items())): iobound.implicit_gemm_traffic(p, c).total for c in VALID}
    best = min(totals, key=totals.get)
    assert dict(best) in kept
    assert len(kept) + len(pruned) == len(VALID) and pruned
    assert all(ratio > 4.0 for _, ratio in pruned)
    assert all(totals[tuple(sorted(c.items()))] <= 4.0 * totals[best] for c in kept)
    only, _ = iobound.prune("implicit_gemm", VALID, p, factor=1.0)
    assert dict(best) in only


def test_groups_refused():
    p = ConvProblem(n=1, c=4, h=8, w=8, k=4, r=3, s=3, groups=2)
    with pytest.raises(ValueError, match="groups"):
        iobound.implicit_gemm_traffic(p, ig.DEFAULT)


# ----------------------------------------------------------------------------------- implicit_gemm_tc
TC_VALID = tc.space().valid_configs()
# Multi-block shapes for the tc kernel: K and NPQ past one tile, CRS over many K-tiles (so split-K slices,
# empty trailing slices included, and the loader's carrying (c, r, s) counters are exercised), CRS % 4 both ways.
TC_SMALL = SMALL[:4] + [
    ConvProblem(n=2, c=5, h=10, w=9, k=70, r=3, s=3, padding=(1, 1)),
    ConvProblem(n=1, c=16, h=12, w=12, k=40, r=3, s=3, stride=(2, 2), padding=(1, 1), bias=False),
]


@pytest.mark.parametrize("problem", TC_SMALL, ids=lambda p: p.short())
def test_tc_model_equals_brute_force(problem):
    rng = random.Random(hash(problem.short()) % 1000)
    configs = [tc.DEFAULT] + rng.sample(TC_VALID, 4)
    # many empty split-K slices, one K-tile per slice, 32 threads (8 B rows per thread per tile); 512 threads
    # over BN=32 (16 rows per pass > BK=8: the loader's `row < BK` guard must skip the extra rows)
    configs += [{"BM": 32, "BN": 32, "BK": 8, "WM": 1, "WN": 1, "STAGES": 4, "SPLIT": 32},
                {"BM": 64, "BN": 32, "BK": 8, "WM": 4, "WN": 4, "STAGES": 3, "SPLIT": 4},
                {"BM": 128, "BN": 32, "BK": 32, "WM": 4, "WN": 2, "STAGES": 2, "SPLIT": 2}]
    for config in configs:
        assert tc.space().is_valid(config), config
        model = iobound.implicit_gemm_tc_traffic(problem, config)
        brute = iobound_oracles.brute_force_tc_traffic(problem, config)
        assert model == brute, (config, model, brute)


def test_tc_split_k_terms():
    p = TC_SMALL[4]
    one = iobound.traffic(tc, p, dict(tc.DEFAULT, SPLIT=1))
    four = iobound.traffic(tc, p, dict(tc.DEFAULT, SPLIT=4))
    out = p.k * p.n * p.out_hw[0] * p.out_hw[1]
    # split-K moves the same operands and adds the memset and 4 read-modify-writes per output element
    assert (four.words_read_input, four.words_read_weight) == (one.words_read_input, one.words_read_weight)
    assert one.words_written == out and one.words_read_output == 0 and one.words_memset == 0
    assert four.words_memset == out and four.words_read_output == 4 * out and four.words_written == 5 * out
    assert four.total - one.total == 8 * out


# ----------------------------------------------------------------------------------- implicit_gemm_wgmma
WGMMA_VALID = wgk.space().valid_configs()
# K past one 64-channel block and off every instruction width, N*P*Q past one 64/128-pixel block, C*R*S over many
# 32-row tiles (split-K slices, empty trailing ones, the shared row cursors' carries) and C*R*S % 4 both ways
# (the weights' 16-byte and 4-byte copies), stride, padding and dilation.
WGMMA_SMALL = [
    ConvProblem(n=2, c=5, h=10, w=9, k=70, r=3, s=3, padding=(1, 1)),
    ConvProblem(n=1, c=16, h=12, w=12, k=40, r=3, s=3, stride=(2, 2), padding=(1, 1), bias=False),
    ConvProblem(n=1, c=3, h=15, w=13, k=9, r=5, s=5, stride=(2, 2), padding=(2, 2), dilation=(1, 1)),
    ConvProblem(n=1, c=8, h=9, w=11, k=130, r=1, s=1),
    ConvProblem(n=1, c=4, h=11, w=11, k=20, r=3, s=3, padding=(2, 2), dilation=(2, 2)),
    ConvProblem(n=1, c=3, h=17, w=16, k=12, r=7, s=7, stride=(2, 2), padding=(3, 3)),  # R*S > 32: no channel carry
    ConvProblem(n=1, c=6, h=9, w=14, k=10, r=1, s=7, stride=(1, 2), padding=(0, 3)),
    ConvProblem(n=2, c=5, h=12, w=9, k=17, r=3, s=5, stride=(2, 1), padding=(1, 2), dilation=(1, 2)),
]


@pytest.mark.parametrize("problem", WGMMA_SMALL, ids=lambda p: p.short())
def test_wgmma_model_equals_brute_force(problem):
    rng = random.Random(zlib.crc32(problem.short().encode()))  # the same sample in every process (xdist workers)
    small = [c for c in WGMMA_VALID if c["WN"] * c["NB"] <= 128]
    configs = [wgk.DEFAULT, wgk.default_for(problem)] + rng.sample(small, 2)
    configs += [{"WN": 64, "NB": 1, "WG": 1, "STAGES": 3, "SPLIT": 16},   # many empty slices, 128 threads
                {"WN": 64, "NB": 2, "WG": 2, "STAGES": 4, "SPLIT": 2}]
    for config in configs:
        assert wgk.space().is_valid(config), config
        model = iobound.implicit_gemm_wgmma_traffic(problem, config)
        brute = iobound_oracles.brute_force_wgmma_traffic(problem, config)
        assert model == brute, (config, model, brute)


def test_wgmma_bound_below_every_config():
    for problem in alexnet(32) + WGMMA_SMALL:
        for config in WGMMA_VALID[::4] + [wgk.DEFAULT]:
            t = iobound.traffic("implicit_gemm_wgmma", problem, config)
            assert t.fast_memory_words == iobound.fast_memory_words(wgk, config)
            assert iobound.direct_lower_bound(problem, t.fast_memory_words) <= t.total, (problem, config)


# ------------------------------------------------------------------------------- implicit_gemm_tma_tf32
TMA_SMALL = [  # C % 4 == 0 (the family's rule): C below, at and past one 32-channel tile; K and N*P*Q off the tiles
    ConvProblem(n=2, c=8, h=10, w=9, k=70, r=3, s=3, padding=(1, 1), tf32=True),
    ConvProblem(n=1, c=36, h=12, w=11, k=40, r=3, s=3, stride=(2, 2), padding=(1, 1), bias=False, tf32=True),
    ConvProblem(n=1, c=4, h=15, w=13, k=9, r=5, s=5, stride=(2, 2), padding=(2, 2), tf32=True, layout="nhwc"),
    ConvProblem(n=2, c=12, h=12, w=9, k=17, r=3, s=5, stride=(2, 1), padding=(1, 2), dilation=(1, 2), tf32=True),
    ConvProblem(n=1, c=128, h=7, w=7, k=130, r=1, s=1, tf32=True, layout="nhwc"),
]


@pytest.mark.parametrize("problem", TMA_SMALL, ids=lambda p: p.short())
def test_tma_tf32_model_equals_brute_force(problem):
    from bagf_torch.kernels import implicit_gemm_tma_tf32 as tt

    rng = random.Random(zlib.crc32(problem.short().encode()))
    nhwc = int(problem.layout == "nhwc")
    valid = [c for c in tt.space().valid_configs() if c["NHWC"] == nhwc and tt.problem_rule(c, problem) is None]
    configs = [tt.default_for(problem)] + rng.sample([c for c in valid if c["WN"] <= 128], 3)
    configs += [c for c in valid if c["SPLIT"] > 1][:1] + [c for c in valid if c["SK"]][:1]
    configs += [dict(tt.default_for(problem), SK=1, SPLIT=1)]  # (a tile shared by several blocks: few k tiles each)
    configs += [c for c in valid if c["CR"]][:1]  # (split-K in clusters: no workspace traffic)
    configs += [dict(tt.default_for(problem), SK=2, SPLIT=1), dict(tt.default_for(problem), SK=2, SPLIT=1, WN=64, WG=1)]
    assert any(c["SPLIT"] > 1 for c in configs) and any(c["CR"] for c in configs)
    assert {1, 2} <= {c["SK"] for c in configs}
    for config in configs:
        model = iobound.implicit_gemm_tma_tf32_traffic(problem, config)
        brute = iobound_oracles.brute_force_tma_tf32_traffic(problem, config)
        assert model == brute, (config, model, brute)


def test_tma_tf32_bound_below_every_config():
    from bagf_torch.kernels import implicit_gemm_tma_tf32 as tt

    valid = tt.space().valid_configs()
    for problem in [dataclasses.replace(p, tf32=True) for p in alexnet(32)[1:]] + TMA_SMALL:
        for config in valid[::5]:
            if tt.problem_rule(config, problem) is not None:
                continue
            t = iobound.traffic("implicit_gemm_tma_tf32", problem, config)
            assert t.fast_memory_words == iobound.fast_memory_words(tt, config)
            assert iobound.direct_lower_bound(problem, t.fast_memory_words) <= t.total, (problem, config)


@pytest.mark.parametrize("n", [1, 128])
def test_tc_bound_below_every_config(n):
    for problem in alexnet(n) + TC_SMALL:
        for config in TC_VALID[::3] + [tc.DEFAULT]:
            t = iobound.traffic("implicit_gemm_tc", problem, config)
            assert t.fast_memory_words == iobound.fast_memory_words(tc, config)
            assert iobound.direct_lower_bound(problem, t.fast_memory_words) <= t.total, (problem, config)


@pytest.mark.parametrize("problem", [
    ConvProblem(n=2, c=8, h=18, w=18, k=256, r=3, s=3),   # no padding: every im2col element is read
    ConvProblem(n=2, c=16, h=16, w=16, k=128, r=1, s=1),
], ids=lambda p: p.short())
def test_tc_balance(problem):
    """Implicit GEMM reads R*S input words per (pixel, channel) (no halo reuse), so docs/architecture.md's balance
    x*y*e^2 = z*R*S with e^2 = R*S reads x*y = z: BN (pixels) = BM (channels). Among SPLIT=1 tiles of the
    same accumulator size BM*BN, the minimum-traffic tile is square up to the factor-2 grid of the space."""
    p, q = problem.out_hw
    assert (problem.n * p * q) % 128 == 0 and problem.k % 128 == 0  # no partial tiles: rounding stays out
    by_area: dict[int, list] = {}
    for c in TC_VALID:
        if c["SPLIT"] == 1:
            by_area.setdefault(c["BM"] * c["BN"], []).append(c)
    checked = 0
    for area, configs in by_area.items():
        best = min(configs, key=lambda c: iobound.traffic(tc, problem, c).total)
        x_y, z = best["BN"], best["BM"]
        ratio = x_y * problem.r * problem.s / (z * problem.r * problem.s)
        if math.isqrt(area) ** 2 == area and math.isqrt(area) in tc.PARAMS["BM"]:
            assert ratio == 1, (area, best)
            checked += 1
        else:
            assert 0.5 <= ratio <= 2, (area, best)
    assert checked >= 2


def test_tc_prune_keeps_best_and_always():
    p = alexnet(1)[3]
    totals = {tuple(sorted(c.items())): iobound.traffic(tc, p, c).total for c in TC_VALID}
    best = min(totals, key=totals.get)
    worst = max(totals, key=totals.get)
    kept, pruned = iobound.prune(tc, TC_VALID, p, factor=1.5, always=[dict(worst)])
    assert dict(best) in kept and dict(worst) in kept
    assert len(kept) + len(pruned) == len(TC_VALID) and pruned
    assert all(ratio > 1.5 for _, ratio in pruned)
    kept_all, none = iobound.prune(tc, TC_VALID, p, factor=totals[worst] / totals[best])
    assert not none and len(kept_all) == len(TC_VALID)


def test_unknown_family_refused():
    with pytest.raises(ValueError, match="no traffic model"):
        iobound.traffic("winograd_f4", alexnet(1)[2], {})
    assert iobound.has_model(tc) and iobound.has_model("implicit_gemm") and not iobound.has_model("toy")


def test_layer_analysis_reports_roofline_and_traffic_against_the_bound():
    from bagf_torch.kernels import implicit_gemm_tc as tc
    from bagf_torch.report import Ceilings, layer_analysis

    p = ConvProblem(n=1, c=384, h=13, w=13, k=256, r=3, s=3, padding=(1, 1))
    ceil = Ceilings(flops=50e12, bandwidth=4e12)
    a = layer_analysis(p, 30.0, ceil, tc.FAMILY, tc.default_for(p))
    assert a["tflops"] == pytest.approx(2 * p.macs / 30e-6 / 1e12)
    assert a["roofline_tflops"] <= 50 and 0 < a["fraction_of_roofline"] and a["fraction_of_peak"] <= 1
    assert a["traffic_over_bound"] >= 1.0 and a["lower_bound_words"] > 0
    cudnn = layer_analysis(p, 86.8, ceil)  # no family: no traffic columns
    assert "traffic_words" not in cudnn and cudnn["fraction_of_roofline"] < a["fraction_of_roofline"]


# ------------------------------------------------------------------------------------------- winograd
WG_VALID = wg.space().valid_configs()
# Odd small 3x3 stride-1 shapes: C not a multiple of BC, K not a multiple of BK, P and Q not multiples of MT,
# padding 0, 1, 2 and mixed, with and without bias, partial tile blocks.
WG_SMALL = [
    ConvProblem(n=2, c=5, h=7, w=9, k=19, r=3, s=3, padding=(1, 1)),
    ConvProblem(n=1, c=11, h=6, w=5, k=3, r=3, s=3, bias=False),
    ConvProblem(n=1, c=3, h=5, w=8, k=33, r=3, s=3, padding=(2, 1)),
    ConvProblem(n=2, c=9, h=5, w=6, k=17, r=3, s=3, padding=(2, 2), bias=False),
    ConvProblem(n=1, c=13, h=9, w=7, k=20, r=3, s=3, padding=(0, 2)),
]
# 3x3 layers the family is for: AlexNet conv3-5 and two ResNet-like ones.
WG_LAYERS = [p for n in (1, 128) for p in alexnet(n)[2:]] + [
    ConvProblem(n=1, c=256, h=56, w=56, k=256, r=3, s=3, padding=(1, 1)),
    ConvProblem(n=1, c=512, h=7, w=7, k=512, r=3, s=3, padding=(1, 1)),
]
WG_CASES = [  # every one valid; the comments say what each exercises
    {"MT": 2, "BK": 16, "BT": 16, "BC": 4, "TK": 2, "TT": 2, "EG": 4, "DB": 1, "SPLIT": 4},    # C=5: slices 2, 3 empty
    {"MT": 4, "BK": 16, "BT": 16, "BC": 4, "TK": 2, "TT": 2, "EG": 4, "DB": 0, "SPLIT": 16},   # most slices empty
    {"MT": 2, "BK": 16, "BT": 32, "BC": 4, "TK": 4, "TT": 4, "EG": 8, "DB": 1, "SPLIT": 2},    # uneven slices (C=11, 13)
    {"MT": 2, "BK": 32, "BT": 64, "BC": 4, "TK": 2, "TT": 4, "EG": 1, "DB": 0, "SPLIT": 1},    # output stage in 8 rounds
    {"MT": 4, "BK": 16, "BT": 16, "BC": 16, "TK": 2, "TT": 2, "EG": 2, "DB": 0, "SPLIT": 1},   # one chunk covers C
]


def test_winograd_cases_cover_what_they_say():
    assert all(wg.space().is_valid(c) for c in WG_CASES)
    assert wg.out_rounds(WG_CASES[3]) == 8
    # the shared-memory part of the fast memory is the allocation, at least the loop's buffers
    for c in WG_VALID:
        e = wg.points(c)
        shared = iobound.fast_memory_words(wg, c) - e * c["BK"] * c["BT"]
        assert shared == wg.smem_bytes(c) // 4 >= e * c["BC"] * (c["BK"] + 4 + c["BT"] + 4), c


@pytest.mark.parametrize("problem", WG_SMALL, ids=lambda p: p.short())
def test_winograd_model_equals_brute_force(problem):
    rng = random.Random(hash(problem.short()) % 1000)
    configs = [wg.DEFAULT, wg.default_for(problem)] + WG_CASES + rng.sample(WG_VALID, 25)
    for config in configs:
        model = iobound.winograd_traffic(problem, config)
        brute = iobound_oracles.brute_force_winograd_traffic(problem, config)
        assert model == brute, (config, model, brute)
        assert model == iobound.traffic("winograd", problem, config)


@pytest.mark.parametrize("problem", WG_SMALL[:3], ids=lambda p: p.short())
def test_winograd_tc_model_equals_brute_force(problem):
    """winograd_tc runs winograd.cuh's channel loop and output stage (wino::channel_loop, output_round) with
    its own thread count and output rounds: the brute force walks it with those."""
    from bagf_torch.kernels import winograd_tc as wt

    valid = wt.space().valid_configs()
    multi_round = [c for c in valid if wt.out_rounds(c) > 1][:2]
    configs = [wt.DEFAULT, wt.default_for(problem)] + multi_round + random.Random(7).sample(valid, 12)
    for config in configs:
        model = iobound.traffic("winograd_tc", problem, config)
        assert model == iobound_oracles.brute_force_winograd_traffic(problem, config, wt), config
        assert model.fast_memory_words == wt.smem_bytes(config) // 4 + wt.points(config) * config["BK"] * config["BT"]
        fused = iobound.winograd_lower_bound(problem, config["MT"], 3, model.fast_memory_words, fused=True)
        assert fused <= model.total


def test_winograd_terms():
    # No padding and P, Q multiples of MT: every A x A patch is inside the image, so the input is read
    # (A/MT)^2 times per block row (the halo overlap) and the grid's rows multiply that.
    p = ConvProblem(n=2, c=6, h=10, w=14, k=40, r=3, s=3)  # P x Q = 8 x 12
    out = p.k * p.n * 8 * 12
    for mt in (2, 4):
        c = dict(wg.DEFAULT, MT=mt, BK=16, SPLIT=1)
        t = iobound.traffic(wg, p, c)
        tiles = p.n * (8 // mt) * (12 // mt)
        assert t.grid == (-(-tiles // c["BT"]), 3, 1)
        assert t.words_read_input * mt * mt == 3 * (mt + 2) ** 2 * p.n * p.c * 8 * 12
        assert t.words_read_weight == t.grid[0] * 9 * p.k * p.c
        assert t.words_read_bias == tiles * p.k and t.words_written == out
        four = iobound.traffic(wg, p, dict(c, SPLIT=4))
        assert (four.words_read_input, four.words_read_weight, four.words_read_bias) == \
               (t.words_read_input, t.words_read_weight, t.words_read_bias)
        assert four.words_memset == out and four.words_read_output == 4 * out and four.words_written == 5 * out
        assert four.total - t.total == 8 * out and four.blocks == 4 * t.blocks
    assert iobound.winograd_traffic(p, dict(wg.DEFAULT, BC=16)).fast_memory_words == \
        16 * 16 * (32 + 4 + 32 + 4) + 16 * 32 * 32
    with pytest.raises(ValueError, match="stride-1"):
        iobound.winograd_traffic(alexnet(1)[0], wg.DEFAULT)


def test_winograd_traffic_is_fast_enough_for_the_whole_space():
    import time

    start = time.perf_counter()
    for c in WG_VALID:
        iobound.winograd_traffic(WG_LAYERS[-2], c)
    assert time.perf_counter() - start < 2.0, len(WG_VALID)


def test_winograd_direct_bound_below_every_config():
    """As the other families' tests phrase "never below the bound": the direct bound (and the compulsory
    traffic) never exceeds any configuration's modelled traffic, over the whole valid space. Winograd does
    fewer multiplies than direct convolution, so this is not implied by theory; it holds for this kernel
    because its accumulators take E*BK*BT of the fast memory M (docs/iobound.md)."""
    for problem in WG_LAYERS + WG_SMALL:
        comp = sum(iobound.compulsory_words(problem).values())
        for config in WG_VALID:
            t = iobound.winograd_traffic(problem, config)
            assert iobound.direct_lower_bound(problem, t.fast_memory_words) <= t.total, (problem, config)
            assert comp <= t.total, (problem, config)


def test_winograd_bound_below_every_config_with_many_tiles():
    """winograd_lower_bound(problem, MT, 3, M) <= modelled traffic for every configuration on the problems
    with many tiles per grid row. It does NOT hold on problems with few tiles: see the xfail below."""
    for problem in [p for p in WG_LAYERS if p.n == 128] + [WG_LAYERS[-2]]:
        for config in WG_VALID:
            t = iobound.winograd_traffic(problem, config)
            assert iobound.winograd_lower_bound(problem, config["MT"], 3, t.fast_memory_words) <= t.total, \
                (problem.short(), config)


def test_fused_winograd_bound_below_every_config_on_every_problem():
    """The fused form of the bound (max with the compulsory reads, not a sum) holds for the fused kernel on
    every problem, few-tile ones included; the summed (unfused pipeline) form does not: on a one-tile
    problem the kernel moves exactly the compulsory words, which the summed form exceeds."""
    p = ConvProblem(n=1, c=64, h=3, w=3, k=64, r=3, s=3)  # one 1x1 output tile per image
    c = {"MT": 2, "BK": 64, "BT": 16, "BC": 4, "TK": 4, "TT": 2, "EG": 1, "DB": 0, "SPLIT": 1}
    assert wg.space().is_valid(c)
    t = iobound.winograd_traffic(p, c)
    assert t.total == sum(iobound.compulsory_words(p).values())  # nothing can move less
    assert iobound.winograd_lower_bound(p, 2, 3, t.fast_memory_words, fused=True) <= t.total
    assert iobound.winograd_lower_bound(p, 2, 3, t.fast_memory_words) > t.total
    for problem in WG_LAYERS + [p]:
        for config in WG_VALID:
            t = iobound.winograd_traffic(problem, config)
            bound = iobound.winograd_lower_bound(problem, config["MT"], 3, t.fast_memory_words, fused=True)
            assert bound <= t.total, (problem.short(), config)


def test_winograd_prune():
    p = alexnet(1)[3]
    totals = {tuple(sorted(c.items())): iobound.traffic(wg, p, c).total for c in WG_VALID}
    best = min(totals, key=totals.get)
    kept, pruned = iobound.prune("winograd", WG_VALID, p, factor=2.0, always=[wg.DEFAULT])
    assert dict(best) in kept and wg.DEFAULT in kept and pruned
    assert len(kept) + len(pruned) == len(WG_VALID)
    assert all(ratio > 2.0 for _, ratio in pruned)
    assert iobound.has_model(wg) and iobound.fast_memory_words(wg, wg.DEFAULT) == \
        iobound.winograd_fast_memory_words(wg.DEFAULT)


# --------------------------------------------------------------------------------------------- direct
from bagf_torch.kernels import direct as dr  # noqa: E402

DR_VALID = dr.space().valid_configs()
# Odd small shapes for the direct family: strides 1-4, an 11x11 stride-4 filter, dilation, 1x1, partial tiles in
# both directions, C not a multiple of BC (uneven and empty slices), K not a multiple of BK, bias or not.
DR_SMALL = [
    ConvProblem(n=2, c=3, h=9, w=7, k=5, r=3, s=3, padding=(1, 1)),
    ConvProblem(n=1, c=5, h=23, w=19, k=70, r=11, s=11, stride=(4, 4), padding=(2, 2)),
    ConvProblem(n=1, c=4, h=10, w=9, k=17, r=3, s=3, padding=(2, 1), dilation=(2, 3), bias=False),
    ConvProblem(n=2, c=9, h=6, w=6, k=9, r=1, s=1, stride=(2, 2)),
    ConvProblem(n=1, c=2, h=12, w=13, k=4, r=2, s=5, stride=(3, 2), dilation=(2, 1), padding=(1, 0)),
]
DR_CASES = [  # valid; the comments say what each exercises
    {"TH": 2, "TW": 32, "BK": 16, "BC": 2, "TK": 4, "PX": 4, "DB": 1, "SPLIT": 8, "G": 0},   # most slices empty
    {"TH": 16, "TW": 4, "BK": 32, "BC": 4, "TK": 8, "PX": 2, "DB": 0, "SPLIT": 2, "G": 0},   # tall tile, uneven slices
    {"TH": 8, "TW": 8, "BK": 16, "BC": 8, "TK": 4, "PX": 4, "DB": 0, "SPLIT": 1, "G": 0},    # one chunk covers most C
]


@pytest.mark.parametrize("problem", DR_SMALL, ids=lambda p: p.short())
def test_direct_model_equals_brute_force(problem):
    rng = random.Random(hash(problem.short()) % 1000)
    small = [c for c in DR_VALID if dr.threads(c) <= 256]
    configs = [dr.DEFAULT, dr.default_for(problem)] + DR_CASES + rng.sample(small, 6)
    for config in configs:
        assert dr.space().is_valid(config), config
        model = iobound.direct_traffic(problem, config)
        brute = iobound_oracles.brute_force_direct_traffic(problem, config)
        assert model == brute, (config, model, brute)
        assert model == iobound.traffic("direct", problem, config)


def test_direct_terms():
    """The counts that make the family near-I/O-optimal: conv1's input is read once per block row of channels
    (times the halo overlap), weights once per tile; the fast memory is the problem's shared memory."""
    p = alexnet(1)[0]
    c = dr.DEFAULT
    t = iobound.direct_traffic(p, c)
    assert t.grid == (7 * 4, 1, 1) and t.words_read_weight == 28 * 64 * 3 * 121
    assert t.fast_memory_words == dr.smem_bytes(c, p) // 4 + 64 * 8 * 16 == iobound.fast_memory_words(dr, c)
    # 39 x 71 patches of 8 x 16 tiles: the overlap of neighbouring halos is ~1.3x the input at conv1
    assert 1.0 < t.words_read_input / iobound.used_input_words(p) < 1.5
    assert iobound.direct_traffic(p, dict(c, SPLIT=4)).words_read_output == 4 * 64 * 55 * 55
    with pytest.raises(ValueError, match="groups=1"):
        iobound.direct_traffic(ConvProblem(n=1, c=4, h=9, w=9, k=4, r=3, s=3, groups=2), c)


def test_direct_bound_below_every_config():
    """direct_lower_bound(problem, M) and the compulsory traffic never exceed any configuration's modelled
    traffic, over the whole valid space, on AlexNet conv1-2 (N=1, 32) and the odd small shapes."""
    for problem in [p for n in (1, 32) for p in alexnet(n)[:2]] + DR_SMALL:
        comp = sum(iobound.compulsory_words(problem).values())
        for config in DR_VALID:
            t = iobound.direct_traffic(problem, config)
            assert iobound.direct_lower_bound(problem, t.fast_memory_words) <= t.total, (problem, config)
            assert comp <= t.total, (problem, config)


def test_direct_prune_keeps_default():
    p = alexnet(1)[0]
    kept, pruned = iobound.prune("direct", DR_VALID, p, factor=2.0, always=[dr.DEFAULT])
    assert dr.DEFAULT in kept and len(kept) + len(pruned) == len(DR_VALID) and pruned


# -------------------------------------------------------------------------------------------- winograd_gemm
from bagf_torch.kernels import winograd_gemm as wgg  # noqa: E402

WGG_VALID = wgg.space().valid_configs()
# Odd small 3x3 stride-1 shapes: P, Q not multiples of MT (either), padding 0, 1, 2 and mixed, bias or not,
# N up to 3; the last one has K = 130 and, for MT=2, T = 192, so the modelled GEMM has 2 blocks along each side.
WGG_SMALL = [
    ConvProblem(n=2, c=5, h=7, w=9, k=19, r=3, s=3, padding=(1, 1)),
    ConvProblem(n=3, c=3, h=6, w=5, k=3, r=3, s=3, bias=False),
    ConvProblem(n=1, c=9, h=5, w=8, k=13, r=3, s=3, padding=(2, 1)),
    ConvProblem(n=2, c=11, h=5, w=6, k=7, r=3, s=3, padding=(2, 2), bias=False),
    ConvProblem(n=3, c=2, h=17, w=15, k=130, r=3, s=3, padding=(0, 1)),
    # strided, through the polyphase components: conv1-like 11x10 at stride 4, 5x5 at stride 2 without bias
    ConvProblem(n=2, c=3, h=23, w=21, k=5, r=11, s=10, stride=(4, 4), padding=(2, 1)),
    ConvProblem(n=1, c=2, h=13, w=11, k=3, r=5, s=5, stride=(2, 2), padding=(2, 2), bias=False),
]
# AlexNet conv1 (polyphase) and conv3-5, ResNet-like 3x3 layers (64@56, 128@28, 256@14, 512@7 and 256@56),
# N = 1, 32, 128.
WGG_LAYERS = [p for n in (1, 32, 128) for i, p in enumerate(alexnet(n)) if i != 1] + [
    ConvProblem(n=n, c=c, h=h, w=h, k=c, r=3, s=3, padding=(1, 1))
    for n in (1, 32) for c, h in ((64, 56), (128, 28), (256, 14), (512, 7), (256, 56))]


@pytest.mark.parametrize("problem", WGG_SMALL, ids=lambda p: p.short())
def test_winograd_gemm_model_equals_brute_force(problem):
    """Every MT, VL, ML and GEMM (our seven tiles and cuBLAS's modelled one), and TB but on the largest shape,
    where one TB keeps the replay short."""
    configs = WGG_VALID if problem.k < 100 else [c for c in WGG_VALID if c["TB"] == 64]
    assert {(c["MT"], c["VL"], c["ML"]) for c in configs} == {(m, v, l) for m in wgg.PARAMS["MT"] for v in (0, 1) for l in (0, 1)}
    assert {c["GE"] for c in configs} == set(wgg.PARAMS["GE"])
    for config in configs:
        model = iobound.winograd_gemm_traffic(problem, config)
        brute = iobound_oracles.brute_force_winograd_gemm_traffic(problem, config)
        assert model == brute, (config, model, brute)
        assert model == iobound.traffic("winograd_gemm", problem, config)


def test_winograd_gemm_terms():
    # No padding and P, Q multiples of MT: every patch inside the image, so stage 1 reads the input (A/MT)^2
    # times; the workspaces are the host's allocations; the modelled GEMM re-reads U ceil(T/128) times and
    # V ceil(K/128) times per point; layouts and block size change no count.
    p = ConvProblem(n=3, c=6, h=18, w=14, k=200, r=3, s=3)  # P x Q = 16 x 12
    for mt in (2, 4):
        e, tiles = (mt + 2) ** 2, 3 * (16 // mt) * (12 // mt)
        c = dict(wgg.DEFAULT, MT=mt, GE=0)
        t = iobound.traffic(wgg, p, c)
        assert t.words_read_input * mt * mt == (mt + 2) ** 2 * p.n * p.c * 16 * 12
        assert t.words_read_weight == 9 * p.k * p.c and t.words_read_bias == p.k * tiles
        assert t.words_written == p.k * p.n * 16 * 12 and t.words_read_output == t.words_memset == 0
        assert dict(t.workspace_written) == wgg.workspace_words(c, p)
        gemm_blocks = -(-tiles // 128) * 2
        assert dict(t.workspace_read) == {"U": e * p.k * p.c * -(-tiles // 128), "V": e * p.c * tiles * 2,
                                          "M": e * p.k * tiles}
        assert t.grid == (-(-p.k * p.c // 256), -(-p.c * tiles // 256), e * gemm_blocks, -(-p.k * tiles // 256))
        assert t.total == (t.words_read_input + t.words_read_weight + t.words_read_bias + t.words_written
                           + t.words_written_workspace + t.words_read_workspace)
        for other in WGG_VALID:
            if other["MT"] == mt and other["GE"] == 0:
                assert iobound.traffic(wgg, p, other).total == t.total, other
        # our GEMM (GE > 0): its own block tile re-reads U ceil(T/BN) and V ceil(K/BM) times per point
        for ge, (bm, bn, bk, _, _, stages, _) in wgg.GEMMS.items():
            g = iobound.traffic(wgg, p, dict(c, GE=ge))
            assert dict(g.workspace_read) == {"U": e * p.k * p.c * -(-tiles // bn), "V": e * p.c * tiles * -(-p.k // bm),
                                              "M": e * p.k * tiles}
            assert g.grid[2] == e * -(-tiles // bn) * -(-p.k // bm)
            assert g.fast_memory_words == bm * bn + stages * bk * (bm + bn)
        # the wgmma GEMM (GE 6-7): stage 0 writes U's small parts as E more batches, which the GEMM reads
        # with U (two A panels per block), and its block holds both planes
        for ge, (wn, nb, wgs, stages) in wgg.WGMMA_GEMMS.items():
            bm, bn = wn * nb, 64 * wgs
            cw = dict(c, GE=ge)
            g = iobound.traffic(wgg, p, cw)
            assert dict(g.workspace_written) == wgg.workspace_words(cw, p) == {
                "U": 2 * e * p.k * p.c, "V": e * p.c * tiles, "M": e * p.k * tiles}
            assert dict(g.workspace_read) == {"U": 2 * e * p.k * p.c * -(-tiles // bn),
                                              "V": e * p.c * tiles * -(-p.k // bm), "M": e * p.k * tiles}
            assert g.fast_memory_words == bm * bn + stages * 32 * (2 * bm + bn)
            assert wgg.launch(cw).layout == 4 and wgg.launch(dict(c, GE=1)).layout == 0
        # staged stage 2 (SO = 1): the same words, a block per (k, TB // tiles-per-image whole images)
        staged = iobound.traffic(wgg, p, dict(c, SO=1))
        per_img = (16 // mt) * (12 // mt)
        assert staged.total == t.total and wgg.launch(dict(c, SO=1)).layout == 8
        assert staged.grid[3] == p.k * -(-p.n // (256 // per_img)) and staged.grid[:3] == t.grid[:3]
        big = ConvProblem(n=2, c=6, h=66, w=66, k=8, r=3, s=3)  # (64/MT)^2 > 128 tiles per image: per tile
        assert wgg.staged_images(dict(c, SO=1, TB=128), big) == 0
        assert iobound.traffic(wgg, big, dict(c, SO=1, TB=128)).grid[3] == -(-8 * 2 * (64 // mt) ** 2 // 128)
    cublas = dict(wgg.DEFAULT, GE=0)
    assert iobound.fast_memory_words("winograd_gemm", cublas) == 128 * 128 + 2 * 8 * 256 == \
        iobound.traffic(wgg, p, cublas).fast_memory_words
    # the fused families have no workspace: their totals are what they were
    fused = iobound.winograd_traffic(p, wg.DEFAULT)
    assert fused.workspace_written == fused.workspace_read == () and fused.words_read_workspace == 0
    with pytest.raises(ValueError, match="stride-1"):
        iobound.winograd_gemm_traffic(alexnet(1)[1], wgg.DEFAULT)  # conv2, 5x5 at stride 1


def test_winograd_gemm_polyphase_terms():
    # conv1 (11x11, stride 4, C = 3) runs over C' = 48 polyphase channels: the workspaces and the GEMM's reads
    # are those of the 3x3 problem over 48 channels; the filters are read once (121 taps per (k, c), not 9 per
    # (k, c')); each component reads only its in-bounds rows and columns.
    p = alexnet(32)[0]
    q3 = ConvProblem(n=32, c=48, h=57, w=57, k=64, r=3, s=3)  # the polyphase problem, 55 x 55 outputs
    assert p.out_hw == q3.out_hw == (55, 55) and wgg.channels(p) == 48 and wgg.applies(p) is None
    for config in (wgg.DEFAULT, dict(wgg.DEFAULT, MT=5, GE=6, SO=1, TB=128)):
        t, t3 = iobound.traffic(wgg, p, config), iobound.traffic(wgg, q3, config)
        assert t.workspace_written == t3.workspace_written and t.workspace_read == t3.workspace_read
        assert dict(t.workspace_written) == wgg.workspace_words(config, p)
        assert t.grid == t3.grid and t.words_written == t3.words_written
        assert t.words_read_weight == 64 * 3 * 121
        # rows s*(tile*MT + a) + ph - 2 in [0, 224): per component, the A-row patches of ceil(55/MT) tiles
        mt, a = config["MT"], config["MT"] + 2
        rows = sum(0 <= 4 * (ti * mt + i) + ph - 2 < 224 for ph in range(4) for ti in range(-(-55 // mt))
                   for i in range(a))
        assert t.words_read_input == 32 * 3 * rows * rows
        # the bound: the polyphase problem's core term (C' = 48), the real problem's compulsory words
        bound = iobound.winograd_lower_bound(p, mt, 3, t.fast_memory_words)
        bound3 = iobound.winograd_lower_bound(q3, mt, 3, t.fast_memory_words)
        comp, comp3 = iobound.compulsory_words(p), iobound.compulsory_words(q3)
        assert bound <= t.total
        assert bound - bound3 == pytest.approx(sum(comp.values()) - sum(comp3.values()))
    with pytest.raises(ValueError, match="at most 8x8"):
        iobound.winograd_lower_bound(alexnet(1)[0], 4, 2, 8192)



def test_winograd_gemm_bound_below_every_config():
    """The unfused winograd_lower_bound (the summed form: this pipeline stores its transformed operands) at
    the modelled GEMM's fast memory never exceeds the modelled traffic, over the whole space."""
    for problem in WGG_LAYERS + WGG_SMALL:
        for config in WGG_VALID:
            t = iobound.winograd_gemm_traffic(problem, config)
            bound = iobound.winograd_lower_bound(problem, config["MT"], 3, t.fast_memory_words, fused=False)
            assert bound <= t.total, (problem.short(), config)


def test_winograd_gemm_prune_keeps_default_and_minimum():
    # conv3 at N=1 (16 F(4x4) tiles): U (E*K*C words, written and read) dominates and F(2x2)'s is 16/36 of
    # F(4x4)'s, so the minimum is an MT=2 configuration, not the DEFAULT; at N=128 it is F(5x5) (3 x 3 tiles of 49
    # points on the 13x13 map: 441 per channel pair against F(4x4)'s and F(6x6)'s 576)
    for p, best_mt in ((alexnet(1)[2], 2), (alexnet(128)[2], 5)):
        totals = {tuple(sorted(c.items())): iobound.traffic("winograd_gemm", p, c).total for c in WGG_VALID}
        best = min(totals, key=totals.get)
        assert dict(best)["MT"] == best_mt
        kept, pruned = iobound.prune(wgg, WGG_VALID, p, factor=1.0, always=[wgg.DEFAULT])
        assert dict(best) in kept and wgg.DEFAULT in kept
        assert len(kept) + len(pruned) == len(WGG_VALID) and pruned
        assert all(ratio > 1.0 for _, ratio in pruned)
    assert iobound.has_model(wgg) and iobound.has_model("winograd_gemm")


def test_layer_analysis_takes_winograd_gemm():
    from bagf_torch.report import Ceilings, layer_analysis

    p = alexnet(32)[3]
    a = layer_analysis(p, 300.0, Ceilings(flops=50e12, bandwidth=4e12), wgg.FAMILY, wgg.DEFAULT)
    assert a["traffic_words"] == iobound.traffic(wgg, p, wgg.DEFAULT).total and a["traffic_over_bound"] >= 1.0
    # conv1 through the polyphase form: against the direct bound and its own (polyphase, unfused) bound
    c1 = alexnet(32)[0]
    a = layer_analysis(c1, 100.0, Ceilings(flops=50e12, bandwidth=4e12), wgg.FAMILY, dict(wgg.DEFAULT, MT=5))
    assert a["traffic_over_bound"] >= 1.0 and a["traffic_over_winograd_bound"] >= 1.0
    assert a["winograd_bound_form"] == "unfused"
