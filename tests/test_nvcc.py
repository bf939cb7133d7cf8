"""nvcc compiles the kernel templates for sm_90 (CI has nvcc but no GPU): a sample of valid configurations
and the extremes of the space, so a template change that breaks some instantiation fails on CPU."""

from __future__ import annotations

import random
import re
import shutil
import subprocess

import pytest

from bagf_torch.jit import kernels_dir
from bagf_torch.kernels import implicit_gemm as ig

pytestmark = pytest.mark.nvcc


def _sample(n=16, seed=0):
    valid = ig.space().valid_configs()
    by_threads = sorted(valid, key=ig.threads)
    by_smem = sorted(valid, key=ig.smem_bytes)
    by_regs = sorted(valid, key=lambda c: (ig.estimated_registers(c), -ig.threads(c)))
    return ([ig.DEFAULT, by_threads[0], by_threads[-1], by_smem[-1], by_regs[-1], by_regs[-2]]
            + random.Random(seed).sample(valid, n))


def test_nvcc_compiles_sampled_instantiations_for_sm90(tmp_path):
    configs = _sample()
    src = tmp_path / "inst.cu"
    lines = [f'#include "{ig.SOURCE}"']
    for c in configs:
        lines.append(f"template __global__ void {ig.name_expression(c)}(const float*, const float*, const float*, "
                     "float*, const bagf::Conv2dParams);")
    src.write_text("\n".join(lines) + "\n")
    cmd = [shutil.which("nvcc"), "-std=c++17", "-gencode=arch=compute_90,code=sm_90", f"-I{kernels_dir()}",
           "-cubin", "-Xptxas", "-v", str(src), "-o", str(tmp_path / "inst.cubin")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    # every instantiation was emitted; the default configuration keeps its tiles in registers (a spill is a
    # speed problem the tuner measures, not a correctness one: bm128_bn64_bk32_tm8_tn2_db1_v1 spills 480
    # bytes under its 512-thread register cap, so spills are not asserted for the whole sample)
    entries = re.findall(r"Compiling entry function '(\w+)'", res.stderr)
    assert len(set(entries)) == len(set(map(ig.name, configs)))
    frames = dict(re.findall(r"Function properties for (\w+)\n\s+(\d+) bytes stack frame", res.stderr))
    default = [v for k, v in frames.items() if k.startswith("_ZN4bagf20implicit_gemm_conv2dILi64ELi64ELi8ELi4ELi4ELi1ELi4E")]
    assert default == ["0"], res.stderr[-3000:]
