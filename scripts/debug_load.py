"""Reproduce the fault-matrix resource row outside pytest (needs a GPU): compile the faulty family's
4096-thread candidate through KernelCompiler and load it. Run under cuda-gdb for a native backtrace:

    cuda-gdb -batch -ex run -ex bt --args python3 scripts/debug_load.py
"""
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch  # noqa: E402

import faulty_family as ff  # noqa: E402
from bagf_torch.cache import Cache  # noqa: E402
from bagf_torch.jit.compiler import KernelCompiler  # noqa: E402

compiler = KernelCompiler(Cache.for_dir(tempfile.mkdtemp()), 0, workers=2)
print("compiler ready", compiler.limits, flush=True)
for cfg in ([ff.config(ff.CORRECT)], [dict(ff.config(ff.CORRECT), BM=64, BN=64)]):
    print("compiling", cfg, flush=True)
    out = compiler.compile(ff, cfg)
    print("result", [getattr(o, "handle", None) or getattr(o, "detail", o) for o in out], flush=True)
