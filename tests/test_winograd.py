"""Winograd F(2x2,3x3) and F(4x4,3x3): the transform matrices are exact (float64 matches direct convolution on
odd shapes), the applicability rule, the multiply count, and the fp32 error bound the tuner's check enforces."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bagf_torch import winograd as wg
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


@pytest.mark.parametrize("m", wg.TILES)
def test_fp32_error_is_within_the_check_and_f4_is_the_larger(m):
    """On AlexNet conv4's shape (N=1) both stay far inside the tuner's tolerance (measured: F2 ~3e-7,
    F4 ~2e-6 norm and ~7e-6 max; direct fp32 ~1e-6), so the check never has to reject them for rounding."""
    p = ConvProblem(n=1, c=384, h=13, w=13, k=256, r=3, s=3, padding=(1, 1))
    e = wg.fp32_error(p, m)
    assert e["winograd_norm"] < REL_TOL / 10 and e["winograd_max"] < REL_TOL
    if m == 4:
        assert e["winograd_norm"] > wg.fp32_error(p, 2)["winograd_norm"]
