"""The TF32 TMA implicit-GEMM family's space, start point, problem rule and launch (CPU); its kernel is checked on the
GPU by tests/test_gpu.py (odd shapes NCHW and channels_last within twice cuDNN's TF32 error, split-K, CUDA graphs)
and compiled by tests/test_nvcc.py."""

import math

import torch
import torch.nn.functional as F

from bagf_torch.kernels import FAMILIES, family_refuses, format_refuses
from bagf_torch.kernels import implicit_gemm_tma_h16 as th
from bagf_torch.kernels import implicit_gemm_tma_tf32 as tt
from bagf_torch.problem import ConvProblem
from bagf_torch.winograd_math import tf32_round


def _problem(n, c, h, k, r, layout="nchw", tf32=True, stride=1, pad=None, dil=1, dtype="float32"):
    pad = r // 2 if pad is None else pad
    return ConvProblem(n=n, c=c, h=h, w=h, k=k, r=r, s=r, stride=(stride, stride), padding=(pad, pad),
                       dilation=(dil, dil), bias=True, dtype=dtype, layout=layout, tf32=tf32)


def test_every_valid_config_obeys_the_documented_rules():
    valid = tt.space().valid_configs()
    assert len(valid) > 150
    for c in valid:
        g = tt.launch(c)
        assert g.threads == 128 * (c["WG"] + 1) and g.bn == 64 * c["MI"] * c["WG"] <= 256 and g.bm == c["WN"]
        assert (g.dtype, g.nhwc, g.tma, g.split, g.stream_k, g.split_cluster) == \
            (0, c["NHWC"], 1, c["SPLIT"], c["SK"], c["CR"]) and c["DT"] == 2
        assert c["SK"] == 0 or c["SPLIT"] == 1
        assert c["MI"] * c["WN"] // 2 <= 128
        assert g.smem == c["STAGES"] * (g.bn + g.bm) * 128 + 1024 + th.stage_bytes(c) \
            <= tt.SM90_SMEM_LIMIT - tt.STATIC_SMEM
    assert {c["WN"] for c in valid} == {64, 128, 192, 256} and {c["NHWC"] for c in valid} == {0, 1}
    # SPLIT and CR are launch parameters: configurations that differ only in them share a cubin
    assert len({tt.name_expression(c) for c in valid}) == len({tt.name(dict(c, SPLIT=1, CR=0)) for c in valid})
    # the same kernel template as the 16-bit family, DT 2; never one of its instantiations
    h16 = {th.name_expression(c) for c in th.space().valid_configs()}
    assert h16.isdisjoint(tt.name_expression(c) for c in valid)
    assert FAMILIES[tt.FAMILY] is tt


def test_names_and_who_it_takes():
    assert tt.name(tt.DEFAULT) == "implicit_gemm_tma_tf32_nchw_wn128_mi1_wg2_st4_s1_sm90"
    assert tt.name(dict(tt.DEFAULT, NHWC=1, SPLIT=4)) == "implicit_gemm_tma_tf32_wn128_mi1_wg2_st4_s4_sm90"
    assert tt.name_expression(dict(tt.DEFAULT, SPLIT=8)) == ("bagf::implicit_gemm_tma_h16_conv2d<2, 128, 1, 2, 4, 0, 0>;"
                                                             "bagf::nchw_to_nhwc<2>")  # (an NCHW plan's input copy)
    assert tt.name(dict(tt.DEFAULT, SK=1)) == "implicit_gemm_tma_tf32_nchw_wn128_mi1_wg2_st4_sk_sm90"
    assert tt.name_expression(dict(tt.DEFAULT, SK=1, NHWC=1)) == "bagf::implicit_gemm_tma_h16_conv2d<2, 128, 1, 2, 4, 1, 1>"
    legacy = {k: v for k, v in tt.DEFAULT.items() if k != "SK"}  # recorded before stream-K
    assert (tt.name(legacy), tt.launch(legacy), tt.name_expression(legacy)) == (
        tt.name(tt.DEFAULT), tt.launch(tt.DEFAULT), tt.name_expression(tt.DEFAULT))
    assert tt.gpu_arch(tt.DEFAULT, "sm_90") == "sm_90a" and "sm_90" in tt.arch_rule(tt.DEFAULT, "sm_80")
    conv3 = _problem(32, 192, 13, 384, 3)
    assert tt.applies(conv3) is None and format_refuses(tt, conv3) is None
    assert tt.applies(_problem(32, 192, 13, 384, 3, layout="nhwc")) is None
    assert "TF32 mode only" in tt.applies(_problem(32, 192, 13, 384, 3, tf32=False))
    assert tt.problem_rule(tt.DEFAULT, _problem(32, 192, 13, 384, 3, tf32=False)) is None  # (applies' to say)
    assert "float32" in tt.applies(_problem(32, 192, 13, 384, 3, dtype="bfloat16"))
    assert format_refuses(tt, _problem(32, 192, 13, 384, 3, dtype="float16")) is not None
    assert "multiple of 4" in tt.applies(_problem(32, 3, 224, 64, 11, stride=4))
    assert "multiple of 4" in tt.problem_rule(tt.DEFAULT, _problem(32, 6, 224, 64, 11, stride=4))
    assert tt.applies(_problem(32, 4, 224, 64, 11, stride=4)) is None  # (fp32: 4 channels are 16 bytes)
    # an imported plan is held to the rules: a TF32 plan under a strict problem, a layout it was not built for
    assert family_refuses(tt.FAMILY, tt.DEFAULT, _problem(32, 192, 13, 384, 3, tf32=False)) is not None
    assert "compiled for nchw" in tt.problem_rule(tt.DEFAULT, _problem(32, 192, 13, 384, 3, layout="nhwc"))
    assert tt.problem_rule(tt.DEFAULT, conv3) is None
    # k tiles are a tap's 32 channels: C = 40 takes 2 per tap
    assert tt.k_tiles(conv3) == 54 and tt.k_tiles(_problem(1, 40, 13, 64, 3)) == 18
    assert "TMA" in tt.problem_rule(tt.DEFAULT, _problem(2, 16, 64, 16, 3, stride=9))
    conv3_1 = _problem(1, 192, 13, 384, 3)
    assert tt.problem_rule(dict(tt.DEFAULT, SPLIT=16), conv3_1) is None  # 54 // 16 = 3 k tiles per slice
    assert "under 2" in tt.problem_rule(dict(tt.DEFAULT, SPLIT=16), _problem(1, 16, 13, 64, 1))


def test_the_start_point_follows_the_grid():
    big = tt.default_for(_problem(128, 192, 13, 384, 3))
    assert (big["WN"], big["WG"], big["STAGES"], big["SPLIT"], big["NHWC"]) == (128, 2, 4, 1, 0)
    one = tt.default_for(_problem(1, 192, 13, 384, 3, layout="nhwc"))
    assert (one["WN"], one["WG"], one["MI"], one["NHWC"]) == (64, 1, 1, 1) and one["SPLIT"] > 1
    assert tt.tiles(one, _problem(1, 192, 13, 384, 3)) * one["SPLIT"] <= tt.H200_SMS
    assert tt.default_for(_problem(32, 64, 27, 192, 5))["WN"] == 192
    for p in (_problem(128, 192, 13, 384, 3), _problem(1, 192, 13, 384, 3, layout="nhwc"), _problem(32, 64, 27, 192, 5)):
        c = tt.default_for(p)
        assert tt.space().is_valid(c) and tt.problem_rule(c, p) is None


def _tf32_trunc(t: torch.Tensor) -> torch.Tensor:
    """fp32 -> TF32 by dropping the low 13 bits: what the tensor cores read of an fp32 operand."""
    return (t.view(torch.int32) & ~0x1FFF).view(torch.float32)


def test_rounding_both_operands_is_what_keeps_tf32_within_the_check():
    """Why the plans map fp32 as TF32 (the TMA unit rounds as it copies): on an AlexNet-like layer, truncating both
    operands to TF32 (what the tensor cores do with an operand read as plain fp32) misses by over 2x what rounding
    both to nearest does, and the check allows twice cuDNN's TF32 error; rounding to nearest is its arithmetic."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 64, 13, 13, generator=g)
    w = torch.randn(96, 64, 3, 3, generator=g) / math.sqrt(64 * 9)
    ref = F.conv2d(x.double(), w.double(), padding=1)

    def err(a, b):
        return float((F.conv2d(a.double(), b.double(), padding=1) - ref).norm() / ref.norm())

    rn, rz = err(tf32_round(x), tf32_round(w)), err(_tf32_trunc(x), _tf32_trunc(w))
    assert 1e-4 < rn < 5e-4 and rz > 2 * rn


def test_stream_k_grid_workspace_and_features():
    """Stream-K (SK = 1): the blocks the device holds at once, fewer where a block would get under 8 k tiles; two
    tiles of workspace per block and a counter per tile, bounded by the grid; the tuner's grid features see the
    blocks and their share of the k tiles; a problem whose tiles' k tiles pass 2^31 is refused (32-bit counts)."""
    sk = dict(tt.DEFAULT, SK=1)
    conv4 = _problem(128, 384, 13, 256, 3)  # 169 x 2 tiles of 128 x 128, 108 k tiles each
    assert tt.tiles(sk, conv4) == 338 and tt.k_tiles(conv4) == 108
    assert tt.blocks_per_sm(sk) == 1 and th.stream_k_blocks(sk, conv4, 108) == tt.H200_SMS
    assert tt.workspace_bytes(sk, conv4) == 4 * (2 * 132 * 128 * 128 + 338)
    assert tt.workspace_bytes(tt.DEFAULT, conv4) == 0
    small = _problem(1, 16, 13, 64, 3)  # 2 x 1 tiles of 9 k tiles: 18 // 8 = 2 blocks
    assert th.stream_k_blocks(sk, small, tt.k_tiles(small)) == 2
    f = tt.features(conv4, sk)
    assert f["log2_blocks_per_sm"] == 0 and f["log2_k_tiles"] == math.log2(-(-338 * 108 // 132))
    assert tt.features(conv4, tt.DEFAULT)["log2_blocks_per_sm"] == math.log2(338 / 132)
    assert tt.problem_rule(sk, conv4) is None
    huge = _problem(64, 16384, 128, 1024, 11)  # 65536 tiles of 61952 k tiles; N*P*Q*K = 2^30
    assert "2^31" in tt.problem_rule(sk, huge) and tt.problem_rule(dict(sk, SK=0), huge) is None


def test_persistent_blocks_grid_workspace_and_features():
    """Persistent blocks (SK = 2): the blocks the device holds at once, at most one per tile, each taking whole tiles
    in turn; no workspace; the grid features see the blocks and each block's k tiles (its tiles' all); no 2^31 rule
    on the k tiles (none are counted)."""
    pt = dict(tt.DEFAULT, SK=2)
    conv4 = _problem(128, 384, 13, 256, 3)  # 338 tiles of 128 x 128, 108 k tiles each
    assert tt.persistent_blocks(pt, conv4) == tt.H200_SMS and tt.workspace_bytes(pt, conv4) == 0
    small = _problem(1, 16, 13, 64, 3)  # 2 tiles: 2 blocks
    assert tt.persistent_blocks(pt, small) == 2
    f = tt.features(conv4, pt)
    assert f["log2_blocks_per_sm"] == 0 and f["log2_k_tiles"] == math.log2(3 * 108)
    huge = _problem(64, 16384, 128, 1024, 11)
    assert tt.problem_rule(pt, huge) is None and tt.launch(pt).stream_k == 2
    assert tt.name(pt) == "implicit_gemm_tma_tf32_nchw_wn128_mi1_wg2_st4_pt_sm90"
    # the start's persistent twin is its second start on a multi-wave grid, its cluster twin where it splits
    assert tt.start_alternatives(conv4, arch="sm_90") == [dict(tt.default_for(conv4), SK=2)]
    one = _problem(1, 384, 13, 256, 3)
    assert tt.start_alternatives(one, arch="sm_90") == [dict(tt.default_for(one), CR=1)]
    assert tt.start_alternatives(conv4, arch="sm_80") == []

