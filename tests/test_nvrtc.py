"""NVRTC compiles a sample of each family's instantiations for sm_90 exactly as the runtime asks it to (the spec's
source, name expressions and options), without a GPU: NVRTC's JIT mode rejects code that nvcc accepts (a generic
lambda's call operator is host code there), which test_nvcc's whole-program compiles cannot see. Needs libnvrtc: a
CUDA toolkit's, or the nvidia-cuda-nvrtc wheel's (the test extra installs it; CUDA 13's is preferred to a CUDA 12
wheel's, which may be the one a cu12 torch would use); skipped with the reason otherwise."""

from __future__ import annotations

import ctypes
import glob
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from bagf_torch.jit.compiler import KernelSpec
from bagf_torch.kernels import FAMILIES
from test_nvcc import _sample as nvcc_sample  # tests/ is on sys.path (pytest's default prepend import mode)

pytestmark = pytest.mark.slow


def _candidates() -> list[str]:
    """Where a libnvrtc may be: $CUDA_HOME's, the nvidia wheels' (CUDA 13, then 12) in each site directory."""
    paths = []
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            paths += sorted(glob.glob(os.path.join(home, "lib64", "libnvrtc.so.*")))
    for site in sys.path:
        paths += sorted(glob.glob(os.path.join(site, "nvidia", "cu13", "lib", "libnvrtc.so.*")))
        paths += sorted(glob.glob(os.path.join(site, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so.*")))
    return [p for p in paths if "builtins" not in p and ".alt." not in p]


def _load_nvrtc():
    """libnvrtc with its builtins library loaded first (NVRTC opens that by name: a wheel's directory is not on the
    loader's path), or the reason there is none."""
    tried = []
    for path in _candidates():
        try:
            for builtins in sorted(glob.glob(os.path.join(os.path.dirname(path), "libnvrtc-builtins.so.*"))):
                if ".alt." not in builtins:
                    ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
            lib = ctypes.CDLL(path)
            major, minor = ctypes.c_int(), ctypes.c_int()
            if lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)) == 0 and major.value >= 12:
                return lib, f"{path} ({major.value}.{minor.value})"
            tried.append(f"{path}: NVRTC {major.value}.{minor.value}, older than 12")
        except OSError as e:
            tried.append(f"{path}: {e}")
    return None, "no libnvrtc found (a CUDA toolkit or `pip install nvidia-cuda-nvrtc`)" + "".join(
        f"; {t}" for t in tried)


@pytest.fixture(scope="module")
def nvrtc():
    lib, about = _load_nvrtc()
    if lib is None:
        pytest.skip(about)
    return lib


def _compile(lib, spec: KernelSpec) -> str | None:
    """NVRTC's compile of ``spec`` as csrc/nvrtc_compile.h runs it: None, or what went wrong with the log."""
    c = ctypes.c_char_p
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), c(spec.source().encode()), c(b"bagf_kernel.cu"), 0, None,
                              None) != 0:
        return "nvrtcCreateProgram failed"
    try:
        names = [n.encode() for n in spec.name_expression.split(";")]
        for n in names:
            lib.nvrtcAddNameExpression(prog, c(n))
        options = [o.encode() for o in spec.options()]
        r = lib.nvrtcCompileProgram(prog, len(options), (c * len(options))(*options))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value + 1)
        lib.nvrtcGetProgramLog(prog, log)
        if r != 0:
            return f"nvrtcCompileProgram {r}: {log.value.decode(errors='replace')[-3000:]}"
        for n in names:
            lowered = c()
            if lib.nvrtcGetLoweredName(prog, c(n), ctypes.byref(lowered)) != 0:
                return f"no lowered name for {n.decode()}"
        if lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)) != 0 or size.value == 0:
            return f"no cubin for {spec.target}"
        return None
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _sample(fam) -> list[dict]:
    """test_nvcc's sample (the default, the space's extremes) with three drawn at random, and the default in each
    memory format the family has."""
    picked = nvcc_sample(fam, n=3)
    if "NHWC" in fam.PARAMS:
        picked += [dict(fam.DEFAULT, NHWC=v) for v in fam.PARAMS["NHWC"]]
    return list({fam.name(c): c for c in picked}.values())


@pytest.mark.parametrize("family", sorted(n for n, f in FAMILIES.items() if not getattr(f, "LIBRARY", "")))
def test_nvrtc_compiles_sampled_instantiations_as_the_runtime_does(nvrtc, family):
    fam = FAMILIES[family]
    specs = [KernelSpec(fam, c, "sm_90") for c in _sample(fam)]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        failed = [(s.name, e) for s, e in zip(specs, pool.map(lambda s: _compile(nvrtc, s), specs)) if e]
    assert not failed, "\n\n".join(f"{name}:\n{error}" for name, error in failed)
