"""Static checks of the extension's C++ source that need no GPU: by reading it, and by compiling it for syntax."""

from __future__ import annotations

import os
import re
from pathlib import Path


def test_extension_source_formats_no_messages_with_iostreams():
    """On the H200 image any std::ostream formatting inside bagf_ext.so segfaulted (cuda-gdb: inside
    basic_ostream::_M_insert<long>), and TORCH_CHECK / TORCH_WARN with several arguments format through
    c10::str -> std::ostringstream. So a failing check took the process down instead of raising. The
    extension builds its messages with ``cat`` and throws with ``BAGF_CHECK``; this keeps it that way."""
    src = (Path(__file__).resolve().parents[1] / "csrc" / "bagf_ext.cpp").read_text()
    code = "\n".join(line.split("//", 1)[0] for line in src.splitlines())  # comments may mention them
    assert "TORCH_CHECK(" not in code and "TORCH_INTERNAL_ASSERT(" not in code
    assert "stringstream" not in code and "std::cout" not in code and "std::cerr" not in code
    assert not re.search(r"<<\s*\"|\"\s*<<", code), "a '<<' with a string literal: iostream formatting"
    # TORCH_WARN* must get one pre-built string (c10::str passes a single std::string through untouched)
    for m in re.finditer(r"TORCH_WARN\w*\((.*?)\);", code, re.S):
        assert m.group(1).strip().startswith("cat("), m.group(0)


def test_the_extension_compiles_against_this_torchs_headers(tmp_path):
    """csrc/bagf_ext.cpp through the host compiler against the installed torch's headers and the CUDA toolkit's
    (-fsyntax-only: no CUDA build of torch to link against here): a change to the host code made on a machine
    without a GPU fails here, not in the first device session's build. NVRTC is the tests' stub header; the one
    header a CPU build of torch lacks (c10's CUDA build macros) is stood in for."""
    import shutil
    import subprocess
    import sysconfig

    import pytest
    from torch.utils import cpp_extension

    cxx = shutil.which("g++") or shutil.which("c++")
    nvcc = shutil.which("nvcc")
    if cxx is None or nvcc is None:
        pytest.skip("needs a host C++ compiler and the CUDA toolkit (nvcc) for its headers")
    dry = subprocess.run([nvcc, "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull], capture_output=True,
                         text=True, timeout=120)
    found = re.search(r'INCLUDES="([^"]*)"', dry.stderr + dry.stdout)
    cuda_includes = found.group(1).split() if found else []
    if not any(Path(flag[2:], "cuda_runtime_api.h").is_file() for flag in cuda_includes if flag.startswith("-I")):
        pytest.skip("the CUDA toolkit's headers were not found through nvcc")
    macros = tmp_path / "c10" / "cuda" / "impl"
    macros.mkdir(parents=True)
    (macros / "cuda_cmake_macros.h").write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    repo = Path(__file__).resolve().parents[1]
    cmd = [cxx, "-std=c++17", "-fsyntax-only", "-w", f"-I{tmp_path}",
           *(f"-I{p}" for p in cpp_extension.include_paths()), *cuda_includes, f"-I{repo / 'csrc'}",
           f"-I{repo / 'tests' / 'stub_nvrtc'}", f"-I{sysconfig.get_paths()['include']}",
           "-DTORCH_EXTENSION_NAME=bagf_ext", str(repo / "csrc" / "bagf_ext.cpp")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]


def test_the_ops_tf32_read_answers_as_cudnn_tf32_in_every_flag_state(tmp_path):
    """The op sends a TF32-product plan's call to ATen when csrc/bagf_ext.cpp's ``cudnn_conv_tf32()`` says cuDNN's
    TF32 is off: that function, cut from the source and compiled alone against this torch (its branch for this
    torch's version), must answer as ``problem.cudnn_tf32`` (the mode the plan was tuned for) through the legacy
    flag and ``cudnn_conv_mode``, and where this torch has them the newer ``cudnn.conv.fp32_precision`` and the
    generic ``torch.backends.fp32_precision``; else default users' TF32 plans would all run as ATen, or strict
    callers get TF32 products."""
    import shutil

    import pytest
    import torch
    from torch.utils import cpp_extension

    from bagf_torch.problem import cudnn_conv_mode, cudnn_tf32

    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("needs a host C++ compiler")
    src = (Path(__file__).resolve().parents[1] / "csrc" / "bagf_ext.cpp").read_text()
    fn = re.search(r"^inline bool cudnn_conv_tf32\(\) \{\n.*?\n\}$", src, re.M | re.S)
    assert fn is not None, "csrc/bagf_ext.cpp has no cudnn_conv_tf32()"
    ext = cpp_extension.load_inline(
        "bagf_tf32_read", cpp_sources="#include <torch/extension.h>\n#include <torch/version.h>\n" + fn.group(0) +
        "\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def(\"read\", &cudnn_conv_tf32); }\n",
        build_directory=str(tmp_path), verbose=False)
    conv = getattr(torch.backends.cudnn, "conv", None)
    newer = conv is not None and hasattr(conv, "fp32_precision")
    generic, before = getattr(torch.backends, "fp32_precision", None), cudnn_tf32()
    states = []
    try:
        states.append(("as found", ext.read(), cudnn_tf32(), None))
        for legacy in (False, True):
            torch.backends.cudnn.allow_tf32 = legacy
            states.append((f"allow_tf32={legacy}", ext.read(), cudnn_tf32(), legacy))
        for tf32 in (False, True):
            with cudnn_conv_mode(tf32=tf32):
                states.append((f"cudnn_conv_mode(tf32={tf32})", ext.read(), cudnn_tf32(), tf32))
        if newer:
            for precision in ("ieee", "tf32"):
                conv.fp32_precision = precision
                states.append((f"conv.fp32_precision={precision}", ext.read(), cudnn_tf32(), precision == "tf32"))
                with cudnn_conv_mode(tf32=precision != "tf32"):
                    states.append((f"{precision}, then the mode", ext.read(), cudnn_tf32(), precision != "tf32"))
        if generic is not None:
            torch.backends.fp32_precision = "ieee"
            states.append(("fp32_precision=ieee", ext.read(), cudnn_tf32(), None))
    finally:  # (the state found, through the legacy API: conv's and the RNN's alike, as torch's default has them)
        if generic is not None:
            torch.backends.fp32_precision = generic
        if newer:
            conv.fp32_precision = "tf32" if before else "ieee"
        torch.backends.cudnn.allow_tf32 = before
        assert cudnn_tf32() is before
    assert all(read == python and (want is None or read == want) for _, read, python, want in states), states
