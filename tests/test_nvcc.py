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


def _instantiations(fam, exprs) -> str:
    """A source that includes ``fam``'s kernel header and instantiates each of ``exprs`` with its KERNEL_ARGS (a
    plan's second kernel, after ';', with its AUX_KERNEL_ARGS: an NCHW TMA plan's input copy), each kernel once."""
    kernels = {}
    for e in exprs:
        main, *aux = e.split(";")
        kernels[main] = fam.KERNEL_ARGS
        kernels.update((a, _aux_args(fam, a)) for a in aux)
    return f'#include "{fam.SOURCE}"\n' + "".join(f"template __global__ void {e}({args});\n"
                                                   for e, args in kernels.items())


def _aux_args(fam, expr: str) -> str:
    """The parameter list of a plan's kernel after its first (``expr``): a polyphase plan's gather and weight kernels
    (``POLYPHASE_KERNEL_ARGS``), winograd_gemm's own GEMM (``GEMM_KERNEL_ARGS``), an NCHW TMA plan's input copy
    (``AUX_KERNEL_ARGS``)."""
    if expr.startswith((getattr(fam, "GATHER_KERNEL", "-"), getattr(fam, "WEIGHT_KERNEL", "-"))):
        return fam.POLYPHASE_KERNEL_ARGS
    return getattr(fam, "GEMM_KERNEL_ARGS", getattr(fam, "AUX_KERNEL_ARGS", ""))


def _ptxas(tmp_path, stem: str, source: str, target: str) -> subprocess.CompletedProcess:
    """``source`` compiled by nvcc to a cubin for ``target`` (e.g. "sm_90a") with ptxas's verbose report in stderr."""
    src = tmp_path / f"{stem}.cu"
    src.write_text(source)
    num = target.split("_")[1]
    return subprocess.run([shutil.which("nvcc"), "-std=c++17", f"-gencode=arch=compute_{num},code={target}",
                           f"-I{kernels_dir()}", "-cubin", "-Xptxas", "-v", str(src), "-o",
                           str(tmp_path / f"{stem}.cubin")], capture_output=True, text=True, timeout=600)


def _host_program(tmp_path, name: str, source: str):
    """``source`` built with nvcc as a host program (it includes the kernels' headers): the executable's path."""
    src = tmp_path / f"{name}.cu"
    src.write_text(source)
    exe = tmp_path / name
    res = subprocess.run([shutil.which("nvcc"), "-std=c++17", f"-I{kernels_dir()}", str(src), "-o", str(exe)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    return exe


@pytest.mark.parametrize("family", sorted(n for n, f in FAMILIES.items() if not getattr(f, "LIBRARY", "")))
def test_nvcc_compiles_sampled_instantiations_for_sm90(tmp_path, family):
    """Each configuration compiles for the target the tuner would give NVRTC on an sm_90 GPU (sm_90, or sm_90a
    for winograd_gemm's wgmma GEMM: ``gpu_arch``), one cubin per target."""
    fam = FAMILIES[family]
    configs = _sample(fam)
    if family == "winograd_gemm":  # both GEMM kinds, whatever the sample drew
        configs += [dict(fam.DEFAULT, GE=ge) for ge in fam.WGMMA_GEMMS] + [dict(fam.DEFAULT, GE=1)]
        configs = list({fam.name(c): c for c in configs}.values())
    if "PP" in fam.PARAMS:  # polyphase plans in both formats and dtypes, whatever the sample drew
        configs += [dict(fam.DEFAULT, PP=1, DT=dt, NHWC=nhwc) for dt in (0, 1) for nhwc in (0, 1)]
        configs = list({fam.name(c): c for c in configs}.values())
    gpu_arch = getattr(fam, "gpu_arch", lambda c, arch: arch)
    by_target: dict[str, list] = {}
    for c in configs:
        by_target.setdefault(gpu_arch(c, "sm_90"), []).append(c)
    frames = {}
    for target, group in sorted(by_target.items()):
        lines = [f'#include "{fam.SOURCE}"']
        seen = set()
        for c in group:
            # a plan may have more kernels (winograd_gemm's own GEMM, an NCHW TMA plan's input copy, a polyphase
            # plan's gather and weight kernels): "stages<...>;gemm<...>", each instantiated once (several
            # configurations share a GEMM tile)
            kernels = fam.name_expression(c).split(";")
            arg_lists = [getattr(fam, "KERNEL_ARGS", "const float*, const float*, const float*, float*, "
                                                     "const bagf::Conv2dParams")] + [_aux_args(fam, e)
                                                                                     for e in kernels[1:]]
            for expr, args in zip(kernels, arg_lists):
                if expr not in seen:
                    seen.add(expr)
                    lines.append(f"template __global__ void {expr}({args});")
        res = _ptxas(tmp_path, f"inst_{target}", "\n".join(lines) + "\n", target)
        assert res.returncode == 0, res.stderr[-4000:]
        # every instantiation was emitted; the default configuration keeps its tiles in registers (a spill is a
        # speed problem the tuner measures, not a correctness one: implicit_gemm's bm128_bn64_bk32_tm8_tn2_db1_v1
        # spills 480 bytes under its 512-thread register cap, so spills are not asserted for the whole sample)
        entries = re.findall(r"Compiling entry function '(\w+)'", res.stderr)
        assert len(set(entries)) == len(seen)
        frames.update(re.findall(r"Function properties for (\w+)\n\s+(\d+) bytes stack frame", res.stderr))
    kernel = fam.KERNEL.split("::")[-1]
    args = "".join(f"Li{fam.DEFAULT[k]}E" for k in fam.TEMPLATE_ORDER)
    mangled = f"_ZN4bagf{len(kernel)}{kernel}I{args}"
    default = [v for k, v in frames.items() if k.startswith(mangled)]
    assert default and set(default) == {"0"}, (mangled, frames)


def test_gemm_wgmma_tiles_compile_for_sm90a_only(tmp_path):
    """winograd_gemm's wgmma GEMM tiles compile for sm_90a without spills and without ptxas serialising the
    wgmmas (warning C7515: the pipelining the kernel is built on would be lost); for plain sm_90 the compile
    fails with the static_assert that says what it needs (the tuner records that as a compile failure, never
    a launch)."""
    from bagf_torch.kernels import winograd_gemm as wgg

    source = '#include "gemm_wgmma.cuh"\n' + "".join(
        f"template __global__ void {wgg.WGMMA_GEMM_KERNEL}<{', '.join(map(str, t))}>({wgg.GEMM_KERNEL_ARGS});\n"
        for t in wgg.WGMMA_GEMMS.values())
    res = _ptxas(tmp_path, "wgmma", source, "sm_90a")
    assert res.returncode == 0, res.stderr[-4000:]
    assert "C7515" not in res.stderr and "serialized" not in res.stderr, res.stderr[-3000:]
    frames = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores", res.stderr)
    assert len(frames) == len(wgg.WGMMA_GEMMS) and all(f == ("0", "0") for f in frames), frames
    res = _ptxas(tmp_path, "wgmma", source, "sm_90")
    assert res.returncode != 0 and "needs sm_90a" in res.stderr, res.stderr[-2000:]


_WINO_HOST = r"""
#include <cstdio>
#include <cstdlib>
#include "winograd.cuh"

// One tile through the kernel's own transforms: Y = A^T [(G g G^T) . (B^T d B)] A, printed with the inputs.
template <int MT, typename Co>
void tile(unsigned seed) {
  constexpr int A = MT + 2;
  srand(seed);
  float d[A][A], g[3][3], v[A][A], u[A][A], t1[A][A], t2[A][3], m[A][A], t3[MT][A], y[MT][MT];
  for (int i = 0; i < A; ++i) for (int j = 0; j < A; ++j) d[i][j] = rand() / (float)RAND_MAX - 0.5f;
  for (int i = 0; i < 3; ++i) for (int j = 0; j < 3; ++j) g[i][j] = rand() / (float)RAND_MAX - 0.5f;
  bagf::wino::left<A, A, A>(typename Co::Bt(), d, t1);
  bagf::wino::right<A, A, A>(typename Co::Bt(), t1, v);
  bagf::wino::left<A, 3, 3>(typename Co::G(), g, t2);
  bagf::wino::right<A, 3, A>(typename Co::G(), t2, u);
  for (int i = 0; i < A; ++i) for (int j = 0; j < A; ++j) m[i][j] = u[i][j] * v[i][j];
  bagf::wino::left<MT, A, A>(typename Co::At(), m, t3);
  bagf::wino::right<MT, A, MT>(typename Co::At(), t3, y);
  printf("tile %d", MT);
  for (int i = 0; i < A; ++i) for (int j = 0; j < A; ++j) printf(" %.9g", d[i][j]);
  for (int i = 0; i < 3; ++i) for (int j = 0; j < 3; ++j) printf(" %.9g", g[i][j]);
  for (int i = 0; i < MT; ++i) for (int j = 0; j < MT; ++j) printf(" %.9g", y[i][j]);
  printf("\n");
}

int main(int argc, char** argv) {
  for (unsigned s = 1; s <= 4; ++s) {
    tile<2, bagf::wino::Coefs<2>>(s);
    tile<4, bagf::wino::Coefs<4>>(s);
    tile<5, bagf::wino::Coefs<5>>(s);
    tile<6, bagf::wino::Coefs<6>>(s);
  }
  for (int i = 1; i + 4 < argc; i += 5) {  // e, bk, bt, ttn, loop_floats -> rounds
    printf("rounds %d\n", bagf::wino::out_rounds(atoi(argv[i]), atoi(argv[i + 1]), atoi(argv[i + 2]),
                                                 atoi(argv[i + 3]), atoi(argv[i + 4])));
  }
  return 0;
}
"""


def test_winograd_transforms_and_output_rounds_match_python_on_host(tmp_path):
    """The Winograd kernel's transforms (compile-time zero skipping included) compute a direct 3x3 correlation
    of one tile, for F(2x2), F(4x4), F(5x5) and F(6x6) (the last two only in the non-fused family); and its output-stage rounds equal the Python model's, on which the
    shared memory the host allocates depends (a mismatch would overrun shared memory)."""
    import numpy as np

    from bagf_torch.kernels import winograd as wg

    exe = _host_program(tmp_path, "wino_host", _WINO_HOST)
    configs = random.Random(3).sample(wg.space().valid_configs(), 200)
    args = []
    for c in configs:
        e = wg.points(c)
        args += [e, c["BK"], c["BT"], c["BT"] // c["TT"], e * c["BC"] * (c["BK"] + 4 + c["BT"] + 4)]
    out = subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True, timeout=60, check=True).stdout
    tiles = [line.split()[1:] for line in out.splitlines() if line.startswith("tile")]
    assert len(tiles) == 16
    for row in tiles:
        m, vals = int(row[0]), np.array(row[1:], dtype=np.float64)
        a = m + 2
        d, g, y = vals[: a * a].reshape(a, a), vals[a * a: a * a + 9].reshape(3, 3), vals[a * a + 9:].reshape(m, m)
        want = np.array([[(d[i:i + 3, j:j + 3] * g).sum() for j in range(m)] for i in range(m)])
        np.testing.assert_allclose(y, want, rtol=0, atol=1e-5 * (1 if m == 2 else 8 if m == 4 else 32))
    rounds = [int(line.split()[1]) for line in out.splitlines() if line.startswith("rounds")]
    assert rounds == [wg.out_rounds(c) for c in configs]
    assert len(set(rounds)) > 1  # the sample exercises more than one round count


_HALO_HOST = r"""
#include <cstdio>
#include <cstdlib>
#include "conv_params.h"

int main(int argc, char** argv) {
  for (int i = 1; i + 7 < argc; i += 8) {  // th, tw, R, S, stride_h, stride_w, dil_h, dil_w -> rows cols pitch
    bagf::Conv2dParams p{};
    p.R = atoi(argv[i + 2]); p.S = atoi(argv[i + 3]);
    p.stride_h = atoi(argv[i + 4]); p.stride_w = atoi(argv[i + 5]);
    p.dil_h = atoi(argv[i + 6]); p.dil_w = atoi(argv[i + 7]);
    const bagf::HaloPatch h = bagf::halo_patch(atoi(argv[i]), atoi(argv[i + 1]), p);
    printf("%d %d %d\n", h.rows, h.cols, h.pitch);
  }
  return 0;
}
"""


def test_direct_halo_patch_matches_python_on_host(tmp_path):
    """``bagf::halo_patch`` (conv_params.h), which the host uses to size a direct plan's shared memory per call
    and the kernel to lay its buffers out, equals ``kernels.direct.patch`` (the Python side's smem_bytes and
    traffic model) on sampled tiles and filter geometries: a mismatch would overrun shared memory."""
    from bagf_torch.kernels import direct as dr
    from bagf_torch.problem import ConvProblem

    exe = _host_program(tmp_path, "halo_host", _HALO_HOST)
    rng = random.Random(5)
    cases = []
    for c in rng.sample(dr.space().valid_configs(), 60):
        r, s = rng.choice((1, 2, 3, 5, 7, 11)), rng.choice((1, 3, 4, 11))
        st, dl = (rng.randint(1, 4), rng.randint(1, 4)), (rng.randint(1, 3), rng.randint(1, 3))
        cases.append((c, ConvProblem(n=1, c=1, h=64, w=64, k=1, r=r, s=s, stride=st, dilation=dl)))
    args = [v for c, p in cases for v in (c["TH"], c["TW"], p.r, p.s, *p.stride, *p.dilation)]
    out = subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True, timeout=60, check=True).stdout
    got = [tuple(map(int, line.split())) for line in out.splitlines()]
    assert got == [dr.patch(c, p) for c, p in cases]
    assert any(pitch != cols for _, cols, pitch in got)  # even widths get the odd pitch


_POLYPHASE_HOST = r"""
#include <cstdio>
#include <cstdlib>
#include "conv_params.h"

int main(int argc, char** argv) {
  for (int i = 1; i + 12 < argc; i += 13) {  // N C H W K R S P Q stride_h stride_w pad_h pad_w -> the inner problem
    bagf::Conv2dParams p{};
    p.N = atoi(argv[i]); p.C = atoi(argv[i + 1]); p.H = atoi(argv[i + 2]); p.W = atoi(argv[i + 3]);
    p.K = atoi(argv[i + 4]); p.R = atoi(argv[i + 5]); p.S = atoi(argv[i + 6]);
    p.P = atoi(argv[i + 7]); p.Q = atoi(argv[i + 8]);
    p.stride_h = atoi(argv[i + 9]); p.stride_w = atoi(argv[i + 10]);
    p.pad_h = atoi(argv[i + 11]); p.pad_w = atoi(argv[i + 12]);
    p.dil_h = p.dil_w = 1;
    const bagf::PolyphaseParams q = bagf::polyphase_form(p, 1, 2, 3, 4);
    const bagf::Conv2dParams f = bagf::polyphase_inner(p, q);
    printf("%d %d %d %d %d %d %d %d %d %d %d %d %d %d %d %d\n", f.N, f.C, f.H, f.W, f.K, f.R, f.S, f.P, f.Q,
           f.stride_h, f.stride_w, f.pad_h, f.pad_w, f.dil_h, f.dil_w, q.sh * q.sw * q.C <= q.Cp && q.Cp % 8 == 0);
  }
  return 0;
}
"""


def test_polyphase_form_matches_python_on_host(tmp_path):
    """``bagf::polyphase_form`` and ``polyphase_inner`` (conv_params.h), the problem the host runs a polyphase plan's
    kernel on and sizes its gather and weight from, equal ``implicit_gemm_tma_h16.polyphase_problem`` (the family's
    rules, k tiles and workspace) on sampled strided problems: a mismatch would size the form's tensors or grids
    from one problem and check another."""
    from bagf_torch.kernels import implicit_gemm_tma_h16 as th
    from bagf_torch.problem import ConvProblem

    exe = _host_program(tmp_path, "polyphase_host", _POLYPHASE_HOST)
    rng = random.Random(7)
    problems = []
    while len(problems) < 60:
        st = (rng.randint(1, 8), rng.randint(1, 8))
        p = ConvProblem(n=rng.randint(1, 40), c=rng.randint(1, 63), h=rng.randint(1, 300), w=rng.randint(1, 300),
                        k=rng.randint(1, 300), r=rng.randint(1, 13), s=rng.randint(1, 13), stride=st,
                        padding=(rng.randint(0, 7), rng.randint(0, 7)), dtype="bfloat16", layout="nhwc")
        if min(p.out_hw) >= 1 and st != (1, 1):
            problems.append(p)
    args = [v for p in problems for v in (p.n, p.c, p.h, p.w, p.k, p.r, p.s, *p.out_hw, *p.stride, *p.padding)]
    out = subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True, timeout=60, check=True).stdout
    got = [tuple(map(int, line.split())) for line in out.splitlines()]
    want = []
    for p in problems:
        f = th.polyphase_problem(p)
        want.append((f.n, f.c, f.h, f.w, f.k, f.r, f.s, *f.out_hw, *f.stride, *f.padding, *f.dilation, 1))
    assert got == want


def test_h16_pipeline_stages_compile_without_spills(tmp_path):
    """implicit_gemm_h16's cp.async pipeline (ST 3 and 4) next to the register path (ST 2) in both dtypes: the
    default tile and a batch-1 start point at every ST, the largest shared memory of the space, and the smallest
    block; each an entry of its own, the default-sized ones without a stack frame or spills."""
    from bagf_torch.kernels import implicit_gemm_h16 as h16

    valid = h16.space().valid_configs()
    largest = max(valid, key=lambda c: (h16.smem_bytes(c), -h16.estimated_registers(c)))
    smallest = min(valid, key=lambda c: (h16.threads(c), h16.smem_bytes(c)))
    plain = [dict(h16.DEFAULT, DT=dt, ST=st) for dt in (0, 1) for st in h16.PARAMS["ST"]]
    plain += [dict(h16.DEFAULT, BM=64, BN=64, ST=st) for st in h16.PARAMS["ST"]]
    configs = plain + [largest, smallest, dict(smallest, NHWC=1, ST=4)]
    assert largest["ST"] == 4 and all(h16.space().is_valid(c) for c in configs)
    exprs = list(dict.fromkeys(h16.name_expression(c) for c in configs))
    res = _ptxas(tmp_path, "h16", _instantiations(h16, exprs), "sm_90")
    assert res.returncode == 0, res.stderr[-4000:]
    info = re.findall(r"Function properties for (\w+)\n\s+(\d+) bytes stack frame, (\d+) bytes spill stores, "
                      r"(\d+) bytes spill loads\n.*?Used (\d+) registers", res.stderr)
    assert len(info) == len(exprs), res.stderr[-3000:]
    by_args = {}
    for mangled, frame, stores, loads, regs in info:
        args = tuple(int(v) for v in re.findall(r"Li(\d+)E", mangled))
        by_args[args] = (int(frame), int(stores), int(loads), int(regs))
    for c in plain:
        got = by_args[tuple(c[k] for k in h16.TEMPLATE_ORDER)]
        assert got[:3] == (0, 0, 0), (h16.name(c), got)
        assert got[3] <= 255 and abs(got[3] - h16.estimated_registers(c)) <= 40, (h16.name(c), got)
    # the pipeline is compiled in: every ST 3-4 entry issues asynchronous global->shared copies, ST 2 none (PTX:
    # the CUDA toolkit's SASS disassembler is not everywhere nvcc is)
    res = subprocess.run([shutil.which("nvcc"), "-std=c++17", "-arch=compute_90", f"-I{kernels_dir()}", "-ptx",
                          str(tmp_path / "h16.cu"), "-o", str(tmp_path / "h16.ptx")], capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    entries = re.split(r"\.entry ", (tmp_path / "h16.ptx").read_text())[1:]
    copies = {tuple(int(v) for v in re.findall(r"Li(\d+)E", e.split("(")[0])): "cp.async.cg.shared.global" in e
              for e in entries}
    assert len(copies) == len(exprs)
    for args, has in copies.items():
        assert has == (args[-1] >= 3), (args, has)


def _tma_compiles_without_serialized_wgmma_or_spills(tmp_path, fam, configs):
    """``configs`` of a TMA family compiled for sm_90a: no stack frame, no spills, and no "wgmma ... serialized"
    performance warning from ptxas (C7515: where anything but a wgmma defines the accumulators between a group's
    issue and its wait -- an accumulator zeroed by plain moves that ptxas re-creates inside the loop did -- ptxas
    makes every wgmma wait for the one before)."""
    space = fam.space()
    assert all(space.is_valid(c) for c in configs), [fam.name(c) for c in configs if not space.is_valid(c)]
    exprs = list(dict.fromkeys(fam.name_expression(c) for c in configs))
    res = _ptxas(tmp_path, "tma", _instantiations(fam, exprs), "sm_90a")
    assert res.returncode == 0, res.stderr[-4000:]
    assert "C7515" not in res.stderr and "serialized" not in res.stderr, res.stderr[-3000:]
    info = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads\n.*?Used (\d+) "
                      r"registers", res.stderr)
    assert len(info) == len({k for e in exprs for k in e.split(";")}), res.stderr[-3000:]
    assert all(tuple(map(int, i[:3])) == (0, 0, 0) for i in info), info


def test_tma_h16_wgmma_groups_overlap_and_nothing_spills(tmp_path):
    """implicit_gemm_tma_h16 at its start point, its largest accumulator tiles (128 per consumer thread, one and two
    consumer warpgroups) and its deepest rings, channels_last and NCHW, stream-K and persistent blocks. Two consumer
    warpgroups run at 168 registers per thread at launch, which the producer's setmaxnreg hands over."""
    from bagf_torch.kernels import implicit_gemm_tma_h16 as th

    _tma_compiles_without_serialized_wgmma_or_spills(tmp_path, th, [
        th.DEFAULT, dict(th.DEFAULT, NHWC=0, DT=0), dict(th.DEFAULT, WN=256, STAGES=3),
        dict(th.DEFAULT, WN=128, MI=2, STAGES=4), dict(th.DEFAULT, WN=256, WG=1, STAGES=4),
        dict(th.DEFAULT, WN=64, WG=1, STAGES=6), dict(th.DEFAULT, SK=1), dict(th.DEFAULT, WN=256, STAGES=3, SK=1),
        dict(th.DEFAULT, WN=128, MI=2, STAGES=4, SK=1, NHWC=0), dict(th.DEFAULT, SK=2),
        dict(th.DEFAULT, WN=256, STAGES=3, SK=2, NHWC=0), dict(th.DEFAULT, WN=256, WG=1, STAGES=4, SK=2)])


def test_tma_tf32_wgmma_groups_overlap_and_nothing_spills(tmp_path):
    """implicit_gemm_tma_tf32 (the same kernel on fp32 stages, k8 TF32 wgmma) at its start point, its largest
    accumulator tiles and deepest rings, NCHW and channels_last."""
    from bagf_torch.kernels import implicit_gemm_tma_tf32 as tt

    _tma_compiles_without_serialized_wgmma_or_spills(tmp_path, tt, [
        tt.DEFAULT, dict(tt.DEFAULT, NHWC=1, SPLIT=4), dict(tt.DEFAULT, WN=256, STAGES=3),
        dict(tt.DEFAULT, WN=128, MI=2, STAGES=4), dict(tt.DEFAULT, WN=256, WG=1, STAGES=4),
        dict(tt.DEFAULT, WN=64, WG=1, STAGES=6), dict(tt.DEFAULT, WN=192, STAGES=3), dict(tt.DEFAULT, SK=1),
        dict(tt.DEFAULT, WN=256, STAGES=3, SK=1, NHWC=1), dict(tt.DEFAULT, WN=128, MI=2, STAGES=4, SK=1),
        dict(tt.DEFAULT, SK=2), dict(tt.DEFAULT, WN=256, STAGES=3, SK=2, NHWC=1)])


_SLICE_HOST = r"""
#include <cstdio>
#include <cstdlib>
#include "implicit_gemm_h16.cuh"

int main(int argc, char** argv) {
  for (int i = 1; i + 1 < argc; i += 2) {  // num_k, split -> the first step of each slice and the end
    const int num_k = atoi(argv[i]), split = atoi(argv[i + 1]);
    for (int z = 0; z <= split; ++z) printf("%d ", bagf::h16::slice_begin(z, num_k, split));
    printf("\n");
  }
  return 0;
}
"""


_STREAM_K_HOST = r"""
#include <cstdio>
#include <cstdlib>
#include "implicit_gemm_tma_h16.cuh"

int main(int argc, char** argv) {
  for (int i = 1; i + 2 < argc; i += 3) {  // work, blocks, x stride -> the shares' bounds, then sampled owners
    const long long work = atoll(argv[i]), blocks = atoll(argv[i + 1]), step = atoll(argv[i + 2]);
    for (long long c = 0; c <= blocks; ++c) printf("%lld ", bagf::wgt::sk_begin(c, work, blocks));
    printf("|");
    for (long long x = 0; x < work; x += step) printf(" %lld", bagf::wgt::sk_owner(x, work, blocks));
    if (work > 0) printf(" %lld", bagf::wgt::sk_owner(work - 1, work, blocks));
    printf("\n");
  }
  return 0;
}
"""


def test_stream_k_shares_and_owners_on_host(tmp_path):
    """Stream-K's even split of all tiles' k tiles (``wgt::sk_begin``) is h16's slice rule over the whole work, and
    ``wgt::sk_owner(x)`` is the block whose share holds iteration x (so a shared tile's parts are found where their
    blocks stored them), for small grids, AlexNet's conv4 at N = 32 and 128 on 132 SMs, and work near 2^31."""
    from bagf_torch.kernels import implicit_gemm_h16 as h16

    exe = _host_program(tmp_path, "stream_k_host", _STREAM_K_HOST)
    cases = [(w, g, 1) for w in (1, 7, 8, 64, 100) for g in (1, 2, 3, 7) if w >= g]
    cases += [(86 * 108, 132, 1), (338 * 108, 132, 1), (2**31 - 1, 132, 2**24 + 1), (2**31 - 1, 396, 2**24 + 3)]
    args = [v for case in cases for v in case]
    out = subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True, timeout=60, check=True).stdout
    rows = out.splitlines()
    assert len(rows) == len(cases)
    for (work, blocks, step), row in zip(cases, rows):
        bounds_text, owners_text = row.split("|")
        bounds = list(map(int, bounds_text.split()))
        assert bounds == [h16.split_range(c, work, blocks).start for c in range(blocks)] + [work]
        xs = list(range(0, work, step)) + [work - 1]
        for x, owner in zip(xs, map(int, owners_text.split()), strict=True):
            assert bounds[owner] <= x < bounds[owner + 1], (work, blocks, x, owner)


_CLUSTER_SHARE_HOST = r"""
#include <cstdio>
#include "implicit_gemm_tma_h16.cuh"

int main() {  // every tile width, unit, cluster size, rank and channel count below the tile's end
  for (int wn = 64; wn <= 256; wn += 64)
    for (int unit = 1; unit <= 4; unit += 3)
      for (int ranks = 2; ranks <= 8; ranks *= 2)
        for (int channels = 1; channels <= wn; ++channels)
          for (int rank = 0; rank < ranks; ++rank) {
            int jb = -1, je = -1;
            bagf::wgt::cluster_share(rank, ranks, wn / 8, unit, channels, &jb, &je);
            printf("%d %d %d %d %d %d %d\n", wn, unit, ranks, channels, rank, jb, je);
          }
  return 0;
}
"""


def test_cluster_shares_cover_each_channel_group_once_on_host(tmp_path):
    """Split-K in clusters: the kernel's share of each rank (``wgt::cluster_share``) is the Python rule's
    (``implicit_gemm_tma_h16.cluster_share``) for every tile width, unit (channels_last 1, NCHW 4 groups), cluster size
    and channel count; the ranks' shares are consecutive and disjoint and cover every group holding a channel below K
    (so each output channel is stored by exactly one rank), in whole units."""
    from bagf_torch.kernels import implicit_gemm_tma_h16 as th

    exe = _host_program(tmp_path, "cluster_share_host", _CLUSTER_SHARE_HOST)
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60, check=True).stdout
    shares: dict[tuple[int, int, int, int], list[range]] = {}
    for line in out.splitlines():
        wn, unit, ranks, channels, rank, jb, je = map(int, line.split())
        assert range(jb, je) == th.cluster_share(rank, ranks, wn, int(unit == 1), channels), line
        assert jb % unit == 0 and je % unit == 0 and 0 <= jb <= je <= wn // 8, line
        shares.setdefault((wn, unit, ranks, channels), []).append(range(jb, je))
    assert len(shares) == (64 + 128 + 192 + 256) * 2 * 3  # every tile width's channel counts x units x cluster sizes
    for (wn, unit, ranks, channels), parts in shares.items():
        assert len(parts) == ranks
        assert all(a.stop == b.start for a, b in zip(parts, parts[1:])) and parts[0].start == 0
        held = -(-channels // 8)  # the groups holding a channel below K
        assert held <= parts[-1].stop <= held + unit - 1, (wn, unit, ranks, channels, parts)


def test_h16_split_k_slices_match_python_on_host(tmp_path):
    """The kernel's even split (``h16::slice_begin``) equals ``implicit_gemm_h16.split_range`` for every slice count
    of the space and K-step counts from 0 up (num_k near 2^31 and split up to the host's 65535 too: no overflow):
    consecutive slices, every step once, the problem rule's floor(steps / SPLIT) the smallest share."""
    from bagf_torch.kernels import implicit_gemm_h16 as h16

    exe = _host_program(tmp_path, "slice_host", _SLICE_HOST)
    cases = [(k, s) for s in h16.PARAMS["SPLIT"] + (3, 5, 7) for k in list(range(0, 70)) + [333, 1001, 2**31 - 1]]
    cases += [(k, 65535) for k in (0, 1, 65534, 65535, 65536, 2**31 - 1)]  # the host's largest split: z*r near 2^32
    args = [v for case in cases for v in case]
    out = subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True, timeout=60, check=True).stdout
    rows = [list(map(int, line.split())) for line in out.splitlines()]
    assert len(rows) == len(cases)
    for (k, s), bounds in zip(cases, rows):
        want = [h16.split_range(z, k, s) for z in range(s)]
        assert bounds == [r.start for r in want] + [k], (k, s, bounds)
        assert all(want[z].stop == bounds[z + 1] for z in range(s))
        assert min(len(r) for r in want) == k // s
