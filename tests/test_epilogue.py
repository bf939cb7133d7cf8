"""The pooling epilogue: convert() making Sequentials FusedSequential, whose forward runs nn.ReLU -> nn.MaxPool2d
after a conv as one kernel, ATen's answer to the bit on every path (CPU: which calls the container fuses, with the
kernel stood in for; its ATen path; GPU: the kernel itself, bit patterns compared)."""

from __future__ import annotations

import contextlib
import copy
import pickle
import re
import shutil
import subprocess

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import bagf_torch
from bagf_torch import epilogue, models
from bagf_torch.epilogue import FusedSequential
from bagf_torch.jit import kernels_dir


def _net():
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
                         nn.Conv2d(8, 8, 3, padding=1), nn.MaxPool2d(2, ceil_mode=True),
                         nn.Conv2d(8, 6, 1), nn.ReLU(),
                         nn.ReLU(), nn.MaxPool2d(2))  # (a pool after a ReLU after a ReLU: not after a conv)


def _types(seq):
    return [type(m).__name__ for m in seq]


def test_convert_makes_sequentials_with_a_pair_fused_and_keeps_every_module():
    m = bagf_torch.convert(_net())
    assert type(m) is FusedSequential
    assert _types(m) == ["TunedConv2d", "ReLU", "MaxPool2d", "TunedConv2d", "MaxPool2d", "TunedConv2d", "ReLU", "ReLU",
                         "MaxPool2d"]
    assert epilogue.pairs(list(m)) == {0: (2, True), 3: (4, False)}
    assert type(bagf_torch.convert(_net(), fuse=False)) is nn.Sequential
    assert type(bagf_torch.convert(m)) is FusedSequential  # (converting twice changes nothing)
    net = models.alexnet()
    assert type(net.features) is FusedSequential and type(net.classifier) is nn.Sequential
    assert epilogue.pairs(list(net.features)) == {0: (2, True), 3: (5, True), 10: (12, True)}
    assert list(net.state_dict()) == list(models.alexnet(tuned=False).state_dict())
    assert type(m[:3]) is FusedSequential and _types(m[:3]) == ["TunedConv2d", "ReLU", "MaxPool2d"]


class _Recorder:
    """Stands in for the CUDA kernel on CPU: ATen's answer, and the pairs the container sent to it."""

    def __init__(self):
        self.calls = []

    def __call__(self, x, pool, relu, relu_inplace=True):
        self.calls.append((pool, relu))
        return F.max_pool2d(torch.relu(x) if relu else x, pool.kernel_size, pool.stride, pool.padding, pool.dilation,
                            pool.ceil_mode)


@pytest.fixture
def recorder(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(epilogue, "relu_max_pool2d", rec)
    return rec


def test_the_container_fuses_the_pairs_it_calls_in_sequence_and_nothing_else(recorder):
    torch.manual_seed(0)
    ref = _net().eval()
    m = bagf_torch.convert(copy.deepcopy(ref))
    x = torch.randn(2, 3, 21, 19)
    torch.testing.assert_close(m(x), ref(x), rtol=0, atol=0)
    assert recorder.calls == [(m[2], True), (m[4], False)]
    recorder.calls.clear()
    torch.testing.assert_close(m[1:](ref[0](x)), ref[1:](ref[0](x)), rtol=0, atol=0)
    assert recorder.calls == [(m[4], False)]  # (a slice that starts at the ReLU holds no conv before it)
    recorder.calls.clear()
    outs = []  # a loop over the layers, as feature extractors and perceptual losses do: each layer's own output
    h = x
    for layer in m:
        h = layer(h)
        outs.append(h)
    assert recorder.calls == [] and outs[1].min() >= 0  # the ReLU's output, not the conv's
    for i in (0, 1, 2):  # a hook on any of the three: called module by module, so the hook sees what it saw
        seen = []
        handle = m[i].register_forward_hook(lambda mod, inp, out: seen.append(out.min().item()))
        torch.testing.assert_close(m(x), ref(x), rtol=0, atol=0)
        assert recorder.calls == [(m[4], False)] and seen
        recorder.calls.clear()
        handle.remove()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:
        m(x)
    finally:
        handle.remove()
    assert recorder.calls == []
    for i in (1, 2):  # a forward set on the ReLU's or the pool's instance (what its call runs): called
        m[i].forward = lambda t, f=m[i].forward: f(t)
        torch.testing.assert_close(m(x), ref(x), rtol=0, atol=0)
        assert recorder.calls == [(m[4], False)]
        recorder.calls.clear()
        del m[i].forward
    m[4] = type("MyPool", (nn.MaxPool2d,), {})(2, ceil_mode=True)  # (changed after convert: read per call)
    torch.testing.assert_close(m(x), ref(x), rtol=0, atol=0)
    assert recorder.calls == [(m[2], True)]  # (a subclass's forward may differ: called as it is)


def test_relu_pairs_are_a_conv_and_the_relu_after_it_with_no_pool_after_that():
    m = bagf_torch.convert(_net())
    assert epilogue.relu_pairs(list(m)) == {5: 6}  # (conv 0's ReLU leads to a pool: the pooling kernel's pair)
    assert epilogue.relu_pairs(list(models.alexnet().features)) == {6: 7, 8: 9}
    only = bagf_torch.convert(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()))
    assert type(only) is FusedSequential and epilogue.pairs(list(only)) == {}
    assert type(bagf_torch.convert(nn.Sequential(nn.Conv2d(3, 4, 3), nn.GELU()))) is nn.Sequential
    assert epilogue.relu_pairs([bagf_torch.TunedConv2d(3, 4, 3), type("R", (nn.ReLU,), {})()]) == {}  # (a subclass)


class _ReluRecorder:
    """Stands in for TunedConv2d._relu_forward on CPU: ATen's conv and ReLU (or None: no TMA plan), and the convs
    the container sent to it."""

    def __init__(self, answer=True):
        self.calls, self.answer = [], answer

    def __call__(self, conv, x):
        self.calls.append(conv)
        return torch.relu(conv._conv_forward(x, conv.weight, conv.bias)) if self.answer else None


def test_the_container_runs_a_conv_and_its_relu_as_one_call_where_the_conv_can(monkeypatch, recorder):
    torch.manual_seed(0)
    ref = _net().eval()
    m = bagf_torch.convert(copy.deepcopy(ref)).eval()
    x = torch.randn(2, 3, 21, 19)
    called = []
    relu_forward = nn.ReLU.forward
    monkeypatch.setattr(nn.ReLU, "forward", lambda self, t: called.append(self) or relu_forward(self, t))
    rec = _ReluRecorder()
    monkeypatch.setattr(bagf_torch.TunedConv2d, "_relu_forward", lambda self, x: rec(self, x))
    torch.testing.assert_close(m(x), ref(x), rtol=0, atol=0)
    assert rec.calls == [m[5]] and m[6] not in called  # (the ReLU after it not called)
    for i in (5, 6):  # a hook on the conv or the ReLU: both called
        rec.calls.clear(), called.clear()
        handle = m[i].register_forward_pre_hook(lambda *a: None)
        torch.testing.assert_close(m(x), ref(x), rtol=0, atol=0)
        assert rec.calls == [] and m[6] in called
        handle.remove()
    # a forward set on the conv's instance (what its call runs) or the ReLU's: both called
    for mod in (m[5], m[6]):
        rec.calls.clear(), called.clear()
        mod.forward = lambda t, f=mod.forward: f(t)
        torch.testing.assert_close(m(x), ref(x), rtol=0, atol=0)
        assert rec.calls == [] and m[6] in called
        del mod.forward
    rec.answer = False  # (no TMA plan for the call: the two modules)
    rec.calls.clear(), called.clear()
    torch.testing.assert_close(m(x), ref(x), rtol=0, atol=0)
    assert rec.calls == [m[5]] and m[6] in called
    # an out-of-place ReLU after an output both contiguous and channels_last (one channel): ATen's ReLU gives it
    # contiguous strides, and so does the fused call
    stock = nn.Sequential(nn.Conv2d(3, 1, 3), nn.ReLU(), nn.Conv2d(1, 2, 1), nn.ReLU(inplace=True)).eval()
    one = bagf_torch.convert(copy.deepcopy(stock))
    xl = x.contiguous(memory_format=torch.channels_last)
    rec.answer, rec.calls = True, []
    # (the strides a plan's output has: channels_last for an input in channels_last only, as bagf's memory_layout)
    monkeypatch.setattr(bagf_torch.TunedConv2d, "_relu_forward", lambda self, x: torch.empty_like(
        y := rec(self, x), memory_format=torch.contiguous_format if x.is_contiguous() else torch.channels_last
    ).copy_(y))
    with torch.no_grad():
        h = one[0]._relu_forward(xl)
        assert h.is_contiguous() and h.is_contiguous(memory_format=torch.channels_last) and h.stride()[1] == 1
        got, want = one(xl), stock(xl)
        assert rec.calls == [one[0], one[0], one[2]]
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert got.stride() == want.stride()
    # the pair last, its output the model's: ATen's strides (restrided from the plan's channels_last ones)
    for stock in (nn.Sequential(nn.Conv2d(3, 1, 3), nn.ReLU()).eval(),
                  nn.Sequential(nn.Conv2d(3, 5, (19, 17)), nn.ReLU()).eval()):  # (one channel; a 1x1 map)
        last = bagf_torch.convert(copy.deepcopy(stock))
        with torch.no_grad():
            got, want = last(xl), stock(xl)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert got.stride() == want.stride(), (got.stride(), want.stride())


def test_a_conv_subclass_is_not_fused_with_its_relu():
    class Scaled(bagf_torch.TunedConv2d):
        def forward(self, x):
            return 2 * super().forward(x)

    assert epilogue.relu_pairs([Scaled(3, 4, 3), nn.ReLU()]) == {}
    assert epilogue.relu_pairs([bagf_torch.TunedConv2d(3, 4, 3), nn.ReLU()]) == {0: 1}


class _ReluExt:
    """A stand-in host extension on CPU for TunedConv2d._relu_forward: the plans in ``fused`` run the ReLU in their
    epilogue (here ATen's conv and ReLU); each conv2d_relu_inference call is recorded."""

    def __init__(self, fused):
        self.fused, self.calls = set(fused), []

    def plan_fuses_relu(self, handle):
        return handle in self.fused

    def conv2d_relu_inference(self, x, w, b, stride, padding, dilation, handle, relu):
        self.calls.append((handle, stride, padding, dilation, relu))
        return torch.relu(F.conv2d(x, w, b, stride, padding, dilation))


def test_relu_forward_takes_only_planned_eager_calls_of_a_relu_plan(monkeypatch):
    """TunedConv2d._relu_forward with a stand-in extension (CPU): the call goes to conv2d_relu_inference with the
    layer's plan for such inputs and the ReLU mode of the device's own ReLU; None for a call the kernels do not take (a
    CPU tensor: remembered as such on its first call), a plan whose
    epilogue has no ReLU, cuDNN's plan, a gradient to record, autocast, strides of neither format."""
    from bagf_torch import nn as bnn

    ext = _ReluExt(fused={7})
    monkeypatch.setattr(bnn, "_extension_loaded", lambda: ext)
    monkeypatch.setattr(bnn, "_FUSES_RELU", {})
    torch.manual_seed(0)
    conv = bagf_torch.TunedConv2d(4, 6, 3, padding=1).eval()
    x = torch.randn(2, 4, 9, 8)
    assert conv._relu_forward(x) is None and conv._plan_entry(x) == ("unsupported",)  # (a CPU tensor)
    conv._remember(x, ("kernel", 7, [1, 1], [1, 1], [1, 1], False))
    mode = 2 if torch.signbit(torch.relu(torch.tensor([-0.0]))).item() else 1
    with torch.no_grad():
        torch.testing.assert_close(conv._relu_forward(x), torch.relu(F.conv2d(x, conv.weight, conv.bias, 1, 1)))
    assert ext.calls == [(7, [1, 1], [1, 1], [1, 1], mode)]
    assert conv._relu_forward(x) is None  # (the weight needs a gradient)
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert conv._relu_forward(x) is None
        assert conv._relu_forward(x[..., ::2]) is None  # (neither contiguous nor channels_last: another key anyway)
        assert conv._relu_forward(x.double()) is None  # (not planned in float64)
        conv._remember(x, ("kernel", 8, [1, 1], [1, 1], [1, 1], False))
        assert conv._relu_forward(x) is None  # (its epilogue has no ReLU)
        conv._remember(x, ("aten",))
        assert conv._relu_forward(x) is None
    assert len(ext.calls) == 1


def test_relu_forward_looks_up_the_plan_of_a_first_call_as_the_convs_own_call_would(monkeypatch):
    """A pair's first call like its input (after tune_model, or in a process serving the cache: the layer's plan
    table is empty) takes the runtime's plan for it, remembers it and runs fused, as the conv's own first call would
    have remembered it: a first call inside a CUDA graph capture is one launch too. A dtype no family computes is not
    looked up here (the conv's call says why)."""
    from bagf_torch import nn as bnn

    ext = _ReluExt(fused={7})
    looked = []
    monkeypatch.setattr(bnn, "_extension_loaded", lambda: ext)
    monkeypatch.setattr(bnn, "_FUSES_RELU", {})
    monkeypatch.setattr(bnn, "_RELU_MODES", {})
    monkeypatch.setattr(bagf_torch.TunedConv2d, "_tell", lambda self, x, kind: None)  # (taken, as on a GPU)
    monkeypatch.setattr(bagf_torch.TunedConv2d, "_lookup", lambda self, x, padding: looked.append(tuple(x.shape))
                        or ("kernel", 7, [1, 1], [1, 1], [1, 1], False))
    torch.manual_seed(0)
    conv = bagf_torch.TunedConv2d(4, 6, 3, padding=1).eval()
    x = torch.randn(2, 4, 9, 8)
    with torch.no_grad():
        torch.testing.assert_close(conv._relu_forward(x), torch.relu(F.conv2d(x, conv.weight, conv.bias, 1, 1)))
        assert looked == [(2, 4, 9, 8)] and [c[0] for c in ext.calls] == [7] and conv._plan_entry(x)[1] == 7
        conv._relu_forward(x)  # (remembered: not looked up again)
        assert looked == [(2, 4, 9, 8)] and [c[0] for c in ext.calls] == [7, 7]
        assert conv._relu_forward(x.double()) is None and looked == [(2, 4, 9, 8)]


def test_a_pairs_first_call_that_gets_torchs_conv_looks_its_plan_up_once(monkeypatch):
    """Through FusedSequential: a pair's first call that _relu_forward cannot fuse after its lookup (cuDNN's plan,
    or none yet) leaves the remembered entry to the conv's own call, which neither looks up nor tunes again."""
    from bagf_torch import runtime

    looked = []
    monkeypatch.setattr(bagf_torch.TunedConv2d, "_tell", lambda self, x, kind: None)  # (taken, as on a GPU)
    for entry in (("aten",), ("later", float("inf"), runtime.GENERATION)):
        monkeypatch.setattr(bagf_torch.TunedConv2d, "_lookup",
                            lambda self, x, padding, e=entry: looked.append(e[0]) or e)
        torch.manual_seed(0)
        seq = bagf_torch.convert(nn.Sequential(nn.Conv2d(4, 6, 3, padding=1), nn.ReLU()))
        assert type(seq) is FusedSequential
        x = torch.randn(2, 4, 9, 8)
        with torch.no_grad():
            want = torch.relu(F.conv2d(x, seq[0].weight, seq[0].bias, 1, 1))
            torch.testing.assert_close(seq(x), want, rtol=0, atol=0)
            torch.testing.assert_close(seq(x), want, rtol=0, atol=0)
        assert looked == [entry[0]] and seq[0]._plan_entry(x) == entry
        looked.clear()


def test_pool_arguments_the_kernel_takes():
    assert epilogue._pool_args(nn.MaxPool2d(3, 2)) == ((3, 3), (2, 2), (0, 0), (1, 1), False)
    assert epilogue._pool_args(nn.MaxPool2d(np.int64(3), (2, 1), 1, 2, ceil_mode=True)) == (
        (3, 3), (2, 1), (1, 1), (2, 2), True)
    assert epilogue._pool_args(nn.MaxPool2d(3, return_indices=True)) is None
    assert epilogue._pool_args(nn.MaxPool2d(3, padding=2)) is None  # (ATen raises its own error)
    assert epilogue._pool_args(nn.MaxPool2d(70000)) is None
    assert epilogue._pool_args(nn.MaxPool2d(2.0)) is None and epilogue._pool_args(nn.MaxPool2d(True)) is None
    pool = nn.MaxPool2d(3)
    assert epilogue._pool_args(pool)[0] == (3, 3)
    pool.kernel_size = 2  # (kept on the module while its arguments stay the same)
    assert epilogue._pool_args(pool)[0] == (2, 2)
    assert epilogue._pool_args(type("P", (nn.MaxPool2d,), {})(3)) is None


@pytest.mark.parametrize("train", [False, True])
def test_fused_model_equals_the_stock_one_to_the_bit_on_cpu(train):
    torch.manual_seed(0)
    ref = _net().train(train)
    m = bagf_torch.convert(copy.deepcopy(ref))
    x = torch.randn(2, 3, 21, 19)
    x[0, 0, 5, 5] = float("nan")
    x.requires_grad_(train)
    torch.testing.assert_close(m(x), ref(x), rtol=0, atol=0, equal_nan=True)
    if train:
        x = torch.nan_to_num(x.detach())  # (gradients through a NaN are NaN either way)
        m(x).sum().backward()
        ref(x).sum().backward()
        for p, q in zip(m.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


def test_fused_container_survives_script_pickle_deepcopy_export_and_compile():
    torch.manual_seed(1)
    ref = _net().eval()
    m = bagf_torch.convert(copy.deepcopy(ref))
    x = torch.randn(1, 3, 24, 24)
    want = ref(x)
    m(x)  # (after a call: the layers' and the container's memos are neither pickled nor scripted)
    for other in (torch.jit.script(m), pickle.loads(pickle.dumps(m)), copy.deepcopy(m),
                  torch.export.export(m, (x,)).module()):
        torch.testing.assert_close(other(x), want, rtol=0, atol=0)
    assert type(pickle.loads(pickle.dumps(m))) is FusedSequential
    torch.testing.assert_close(torch.compile(m, fullgraph=True)(x), torch.compile(ref, fullgraph=True)(x),
                               rtol=0, atol=0)


def test_prepare_stores_the_cubin_in_the_current_cache_even_when_loaded_under_another(monkeypatch):
    """tune_model's prepare() is what puts the kernel's cubin in the cache a serving process reads: when this process
    loaded the kernel earlier (under another cache: a new BAGF_CACHE_DIR and runtime.reset()), prepare still asks the
    current cache's compiler for it (a hit, or compiled and stored); a failure there leaves the loaded kernel in use,
    logged. No pair in the model: nothing asked."""
    import types

    asked = []

    class Compiler:
        arch = "sm_90"

        def cubin(self, spec):
            asked.append(spec.name)
            if fail:
                raise OSError("disk full")
            return b"cubin", "lowered", 0.0

    fake = types.SimpleNamespace(device=lambda d: types.SimpleNamespace(compiler=Compiler()))
    monkeypatch.setattr(epilogue.runtime, "get", lambda: fake)
    monkeypatch.setattr(epilogue.torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(epilogue, "_state", {0: True})  # (loaded before, in this process)
    fail = False
    model = bagf_torch.convert(_net())
    assert epilogue.prepare(model, 0) is True and len(asked) == 1
    assert epilogue.prepare(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()), 0) is False and len(asked) == 1
    fail = True
    assert epilogue.prepare(model, 0) is True and len(asked) == 2  # (still loaded and used; the cache lacks it)
    monkeypatch.setattr(epilogue, "_state", {0: False})  # (failed to build here: nothing more asked)
    assert epilogue.prepare(model, 0) is False and len(asked) == 2


def test_prepare_relu_asks_torchs_relu_sign_rule_up_front_where_a_conv_relu_pair_can_fuse(monkeypatch):
    """tune_model's prepare_relu() asks, outside any capture, how torch's ReLU treats -0.0 on the CUDA device in each
    dtype the model's convs run in (a first call inside a CUDA graph capture cannot ask, and would run the pair
    unfused): only for a model with a conv -> ReLU pair that no pool follows."""
    asked = []
    monkeypatch.setattr(epilogue, "_relu_mode", lambda device, dtype: asked.append((device, dtype)) or 2)
    pooled = bagf_torch.convert(nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.MaxPool2d(2)))
    assert type(pooled) is FusedSequential and epilogue.prepare_relu(pooled, 0, {torch.float32}) is False
    assert epilogue.prepare_relu(bagf_torch.convert(_net(), fuse=False), 0, {torch.float32}) is False
    assert asked == []
    paired = bagf_torch.convert(nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 1)))
    assert epilogue.prepare_relu(nn.Sequential(paired), 1, [torch.float32, torch.bfloat16]) is True
    assert asked == [(torch.device("cuda", 1), torch.float32), (torch.device("cuda", 1), torch.bfloat16)]


def test_kernel_names_are_the_hosts_order():
    names = epilogue._NAMES
    assert len(names) == 12 and len(set(names)) == 12
    # bagf_ext's table is [dtype][nhwc][relu] in that order, from the i-th name: i / 4, (i / 2) % 2, i % 2
    for i, name in enumerate(names):
        assert re.fullmatch(rf"bagf::relu_max_pool2d<{i // 4}, {(i // 2) % 2}, {i % 2}>", name)


@pytest.mark.nvcc
def test_nvcc_compiles_every_instantiation(tmp_path):
    src = tmp_path / "pool.cu"
    src.write_text('#include "pool_epilogue.cuh"\n' + "".join(
        f"template __global__ void {n}(const void*, void*, bagf::PoolParams);\n" for n in epilogue._NAMES))
    out = subprocess.run([shutil.which("nvcc"), "-arch=sm_90", "-std=c++17", f"-I{kernels_dir()}", "-c", str(src),
                          "-o", str(tmp_path / "pool.o")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


# --------------------------------------------------------------------------------------------------- GPU

_POOLS = [  # kernel, stride, padding, dilation, ceil_mode
    (3, 2, 0, 1, False),  # AlexNet's
    (2, 2, 0, 1, True),
    (3, 2, 1, 1, True),
    ((3, 2), (1, 2), (1, 0), (1, 1), False),
    (3, 1, 1, 2, False),
    (5, 3, 2, 1, True),
    (2, 1, 1, 3, False),  # dilated taps: on a 2-row input a window can hold no input at all (-inf)
]
_SHAPES = [(1, 64, 55, 55), (2, 3, 13, 14), (3, 37, 9, 7), (1, 256, 13, 13), (2, 1, 5, 6), (1, 4, 2, 2)]


def _bits(t):
    """``t``'s bit patterns as integers: +0.0 and -0.0 differ, NaN equals NaN of the same payload."""
    return t.contiguous().view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _same_bits(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape and got.stride() == want.stride()
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)  # (NaN payloads may differ between kernels: compared as NaN)
    assert torch.equal(_bits(got.masked_fill(nan, 0)), _bits(want.masked_fill(nan, 0)))


def _poisoned_call(fn, like):
    """``fn()`` right after a block of ``like``'s size was filled with NaN and freed: the caching allocator hands that
    block to the output, so an element the kernel skips shows up as NaN."""
    junk = torch.full_like(like, float("nan"))
    del junk
    return fn()


@pytest.fixture
def fresh_runtime(cache_dir, monkeypatch):
    monkeypatch.setenv("BAGF_CACHE_DIR", str(cache_dir))
    from bagf_torch import runtime

    runtime.reset()
    epilogue._state.clear()
    yield
    runtime.reset()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [False, True])
def test_kernel_is_atens_relu_and_max_pool2d_to_the_bit(dtype, channels_last, fresh_runtime):
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    gen = torch.Generator(device="cuda").manual_seed(3)
    for shape in _SHAPES:
        x = torch.randn(shape, device="cuda", generator=gen).to(dtype)
        flat = x.view(-1)
        flat[::97] = float("nan")
        flat[5::131] = float("-inf")
        flat[7::11] = -0.0  # (beside negatives and +0.0: ATen's ReLU and the first-of-equals rule decide the sign)
        flat[8::11] = 0.0
        x = x.contiguous(memory_format=fmt)
        for k, s, p, d, ceil in _POOLS:
            kk, pp, dd = (v if isinstance(v, tuple) else (v, v) for v in (k, p, d))
            if any(shape[2 + i] + 2 * pp[i] - dd[i] * (kk[i] - 1) - 1 < 0 for i in range(2)):
                continue
            pool = nn.MaxPool2d(k, s, p, d, ceil_mode=ceil)
            for relu in (True, False):
                want = pool(torch.relu_(x.clone()) if relu else x)  # (nn.ReLU(inplace=True): x's strides kept)
                got = _poisoned_call(lambda: epilogue.relu_max_pool2d(x, pool, relu), want)
                assert got is not None, (shape, k, s, p, d, ceil, relu)  # (the kernel answered, not ATen)
                _same_bits(got, want)
                if x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last):  # (C = 1)
                    # an out-of-place ReLU gives such a tensor contiguous strides, and the pool's output follows
                    assert epilogue.relu_max_pool2d(x, pool, True, relu_inplace=False) is None
    # a strided view is not the kernel's (nor a conv's output): ATen answers it
    view = torch.randn(2, 20, 11, 12, device="cuda", dtype=dtype).contiguous(memory_format=fmt)[:, ::2]
    assert epilogue.relu_max_pool2d(view, nn.MaxPool2d(3, 2, 1), True) is None


@pytest.mark.cuda
def test_fused_alexnet_features_eager_in_a_cuda_graph_and_with_gradients(fresh_runtime, monkeypatch):
    monkeypatch.setenv("BAGF_TUNE", "0")  # (the convs run cuDNN: this test is about the pooling)
    torch.manual_seed(0)
    ref = models.alexnet(tuned=False).features.cuda().to(torch.bfloat16).to(memory_format=torch.channels_last).eval()
    m = bagf_torch.convert(copy.deepcopy(ref))
    assert type(m) is FusedSequential
    x = torch.randn(2, 3, 224, 224, device="cuda", dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)

    def graphed(model, static):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g), torch.no_grad():
            out = model(static)
        return g, out

    # a first call inside a capture: captured with ATen's ops (no compile or module load while capturing). cuDNN
    # allocates device memory the first time it runs an engine for a shape, which a capture refuses (stock PyTorch's
    # own first conv inside a capture fails so: CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED); so the stock
    # model runs once first, as any capture of a cuDNN conv needs, and the converted model's first call is the capture
    with torch.no_grad():
        ref(x)
    torch.cuda.synchronize()
    static = x.clone()
    g, out = graphed(m, static)
    assert epilogue._state == {}
    g.replay()
    _same_bits(out, ref(static))
    with torch.inference_mode():
        want = ref(x)
        _same_bits(m(x), want)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            m(x)
            torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    assert sum("relu_max_pool2d" in n for n in names) == 3, names
    assert not any("max_pool" in n and "relu_max_pool2d" not in n for n in names), names
    g, out = graphed(m, static)  # (loaded now: the capture holds our kernel)
    static.copy_(torch.randn_like(static))
    g.replay()
    with torch.no_grad():
        _same_bits(out, ref(static))
    xg = x.float().requires_grad_()  # a gradient to record: ATen's ops, so backward works
    mf, rf = copy.deepcopy(m).float(), copy.deepcopy(ref).float()
    mf(xg).sum().backward()
    gm = xg.grad.clone()
    xg.grad = None
    rf(xg).sum().backward()
    assert (gm - xg.grad).norm() <= 1e-4 * xg.grad.norm()  # (cuDNN's backward may sum in another order per call)


@pytest.mark.cuda
def test_tune_model_stores_the_pooling_kernel_so_a_serving_process_compiles_nothing(fresh_runtime, monkeypatch):
    import json
    import os
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    monkeypatch.setenv("BAGF_STRATEGY", "random")
    monkeypatch.setenv("BAGF_BUDGET", "4")

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2)).cuda()

    x = torch.randn(1, 3, 33, 33, device="cuda")
    m = bagf_torch.convert(build())
    bagf_torch.tune_model(m, [x], progress=False)
    assert epilogue._state == {torch.cuda.current_device(): True}
    with torch.no_grad():
        expected = m(x)
    d = os.environ["BAGF_CACHE_DIR"]
    torch.save((x.cpu(), expected.cpu()), os.path.join(d, "xy.pt"))
    script = textwrap.dedent(f"""
        import json, os, sys
        sys.path.insert(0, {str(Path(bagf_torch.__file__).resolve().parent.parent)!r})
        import torch, bagf_torch
        from torch import nn
        from bagf_torch import epilogue
        from bagf_torch.jit.compiler import STATS
        torch.manual_seed(0)
        m = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2)).cuda()
        m = bagf_torch.convert(m)
        x, y = torch.load(os.path.join(os.environ["BAGF_CACHE_DIR"], "xy.pt"))
        with torch.no_grad():
            got = m(x.cuda()).cpu()
        ready = epilogue._state.get(torch.cuda.current_device())
        print(json.dumps(dict(nvrtc=STATS.nvrtc_compiles, ready=ready, same=torch.equal(got, y))))
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, BAGF_TUNE="0"))
    assert res.returncode == 0, res.stderr[-3000:]
    stats = json.loads(res.stdout.strip().splitlines()[-1])
    assert stats == {"nvrtc": 0, "ready": True, "same": True}, stats
