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
