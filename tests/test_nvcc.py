"""nvcc compiles the kernel templates for sm_90 (CI has nvcc but no GPU): a sample of valid configurations
and the extremes of the space, so a template change that breaks some instantiation fails on CPU."""

from __future__ import annotations

import random
import re
import shutil
import subprocess

import pytest

from bagf_torch.jit import kernels_dir
from bagf_torch.kernels import FAMILIES

pytestmark = pytest.mark.nvcc


def _sample(fam, n=16, seed=0):
    valid = fam.space().valid_configs()
    by_threads = sorted(valid, key=fam.threads)
    by_smem = sorted(valid, key=fam.smem_bytes)
    by_regs = sorted(valid, key=lambda c: (fam.estimated_registers(c), -fam.threads(c)))
    picked = [fam.DEFAULT, by_threads[0], by_threads[-1], by_smem[-1], by_regs[-1], by_regs[-2]]
    picked += random.Random(seed).sample(valid, n)
    return list({fam.name(c): c for c in picked}.values())  # an explicit instantiation may appear only once


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_nvcc_compiles_sampled_instantiations_for_sm90(tmp_path, family):
    fam = FAMILIES[family]
    configs = _sample(fam)
    src = tmp_path / "inst.cu"
    lines = [f'#include "{fam.SOURCE}"']
    for c in configs:
        lines.append(f"template __global__ void {fam.name_expression(c)}(const float*, const float*, const float*, "
                     "float*, const bagf::Conv2dParams);")
    src.write_text("\n".join(lines) + "\n")
    cmd = [shutil.which("nvcc"), "-std=c++17", "-gencode=arch=compute_90,code=sm_90", f"-I{kernels_dir()}",
           "-cubin", "-Xptxas", "-v", str(src), "-o", str(tmp_path / "inst.cubin")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    # every instantiation was emitted; the default configuration keeps its tiles in registers (a spill is a
    # speed problem the tuner measures, not a correctness one: implicit_gemm's bm128_bn64_bk32_tm8_tn2_db1_v1
    # spills 480 bytes under its 512-thread register cap, so spills are not asserted for the whole sample)
    entries = re.findall(r"Compiling entry function '(\w+)'", res.stderr)
    assert len(set(entries)) == len(set(map(fam.name, configs)))
    frames = dict(re.findall(r"Function properties for (\w+)\n\s+(\d+) bytes stack frame", res.stderr))
    kernel = fam.KERNEL.split("::")[-1]
    args = "".join(f"Li{fam.DEFAULT[k]}E" for k in fam.TEMPLATE_ORDER)
    mangled = f"_ZN4bagf{len(kernel)}{kernel}I{args}"
    default = [v for k, v in frames.items() if k.startswith(mangled)]
    assert default == ["0"], (mangled, res.stderr[-3000:])
