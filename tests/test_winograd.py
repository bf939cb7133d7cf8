"""Winograd F(2x2,3x3) and F(4x4,3x3): the transform matrices are exact (float64 matches direct convolution on
odd shapes), the applicability rule, the multiply count, and the fp32 error bound the tuner's check enforces."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bagf_torch import winograd_math as wg
from bagf_torch.problem import ConvProblem
from bagf_torch.tuning.measure import REL_TOL

ODD = [  # n, c, h, w, k, padding
    (2, 5, 13, 11, 7, (1, 1)),
    (1, 3, 8, 9, 4, (0, 0)),
    (1, 4, 6, 7, 3, (1, 0)),
    (3, 2, 3, 3, 5, (1, 1)),  # one tile, mostly padding
    (1, 6, 17, 5, 2, (0, 1)),
]


@pytest.mark.parametrize("m", wg.TILES)
@pytest.mark.parametrize("shape", ODD)
def test_float64_winograd_equals_direct_convolution(m, shape):
    n, c, h, w, k, pad = shape
    g = torch.Generator().manual_seed(hash((m, shape)) % 2**31)
    x = torch.randn(n, c, h, w, dtype=torch.float64, generator=g)
    wt = torch.randn(k, c, 3, 3, dtype=torch.float64, generator=g)
    b = torch.randn(k, dtype=torch.float64, generator=g)
    ref = F.conv2d(x, wt, b, 1, pad)
    got = wg.conv2d(x, wt, b, pad, m)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=1e-11, atol=1e-11)
    torch.testing.assert_close(wg.conv2d(x, wt, None, pad, m), F.conv2d(x, wt, None, 1, pad), rtol=1e-11,
                               atol=1e-11)


def test_toom_cook_gives_lavin_f4_and_exact_generated_tiles():
    """The generator reproduces Lavin and Gray's F(4, 3) from its points, and the generated F(5, 3) and F(6, 3)
    satisfy the 1-D identity exactly (rational arithmetic) for every basis input and filter."""
    assert wg.toom_cook(4, 3, (0, 1, -1, 2, -2)) == tuple(wg._MATRICES[4])
    for m in (5, 6):
        bt, g, at = wg._MATRICES[m]
        n = m + 2
        for l in range(n):
            for k in range(3):
                y = [sum(at[i][j] * g[j][k] * bt[j][l] for j in range(n)) for i in range(m)]
                assert y == [int(l == i + k) for i in range(m)]
    with pytest.raises(ValueError, match="distinct"):
        wg.toom_cook(4, 3, (0, 1, 1, 2, -2))


def test_transform_identities():
    # A^T (G g G^T . B^T d B) A for one tile is the 2D correlation of d with g: check on a delta filter
    for m in wg.TILES:
        bt, g, at = wg.matrices(m)
        assert bt.shape == (m + 2, m + 2) and g.shape == (m + 2, 3) and at.shape == (m, m + 2)
        d = torch.arange((m + 2) ** 2, dtype=torch.float64).view(m + 2, m + 2)
        delta = torch.zeros(3, 3, dtype=torch.float64)
        delta[1, 1] = 1.0
        y = at @ ((g @ delta @ g.T) * (bt @ d @ bt.T)) @ at.T
        torch.testing.assert_close(y, d[1:m + 1, 1:m + 1])


def test_applies_only_to_stride1_3x3():
    ok = ConvProblem(n=1, c=4, h=9, w=9, k=4, r=3, s=3, padding=(1, 1))
    assert wg.applies(ok) is None
    assert "3x3" in wg.applies(ConvProblem(n=1, c=4, h=9, w=9, k=4, r=5, s=5))
    assert "stride" in wg.applies(ConvProblem(n=1, c=4, h=9, w=9, k=4, r=3, s=3, stride=(2, 2)))
    assert "stride" in wg.applies(ConvProblem(n=1, c=4, h=9, w=9, k=4, r=3, s=3, dilation=(2, 2)))
    with pytest.raises(ValueError, match="not implemented"):
        wg.matrices(3)


def test_multiplies_saved():
    p = ConvProblem(n=1, c=256, h=16, w=16, k=256, r=3, s=3, padding=(1, 1))  # 16x16 output: whole tiles
    assert p.macs / wg.multiplies(p, 2) == pytest.approx(9 * 4 / 16)
    assert p.macs / wg.multiplies(p, 4) == pytest.approx(9 * 16 / 36)
    # conv1 through its polyphase components: 48 channels of 3x3 (121 taps padded to 144), F(5x5)'s 11 x 11
    # tiles of 49 points cover the 55 x 55 output: 3.86x fewer products than direct
    c1 = ConvProblem(n=1, c=3, h=224, w=224, k=64, r=11, s=11, stride=(4, 4), padding=(2, 2))
    assert wg.multiplies(c1, 5) == 49 * 121 * 64 * 48
    assert c1.macs / wg.multiplies(c1, 5) == pytest.approx(3025 * 363 / (49 * 121 * 48))


@pytest.mark.parametrize("m", wg.TILES)
def test_fp32_error_is_within_the_check_and_f4_is_the_larger(m):
    """On AlexNet conv4's shape (N=1) both stay far inside the tuner's tolerance (measured: F2 ~3e-7,
    F4 ~2e-6 norm and ~7e-6 max; direct fp32 ~1e-6), so the check never has to reject them for rounding."""
    p = ConvProblem(n=1, c=384, h=13, w=13, k=256, r=3, s=3, padding=(1, 1))
    e = wg.fp32_error(p, m)
    assert e["winograd_norm"] < REL_TOL / 10 and e["winograd_max"] < REL_TOL
    if m == 4:
        assert e["winograd_norm"] > wg.fp32_error(p, 2)["winograd_norm"]


# ------------------------------------------------------------------ polyphase form (winograd_gemm at stride s)
STRIDED = [  # n, c, h, w, k, r, s, stride, padding
    (2, 3, 23, 21, 5, 11, 10, 4, (2, 1)),  # conv1-like: 11 x 10 taps at stride 4
    (1, 2, 13, 11, 3, 5, 5, 2, (2, 2)),
    (3, 2, 19, 17, 3, 7, 6, 3, (0, 1)),
    (1, 1, 11, 11, 2, 11, 11, 4, (0, 0)),  # one output, no padding
    (2, 2, 9, 14, 3, 4, 6, 2, (3, 0)),     # padding larger than the stride, rectangular filter
]


@pytest.mark.parametrize("shape", STRIDED)
def test_polyphase_form_equals_strided_convolution(shape):
    """The polyphase components (C s^2 channels, 3x3 filters) convolved at stride 1 are the strided convolution
    exactly, and so is Winograd over them in float64 for every tile size."""
    n, c, h, w, k, r, s, st, pad = shape
    g = torch.Generator().manual_seed(hash(shape) % 2**31)
    x = torch.randn(n, c, h, w, dtype=torch.float64, generator=g)
    wt = torch.randn(k, c, r, s, dtype=torch.float64, generator=g)
    b = torch.randn(k, dtype=torch.float64, generator=g)
    ref = F.conv2d(x, wt, b, st, pad)
    xp, wp = wg.polyphase(x, wt, st, pad)
    assert xp.shape[1] == wp.shape[1] == c * st * st and wp.shape[2:] == (3, 3)
    torch.testing.assert_close(F.conv2d(xp, wp, b), ref, rtol=1e-12, atol=1e-12)
    for m in wg.TILES:
        torch.testing.assert_close(wg.conv2d(x, wt, b, pad, m, st), ref, rtol=1e-11, atol=1e-11)


def test_polyphase_applies():
    def prob(r, s, st, **kw):
        return ConvProblem(n=1, c=3, h=64, w=64, k=8, r=r, s=s, stride=(st, st) if isinstance(st, int) else st, **kw)

    assert wg.polyphase_applies(prob(3, 3, 1)) is None and wg.polyphase_applies(prob(11, 11, 4)) is None
    assert wg.polyphase_applies(prob(5, 5, 2)) is None and wg.polyphase_applies(prob(7, 6, 3)) is None
    assert "3x3" in wg.polyphase_applies(prob(5, 5, 1))             # stride 1: only 3x3 (as the fused families)
    assert "more than 2.0x" in wg.polyphase_applies(prob(3, 3, 2))  # 36 taps for 9 real ones
    assert "larger than" in wg.polyphase_applies(prob(7, 7, 2))     # 7 > 3*2
    assert "differ" in wg.polyphase_applies(prob(11, 11, (4, 2)))
    assert "dilation" in wg.polyphase_applies(prob(5, 5, 2, dilation=(2, 2)))
    assert "groups" in wg.polyphase_applies(prob(5, 5, 2, groups=3))
    assert "above" in wg.polyphase_applies(prob(27, 27, 9))
    assert wg.applies(prob(11, 11, 4)) is not None  # the fused families stay 3x3 stride 1
    with pytest.raises(ValueError, match="3x3 polyphase"):
        wg.polyphase(torch.zeros(1, 1, 9, 9), torch.zeros(1, 1, 7, 7), 2, (0, 0))


@pytest.mark.parametrize("m", wg.TILES)
def test_fp32_error_of_the_polyphase_form_on_conv1(m):
    """AlexNet conv1 (11x11, stride 4, 3 channels, as 3x3 over 48 polyphase channels) in float32: measured norm
    1.6e-7 (F2) to 2.0e-6 (F6), max 7.4e-6 at most, far inside the tuner's check."""
    p = ConvProblem(n=2, c=3, h=224, w=224, k=64, r=11, s=11, stride=(4, 4), padding=(2, 2))
    e = wg.fp32_error(p, m)
    assert e["winograd_norm"] < REL_TOL / 10 and e["winograd_max"] < REL_TOL


def _emulate_winograd_gemm(x, w, b, stride, pad, mt, vl):
    """csrc/kernels/winograd_gemm.cuh's stages 0, 1 and 2 replayed thread by thread in float64 with the kernel's
    index arithmetic (stage 1's split for VL and the stride, stage 0's filter phases), the GEMM as a matmul."""
    n, c, h, wd = x.shape
    k, _, r, s = w.shape
    st, a = stride, mt + 2
    p, q = (h + 2 * pad[0] - r) // st + 1, (wd + 2 * pad[1] - s) // st + 1
    tiles_q = -(-q // mt)
    tiles_img = -(-p // mt) * tiles_q
    t_all, cc = n * tiles_img, c * st * st
    bt, g, at = (m.numpy() for m in wg.matrices(mt))
    xs, ws = x.numpy().ravel(), w.numpy().ravel()
    u = np.full((a * a, k, cc), np.nan)
    for idx in range(k * cc):  # stage 0
        kk, ci = divmod(idx, cc)
        cin, ph, pw = ci // (st * st), (ci // st) % st, ci % st
        gg = np.zeros((3, 3))
        for i in range(3):
            for j in range(3):
                rr, qq = st * i + ph, st * j + pw
                if rr < r and qq < s:
                    gg[i, j] = ws[((kk * c + cin) * r + rr) * s + qq]
        u[:, kk, ci] = (g @ gg @ g.T).ravel()
    v = np.full((a * a, cc, t_all), np.nan)
    for idx in range(cc * t_all):  # stage 1
        ph = pw = 0
        if vl == 0:
            if st == 1:
                ci, t = divmod(idx, t_all)
            else:
                pw = idx % st
                cph, t = divmod(idx // st, t_all)
                ph, ci = cph % st, cph * st + pw
        else:
            t, ci = divmod(idx, cc)
            if st > 1:
                ph, pw = (ci // st) % st, ci % st
        nn, rem = divmod(t, tiles_img)
        tp = rem // tiles_q
        h0, w0 = st * tp * mt + ph - pad[0], st * (rem - tp * tiles_q) * mt + pw - pad[1]
        d = np.zeros((a, a))
        for i in range(a):
            for j in range(a):
                hh, ww = h0 + st * i, w0 + st * j
                if 0 <= hh < h and 0 <= ww < wd:
                    d[i, j] = xs[((nn * c + ci // (st * st)) * h + hh) * wd + ww]
        v[:, ci, t] = (bt @ d @ bt.T).ravel()
    mm = np.einsum("ekc,ect->ekt", u, v)  # the batched GEMM
    y = np.full((n, k, p, q), np.nan)
    for kk in range(k):  # stage 2 (per tile)
        for t in range(t_all):
            nn, rem = divmod(t, tiles_img)
            tp = rem // tiles_q
            o = at @ mm[:, kk, t].reshape(a, a) @ at.T + b[kk].item()
            p0, q0 = tp * mt, (rem - tp * tiles_q) * mt
            rows, cols = min(mt, p - p0), min(mt, q - q0)
            y[nn, kk, p0:p0 + rows, q0:q0 + cols] = o[:rows, :cols]
    return torch.from_numpy(y)


@pytest.mark.parametrize("vl", (0, 1))
@pytest.mark.parametrize("shape", [STRIDED[0], STRIDED[2], (2, 3, 7, 9, 4, 3, 3, 1, (1, 1))])
def test_kernel_index_map_computes_the_convolution(shape, vl):
    """The kernel's own index arithmetic (emulated), every output written, equal to F.conv2d in float64."""
    n, c, h, w, k, r, s, st, pad = shape
    g = torch.Generator().manual_seed(1 + vl)
    x = torch.randn(n, c, h, w, dtype=torch.float64, generator=g)
    wt = torch.randn(k, c, r, s, dtype=torch.float64, generator=g)
    b = torch.randn(k, dtype=torch.float64, generator=g)
    for mt in (2, 4):
        got = _emulate_winograd_gemm(x, wt, b, st, pad, mt, vl)
        torch.testing.assert_close(got, F.conv2d(x, wt, b, st, pad), rtol=1e-10, atol=1e-10)


def test_winograd_gemm_starts_from_the_output_tile_that_multiplies_less():
    """The start configuration's tile: F(5x5) where its tiles cover the output with less padding (13x13, AlexNet's
    conv1 through its 55x55 polyphase output), F(4x4) where the two multiply alike (56, 28) or 4 does better (7);
    the rest of the start is the fixed default, and it is a valid configuration every time."""
    from bagf_torch.kernels import winograd_gemm as wgm

    def start(n, h, c=64, **kw):
        p = ConvProblem(n=n, c=c, h=h, w=h, k=64, **({"r": 3, "s": 3, "padding": (1, 1)} | kw))
        cfg = wgm.default_for(p, arch="sm_90")
        assert wgm.space().is_valid(cfg)
        return cfg

    conv1 = {"r": 11, "s": 11, "stride": (4, 4), "padding": (2, 2)}
    assert [start(n, 13)["MT"] for n in (1, 32, 128)] == [5, 5, 5]
    assert start(32, 224, c=3, **conv1)["MT"] == 5
    assert [start(32, h)["MT"] for h in (56, 28, 7)] == [4, 4, 4]
    assert start(32, 14)["MT"] == 5
    p = ConvProblem(n=32, c=64, h=13, w=13, k=64, r=3, s=3, padding=(1, 1))
    assert wg.multiplies(p, 5) < wg.multiplies(p, 4)
    assert {k: v for k, v in wgm.default_for(p, arch="sm_90").items() if k not in ("MT", "GE")} == {
        k: v for k, v in dict(wgm.DEFAULT, SO=1).items() if k not in ("MT", "GE")}
    assert wgm.default_for(p) == dict(wgm.DEFAULT, MT=5)  # off sm_90: no wgmma, no staging


def test_winograd_gemm_starts_from_the_wgmma_gemm_whose_blocks_pad_the_products_less():
    """GE 7's 64 x 64 blocks where 6's 128 x 128 ones pad K x T by over 10% more (T = 288: AlexNet's conv3-5 at N=32
    in F(5x5) tiles, where the GEMM probe measured 7 the fastest; K = 64: conv1, where the 25 s tunings kept 64-channel
    tiles), else 6 (K = 256 and 384 with T = 512, 1152, 2048 there)."""
    from bagf_torch.kernels import winograd_gemm as wgm

    assert [wgm.wgmma_start(256, t) for t in (288, 512, 1152, 2048, 6272, 3872)] == [7, 6, 6, 6, 6, 6]
    assert wgm.wgmma_start(384, 130) == 7 and wgm.wgmma_start(384, 128) == 6  # 256/130 vs 192/130; no padding at 128
    assert wgm.wgmma_start(64, 3872) == 7 and wgm.wgmma_start(64, 512) == 7  # half of a 128-channel block is padding
    assert wgm.wgmma_start(192, 512) == 7 and wgm.wgmma_start(128, 1152) == 6  # 256/192 rows padded; none
    conv = dict(c=256, h=13, w=13, k=256, r=3, s=3, padding=(1, 1))
    assert [wgm.default_for(ConvProblem(n=n, **conv), arch="sm_90")["GE"] for n in (32, 128)] == [7, 6]
    conv1 = dict(c=3, h=224, w=224, k=64, r=11, s=11, stride=(4, 4), padding=(2, 2))
    assert [wgm.default_for(ConvProblem(n=n, **conv1), arch="sm_90")["GE"] for n in (32, 128)] == [7, 7]


def test_tf32_rounding_is_cvt_rna():
    """tf32_round keeps 10 mantissa bits, rounds to nearest with ties away from zero, and moves a value by at most
    2^-11 of itself (what the TF32 error tables assume of a tensor-core operand)."""
    t = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 1e3
    r = wg.tf32_round(t)
    assert bool(((r.view(torch.int32) & 0x1FFF) == 0).all())
    assert float(((r - t).abs() / t.abs()).max()) <= 2.0**-11
    assert wg.tf32_round(torch.tensor([1 + 2**-11])).item() == 1 + 2**-10  # a tie: away from zero (even: 1.0)
    assert wg.tf32_round(torch.tensor([1 + 3 * 2**-11])).item() == 1 + 2**-9
    assert wg.tf32_round(torch.tensor([-(1 + 3 * 2**-11)])).item() == -(1 + 2**-9)
    assert torch.equal(wg.tf32_round(r), r)
    nans = torch.tensor([0x7FFFFFFF, -1, 0x7F800001], dtype=torch.int32).view(torch.float32)  # carry would end them
    assert torch.isnan(wg.tf32_round(nans)).all()
    assert wg.tf32_round(torch.tensor([float("inf"), -float("inf")])).tolist() == [float("inf"), -float("inf")]


def test_tf32_products_keep_f2_near_a_tf32_direct_conv_and_not_the_larger_tiles():
    """With TF32 Winograd-domain products, F(2x2)'s error stays near a TF32 direct convolution's (the rule's 2x) and
    F(4x4)'s is an order of magnitude above it: why a TF32 mode can take TF32 products in F(2x2) tiles only
    (benchmarks/results/winograd_error_tf32_cpu.md)."""
    p = ConvProblem(n=1, c=64, h=13, w=13, k=32, r=3, s=3, padding=(1, 1))
    e2, e4 = wg.fp32_error(p, 2, tf32=True), wg.fp32_error(p, 4, tf32=True)
    assert 1e-4 < e2["direct_norm"] < 4e-4  # cuDNN's own TF32 error on the H200 is about 2e-4
    assert e2["winograd_norm"] <= 2 * e2["direct_norm"] and e4["winograd_norm"] > 5 * e4["direct_norm"]
    assert wg.fp32_error(p, 2)["winograd_norm"] < 1e-5  # without tf32: float32 throughout


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_16_bit_products_keep_f2_within_twice_the_direct_error_and_not_the_larger_tiles(dtype):
    """On 16-bit tensors, F(2x2) with 16-bit Winograd-domain products misses by under twice what the direct
    convolution (float32 sums, one rounding) misses by, F(4x4) by over 5x; with float32 products either tile is the
    direct error (the output's one rounding dominates): benchmarks/results/winograd_error_{bf16,fp16}_cpu.md."""
    p = ConvProblem(n=1, c=64, h=13, w=13, k=32, r=3, s=3, padding=(1, 1))
    e2, e4 = wg.h16_error(p, 2, dtype), wg.h16_error(p, 4, dtype)
    unit = 2.0 ** -8 if dtype is torch.bfloat16 else 2.0 ** -11  # the dtype's half ulp at 1
    assert 0.2 * unit < e2["direct_norm"] < unit  # (the H200's 16-bit plans: 1.66e-3 bf16, 2.07e-4 fp16)
    assert e2["direct_norm"] < e2["winograd16_norm"] <= 2 * e2["direct_norm"]
    assert e4["winograd16_norm"] > 5 * e4["direct_norm"]
    for e in (e2, e4):
        assert e["winograd32_norm"] < 1.05 * e["direct_norm"]


def test_winograd_tf32_is_winograd_tc_in_f2_for_tf32_mode_only():
    """winograd_tf32: winograd_tc's knobs, rules, launch and start with MT = 2 only (the one tile whose TF32
    products stay within the rule), its own kernel (one TF32 product per multiply), TF32-mode problems only."""
    from bagf_torch.kernels import FAMILIES, family_refuses
    from bagf_torch.kernels import winograd_tc as wtc
    from bagf_torch.kernels import winograd_tf32 as wt

    assert FAMILIES["winograd_tf32"] is wt
    valid = wt.space().valid_configs()
    assert valid and {c["MT"] for c in valid} == {2}
    assert len(valid) == sum(1 for c in wtc.space().valid_configs() if c["MT"] == 2)
    assert wt.space().invalid_reason(dict(wt.DEFAULT, MT=4)) is not None
    for c in valid[::97]:
        assert wt.launch(c) == dataclasses.replace(wtc.launch(c), tf32=1) and wt.smem_bytes(c) == wtc.smem_bytes(c)
        assert wt.name(c) == wtc.name(c).replace("winograd_tc_", "winograd_tf32_", 1)
        assert wt.name_expression(c) == wtc.name_expression(c).replace("winograd_tc_conv2d", "winograd_tf32_conv2d")
    p = ConvProblem(n=1, c=192, h=13, w=13, k=384, r=3, s=3, padding=(1, 1))
    tf32 = ConvProblem(n=1, c=192, h=13, w=13, k=384, r=3, s=3, padding=(1, 1), tf32=True)
    assert "TF32 mode only" in wt.applies(p) and wt.applies(tf32) is None
    assert "TF32 mode only" in family_refuses("winograd_tf32", wt.DEFAULT, p)
    assert wt.applies(ConvProblem(n=1, c=8, h=9, w=9, k=8, r=5, s=5, padding=(2, 2), tf32=True)) is not None
    assert wt.default_for(tf32) == wtc.default_for(tf32) and wt.default_for(tf32)["MT"] == 2


def test_winograd_gemm_space_keeps_its_own_gemms_within_the_devices_shared_memory():
    """The tuner passes the device's opt-in shared memory per block: the plan's own GEMM must fit it (the host refuses
    the rest at load, after a compile each). All fit on sm_90's 227 KB; on sm_86/89's 99 KB the largest tiles do not."""
    from bagf_torch.kernels import winograd_gemm as wg

    every = wg.space().valid_configs()
    assert wg.space(232448).valid_configs() == every
    small = wg.space(101376)
    too_big = [c for c in every if wg.gemm_smem_bytes(c) > 101376]
    assert too_big and not any(small.is_valid(c) for c in too_big)
    assert all(small.is_valid(c) for c in every if wg.gemm_smem_bytes(c) <= 101376)
    assert "shared memory" in small.invalid_reason(too_big[0])
