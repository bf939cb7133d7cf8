"""The pooling epilogue: convert() fusing nn.ReLU -> nn.MaxPool2d after a conv into FusedMaxPool2d, ATen's answer
to the bit on every path (CPU: the fusion's structure and its ATen path; GPU: the kernel itself)."""

from __future__ import annotations

import copy
import pickle
import re
import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import bagf_torch
from bagf_torch import epilogue, models
from bagf_torch.epilogue import FusedMaxPool2d
from bagf_torch.jit import kernels_dir


def _net():
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
                         nn.Conv2d(8, 8, 3, padding=1), nn.MaxPool2d(2, ceil_mode=True),
                         nn.Conv2d(8, 6, 1), nn.ReLU(),
                         nn.ReLU(), nn.MaxPool2d(2))  # (a pool after a ReLU after a ReLU: not after a conv)


def _types(seq):
    return [type(m).__name__ for m in seq]


def test_convert_fuses_relu_then_pool_after_a_conv_and_nothing_else():
    m = bagf_torch.convert(_net())
    assert _types(m) == ["TunedConv2d", "Identity", "FusedMaxPool2d", "TunedConv2d", "FusedMaxPool2d",
                         "TunedConv2d", "ReLU", "ReLU", "MaxPool2d"]
    assert m[2].relu and not m[4].relu
    assert (m[2].kernel_size, m[2].stride, m[4].kernel_size, m[4].ceil_mode) == (3, 2, 2, True)
    assert "relu=True" in repr(m[2])
    again = _types(bagf_torch.convert(m))  # converting twice changes nothing
    assert again == _types(m)
    assert _types(bagf_torch.convert(_net(), fuse=False)) == ["TunedConv2d", "ReLU", "MaxPool2d", "TunedConv2d",
                                                              "MaxPool2d", "TunedConv2d", "ReLU", "ReLU", "MaxPool2d"]


def test_alexnet_features_fuse_and_keep_torchvisions_state_dict():
    net = models.alexnet()
    f = net.features
    assert _types(f)[:6] == ["TunedConv2d", "Identity", "FusedMaxPool2d"] * 2
    assert _types(f)[6:] == ["TunedConv2d", "ReLU", "TunedConv2d", "ReLU", "TunedConv2d", "Identity", "FusedMaxPool2d"]
    assert list(net.state_dict()) == list(models.alexnet(tuned=False).state_dict())


def test_no_fusion_across_hooks_indices_subclasses_or_other_containers():
    def seq():
        return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.MaxPool2d(2))

    for i in range(3):  # a hook on any of the three: the hooked module sees what it saw before
        m = seq()
        m[i].register_forward_hook(lambda *a: None)
        assert _types(bagf_torch.convert(m)) == ["TunedConv2d", "ReLU", "MaxPool2d"]
    m = seq()
    m[2] = nn.MaxPool2d(2, return_indices=True)
    assert _types(bagf_torch.convert(m))[1:] == ["ReLU", "MaxPool2d"]

    class MyPool(nn.MaxPool2d):
        pass

    m = seq()
    m[2] = MyPool(2)
    assert _types(bagf_torch.convert(m))[1:] == ["ReLU", "MyPool"]

    class MySeq(nn.Sequential):  # (its forward may not call its modules in order)
        pass

    m = MySeq(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.MaxPool2d(2))
    assert _types(bagf_torch.convert(m)) == ["TunedConv2d", "ReLU", "MaxPool2d"]
    with pytest.raises(ValueError, match="return_indices"):
        FusedMaxPool2d(2, return_indices=True)


@pytest.mark.parametrize("train", [False, True])
def test_fused_model_equals_the_stock_one_to_the_bit_on_cpu(train):
    torch.manual_seed(0)
    ref = _net().train(train)
    m = bagf_torch.convert(copy.deepcopy(ref))
    x = torch.randn(2, 3, 21, 19)
    x[0, 0, 5, 5] = float("nan")
    x.requires_grad_(train)
    y, y_ref = m(x), ref(x)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0, equal_nan=True)
    if train:
        x = torch.nan_to_num(x.detach())  # (gradients through a NaN are NaN either way)
        m(x).sum().backward()
        ref(x).sum().backward()
        for p, q in zip(m.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


def test_fused_pool_survives_script_pickle_deepcopy_export_and_compile():
    torch.manual_seed(1)
    ref = _net().eval()
    m = bagf_torch.convert(copy.deepcopy(ref))
    x = torch.randn(1, 3, 24, 24)
    want = ref(x)
    for other in (torch.jit.script(m), pickle.loads(pickle.dumps(m)), copy.deepcopy(m),
                  torch.export.export(m, (x,)).module()):
        torch.testing.assert_close(other(x), want, rtol=0, atol=0)
    torch.testing.assert_close(torch.compile(m, fullgraph=True)(x), torch.compile(ref, fullgraph=True)(x),
                               rtol=0, atol=0)
    bad = FusedMaxPool2d(3, padding=2)  # padding above half the kernel: ATen's own error
    with pytest.raises(RuntimeError, match="pad should be"):
        bad(torch.randn(1, 1, 8, 8))


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
]
_SHAPES = [(1, 64, 55, 55), (2, 3, 13, 14), (3, 37, 9, 7), (1, 256, 13, 13), (2, 1, 5, 6)]


def _ref(x, relu, k, s, p, d, ceil):
    return F.max_pool2d(torch.relu(x) if relu else x, k, s, p, d, ceil)


def _poisoned_call(fn, like):
    """``fn()`` right after a block of ``like``'s size was filled with NaN and freed: the caching allocator hands that
    block to the output, so an element the kernel skips shows up as NaN."""
    junk = torch.full_like(like, float("nan"))
    del junk
    return fn()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [False, True])
def test_kernel_is_atens_relu_and_max_pool2d_to_the_bit(dtype, channels_last, cache_dir, monkeypatch):
    monkeypatch.setenv("BAGF_CACHE_DIR", str(cache_dir))
    from bagf_torch import runtime

    runtime.reset()
    epilogue._state.clear()
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    gen = torch.Generator(device="cuda").manual_seed(3)
    for shape in _SHAPES:
        x = torch.randn(shape, device="cuda", generator=gen).to(dtype)
        x.view(-1)[:: 97] = float("nan")
        x.view(-1)[5:: 131] = float("-inf")
        x = x.contiguous(memory_format=fmt)
        for k, s, p, d, ceil in _POOLS:
            kk, pp, dd = (v if isinstance(v, tuple) else (v, v) for v in (k, p, d))
            if any(shape[2 + i] + 2 * pp[i] - dd[i] * (kk[i] - 1) - 1 < 0 for i in range(2)):
                continue
            for relu in (True, False):
                pool = FusedMaxPool2d(k, s, p, d, ceil_mode=ceil, relu=relu)
                want = _ref(x, relu, k, s, p, d, ceil)
                got = _poisoned_call(lambda: pool(x), want)
                assert got.dtype == want.dtype and got.shape == want.shape
                assert got.is_contiguous(memory_format=fmt)
                torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert epilogue._state[torch.cuda.current_device()] is True  # (the kernel ran, not the fallback)
    # a strided view (every other channel): read through its strides
    x = torch.randn(2, 20, 11, 12, device="cuda", dtype=dtype).contiguous(memory_format=fmt)[:, ::2]
    pool = FusedMaxPool2d(3, 2, 1, relu=True)
    torch.testing.assert_close(pool(x), _ref(x, True, 3, 2, 1, 1, False), rtol=0, atol=0)


@pytest.mark.cuda
def test_fused_alexnet_features_in_a_cuda_graph_and_with_gradients(cache_dir, monkeypatch):
    monkeypatch.setenv("BAGF_CACHE_DIR", str(cache_dir))
    monkeypatch.setenv("BAGF_TUNE", "0")  # (the convs run cuDNN: this test is about the pooling)
    from bagf_torch import runtime

    runtime.reset()
    epilogue._state.clear()
    torch.manual_seed(0)
    ref = models.alexnet(tuned=False).features.cuda().to(torch.bfloat16).to(memory_format=torch.channels_last).eval()
    m = bagf_torch.convert(copy.deepcopy(ref))
    assert sum(isinstance(x, FusedMaxPool2d) for x in m) == 3
    x = torch.randn(2, 3, 224, 224, device="cuda", dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
    with torch.inference_mode():
        want = ref(x)
        torch.testing.assert_close(m(x), want, rtol=0, atol=0)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            m(x)
            torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    assert any("relu_max_pool2d" in n for n in names) and not any("max_pool" in n and "relu" not in n for n in names)
    static = x.clone()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.no_grad():
        m(static)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g), torch.no_grad():
        out = m(static)
    static.copy_(torch.randn_like(static))
    g.replay()
    with torch.no_grad():
        torch.testing.assert_close(out, ref(static), rtol=0, atol=0)
    xg = x.float().requires_grad_()  # a gradient to record: ATen's ops, so backward works
    mf, rf = copy.deepcopy(m).float(), copy.deepcopy(ref).float()
    mf(xg).sum().backward()
    gm = xg.grad.clone()
    xg.grad = None
    rf(xg).sum().backward()
    assert (gm - xg.grad).norm() <= 1e-4 * xg.grad.norm()  # (cuDNN's backward may sum in another order per call)
