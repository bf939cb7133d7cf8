"""Shared fixtures: per-test cache directories, and the GPU / nvcc probes (done once per session)."""

from __future__ import annotations

import functools
import os
import shutil

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


def pytest_collection_modifyitems(config, items):
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
