"""Where a tuner's trials run: one interface, ``TrialBackend``, and its implementations.

A backend is four parts the Tuner drives and a flag:

* ``compiler.compile(family, configs) -> [Loaded | Outcome]`` (a loaded candidate has ``handle``) and
  ``compiler.unload(handle)``; optionally ``compiler.compile_within(family, configs, seconds)``, the same with
  None for a config whose compile was not done within ``seconds`` (the tuner then stops the batch there);
* ``checker.check(workspace, handle) -> Outcome | None`` (None: the output is right);
* ``benchmarker.measure(workspace, handle, cutoff_us) -> Outcome`` and
  ``benchmarker.remeasure(workspace, handles) -> [us]``;
* ``workspace(problem)``: the inputs, output and float64 reference of a problem;
* ``local``: whether the handles it returns are loaded in this process, so that the winner can be launched as
  it is. An isolated backend's handles are a child process's: the caller loads the winner from the cache.

The implementations:

* ``cuda_backend(device)``: NVRTC compiler, ``CudaChecker`` and ``CudaBenchmarker`` in this process. The isolated
  worker runs this same backend in its child process.
* ``tuning.isolated.WorkerPool.backend()``: the same four parts, each a request to a child process that owns its
  own CUDA context (``BAGF_ISOLATE=1``); ``local`` is False. The child names its backend factory as a
  ``"module:function"`` string, the one form that crosses a spawn, which returns a ``TrialBackend``.
* ``tuning.replay.replay_backend(evaluator)``: answers from a recording instead of a GPU, so that the whole Tuner
  (budget, families, finalists, listeners) runs on a CPU (the tests; ``benchmarks/strategies.py`` replays the
  strategies alone, without the Tuner).

Nothing else decides where a trial runs: the runtime picks the backend once per tuning (``Runtime.backend``),
and the Tuner sees only this object.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..problem import ConvProblem


@dataclass
class TrialBackend:
    """The parts a Tuner drives (see the module docstring); ``local``: its handles are this process's."""

    compiler: Any
    checker: Any
    benchmarker: Any
    workspace: Callable[[ConvProblem], Any]
    local: bool = True
    healthy: Callable[[], str | None] = lambda: None
    """None while the device is usable; else why not (the isolated worker asks after every failed request)."""


def cuda_backend(device: int, compiler=None) -> TrialBackend:
    """Real trials on CUDA device ``device``: ``compiler`` (default: a new KernelCompiler on the cache directory's
    cache, as the isolated worker makes its own), CudaChecker, CudaBenchmarker, Workspace on that device."""
    import torch

    from .measure import CudaBenchmarker, CudaChecker, Workspace

    dev = torch.device("cuda", device)
    if compiler is None:
        from .. import settings
        from ..cache import Cache
        from ..jit.compiler import KernelCompiler

        torch.cuda.set_device(device)
        # The same cache file as every process of this user: the cubins compiled here are what a parent process
        # loads an isolated tuning's winner from.
        compiler = KernelCompiler(Cache.for_dir(settings.cache_dir()), device, settings.compile_workers())

    def healthy() -> str | None:
        try:
            torch.cuda.synchronize(dev)
            t = torch.ones(16, device=dev)
            if float((t + 1).sum()) != 32.0:
                return "a probe computation returned a wrong result"
        except Exception as e:  # noqa: BLE001 - any error means the context is gone
            return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return None

    return TrialBackend(compiler, CudaChecker(compiler.ext), CudaBenchmarker(), lambda p: Workspace(p, dev),
                        healthy=healthy)
