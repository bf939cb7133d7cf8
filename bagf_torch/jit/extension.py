"""Build and load the host extension (csrc/bagf_ext.cpp) on first CUDA use.

The build goes into ``$BAGF_CACHE_DIR/build/<torch, CUDA and Python versions>`` through
``torch.utils.cpp_extension.load`` (ninja); a warm build folder makes this a ninja no-op. Missing pieces
(CPU-only torch, no CUDA toolkit, no NVRTC headers, no ninja) raise ``BuildError`` saying what to install.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Iterator

import torch

from .. import log, settings

try:  # POSIX: the build's lock (_build_lock)
    import fcntl
except ImportError:  # pragma: no cover (Windows)
    fcntl = None

_lock = threading.Lock()
_ext: ModuleType | None = None


class BuildError(RuntimeError):
    """The host extension cannot be built here; the message says what is missing and how to fix it."""


def csrc_dir() -> Path:
    """The C++/CUDA sources: ``bagf_torch/_csrc`` in an installed package, ``<repo>/csrc`` in a checkout."""
    here = Path(__file__).resolve().parent.parent
    for candidate in (here / "_csrc", here.parent / "csrc"):
        if (candidate / "bagf_ext.cpp").is_file():
            return candidate
    raise BuildError(f"bagf_torch's C++ sources are missing (looked in {here / '_csrc'} and "
                     f"{here.parent / 'csrc'}); reinstall the package")


def kernels_dir() -> Path:
    return csrc_dir() / "kernels"


def _files_hash(named: list[tuple[str, Path]]) -> str:
    """sha256 over (name, content) of each file, in name order. Names are given, not taken from the paths: csrc is
    _csrc in an installed package, and the same sources must hash the same."""
    h = hashlib.sha256()
    for name, path in sorted(named):
        h.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _csrc_host_files() -> list[tuple[str, Path]]:
    """csrc's host C++ and headers (the extension, its cuBLASLt and NVRTC helpers), named csrc/<file>."""
    return [(f"csrc/{p.name}", p) for p in csrc_dir().iterdir() if p.suffix in (".cpp", ".h")]


def source_hash() -> str:
    """sha256 over every kernel source file (name and content): part of every cache key and cubin digest."""
    return _files_hash([(p.name, p) for p in kernels_dir().iterdir() if p.suffix in (".cuh", ".h")])


def host_hash() -> str:
    """sha256 over the code that launches a plan, beside the kernels themselves: csrc's host C++ (the extension,
    its cuBLASLt and NVRTC helpers) and the kernel families' Python modules (launch geometry, problem rules). Part
    of every cache key, not of cubin digests: a plan tuned and checked under other launch code is tuned again
    (bagf_torch's version alone did not move with such changes); a cubin depends on the kernel sources only."""
    families = Path(__file__).resolve().parent.parent / "kernels"
    return _files_hash(_csrc_host_files() + [(f"kernels/{p.name}", p) for p in families.glob("*.py")])


def _cuda_home() -> Path:
    from torch.utils import cpp_extension

    home = cpp_extension.CUDA_HOME
    if not home:
        raise BuildError("the CUDA toolkit was not found (no CUDA_HOME, no nvcc on PATH, no /usr/local/cuda). "
                         "Install the CUDA toolkit matching torch's CUDA "
                         f"{torch.version.cuda} and set CUDA_HOME to it.")
    home = Path(home)
    if not (home / "include" / "nvrtc.h").is_file():
        raise BuildError(f"NVRTC headers not found in {home / 'include'}; install the toolkit's NVRTC "
                         "component (cuda-nvrtc-dev) or point CUDA_HOME at a full CUDA toolkit.")
    return home


def build_dir() -> Path:
    """BAGF_BUILD_DIR if set, else ``$BAGF_CACHE_DIR/build/<torch, CUDA and Python versions>-src<hash of the
    extension's sources>``: two installs of other sources (two versions side by side, an upgrade whose files kept
    older modification times) never share a build, which ninja's time stamps alone would let them do."""
    override = settings.build_dir()
    if override is not None:
        return override
    tag = (f"torch{torch.__version__}-cu{torch.version.cuda}-py{sys.version_info[0]}{sys.version_info[1]}"
           f"-src{extension_source_hash()[:12]}")
    return settings.cache_dir() / "build" / re.sub(r"[^A-Za-z0-9_.-]", "_", tag)


def extension_source_hash() -> str:
    """sha256 over what the host extension is compiled from: csrc's C++ and headers and the kernels' headers it
    includes (not the kernel templates, which NVRTC compiles)."""
    return _files_hash(_csrc_host_files() + [(f"csrc/kernels/{p.name}", p) for p in kernels_dir().iterdir()
                                             if p.suffix == ".h"])


@contextlib.contextmanager
def _build_lock(out: Path) -> Iterator[None]:
    """Held around torch's build of the extension in ``out``. torch's own lock there (FileBaton: a file ``lock``
    the building process creates, and deletes when it is done) stays behind when that process is killed mid-build
    (SIGKILL, the OOM killer, a notebook's restart), and every later build then waits on it forever, silently.
    This one is an flock, which the kernel drops with its holder: whoever holds it knows that no live build holds
    torch's, and deletes one left behind. (Without fcntl, Windows: torch's lock alone.)"""
    if fcntl is None:
        yield
        return
    with open(out / ".bagf_build.lock", "a+") as f:
        try:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.logger().info(f"waiting for another process's build of the host extension in {out}")
                fcntl.flock(f, fcntl.LOCK_EX)
        except OSError as e:  # a file system without flock (Lustre without -o flock, NFS without lockd): torch's alone
            log.logger().info(f"no flock in {out} ({e}); the build relies on torch's own lock there")
            yield
            return
        stale = out / "lock"
        if stale.exists():
            log.logger().warning(f"removed {stale}, left by a build of the host extension that did not finish "
                                 "(a process killed while building)")
            stale.unlink(missing_ok=True)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _find_ninja() -> bool:
    """Whether ninja is on PATH, putting the interpreter's own scripts folder (or the ninja package's) in front of
    PATH where it is there: a venv's python run without activating the venv (cron, an IDE, a notebook kernel) has
    the ninja that ``pip install ninja`` put beside it, but not on PATH, where torch's build looks."""
    if shutil.which("ninja") is not None:
        return True
    folders = [os.path.dirname(sys.executable)]
    try:
        import ninja

        folders.append(ninja.BIN_DIR)
    except (ImportError, AttributeError):
        pass
    for folder in folders:
        if shutil.which("ninja", path=folder) is not None:
            os.environ["PATH"] = folder + os.pathsep + os.environ.get("PATH", "")
            return True
    return False


def load() -> ModuleType:
    """The host extension module, building it on the first call in this process."""
    global _ext
    if _ext is not None:
        return _ext
    with _lock:
        if _ext is not None:
            return _ext
        if torch.version.cuda is None:
            raise BuildError(f"this torch ({torch.__version__}) is a CPU-only build; bagf_torch's kernels need "
                             "a CUDA build of torch (e.g. pip install torch --index-url "
                             "https://download.pytorch.org/whl/cu130). CPU tensors still work through ATen.")
        if not torch.cuda.is_available():
            raise BuildError("no CUDA device is visible (torch.cuda.is_available() is False); check the driver "
                             "and CUDA_VISIBLE_DEVICES. CPU tensors still work through ATen.")
        if not _find_ninja():
            raise BuildError("ninja is not on PATH (nor beside this Python); pip install ninja")
        home = _cuda_home()
        src = csrc_dir()
        out = build_dir()
        out.mkdir(parents=True, exist_ok=True)
        from torch.utils import cpp_extension

        lib = home / "lib64"
        try:
            with _build_lock(out):
                _ext = cpp_extension.load(
                    name="bagf_ext",
                    sources=[str(src / "bagf_ext.cpp")],
                    extra_include_paths=[str(src)],
                    extra_cflags=["-O3", "-std=c++17"],
                    extra_ldflags=["-lnvrtc", "-lcuda", "-ldl", f"-L{lib}", f"-L{lib / 'stubs'}",
                                   f"-Wl,-rpath,{lib}"],
                    with_cuda=True,
                    build_directory=str(out),
                    verbose=log.logger().level <= logging.DEBUG,  # (BAGF_LOG as the logger took it)
                )
        except Exception as e:  # the compiler's output is in the chained exception
            raise BuildError(f"building the bagf_torch host extension in {out} failed: {e}. "
                             "Check that the CUDA toolkit at "
                             f"{home} matches torch's CUDA {torch.version.cuda}; set BAGF_LOG=debug to see the "
                             "compiler command.") from e
        from .. import ops

        ops.register_fake()
        return _ext


def loaded() -> ModuleType | None:
    """The extension if this process already loaded it, else None (never builds)."""
    return _ext


def environment(device: int) -> dict:
    """Everything about this machine that changes a tuning result; goes into every cache key."""
    from .. import __version__

    ext = load()
    v = ext.versions()
    props = torch.cuda.get_device_properties(device)
    return {
        "gpu": props.name,
        "cc": f"{props.major}.{props.minor}",
        "driver": v["driver"],
        "runtime": v["runtime"],
        "nvrtc": v["nvrtc"],
        "torch": torch.__version__,
        "bagf_torch": __version__,
        "kernels": source_hash(),
        "host": host_hash(),
        "os": os.name,
    }
