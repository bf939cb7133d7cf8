"""The 16-bit wgmma implicit-GEMM family's space, start point, problem rule and targets (CPU); its kernel is checked
on the GPU by tests/test_gpu.py (odd channels_last shapes in bf16 and fp16 against float64 within twice cuDNN's
error, split-K's schedule independence, misaligned tensors, opcheck, torch.compile) and compiled by
tests/test_nvcc.py."""

import pytest

from bagf_torch.kernels import family_refuses
from bagf_torch.kernels import implicit_gemm_wgmma_h16 as wh
from bagf_torch.problem import ConvProblem


def _problem(n, c, h, k, r, dtype="bfloat16", layout="nhwc", stride=1):
    return ConvProblem(n=n, c=c, h=h, w=h, k=k, r=r, s=r, stride=(stride, stride), padding=(r // 2, r // 2),
                       dilation=(1, 1), bias=True, dtype=dtype, layout=layout)


def test_every_valid_config_obeys_the_documented_rules():
    valid = wh.space().valid_configs()
    assert len(valid) > 300
    for c in valid:
        t, g = wh.threads(c), wh.launch(c)
        assert t == 128 * c["WG"] and g.bn == 64 * c["MI"] * c["WG"] and g.bm == c["WN"] and g.threads == t
        assert (g.dtype, g.nhwc, g.split) == (1 + c["DT"], 1, c["SPLIT"])
        assert (8 * g.bn) % t == 0 and (8 * g.bm) % t == 0  # the kernel's whole copy rounds of both tiles
        assert c["MI"] * c["WN"] // 2 <= 128 and c["STAGES"] >= 3
        ring = c["STAGES"] * c["KS"] * (g.bn + g.bm) * 128
        assert wh.smem_bytes(c) == ring + 1024 <= wh.SM90_SMEM_LIMIT - wh.STATIC_SMEM
    assert {c["WN"] for c in valid} == {64, 128, 192, 256} and {c["STAGES"] for c in valid} == {3, 4, 5, 6}
    # one cubin per tile and dtype whatever the split
    assert len({wh.name_expression(c) for c in valid}) == len({wh.name(dict(c, SPLIT=1)) for c in valid})


def test_invalid_configs_say_why():
    s = wh.space()
    assert "accumulators" in s.invalid_reason(dict(wh.DEFAULT, WN=256, MI=2))
    assert "shared memory" in s.invalid_reason(dict(wh.DEFAULT, WN=256, MI=1, WG=2, STAGES=6))
    assert "not one of" in s.invalid_reason(dict(wh.DEFAULT, WN=96))


def test_names_targets_and_formats():
    assert wh.name(wh.DEFAULT) == "implicit_gemm_wgmma_h16_bf16_wn128_mi1_wg2_st4_ks1_s1_sm90"
    assert wh.name_expression(dict(wh.DEFAULT, SPLIT=8)) == "bagf::implicit_gemm_wgmma_h16_conv2d<1, 128, 1, 2, 4, 1>"
    assert wh.gpu_arch(wh.DEFAULT, "sm_90") == "sm_90a" and wh.gpu_arch(wh.DEFAULT, "sm_80") == "sm_80"
    assert wh.arch_rule(wh.DEFAULT, "sm_90") is None and "sm_90" in wh.arch_rule(wh.DEFAULT, "sm_80")
    assert wh.applies(_problem(32, 192, 13, 384, 3)) is None
    assert wh.applies(_problem(32, 192, 13, 384, 3, "float16")) is None
    assert "channels_last" in wh.applies(_problem(32, 192, 13, 384, 3, layout="nchw"))
    assert "channels_last" in wh.applies(_problem(32, 192, 13, 384, 3, dtype="float32", layout="nchw"))
    assert "multiple of 8" in wh.applies(_problem(32, 3, 224, 64, 11, stride=4))


def test_the_problem_rule_holds_dtype_channels_and_split_k():
    conv3_1 = _problem(1, 192, 13, 384, 3)  # C*R*S = 1728: 27 k tiles of 64
    assert wh.problem_rule(dict(wh.DEFAULT, DT=1), conv3_1) is None
    assert "compiled for bfloat16" in wh.problem_rule(dict(wh.DEFAULT, DT=1), _problem(1, 192, 13, 384, 3, "float16"))
    assert "multiple of 8" in wh.problem_rule(wh.DEFAULT, _problem(1, 12, 13, 16, 3))
    assert wh.problem_rule(dict(wh.DEFAULT, SPLIT=8), conv3_1) is None  # 27 // 8 = 3 tiles per slice
    assert "under 2" in wh.problem_rule(dict(wh.DEFAULT, SPLIT=16), conv3_1)  # 27 // 16 = 1
    big = _problem(128, 192, 13, 384, 3)
    assert "MiB" in wh.problem_rule(dict(wh.DEFAULT, SPLIT=8), big)
    assert "under 2" in wh.problem_rule(dict(wh.DEFAULT, KS=2, SPLIT=8), conv3_1)  # 14 k tiles of 128: 1 each
    assert wh.workspace_bytes(dict(wh.DEFAULT, SPLIT=2), conv3_1) == 4 * wh.tiles(wh.DEFAULT, conv3_1) * (
        2 * 128 * 128 + 1)
    # the last blocks' 32-bit indices: K = 1 on 2^31 - 100 output pixels; K = 64 past a huge reduction
    assert "2^31" in wh.problem_rule(wh.DEFAULT, ConvProblem(n=1, c=8, h=1, w=2**31 - 100, k=1, r=1, s=1,
                                                             dtype="bfloat16", layout="nhwc"))
    assert "2^31" in wh.problem_rule(dict(wh.DEFAULT, WN=256), ConvProblem(n=1, c=8 * 2**17, h=4, w=4, k=64, r=3,
                                                                          s=3, dtype="bfloat16", layout="nhwc"))
    assert wh.problem_rule(dict(wh.DEFAULT, WN=256), ConvProblem(n=1, c=8 * 2**12, h=4, w=4, k=64, r=3, s=3,
                                                                  dtype="bfloat16", layout="nhwc")) is None
    # an imported plan is held to the same rules (kernels.family_refuses)
    assert family_refuses(wh.FAMILY, dict(wh.DEFAULT, DT=0), conv3_1) is not None
    assert family_refuses(wh.FAMILY, wh.DEFAULT, _problem(1, 192, 13, 384, 3, layout="nchw")) is not None


@pytest.mark.parametrize("n, c, h, k, r, dtype, wn, wg, split", [
    (128, 192, 13, 384, 3, "bfloat16", 128, 2, 1),  # AlexNet conv3: K = 384 in 3 x 128; 169 x 3 tiles
    (32, 192, 13, 384, 3, "float16", 128, 2, 1),    # 43 x 3 = 129 tiles: one wave, no split
    (32, 256, 13, 256, 3, "bfloat16", 128, 2, 1),   # K = 256: 128 on the tie with 256; 86 tiles, 2 slices pass 132
    (32, 64, 27, 192, 5, "bfloat16", 192, 2, 1),    # conv2: K = 192 in one instruction, a 4-deep ring (201 KB at 5)
    (1, 256, 13, 256, 3, "bfloat16", 64, 1, 8),     # batch 1: 3 x 4 tiles of 64 x 64, 8 slices (36 k tiles)
    (1, 192, 13, 384, 3, "bfloat16", 64, 1, 4),     # 3 x 6 tiles: 4 slices (8 would pass 132)
    (1, 64, 27, 192, 5, "bfloat16", 64, 1, 2),      # 12 x 3 tiles: 2 slices
    (32, 64, 56, 64, 3, "bfloat16", 64, 2, 1),      # ResNet layer1: K = 64
])
def test_start_point_takes_the_dtype_and_fills_the_gpu(n, c, h, k, r, dtype, wn, wg, split):
    p = _problem(n, c, h, k, r, dtype)
    d = wh.default_for(p, sms=132)
    assert (d["DT"], d["WN"], d["WG"], d["SPLIT"]) == (wh.DTYPES[dtype], wn, wg, split)
    assert d["STAGES"] == (4 if wn == 192 else 5) and d["KS"] == 1
    assert wh.smem_bytes(d) <= wh.RING5_LIMIT or d["STAGES"] == 4
    assert wh.space().invalid_reason(d) is None and wh.problem_rule(d, p) is None
    assert wh.tiles(d, p) * d["SPLIT"] <= 132 or d["SPLIT"] == 1
