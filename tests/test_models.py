"""CPU tests: the shipped AlexNet (torchvision's names and shapes), model names, and tune_model's discovery,
deduplication and report with a fake tuning step."""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import types

import pytest
import torch
from torch import nn

import bagf_torch
from bagf_torch import models, pretune
from bagf_torch.nn import TunedConv2d
from bagf_torch.problem import ConvProblem

# torchvision.models.alexnet().state_dict(): names and shapes (torchvision 0.2x, unchanged since 0.13)
TORCHVISION_ALEXNET = {
    "features.0.weight": (64, 3, 11, 11), "features.0.bias": (64,),
    "features.3.weight": (192, 64, 5, 5), "features.3.bias": (192,),
    "features.6.weight": (384, 192, 3, 3), "features.6.bias": (384,),
    "features.8.weight": (256, 384, 3, 3), "features.8.bias": (256,),
    "features.10.weight": (256, 256, 3, 3), "features.10.bias": (256,),
    "classifier.1.weight": (4096, 9216), "classifier.1.bias": (4096,),
    "classifier.4.weight": (4096, 4096), "classifier.4.bias": (4096,),
    "classifier.6.weight": (1000, 4096), "classifier.6.bias": (1000,),
}


class FakeCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA, so TunedConv2d's real support checks pass on a CPU and it asks
    the runtime for a plan exactly as on a GPU (get_device() is -1)."""

    @property
    def is_cuda(self):
        return True


def fake_cuda(*shape):
    return torch.randn(*shape).as_subclass(FakeCuda)


def test_alexnet_has_torchvision_names_and_shapes():
    sd = models.alexnet(tuned=False).state_dict()
    assert {k: tuple(v.shape) for k, v in sd.items()} == TORCHVISION_ALEXNET
    assert list(sd) == list(TORCHVISION_ALEXNET)  # same order, so strict loading in either direction works


def test_alexnet_convs_and_geometry():
    net = models.alexnet()
    convs = {name: m for name, m in net.named_modules() if isinstance(m, nn.Conv2d)}
    assert list(convs) == ["features.0", "features.3", "features.6", "features.8", "features.10"]
    assert all(type(m) is TunedConv2d for m in convs.values())
    geometry = [(m.kernel_size, m.stride, m.padding) for m in convs.values()]
    assert geometry == [((11, 11), (4, 4), (2, 2)), ((5, 5), (1, 1), (2, 2)), ((3, 3), (1, 1), (1, 1)),
                        ((3, 3), (1, 1), (1, 1)), ((3, 3), (1, 1), (1, 1))]
    assert sum(isinstance(m, nn.MaxPool2d) for m in net.features) == 3
    assert isinstance(net.avgpool, nn.AdaptiveAvgPool2d) and net.avgpool.output_size == (6, 6)
    assert type(models.alexnet(tuned=False).features[0]) is nn.Conv2d


def test_alexnet_state_dict_round_trip_and_cpu_forward_equals_plain_convs():
    torch.manual_seed(0)
    plain = models.alexnet(tuned=False).eval()
    tuned = models.alexnet(tuned=True).eval()
    tuned.load_state_dict(plain.state_dict(), strict=True)
    plain.load_state_dict(tuned.state_dict(), strict=True)
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        torch.testing.assert_close(tuned(x), plain(x), rtol=0, atol=0)  # CPU: the fallback is nn.Conv2d itself
    assert tuned(x).shape == (2, 1000)


def test_build_names():
    assert isinstance(models.build("alexnet"), models.AlexNet)
    assert isinstance(models.build(" AlexNet ", tuned=False).features[0], nn.Conv2d)
    with pytest.raises(models.ModelError, match="unknown model 'resnet'.*torchvision:resnet18"):
        models.build("resnet")
    assert models.input_size("torchvision:inception_v3") == 299 and models.input_size("alexnet") == 224
    # checked without building (the tune command checks the name first and builds once)
    assert models.check(" alexnet") is None
    with pytest.raises(models.ModelError, match="unknown model 'resnet'"):
        models.check("resnet")
    # built on the default device: here no memory at all
    with torch.device("meta"):
        net = models.build("alexnet")
    assert {p.device.type for p in net.parameters()} == {"meta"} and isinstance(net.features[0], TunedConv2d)


def test_torchvision_models():
    try:
        import torchvision  # noqa: F401
    except ImportError:
        with pytest.raises(models.ModelError, match="torchvision is not installed.*pip install torchvision"):
            models.build("torchvision:resnet18")
        pytest.skip("torchvision is not installed: checked the error; the model itself needs torchvision")
    net = models.build("torchvision:resnet18")
    assert any(isinstance(m, TunedConv2d) for m in net.modules())
    with pytest.raises(models.ModelError, match="no classification model"):
        models.build("torchvision:not_a_model")


# ---- discovery and tune_model ------------------------------------------------------------------------

def _record(problem: ConvProblem, time_us: float, aten_us: float, family="implicit_gemm", cached=False):
    from bagf_torch.kernels import implicit_gemm as ig

    plan = dict(problem=problem.as_dict(), env={"gpu": "Fake"}, family=family,
                config=None if family == "aten" else dict(ig.DEFAULT), time_us=time_us, aten_us=aten_us,
                default_us=None, evaluations=7, tune_seconds=1.5, cubin_digests=[])
    return pretune.make_record("key-" + problem.short(), plan, cached=cached)


class FakeStep:
    """Tunes nothing: reports two trials and returns a winner 2x faster than "cuDNN"; counts its calls."""

    def __init__(self):
        self.calls: list[ConvProblem] = []

    def __call__(self, problem, device, progress):
        self.calls.append(problem)
        progress.cudnn(100.0)
        progress.trial("ok", 50.0)
        progress.trial("wrong", None)
        return _record(problem, 50.0, 100.0)


def _two_branch_model():
    """Two layers with the same problem (dedup), one unsupported layer (groups=2) and a plain nn.Conv2d."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Conv2d(3, 8, 3, padding=1)
            self.b = nn.Conv2d(3, 8, 3, padding=1)
            self.g = nn.Conv2d(8, 8, 3, padding=1, groups=2)
            self.c = nn.Conv2d(8, 4, 1)

        def forward(self, x):
            return self.c(self.g(self.a(x) + self.b(x)))

    return bagf_torch.convert(Net())


def test_discover_records_what_the_layers_would_ask_and_restores_state(monkeypatch):
    model = _two_branch_model().train()
    had = {(torch.Size((9, 9, 9, 9)), 0, False): model.a._kernel_entry(123, (1, 1))}  # a plan this layer already had
    model.a._bagf_plans.update(had)
    found = pretune.discover(model, [fake_cuda(2, 3, 16, 16), fake_cuda(5, 3, 16, 16), fake_cuda(2, 3, 16, 16)])
    tf32 = torch.backends.cudnn.allow_tf32  # part of the problem, as in nn.py
    pa = ConvProblem(n=2, c=3, h=16, w=16, k=8, r=3, s=3, padding=(1, 1), tf32=tf32)
    pc = ConvProblem(n=2, c=8, h=16, w=16, k=4, r=1, s=1, tf32=tf32)
    assert found.problems[:2] == [pa, pc]
    assert [p.n for p in found.problems] == [2, 2, 5, 5]  # a and b share one problem; N=2 twice is one
    assert found.layers[pa] == ["a", "b"] and found.layers[pc] == ["c"]
    assert found.devices[pa] == -1
    assert set(found.unsupported) == {("g", "groups > 1 (grouped and depthwise convs are not tuned yet)")}
    assert found.calls == 12
    # nothing left behind: the layer's own plans, the training flag, the runtime's lookup
    assert model.a._bagf_plans == had and model.b._bagf_plans == {}
    assert model.training and model.a.training
    from bagf_torch import runtime

    assert "plan_handle" not in vars(runtime.get())


def test_discover_counts_each_problems_calls_per_forward():
    found = pretune.discover(_two_branch_model(), [fake_cuda(2, 3, 16, 16), fake_cuda(5, 3, 16, 16),
                                                   fake_cuda(2, 3, 16, 16)])
    tf32 = torch.backends.cudnn.allow_tf32
    pa = ConvProblem(n=2, c=3, h=16, w=16, k=8, r=3, s=3, padding=(1, 1), tf32=tf32)
    pc = ConvProblem(n=2, c=8, h=16, w=16, k=4, r=1, s=1, tf32=tf32)
    assert found.uses[pa] == {0: 2, 2: 2} and found.uses[pc] == {0: 1, 2: 1}  # a and b call pa once each
    assert found.stock_us == {}  # inputs off the GPU: nothing timed


def test_discover_counts_a_layer_called_again_with_the_same_shape():
    class Loop(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(8, 8, 3, padding=1)

        def forward(self, x):
            for _ in range(4):
                x = self.conv(x)
            return x

    model = bagf_torch.convert(Loop())
    found = pretune.discover(model, fake_cuda(2, 8, 8, 8))
    assert found.calls == 4 and len(found.problems) == 1
    assert found.uses[found.problems[0]] == {0: 4}
    assert model.conv._bagf_plans == {}  # the memo as it was


class FakeCuda0(FakeCuda):
    """A FakeCuda on device 0 (get_device): its problems are on a GPU, for time_stock."""

    def get_device(self):
        return 0


def test_time_stock_times_each_problem_on_its_gpu_and_survives_a_failed_timing(monkeypatch, caplog):
    asked = []

    def fake_stock(problem, device):
        asked.append((problem, device))
        if problem.n == 5 and problem.k == 4:
            raise RuntimeError("CUDA error: out of memory")
        return 10.0 * problem.n

    monkeypatch.setattr(pretune, "stock_us", fake_stock)
    xs = [torch.randn(2, 3, 16, 16).as_subclass(FakeCuda0), torch.randn(5, 3, 16, 16).as_subclass(FakeCuda0)]
    found = pretune.discover(_two_branch_model(), xs)
    assert found.stock_us == {} and not asked  # discovery alone times nothing
    with caplog.at_level(logging.WARNING, logger="bagf_torch"):
        got = pretune.time_stock(found)
    assert [a[1] for a in asked] == [0] * 4 and [a[0] for a in asked] == found.problems
    failed = [p for p in found.problems if p.n == 5 and p.k == 4]
    assert got == {p: 10.0 * p.n for p in found.problems if p not in failed}  # the others kept
    assert any("timing torch's conv failed on 1 problems" in r.getMessage() and "out of memory" in r.getMessage()
               for r in caplog.records)
    found.stock_us = got  # the N=5 forward lacks one timing: the estimate splits it
    by_estimate = pretune.allot_seconds(dataclasses.replace(found, stock_us={}), 7.0)
    split = pretune.allot_seconds(found, 7.0)
    assert all(split[p] == by_estimate[p] for p in found.problems if p.n == 5)


def _resnet_like_discovery(n=32, stock=None):
    """Three problems of one forward: a 3x3 layer used 4 times, a 3x3 one used once, a small 1x1 stride-2 one."""
    big = ConvProblem(n=n, c=64, h=56, w=56, k=64, r=3, s=3, padding=(1, 1), bias=False)
    mid = ConvProblem(n=n, c=64, h=56, w=56, k=128, r=3, s=3, stride=(2, 2), padding=(1, 1), bias=False)
    small = ConvProblem(n=n, c=64, h=56, w=56, k=128, r=1, s=1, stride=(2, 2), bias=False)
    found = pretune.Discovery(problems=[big, mid, small])
    found.uses = {big: {0: 4}, mid: {0: 1}, small: {0: 1}}
    if stock is not None:
        found.stock_us = dict(zip((big, mid, small), stock))
    return found, (big, mid, small)


def test_allot_seconds_gives_the_full_budget_to_a_fair_share_and_less_in_proportion():
    found, (big, mid, small) = _resnet_like_discovery()
    est = {p: pretune.estimated_seconds(p) for p in (big, mid, small)}
    assert est[big] > est[mid] > est[small] > 0
    got = pretune.allot_seconds(found, 7.0)
    total = 4 * est[big] + est[mid] + est[small]
    assert got[big] == 7.0
    assert got[mid] == pytest.approx(max(pretune.MIN_SHARE_SECONDS, 7.0 * 3 * est[mid] / total))
    assert got[small] == pretune.MIN_SHARE_SECONDS < got[mid] < 7.0
    assert pretune.allot_seconds(found, 1.5) == {big: 1.5, mid: 1.5, small: 1.5}  # never above the budget asked for
    # measured stock times win over the estimate: here the 1x1 layer is the slow one
    found, (big, mid, small) = _resnet_like_discovery(stock=[100.0, 50.0, 900.0])
    got = pretune.allot_seconds(found, 7.0)
    assert got[small] == 7.0 and got[big] == pytest.approx(7.0 * 3 * 4 * 100 / (4 * 100 + 50 + 900))  # 4 calls
    # an even split keeps everyone at the budget
    found, (big, mid, small) = _resnet_like_discovery(stock=[300.0, 300.0, 300.0])
    found.uses = {big: {0: 1}, mid: {0: 1}, small: {0: 1}}
    assert pretune.allot_seconds(found, 7.0) == {big: 7.0, mid: 7.0, small: 7.0}
    # a problem of two forwards takes its larger share: small next to a tinier one in the second
    found, (big, mid, small) = _resnet_like_discovery(stock=[300.0, 300.0, 30.0])
    tiny = ConvProblem(n=1, c=8, h=8, w=8, k=8, r=1, s=1)
    found.problems.append(tiny)
    found.uses = {big: {0: 1}, mid: {0: 1}, small: {0: 1, 1: 1}, tiny: {1: 1}}
    found.stock_us[tiny] = 3.0
    got = pretune.allot_seconds(found, 7.0)
    assert got[small] == 7.0 and got[tiny] == pretune.MIN_SHARE_SECONDS  # 30 / 630 of the first pass: 2 s
    # a forward whose problems were not all timed falls back to the estimate for all of them
    found, (big, mid, small) = _resnet_like_discovery(stock=[100.0, 50.0, 900.0])
    del found.stock_us[mid]
    assert pretune.allot_seconds(found, 7.0) == pretune.allot_seconds(_resnet_like_discovery()[0], 7.0)


def test_tune_model_allots_seconds_by_share_unless_even(capsys):
    class AllottedStep(FakeStep):
        seconds = 7.0

        def __init__(self):
            super().__init__()
            self.allotted = None

        def per_problem_seconds(self):
            return self.seconds

        def allot(self, seconds):
            self.allotted = dict(seconds)

        def __call__(self, problem, device, progress):
            rec = super().__call__(problem, device, progress)
            rec["budget_seconds"] = self.allotted.get(problem, self.seconds) if self.allotted else self.seconds
            return rec

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.big = nn.Conv2d(64, 64, 3, padding=1)
            self.small = nn.Conv2d(64, 4, 1, stride=4)

        def forward(self, x):
            return self.small(self.big(x))

    step = AllottedStep()
    report = bagf_torch.tune_model(bagf_torch.convert(Net()), fake_cuda(2, 64, 32, 32), step=step, progress=False)
    by_k = {r.problem.k: r for r in report.rows}
    assert step.allotted[by_k[64].problem] == 7.0 and step.allotted[by_k[4].problem] == pretune.MIN_SHARE_SECONDS
    assert by_k[4].budget_seconds == pretune.MIN_SHARE_SECONDS
    text = str(report)
    assert "1 at 7.0 s, 1 at 2.0-2.0 s (tune --even" in text and "1.5/2.0" in text
    assert pretune.ModelReport.from_dict(json.loads(report.to_json())).rows[1].budget_seconds == 2.0
    # the same step again, even: no split is left from the first run
    report = bagf_torch.tune_model(bagf_torch.convert(Net()), fake_cuda(2, 64, 32, 32), step=step, progress=False,
                                   even=True)
    assert step.allotted == {} and "share" not in str(report)
    assert {r.budget_seconds for r in report.rows} == {7.0}


def test_discover_needs_tuned_layers():
    with pytest.raises(ValueError, match="no TunedConv2d layers .1 plain nn.Conv2d.; call bagf_torch.convert"):
        pretune.discover(nn.Sequential(nn.Conv2d(3, 4, 3)), torch.randn(1, 3, 8, 8))


def test_tune_model_tunes_each_unique_problem_once_and_reports(capsys):
    model = _two_branch_model()
    step = FakeStep()
    report = bagf_torch.tune_model(model, [fake_cuda(2, 3, 16, 16), fake_cuda(5, 3, 16, 16)], step=step,
                                   progress=False)
    assert len(step.calls) == len(set(step.calls)) == 4
    assert [r.problem.n for r in report.rows] == [2, 2, 5, 5]
    row = report.rows[0]
    assert row.layers == ["a", "b"] and row.speedup == 2.0 and row.evaluations == 7 and not row.cached
    assert row.plan == "implicit_gemm_bm64_bn64_bk8_tm4_tn4_db1_v4_sm90"
    # one forward at N=2: a, b (same problem) and c -> 3 calls of cuDNN 100 us vs planned 50 us
    assert report.conv_time_by_batch() == {2: (300.0, 150.0), 5: (300.0, 150.0)}
    text = str(report)
    assert "N2 C3 16x16 -> K8 16x16 k3x3 s1 p1" in text and "a,b" in text and "2.00x" in text
    assert "not tuned: g: groups > 1" in text and "4 unique problems, 4 tuned now" in text
    assert capsys.readouterr().err == ""  # progress=False is silent
    again = pretune.ModelReport.from_dict(json.loads(report.to_json()))
    assert str(again) == text
    assert json.loads(report.to_json())["conv_time_by_batch"]["2"] == {"cudnn_us": 300.0, "planned_us": 150.0}


def test_tune_model_compiles_every_start_point_up_front_through_the_steps_prepare():
    """A step with ``prepare`` hears the whole share of (problem, device) pairs once, before its first problem is
    tuned; the report says how many configurations that wave asked for and how long it took."""
    events = []

    class PreparingStep(FakeStep):
        def prepare(self, problems):
            events.append(("prepare", list(problems)))
            return 9

        def __call__(self, problem, device, progress):
            events.append(("tune", problem))
            return super().__call__(problem, device, progress)

    report = bagf_torch.tune_model(_two_branch_model(), [fake_cuda(2, 3, 16, 16), fake_cuda(5, 3, 16, 16)],
                                   step=PreparingStep(), progress=False)
    assert [e[0] for e in events] == ["prepare"] + ["tune"] * 4
    assert events[0][1] == [(e[1], -1) for e in events[1:]]  # every problem, in tuning order, with its device
    assert report.prefetch["configs"] == 9 and report.prefetch["seconds"] >= 0
    assert "compiling 9 start points up front" in str(report)
    assert pretune.ModelReport.from_dict(json.loads(report.to_json())).prefetch == report.prefetch


def test_tune_model_prepares_the_fused_pairs_kernels_and_relu_rule_on_each_device_in_its_dtypes(monkeypatch):
    """tune_model's own step (none passed) first builds a fused model's pooling kernel and asks the ReLU epilogue's
    sign rule on each device its problems run on, in their dtypes, so that a first call inside a CUDA graph capture
    runs both fused."""
    from bagf_torch import epilogue

    asked = []
    monkeypatch.setattr(pretune, "RuntimeTuneStep", lambda **kw: FakeStep())
    monkeypatch.setattr(pretune, "stock_us", lambda problem, device: 10.0)
    monkeypatch.setattr(epilogue, "prepare", lambda model, device: asked.append(("pool", device)) or False)
    monkeypatch.setattr(epilogue, "prepare_relu",
                        lambda model, device, dtypes: asked.append(("relu", device, set(dtypes))) or True)
    model = bagf_torch.convert(nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 1)))
    report = bagf_torch.tune_model(model, [torch.randn(2, 3, 16, 16).as_subclass(FakeCuda0)], progress=False)
    assert report.tuned == 2
    assert asked == [("pool", 0), ("relu", 0, {torch.float32})]


def test_tune_model_compiles_the_start_points_while_torchs_conv_is_timed(monkeypatch):
    """The start points' compile wave (host) runs beside the stock timing (GPU), not after it: each side waits for
    the other to have started, so run one after the other, the first would give up waiting. The report says
    where the time before the first problem went."""
    started = {"prepare": threading.Event(), "stock": threading.Event()}
    seen = {}

    def fake_stock(problem, device):
        started["stock"].set()
        seen.setdefault("prepare_running", started["prepare"].wait(5.0))
        return 10.0 * problem.n

    class PreparingStep(FakeStep):
        def per_problem_seconds(self):
            return 7.0

        def allot(self, seconds):
            self.allotted = dict(seconds)

        def prepare(self, problems):
            started["prepare"].set()
            seen["stock_running"] = started["stock"].wait(5.0)
            seen["prepare_thread"] = threading.current_thread().name
            return 3

    monkeypatch.setattr(pretune, "stock_us", fake_stock)
    xs = [torch.randn(2, 3, 16, 16).as_subclass(FakeCuda0)]
    step = PreparingStep()
    report = bagf_torch.tune_model(_two_branch_model(), xs, step=step, progress=False)
    assert seen["stock_running"] and seen["prepare_running"], seen
    assert seen["prepare_thread"] != threading.current_thread().name
    assert report.prefetch["configs"] == 3 and len(step.allotted) == 2
    assert set(report.setup) == {"discover_s", "stock_s", "prefetch_wait_s", "before_tuning_s"}
    assert report.setup["before_tuning_s"] >= report.setup["stock_s"] >= 0
    assert pretune.ModelReport.from_dict(json.loads(report.to_json())).setup == report.setup


def test_tune_model_survives_a_failed_compile_wave(monkeypatch, caplog):
    class FailingStep(FakeStep):
        def prepare(self, problems):
            raise RuntimeError("nvrtc is gone")

    with caplog.at_level(logging.WARNING, logger="bagf_torch"):
        report = bagf_torch.tune_model(_two_branch_model(), fake_cuda(2, 3, 16, 16), step=FailingStep(),
                                       progress=False)
    assert len(report.rows) == 2 and report.prefetch == {}
    assert any("compiling the start points up front failed (RuntimeError: nvrtc is gone)" in r.getMessage()
               for r in caplog.records)


def test_tune_model_progress_lines_without_a_terminal(capsys):
    bagf_torch.tune_model(_two_branch_model(), fake_cuda(1, 3, 8, 8), step=FakeStep(), progress=None)
    err = capsys.readouterr().err  # pytest's stderr is not a terminal: one line per problem, no bar
    assert err.count("tuned  N1") == 2 and "2.00x vs cuDNN" in err and "\r" not in err


def test_tune_model_progress_bar_shows_problem_trials_best():
    import io

    from tqdm import tqdm

    bar = pretune._Bar(2, 4, True, "tuning", 0)
    bar._bar.fp = io.StringIO()  # capture what it draws
    bar.start(ConvProblem(n=1, c=3, h=8, w=8, k=4, r=3, s=3))
    bar.cudnn(20.0)
    bar.trial("ok", 30.0)
    bar.trial("ok", 25.0)
    bar.trial("compile", None)
    assert isinstance(bar._bar, tqdm) and bar._bar.n == 3
    assert "N1 C3 8x8 -> K4 6x6 k3x3 s1 p0 | trials 3 | best 25.0us cuDNN 20.0us" in bar._bar.postfix
    bar.finish("done")
    assert bar._bar.n == 4  # the problem's share of the bar is filled when it ends early
    bar.close()


def test_the_bars_per_problem_lines_go_to_its_stream_not_stdout(capsys):
    """With a bar (stderr a terminal), each problem's line goes where the bar is drawn: tqdm's write goes to stdout
    unless told, where it mixed into a redirected table, and met a closed pipe mid-tuning (tune | head)."""
    bar = pretune._Bar(1, 2, True, "tuning", 0)
    bar.start(ConvProblem(n=1, c=3, h=8, w=8, k=4, r=3, s=3))
    bar.finish("tuned  N1 C3 8x8: done")
    bar.close()
    out, err = capsys.readouterr()
    assert "tuned  N1" not in out and "tuned  N1" in err


def test_discovery_takes_keyword_calls_compiled_models_and_refuses_a_tuple_of_inputs():
    """A layer called as conv(input=x) is a tuned call like conv(x) (it was listed as 'no tensor input', not
    tuned); a torch.compile'd model is discovered through the module it wraps (its compiled forward asks the runtime
    nothing: 0 problems, reported as success); a tuple of example inputs, which reads both as one call's arguments
    and as one input per forward, is refused with what to write instead."""

    class ByName(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1)

        def forward(self, x):
            return self.conv(input=x)

    found = pretune.discover(bagf_torch.convert(ByName()), fake_cuda(2, 3, 16, 16))
    assert len(found.problems) == 1 and found.unsupported == []
    model = bagf_torch.convert(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3)))
    compiled = torch.compile(model, backend="eager")
    found = pretune.discover(compiled, fake_cuda(2, 3, 16, 16))
    assert len(found.problems) == 2 and found.layers[found.problems[0]] == ["0"]
    with pytest.raises(ValueError, match=r"example_inputs is a tuple: give a list .* \[\(x, y\)\]"):
        pretune.discover(model, (fake_cuda(2, 3, 16, 16), fake_cuda(4, 3, 16, 16)))


def test_tune_model_on_cpu_inputs_says_move_to_gpu():
    with pytest.raises(ValueError, match="input is not a CUDA tensor; move the model and example inputs to the GPU"):
        bagf_torch.tune_model(_two_branch_model(), torch.randn(1, 3, 8, 8), progress=False)


def test_progress_listener_reports_cudnn_then_every_candidate():
    from bagf_torch.kernels import implicit_gemm as ig
    from bagf_torch.tuning.common import Outcome, TrialEvent

    calls = []
    progress = types.SimpleNamespace(cudnn=lambda t: calls.append(("cudnn", t)),
                                     trial=lambda status, t: calls.append((status, t)))
    listen = pretune._ProgressListener(progress)
    config = dict(ig.DEFAULT)
    listen(TrialEvent("aten", None, Outcome("ok", time_us=20.0), "cuDNN", "baseline"))
    listen(TrialEvent(ig.FAMILY, config, Outcome("ok", time_us=12.5), ig.name(config), "start"))
    listen(TrialEvent(ig.FAMILY, config, Outcome("compile", detail="error"), ig.name(config), "search"))
    listen(TrialEvent("aten", None, Outcome("launch", detail="no cuDNN"), "cuDNN", "baseline"))
    assert calls == [("cudnn", 20.0), ("ok", 12.5), ("compile", None)]  # a failed baseline shows nothing
