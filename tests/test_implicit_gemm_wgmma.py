"""The wgmma implicit-GEMM family's space, start point and targets (CPU); its kernel is checked on the GPU by
tests/test_gpu.py (odd shapes against float64 of TF32-rounded operands, cuDNN's TF32 error, NaNs, misaligned
weights) and compiled by tests/test_nvcc.py."""

import pytest

from bagf_torch.kernels import implicit_gemm_wgmma as wg
from bagf_torch.problem import ConvProblem


def _problem(n, c, h, k, r, tf32=True):
    return ConvProblem(n=n, c=c, h=h, w=h, k=k, r=r, s=r, stride=(1, 1), padding=(r // 2, r // 2),
                       dilation=(1, 1), bias=True, tf32=tf32)


def test_every_valid_config_obeys_the_documented_rules():
    valid = wg.space().valid_configs()
    assert len(valid) > 100
    for c in valid:
        t, bm = wg.threads(c), c["WN"] * c["NB"]
        assert t == 128 * c["WG"] and wg.launch(c).bn == 64 * c["WG"] and wg.launch(c).bm == bm
        assert (8 * bm) % t == 0  # the kernel's whole copy rounds of the weight tile
        assert c["STAGES"] >= 3
        assert wg.smem_bytes(c) == 4 * c["STAGES"] * (bm * 32 + 32 * (64 * c["WG"] + 8)) <= wg.SM90_SMEM_LIMIT
        assert bm // 2 + 100 <= 255 and wg.estimated_registers(c) * t <= 65536
    assert {c["WN"] * c["NB"] for c in valid} == {64, 128, 192, 256}


def test_invalid_configs_say_why():
    s = wg.space()
    assert "registers" in s.invalid_reason(dict(wg.DEFAULT, WN=256, NB=2, WG=1, STAGES=3))
    assert "shared memory" in s.invalid_reason(dict(wg.DEFAULT, WN=256, STAGES=6))
    assert "not one of" in s.invalid_reason(dict(wg.DEFAULT, WN=96))


def test_names_targets_and_mode():
    assert wg.name(wg.DEFAULT) == "implicit_gemm_wgmma_wn128_nb1_wg2_st4_s1_sm90"
    assert wg.name_expression(wg.DEFAULT) == "bagf::implicit_gemm_wgmma_conv2d<128, 1, 2, 4, 1>"
    assert wg.gpu_arch(wg.DEFAULT, "sm_90") == "sm_90a" and wg.gpu_arch(wg.DEFAULT, "sm_80") == "sm_80"
    assert wg.arch_rule(wg.DEFAULT, "sm_90") is None and "sm_90" in wg.arch_rule(wg.DEFAULT, "sm_100")
    assert wg.applies(_problem(32, 192, 13, 384, 3)) is None
    assert "TF32 mode only" in wg.applies(_problem(32, 192, 13, 384, 3, tf32=False))


@pytest.mark.parametrize("n, c, h, k, r, split, wn", [
    (128, 192, 13, 384, 3, 1, 192),  # AlexNet conv3 at N = 128: 169 x 2 blocks of 128 pixels x 192 channels
    (32, 192, 13, 384, 3, 2, 192),   # at N = 32: 43 x 2 blocks, 2 slices fill 132 SMs
    (1, 192, 13, 384, 3, 8, 192),    # at N = 1: 2 x 2 blocks; 54 k tiles: 16 slices would get < 4 each
    (32, 256, 13, 256, 3, 4, 256),   # K = 256: one 256-channel instruction; 43 blocks, 4 slices
    (32, 64, 56, 64, 3, 1, 64),      # ResNet layer1 at N = 32: K = 64 takes 64-channel instructions
    (1, 3, 9, 5, 1, 1, 64),          # one k tile: no split
])
def test_start_point_fills_the_gpu(n, c, h, k, r, split, wn):
    d = wg.default_for(_problem(n, c, h, k, r), sms=132)
    assert (d["SPLIT"], d["WN"]) == (split, wn)
    assert wg.space().invalid_reason(d) is None
