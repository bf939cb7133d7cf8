"""The non-fused Winograd family's staged input (kernels.winograd_gemm, ST=1) on a CPU: every input row a
block's tiles read lies in the row window the block loads into shared memory, and the window never exceeds the
bound the host sizes shared memory with. A row outside the window would be read from the wrong place (the
kernel indexes shared memory relative to the window), a window above the bound would overrun shared memory."""

from __future__ import annotations

import random

from bagf_torch.kernels import winograd_gemm as wgg
from bagf_torch.problem import ConvProblem


def _shapes():
    rng = random.Random(7)
    shapes = [ConvProblem(n=n, c=1, h=hw, w=hw, k=1, r=3, s=3, padding=(1, 1)) for n in (1, 2, 32, 128)
              for hw in (13, 27, 28, 56)]
    for _ in range(150):  # odd sizes, paddings 0-6 (rows entirely in the padding), 1-9 images
        h, w, pad = rng.randint(1, 30), rng.randint(1, 30), rng.randint(0, 6)
        if min(h, w) + 2 * pad >= 3:
            shapes.append(ConvProblem(n=rng.randint(1, 9), c=1, h=h, w=w, k=1, r=3, s=3, padding=(pad, pad)))
    return shapes


def test_every_row_a_block_reads_is_in_its_window_and_the_window_within_the_bound():
    for prob in _shapes():
        p, q = prob.out_hw
        pad = prob.padding[0]
        for mt in wgg.PARAMS["MT"]:
            tiles_q = -(-q // mt)
            tiles_img = -(-p // mt) * tiles_q
            total = prob.n * tiles_img
            for tb in wgg.PARAMS["TB"]:
                bound = wgg.staged_rows_bound(tb, mt, prob)
                for block in range(-(-total // tb)):
                    first, rows = wgg.staged_rows(block, tb, mt, prob)
                    assert 0 <= rows <= bound, (prob.short(), mt, tb, block, rows, bound)
                    for t in range(block * tb, min(total, (block + 1) * tb)):
                        n, r = divmod(t, tiles_img)
                        h0 = (r // tiles_q) * mt - pad
                        for h in range(max(h0, 0), min(h0 + mt + 2, prob.h)):
                            assert first <= n * prob.h + h < first + rows, (prob.short(), mt, tb, block, t, h)


def test_staged_configurations_need_vl0_and_fit_alexnet():
    space = wgg.space()
    assert space.invalid_reason(dict(wgg.DEFAULT, ST=1, VL=1)).startswith("ST=1")
    assert len(space.valid_configs()) == 90
    for n in (1, 32, 128):
        prob = ConvProblem(n=n, c=384, h=13, w=13, k=256, r=3, s=3, padding=(1, 1))
        assert all(wgg.staged_fits(c, prob) for c in space.valid_configs() if c["ST"])
    wide = ConvProblem(n=1, c=3, h=8, w=20000, k=8, r=3, s=3, padding=(1, 1))  # 8 rows x 80 KB
    assert not wgg.staged_fits(dict(wgg.DEFAULT, ST=1, MT=2, TB=512), wide)  # the host gathers instead
