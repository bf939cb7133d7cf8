"""The TMA wgmma implicit-GEMM family's space, start point, problem rule and launch (CPU); its kernel is checked on
the GPU by tests/test_gpu.py (odd channels_last shapes in bf16 and fp16 within twice cuDNN's error, the same bits
as implicit_gemm_wgmma_h16's twin tile where C % 64 == 0, split-K in CUDA graphs, opcheck, torch.compile) and
compiled by tests/test_nvcc.py."""

from bagf_torch.kernels import family_refuses
from bagf_torch.kernels import implicit_gemm_tma_h16 as th
from bagf_torch.problem import ConvProblem


def _problem(n, c, h, k, r, dtype="bfloat16", layout="nhwc", stride=1, pad=None, dil=1):
    pad = r // 2 if pad is None else pad
    return ConvProblem(n=n, c=c, h=h, w=h, k=k, r=r, s=r, stride=(stride, stride), padding=(pad, pad),
                       dilation=(dil, dil), bias=True, dtype=dtype, layout=layout)


def test_every_valid_config_obeys_the_documented_rules():
    valid = th.space().valid_configs()
    assert len(valid) > 300
    for c in valid:
        g = th.launch(c)
        assert g.threads == 128 * (c["WG"] + 1) and g.bn == 64 * c["MI"] * c["WG"] <= 256 and g.bm == c["WN"]
        assert (g.dtype, g.nhwc, g.tma, g.split, g.stream_k, g.split_cluster, g.polyphase) == \
            (1 + c["DT"], c["NHWC"], 1, c["SPLIT"], c["SK"], c["CR"], c["PP"])
        assert c["SK"] == 0 or c["SPLIT"] == 1
        assert c["MI"] * c["WN"] // 2 <= 128
        assert g.smem == th.smem_bytes(c) == c["STAGES"] * (g.bn + g.bm) * 128 + 1024 + th.stage_bytes(c) \
            <= th.SM90_SMEM_LIMIT - th.STATIC_SMEM
        assert th.stage_bytes(c) == (32 * (g.bn + 4) * 4 if c["SK"] == 2 and not c["NHWC"] else 0)
    assert {c["WN"] for c in valid} == {64, 128, 192, 256} and {c["STAGES"] for c in valid} == {3, 4, 5, 6}
    # SPLIT and CR are launch parameters: configurations that differ only in them share a cubin
    assert len({th.name_expression(c) for c in valid}) == len({th.name(dict(c, SPLIT=1, CR=0)) for c in valid})
    s = th.space()
    assert "accumulators" in s.invalid_reason(dict(th.DEFAULT, WN=256, MI=2))
    assert "shared memory" in s.invalid_reason(dict(th.DEFAULT, WN=256, MI=1, WG=2, STAGES=6))
    assert "SPLIT must be 1" in s.invalid_reason(dict(th.DEFAULT, SK=1, SPLIT=2))
    assert {c["SK"] for c in valid} == {0, 1, 2}
    assert "SPLIT must be 1" in s.invalid_reason(dict(th.DEFAULT, SK=2, SPLIT=4))


def test_names_formats_and_the_problem_rule():
    assert th.name(th.DEFAULT) == "implicit_gemm_tma_h16_bf16_wn128_mi1_wg2_st5_s1_sm90"
    assert th.name_expression(dict(th.DEFAULT, SPLIT=8)) == "bagf::implicit_gemm_tma_h16_conv2d<1, 128, 1, 2, 5, 1, 0>"
    assert th.name_expression(dict(th.DEFAULT, SK=1)) == "bagf::implicit_gemm_tma_h16_conv2d<1, 128, 1, 2, 5, 1, 1>"
    assert th.name_expression(dict(th.DEFAULT, NHWC=0, DT=0)) == ("bagf::implicit_gemm_tma_h16_conv2d<0, 128, 1, 2, 5, 0, "
                                                                  "0>;bagf::nchw_to_nhwc<0>")  # (its input copy)
    assert th.name(dict(th.DEFAULT, SK=1)) == "implicit_gemm_tma_h16_bf16_wn128_mi1_wg2_st5_sk_sm90"
    assert th.name(dict(th.DEFAULT, SK=2)) == "implicit_gemm_tma_h16_bf16_wn128_mi1_wg2_st5_pt_sm90"
    assert th.name_expression(dict(th.DEFAULT, SK=2)) == "bagf::implicit_gemm_tma_h16_conv2d<1, 128, 1, 2, 5, 1, 2>"
    assert th.name(dict(th.DEFAULT, NHWC=0, DT=0)) == "implicit_gemm_tma_h16_fp16_nchw_wn128_mi1_wg2_st5_s1_sm90"
    # a configuration recorded before the knobs is a channels_last one without stream-K
    legacy = {k: v for k, v in th.DEFAULT.items() if k not in ("NHWC", "SK")}
    assert th.name(legacy) == th.name(th.DEFAULT) and th.launch(legacy) == th.launch(th.DEFAULT)
    assert th.name_expression(legacy) == th.name_expression(th.DEFAULT)
    assert th.gpu_arch(th.DEFAULT, "sm_90") == "sm_90a" and "sm_90" in th.arch_rule(th.DEFAULT, "sm_80")
    conv3 = _problem(32, 192, 13, 384, 3)
    nchw = _problem(32, 192, 13, 384, 3, layout="nchw")
    assert th.applies(conv3) is None and th.applies(nchw) is None
    assert "float32" in th.applies(_problem(32, 192, 13, 384, 3, "float32", layout="nchw"))
    assert "nchw" in th.problem_rule(th.DEFAULT, nchw) and th.problem_rule(th.default_for(nchw), nchw) is None
    assert th.default_for(nchw)["NHWC"] == 0
    assert "multiple of 8" in th.applies(_problem(32, 3, 224, 64, 3))  # (stride 1: no polyphase plan either)
    assert th.problem_rule(th.DEFAULT, conv3) is None
    assert "compiled for bfloat16" in th.problem_rule(th.DEFAULT, _problem(32, 192, 13, 384, 3, "float16"))
    # k tiles are a tap's 64 channels: C = 72 takes 2 per tap (the second mostly zeros)
    assert th.k_tiles(conv3) == 27 and th.k_tiles(_problem(1, 72, 13, 64, 3)) == 18
    # what the TMA maps cannot describe stays out of the space (the host would send it to ATen)
    assert "TMA" in th.problem_rule(th.DEFAULT, _problem(2, 16, 64, 16, 3, stride=9))
    assert "TMA" in th.problem_rule(th.DEFAULT, _problem(2, 16, 300, 16, 3, pad=129))
    assert "TMA" in th.problem_rule(th.DEFAULT, _problem(2, 16, 300, 16, 3, dil=64))
    assert th.problem_rule(th.DEFAULT, _problem(2, 16, 300, 16, 3, dil=63)) is None
    assert th.problem_rule(th.DEFAULT, _problem(2, 16, 64, 16, 11, stride=4, pad=2)) is None
    conv3_1 = _problem(1, 192, 13, 384, 3)
    assert th.problem_rule(dict(th.DEFAULT, SPLIT=8), conv3_1) is None  # 27 // 8 = 3 k tiles per slice
    assert "under 2" in th.problem_rule(dict(th.DEFAULT, SPLIT=16), conv3_1)
    assert family_refuses(th.FAMILY, dict(th.DEFAULT, DT=0), conv3_1) is not None


def test_the_start_point_follows_the_grid():
    # AlexNet conv3 at N = 128: 128 x 128 tiles, 5 stages, no split; at N = 1: 64 x 64 tiles split to fill the SMs
    big = th.default_for(_problem(128, 192, 13, 384, 3))
    assert (big["WN"], big["WG"], big["STAGES"], big["SPLIT"]) == (128, 2, 5, 1)
    one = th.default_for(_problem(1, 192, 13, 384, 3))
    assert (one["WN"], one["WG"], one["MI"]) == (64, 1, 1) and one["SPLIT"] > 1
    assert th.tiles(one, _problem(1, 192, 13, 384, 3)) * one["SPLIT"] <= th.H200_SMS
    assert th.default_for(_problem(32, 64, 27, 192, 5))["WN"] == 192
    assert th.default_for(_problem(32, 192, 13, 384, 3, "float16"))["DT"] == 0


def test_split_k_in_clusters_rules_workspace_and_start():
    """CR = 1 (a tile's split-K slices as one thread block cluster, handing over in shared memory): SPLIT 2-8, no
    stream-K, a ring that holds the tile's fp32 sums; no workspace; its own plan name but the workspace twin's cubin;
    its problem rule only asks for 2 k tiles per slice (no workspace limit); the start's cluster twin is the second
    start on an sm_90 GPU where the start splits 2-8 ways, its persistent twin where it has more tiles than SMs."""
    conv3 = _problem(1, 192, 13, 384, 3)
    one = th.default_for(conv3)
    assert one["SPLIT"] in (2, 4, 8) and one["CR"] == 0
    twin = dict(one, CR=1)
    s = th.space()
    assert s.invalid_reason(twin) is None and th.problem_rule(twin, conv3) is None
    assert th.workspace_bytes(twin, conv3) == 0 < th.workspace_bytes(one, conv3)
    assert th.name(twin) == th.name(one).replace(f"_s{one['SPLIT']}_", f"_c{one['SPLIT']}_")
    assert th.name_expression(twin) == th.name_expression(one)
    assert th.start_alternatives(conv3, arch="sm_90") == [twin]
    assert th.start_alternatives(conv3, arch="sm_80") == [] == th.start_alternatives(conv3)
    big = _problem(128, 192, 13, 384, 3)  # no split at N = 128: 507 tiles, the persistent twin instead
    assert th.start_alternatives(big, arch="sm_90") == [dict(th.default_for(big), SK=2)]
    assert th.start_alternatives(_problem(32, 192, 13, 384, 3), arch="sm_90") == []  # (129 tiles: one wave, no split)
    assert "2 to 8" in s.invalid_reason(dict(twin, SPLIT=16)) and "2 to 8" in s.invalid_reason(dict(twin, SPLIT=1))
    # the ring holds every valid tile's sums (the accumulator rule keeps 256 x 256 tiles out); the rule guards it
    assert all(th.cluster_rule(dict(c, CR=1, SPLIT=2)) is None for c in s.valid_configs() if not c["SK"])
    assert "ring" in th.cluster_rule(dict(th.DEFAULT, WN=256, MI=2, WG=2, STAGES=3, SPLIT=2, CR=1))
    # one k tile per slice is refused as the workspace plan's is; a workspace past the limit is not a reason
    assert "under 2" in th.problem_rule(dict(twin, SPLIT=8), _problem(1, 64, 13, 64, 1))
    huge = _problem(64, 512, 56, 512, 3)
    wide = dict(th.DEFAULT, WN=64, MI=1, WG=1, STAGES=4, SPLIT=8)
    assert "MiB" in th.problem_rule(wide, huge) and th.problem_rule(dict(wide, CR=1), huge) is None


def test_wide_and_narrow_second_starts_follow_their_rules(monkeypatch):
    """The persistent 256-channel tile where K is a multiple of 256 and its grid has four waves or more; the
    persistent 64-channel tile where it fills at least 0.15 more of the last wave than the start's 128 channels;
    each measured after the start's own twin, on sm_90 GPUs only."""
    r256 = _problem(32, 256, 56, 256, 3)  # 784 tiles of 256 x 128: 5.9 waves on 132 SMs
    start = th.default_for(r256)
    wide = dict(start, WN=256, MI=1, WG=2, SK=2, STAGES=4)  # (5 stages of 256 + 128 rows do not fit)
    assert th.start_alternatives(r256, arch="sm_90") == [dict(start, SK=2), wide]
    assert th.deepest_ring(wide, 5) == 4 and th.deepest_ring(start, 5) == 5 and th.deepest_ring(start, 4) == 4
    assert th.wide_alternatives(start, r256, "sm_80") == [] == th.start_alternatives(r256)
    nchw = _problem(32, 256, 56, 256, 3, layout="nchw")  # (persistent NCHW tiles stage stores: 4 stages still fit)
    assert th.wide_alternatives(th.default_for(nchw), nchw, "sm_90") == [dict(th.default_for(nchw), **{
        "WN": 256, "SK": 2, "STAGES": 4})]
    # K = 384 pads a 256-channel tile; AlexNet conv4 at N = 128 (K = 256) has 169 wide tiles, 1.3 waves
    assert th.wide_alternatives(start, _problem(32, 256, 56, 384, 3), "sm_90") == []
    conv4 = _problem(128, 384, 13, 256, 3)
    assert th.tiles(wide, conv4) == 169 and th.wide_alternatives(th.default_for(conv4), conv4, "sm_90") == []
    few = _problem(11, 256, 56, 256, 3)  # 270 wide tiles: 2 waves
    assert th.wide_alternatives(th.default_for(few), few, "sm_90") == []
    edge = _problem(22, 256, 56, 256, 3)  # 539 wide tiles >= 4 x 132
    assert th.tiles(wide, edge) == 539 and th.wide_alternatives(th.default_for(edge), edge, "sm_90") != []
    assert th.wide_alternatives(th.default_for(edge), edge, "sm_90", sms=135) == []  # 540 > 539
    assert th.wide_alternatives(dict(start, WN=192), r256, "sm_90") == []  # only from the 128-channel start

    r128 = _problem(32, 128, 28, 128, 3)  # 196 tiles of 128 x 128 (1.48 waves), 392 of 64 x 128 (2.97)
    start = th.default_for(r128)
    narrow = dict(start, WN=64, SK=2)
    assert abs(th.wave_fill(start, r128) - 196 / 264) < 1e-9 and abs(th.wave_fill(narrow, r128) - 392 / 396) < 1e-9
    assert th.start_alternatives(r128, arch="sm_90") == [dict(start, SK=2), narrow]
    assert th.narrow_alternatives(start, r128, "sm_80") == []
    assert th.narrow_alternatives(dict(start, SK=2), r128, "sm_90") == []  # (a persistent start is its own twin)
    # AlexNet conv4 at N = 128: 338 tiles (0.85 of 3 waves) against 676 (0.85 of 6): no gain, no narrow start
    assert th.narrow_alternatives(th.default_for(conv4), conv4, "sm_90") == []
    # a grid of one wave or less keeps the start (3x3 128@28 at N = 21: 129 tiles), also where the narrow tiles would
    # fill more of it (N = 8: 49 tiles split 2 ways, a fill of 0.37 against 0.74: split-K serves it)
    one_wave = _problem(21, 128, 28, 128, 3)
    assert th.tiles(start, one_wave) == 129
    assert th.narrow_alternatives(th.default_for(one_wave), one_wave, "sm_90") == []
    small = _problem(8, 128, 28, 128, 3)
    assert th.default_for(small)["SPLIT"] == 2 and th.tiles(start, small) == 49
    assert th.wave_fill(dict(narrow, SPLIT=1), small) - th.wave_fill(start, small) > th.NARROW_MIN_GAIN
    assert th.narrow_alternatives(th.default_for(small), small, "sm_90") == []
    # the gain's threshold: a gain equal to it passes, a gain just under it does not
    gain = th.wave_fill(narrow, r128) - th.wave_fill(start, r128)
    assert 0.24 < gain < 0.26 and th.NARROW_MIN_GAIN == 0.15
    monkeypatch.setattr(th, "NARROW_MIN_GAIN", gain)
    assert th.narrow_alternatives(start, r128, "sm_90") == [narrow]
    monkeypatch.setattr(th, "NARROW_MIN_GAIN", gain + 1e-9)
    assert th.narrow_alternatives(start, r128, "sm_90") == []
    monkeypatch.setattr(th, "WIDE_MIN_WAVES", 1)  # (539 tiles: a grid of exactly the waves asked for passes)
    assert th.wide_alternatives(th.default_for(edge), edge, "sm_90", sms=539) != []


def test_unsplit_second_start_where_the_start_splits_two_warpgroup_tiles():
    """Where the start splits 128-pixel tiles of two warpgroups to fill one wave, the one-warpgroup tile of 64 pixels
    without a split, the deepest ring of at most 6 stages (those tiles fit the wave: the start splits only where its
    tiles fill at most half of it); on sm_90 GPUs only."""
    r256 = _problem(1, 256, 56, 256, 3)  # 50 tiles of 128 x 128 split 2 ways; 98 tiles of 64 x 128
    start = th.default_for(r256)
    assert (start["WN"], start["MI"], start["WG"], start["SPLIT"], start["CR"]) == (128, 1, 2, 2, 0)
    whole = dict(start, WG=1, SPLIT=1, STAGES=6)
    assert th.tiles(whole, r256) == 98 and th.tiles(start, r256) == 50
    assert th.start_alternatives(r256, arch="sm_90") == [dict(start, CR=1), whole]
    assert th.unsplit_alternatives(start, r256, "sm_80") == [] == th.start_alternatives(r256)
    nchw = _problem(1, 256, 56, 256, 3, layout="nchw")
    assert th.unsplit_alternatives(th.default_for(nchw), nchw, "sm_90") == [dict(th.default_for(nchw), WG=1,
                                                                                   SPLIT=1, STAGES=6)]
    # the unsplit tiles fit one wave wherever the rule fires, on any number of SMs
    fired = 0
    for sms in (66, 78, 98, 114, 132, 170):
        for n in (1, 2, 4, 8, 16, 32):
            for c, h, k in ((256, 56, 256), (128, 28, 128), (64, 56, 64), (512, 7, 512), (192, 13, 384)):
                p = _problem(n, c, h, k, 3)
                for whole_n in th.unsplit_alternatives(th.default_for(p, sms), p, "sm_90", sms):
                    fired += 1
                    assert th.tiles(whole_n, p) <= sms and th.problem_rule(whole_n, p) is None
                    assert th.space().is_valid(whole_n)
    assert fired > 20
    # only from a split start of two warpgroups of one 64-pixel row block each
    assert th.unsplit_alternatives(dict(start, SPLIT=1), r256, "sm_90") == []
    assert th.unsplit_alternatives(dict(start, WG=1), r256, "sm_90") == []
    assert th.unsplit_alternatives(dict(start, MI=2), r256, "sm_90") == []
    # a start of one warpgroup already (3x3 128@28 at N = 1: 64 x 64 tiles split 4 ways), or one that does not
    # split (3x3 256@56 at N = 32), gets none
    r128 = _problem(1, 128, 28, 128, 3)
    assert th.default_for(r128)["WG"] == 1 and th.unsplit_alternatives(th.default_for(r128), r128, "sm_90") == []
    r256_32 = _problem(32, 256, 56, 256, 3)
    assert th.unsplit_alternatives(th.default_for(r256_32), r256_32, "sm_90") == []


def test_polyphase_plans_take_strided_problems_of_few_channels():
    conv1 = _problem(32, 3, 224, 64, 11, stride=4, pad=2)  # AlexNet's conv1
    form = th.polyphase_problem(conv1)
    assert (form.c, form.h, form.w, form.r, form.s) == (48, 57, 57, 3, 3)
    assert (form.stride, form.padding, form.dilation, form.out_hw) == ((1, 1), (0, 0), (1, 1), conv1.out_hw)
    assert (form.n, form.k, form.dtype, form.layout, form.bias) == (32, 64, "bfloat16", "nhwc", True)
    # C = 3 has no plan but a polyphase one, which is the start
    assert th.applies(conv1) is None
    start = th.default_for(conv1)
    assert start["PP"] == 1 and th.problem_rule(start, conv1) is None
    assert "multiple of 8" in th.problem_rule(dict(start, PP=0), conv1)
    assert th.features(conv1, start) == th.grid_features(start, conv1, th.k_tiles(form)) and th.k_tiles(form) == 9
    # stream-K's grid counts the form's k tiles (9), not the strided problem's (121 taps of one channel block)
    conv1_n1 = _problem(1, 3, 224, 64, 11, stride=4, pad=2)
    sk = dict(th.default_for(conv1_n1), SK=1, SPLIT=1, CR=0)
    assert th.workspace_bytes(sk, conv1_n1) == th.workspace_bytes(sk, conv1_n1, 9) < th.workspace_bytes(sk, conv1_n1,
                                                                                                        121)
    g = th.launch(start)
    assert g.polyphase == 1 and g.tma == 1 and g.dtype == 2
    assert "_bf16_pp_wn" in th.name(start)
    assert th.name_expression(start).endswith(";bagf::polyphase_gather<1, 1>;bagf::polyphase_weight<1>")
    nchw = _problem(1, 3, 224, 64, 11, "float16", layout="nchw", stride=4, pad=2)
    expr = th.name_expression(th.default_for(nchw))
    assert expr.endswith(";bagf::polyphase_gather<0, 0>;bagf::polyphase_weight<0>") and "nchw_to_nhwc" not in expr
    assert "_fp16_nchw_pp_wn" in th.name(th.default_for(nchw))
    # unequal strides, channels rounded up to 8, taps rounded up: 2 x 3 phases of 5 channels = 30 -> 32
    odd = ConvProblem(n=3, c=5, h=31, w=29, k=24, r=7, s=5, stride=(2, 3), padding=(3, 1), bias=False,
                      dtype="float16", layout="nhwc")
    f = th.polyphase_problem(odd)
    p, q = odd.out_hw
    assert (f.c, f.r, f.s, f.h, f.w, f.out_hw) == (32, 4, 2, p + 3, q + 1, (p, q))
    assert th.problem_rule(th.default_for(odd), odd) is None
    # what no polyphase plan takes
    assert "strides" in th.applies(_problem(2, 3, 32, 16, 3))  # stride 1
    assert "strides" in th.polyphase_refuses(_problem(2, 3, 32, 16, 3, stride=2, dil=2))
    assert "strides" in th.polyphase_refuses(_problem(2, 3, 80, 16, 11, stride=9))
    assert "fewer than 64" in th.polyphase_refuses(_problem(2, 64, 32, 16, 3, stride=2))
    assert "padding" in th.polyphase_refuses(_problem(1, 3, 8, 8, 3, stride=8, pad=65536))
    assert "fewer than 64" in th.problem_rule(dict(th.DEFAULT, PP=1), _problem(2, 64, 32, 16, 3, stride=2))
    # a C % 8 == 0 problem of few channels may take either
    few = _problem(2, 16, 32, 16, 3, stride=2)
    assert th.default_for(few)["PP"] == 0
    assert th.problem_rule(dict(th.default_for(few), PP=1, SPLIT=1, CR=0), few) is None
    assert family_refuses("implicit_gemm_tma_h16", dict(start, PP=0), conv1) is not None
    assert family_refuses("implicit_gemm_tma_h16", start, conv1) is None


def test_polyphase_form_computes_the_strided_convolution():
    """The form as csrc/kernels/conv_params.h defines it (channel (ph s_w + pw) C + c of form pixel (u, v) holds the
    padded input at (s_h u + ph, s_w v + pw); the weight's tap (r', s') of that channel is w[c][s_h r' + ph][s_w s' +
    pw]), built here in float64 with the extents of ``polyphase_problem``: a stride-1 unpadded conv of the two equals
    the strided one. The kernels that build it on the GPU are checked against F.conv2d by tests/test_gpu.py."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    for n, c, h, w, k, r, s, stride, pad in ((2, 3, 227, 227, 8, 11, 11, (4, 4), (2, 2)),
                                              (3, 5, 31, 29, 6, 7, 5, (2, 3), (3, 1)),
                                              (1, 1, 9, 12, 2, 2, 4, (3, 2), (0, 2)),
                                              (1, 3, 17, 17, 4, 3, 3, (1, 2), (1, 1))):
        problem = ConvProblem(n=n, c=c, h=h, w=w, k=k, r=r, s=s, stride=stride, padding=pad, dtype="float16",
                              layout="nhwc")
        f = th.polyphase_problem(problem)
        x = torch.randn(n, c, h, w, dtype=torch.float64, generator=g)
        wt = torch.randn(k, c, r, s, dtype=torch.float64, generator=g)
        sh, sw = stride
        xf = torch.zeros(n, f.c, f.h, f.w, dtype=torch.float64)
        wf = torch.zeros(k, f.c, f.r, f.s, dtype=torch.float64)
        xpad = F.pad(x, (pad[1], sh * f.w + sw, pad[0], sh * f.h + sh))  # (room for every form pixel's window)
        for ph in range(sh):
            for pw in range(sw):
                ch = slice((ph * sw + pw) * c, (ph * sw + pw + 1) * c)
                xf[:, ch] = xpad[:, :, ph::sh, pw::sw][:, :, :f.h, :f.w]
                taps = wt[:, :, ph::sh, pw::sw]
                wf[:, ch, :taps.shape[2], :taps.shape[3]] = taps
        ref = F.conv2d(x, wt, stride=stride, padding=pad)
        got = F.conv2d(xf, wf)
        assert got.shape[2:] == ref.shape[2:] == f.out_hw
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
