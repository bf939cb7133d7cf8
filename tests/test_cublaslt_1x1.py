"""The cuBLASLt family (``kernels.cublaslt_1x1``) on CPU: which problems it takes and under which setting, the knobs
each problem fixes, the launch fields the host receives, and the library path through the compiler and the cache
(nothing compiled, no cubin named, an imported plan stored without one and without a build). Its GEMMs run in
tests/test_gpu.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bagf_torch import settings
from bagf_torch.cache import SCHEMA_VERSION, Cache
from bagf_torch.cache_io import _cubin_digest_from_env
from bagf_torch.jit import extension
from bagf_torch.jit.compiler import KernelCompiler, Loaded, is_library
from bagf_torch.kernels import FAMILIES, cublaslt_1x1 as lt, families_for, family_refuses, format_refuses
from bagf_torch.problem import ConvProblem, fingerprint
from test_launch_geometry import _FakeExt  # tests/ is on sys.path (pytest's default prepend import mode)

R1x1 = ConvProblem(n=32, c=1024, h=14, w=14, k=256, r=1, s=1)
FORMATS = [(dt, fmt, tf32) for dt in ("float32", "float16", "bfloat16") for fmt in ("nchw", "nhwc")
           for tf32 in ((False, True) if dt == "float32" else (False,))]


def _problem(dt="float32", fmt="nchw", tf32=False, **kw):
    fields = dict(R1x1.as_dict(), dtype=dt, layout=fmt, tf32=tf32, **kw)
    return ConvProblem.from_dict(fields)


def test_the_family_is_registered_as_a_library_call():
    assert FAMILIES[lt.FAMILY] is lt and is_library(lt) and lt.LIBRARY == "cublasLt"
    assert lt.SOURCE == lt.KERNEL == "" and lt.name_expression(lt.DEFAULT) == "cublasLt"
    assert len(lt.space().valid_configs()) == 8 * 2 * 3 * 2 * 2 - 8 * 2 * 2 * 2  # TF = 1 in float32 only


def test_applies_to_1x1_stride_1_unpadded_convs_and_is_searched_only_with_the_setting(monkeypatch):
    assert lt.applies(R1x1) is None
    assert lt.applies(_problem(dilation=(2, 3))) is None  # a 1x1 filter has no taps apart
    for other in (_problem(r=3, s=3, padding=(1, 1)), _problem(stride=(2, 2)), _problem(padding=(1, 0)),
                  _problem(r=1, s=3)):
        assert "1x1" in lt.applies(other), other
    monkeypatch.delenv("BAGF_CUBLASLT", raising=False)  # on by default
    assert settings.cublaslt() and lt in families_for((9, 0)) and lt in families_for((8, 0))
    assert lt not in families_for((7, 5))
    monkeypatch.setenv("BAGF_CUBLASLT", "0")
    assert not settings.cublaslt() and lt not in families_for((9, 0))
    assert set(families_for((9, 0))) == set(FAMILIES.values()) - {lt}
    monkeypatch.setenv("BAGF_CUBLASLT", "maybe")
    with pytest.raises(settings.SettingError):
        families_for((9, 0))


@pytest.mark.parametrize("dt,fmt,tf32", FORMATS)
def test_each_problem_fixes_dtype_format_and_tf32_and_the_start_point_obeys(dt, fmt, tf32):
    p = _problem(dt, fmt, tf32)
    assert format_refuses(lt, p) is None
    start = lt.default_for(p, 132)
    assert lt.space().invalid_reason(start) is None and lt.problem_rule(start, p) is None
    assert (start["ALG"], start["WS"]) == (0, 1)
    allowed = [c for c in lt.space().valid_configs() if lt.problem_rule(c, p) is None]
    assert len(allowed) == 16 and {(c["ALG"], c["WS"]) for c in allowed} == {(a, w) for a in range(8) for w in (0, 1)}
    for c in allowed:
        geo = lt.launch(c)
        assert geo.blas == (2 if tf32 else 1) and geo.blas_algo == c["ALG"] and geo.blas_ws == 32 * c["WS"]
        assert geo.dtype == {"float32": 0, "float16": 1, "bfloat16": 2}[dt] and geo.nhwc == (fmt == "nhwc")
        assert (geo.tma, geo.gemm, geo.split, geo.threads, geo.smem, geo.bm, geo.bn) == (0, 0, 1, 0, 0, 0, 0)
    other_tf32 = dict(start, TF=1 - start["TF"])
    assert lt.space().invalid_reason(other_tf32) is not None or lt.problem_rule(other_tf32, p) is not None
    assert lt.problem_rule(dict(start, NHWC=1 - start["NHWC"]), p) is not None
    assert lt.problem_rule(dict(start, DT=(start["DT"] + 1) % 3), p) is not None


def test_names_say_dtype_format_mode_entry_and_workspace():
    c = dict(lt.DEFAULT, TF=1, ALG=3)
    assert lt.name(c) == "cublaslt_1x1_fp32_nchw_tf32_a3_ws32_sm90"
    assert lt.name(dict(lt.DEFAULT, DT=2, NHWC=1, WS=0), "sm80") == "cublaslt_1x1_bf16_nhwc_a0_ws0_sm80"
    assert len({lt.name(c) for c in lt.space().valid_configs()}) == len(lt.space().valid_configs())


def test_an_imported_plan_is_checked_against_the_problem():
    p = _problem("bfloat16", "nhwc")
    assert family_refuses(lt.FAMILY, lt.default_for(p), p) is None
    assert family_refuses(lt.FAMILY, lt.default_for(p), _problem("float16", "nhwc")) is not None
    assert family_refuses(lt.FAMILY, lt.default_for(p), _problem("bfloat16", "nhwc", r=3, s=3,
                                                                  padding=(1, 1))) is not None


def test_the_compiler_loads_a_library_plan_at_once_without_a_cubin():
    compiler = object.__new__(KernelCompiler)  # no device, no NVRTC: a library family needs neither
    compiler.ext, compiler.device, compiler.arch = _FakeExt(), 0, "sm_90"
    configs = [dict(lt.DEFAULT, TF=1, ALG=a) for a in (0, 5)]
    got = compiler.compile_within(lt, configs, 0.0)  # (no wait needed: nothing to wait for)
    assert all(isinstance(g, Loaded) and g.compile_seconds == 0.0 for g in got) and len(compiler.ext.calls) == 2
    for (cubin, lowered, device, geometry), c in zip(compiler.ext.calls, configs):
        assert (cubin, lowered, device) == (b"", "", 0) and geometry.kw == lt.launch(c).as_dict()
    assert compiler.digest(lt, configs[0]) is None
    assert compiler.build(lt, configs) == [None, None]
    assert compiler.prefetch([(lt, configs[0])]) == {}


def test_an_imported_library_plan_is_stored_without_a_cubin_or_a_build(cache_dir, tmp_path):
    env = {"gpu": "NVIDIA H200", "cc": "9.0", "driver": 13000, "runtime": 13000, "nvrtc": "13.0", "torch": "2.11.0",
           "bagf_torch": "0.1.0", "kernels": extension.source_hash(), "os": "posix"}
    config = dict(lt.DEFAULT, TF=1)
    assert _cubin_digest_from_env(lt, config, env) is None
    problem = _problem(tf32=True)
    row = {"key": fingerprint(problem, env), "problem": problem.as_dict(), "env": env, "family": lt.FAMILY,
           "config": config, "time_us": 20.0, "aten_us": 26.0, "default_us": 21.0, "evaluations": 16,
           "tune_seconds": 3.0, "cubin_digests": ["f" * 64], "created": 1.7e9}
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"format": "bagf_torch.cache", "schema": SCHEMA_VERSION, "plans": [row],
                                "cubins": []}))

    class NoBuild:
        def digest(self, family, config):
            return None

        def build(self, family, configs):
            raise AssertionError("a library plan has nothing to build")

    for compiler in (None, NoBuild()):
        with Cache.for_dir(cache_dir / str(compiler is None)) as cache:
            assert cache.import_(path, env, compiler=compiler) == (1, [])
            stored = cache.get_plan(row["key"])
            assert stored["family"] == lt.FAMILY and stored["config"] == config and stored["cubin_digests"] == []


@pytest.mark.slow
def test_the_host_plan_computes_1x1_convolutions_with_cublaslt_semantics(tmp_path):
    """csrc/cublaslt_plan.h built with the host compiler against a stand-in libcublasLt (tests/cublaslt_fake) that
    computes what cuBLASLt documents for the descriptors it is given: every formulation (channels_last with the bias
    epilogue, NCHW with the bias as a batch-stride-0 C, NCHW without bias; N = 1 and a batch) equals the direct 1x1
    convolution; the heuristic gets the workspace limit, fp32 partial sums in 16 bits, TF32 products in TF32 mode
    and each operand's alignment; the call passes the chosen entry and its workspace; an entry the list lacks is
    refused with the reason once and remembered. What it cannot tell: whether the real library accepts each
    descriptor (the GPU test's part)."""
    import os
    import shutil
    import subprocess

    import glob

    from torch.utils import cpp_extension

    cxx = shutil.which("c++") or shutil.which("g++")
    homes = [os.environ.get("CUDA_HOME"), cpp_extension.CUDA_HOME, "/usr/local/cuda",
             *sorted(glob.glob("/usr/local/cuda-*"), reverse=True)]
    includes = [Path(h) / "include" for h in homes if h and (Path(h) / "include" / "cuda_runtime.h").is_file()]
    if cxx is None or not includes:
        pytest.skip("no C++ compiler or CUDA toolkit headers (cuda_runtime.h) here")
    cuda_include = [str(includes[0])]
    fake_dir = Path(__file__).parent / "cublaslt_fake"
    lib = tmp_path / "libcublasLt.so.13"
    harness = tmp_path / "harness"
    for cmd in ([cxx, "-std=c++17", "-O1", "-shared", "-fPIC", "-o", str(lib), str(fake_dir / "fake_cublaslt.cpp")],
                [cxx, "-std=c++17", "-O1", f"-I{extension.csrc_dir()}", *(f"-I{p}" for p in cuda_include), "-o",
                 str(harness), str(fake_dir / "harness.cpp"), "-ldl"]):
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-4000:]
    res = subprocess.run([str(harness)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "FAKE_LT_ALGOS": "3", "LD_LIBRARY_PATH": os.pathsep.join(
                             [str(tmp_path), *filter(None, [os.environ.get("LD_LIBRARY_PATH")])])})
    assert res.returncode == 0 and res.stdout.strip().startswith("ok"), res.stdout + res.stderr
    print(res.stdout.strip())
