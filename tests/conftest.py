"""Shared fixtures: per-test cache directories, and the GPU / nvcc probes (done once per session)."""

from __future__ import annotations

import functools
import logging
import os
import shutil
import zlib

import pytest


@functools.lru_cache(maxsize=None)
def cuda_unavailable_reason() -> str | None:
    """None when CUDA tests can run here, else why not."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    if not torch.cuda.is_available():
        return "no CUDA device visible"
    return None


def _shard(items, spec: str):
    """BAGF_TEST_SHARD="k/n": the k-th of n disjoint parts of ``items`` (by a hash of each test's id, so the same
    test lands in the same part whatever else is selected): (kept, deselected). The GPU suite outgrew one device
    call; its parts run in consecutive calls."""
    try:
        k, n = (int(v) for v in spec.split("/"))
        if not 1 <= k <= n:
            raise ValueError
    except ValueError:
        raise pytest.UsageError(f"BAGF_TEST_SHARD={spec!r}: expected k/n with 1 <= k <= n, e.g. 1/2") from None
    kept, dropped = [], []
    for item in items:
        (kept if zlib.crc32(item.nodeid.encode()) % n == k - 1 else dropped).append(item)
    return kept, dropped


def pytest_collection_modifyitems(config, items):
    spec = os.environ.get("BAGF_TEST_SHARD")
    if spec:
        items[:], dropped = _shard(items, spec)
        config.hook.pytest_deselected(items=dropped)
    reason = cuda_unavailable_reason()
    nvcc = shutil.which("nvcc")
    for item in items:
        if "cuda" in item.keywords and reason is not None:
            item.add_marker(pytest.mark.skip(reason=f"needs a GPU: {reason}"))
        if "nvcc" in item.keywords and nvcc is None:
            item.add_marker(pytest.mark.skip(reason="nvcc is not on PATH"))


@pytest.fixture
def cache_dir(tmp_path):
    """A fresh, empty directory for this test's cache (never the user's real cache)."""
    path = tmp_path / "cache"
    path.mkdir()
    return path


@pytest.fixture
def warnings_log():
    """Warnings logged on the "bagf_torch" logger (captured there, so it works even if propagation is off)."""
    records: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(record)

    log = logging.getLogger("bagf_torch")
    handler = Collect(level=logging.WARNING)
    log.addHandler(handler)
    old_level = log.level
    log.setLevel(logging.WARNING)
    try:
        yield records
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)


@pytest.fixture(scope="session")
def build_dir(tmp_path_factory):
    """One extension build folder for the whole session (BAGF_BUILD_DIR overrides, e.g. on the device)."""
    return os.environ.get("BAGF_BUILD_DIR") or str(tmp_path_factory.mktemp("bagf_build"))


@pytest.fixture(autouse=True)
def _isolated_bagf(monkeypatch, tmp_path, build_dir):
    """Every test gets its own BAGF_CACHE_DIR and a fresh runtime; the extension build is shared."""
    monkeypatch.setenv("BAGF_CACHE_DIR", str(tmp_path / "bagf_cache"))
    monkeypatch.setenv("BAGF_BUILD_DIR", build_dir)
    from bagf_torch import log, runtime

    runtime.reset()
    log.reset()
    yield
    runtime.reset()


def pytest_configure(config):
    """With BAGF_TEST_INSTALLED=1 (what .ci/run sets) the suite must run against an installed copy of the
    package: a bagf_torch imported from the checkout (an editable install, or the repo root on sys.path) would
    hide a broken package -- missing subpackages, missing C++ sources -- exactly as users would meet it."""
    if os.environ.get("BAGF_TEST_INSTALLED", "").strip() not in ("1", "true", "yes", "on"):
        return
    from pathlib import Path

    import bagf_torch

    package = Path(bagf_torch.__file__).resolve().parent
    checkout = Path(str(config.rootpath)).resolve()
    if checkout in package.parents:
        raise pytest.UsageError(f"BAGF_TEST_INSTALLED=1 but bagf_torch was imported from the checkout ({package}); "
                                "install it non-editable (pip install '.[test]') and run pytest from outside the "
                                "checkout (see .ci/run)")
    if not (package / "_csrc" / "bagf_ext.cpp").is_file():
        raise pytest.UsageError(f"the installed bagf_torch at {package} has no _csrc/ (the C++ sources the JIT "
                                "build needs): the wheel or sdist was built without csrc/")
