"""bagf_torch: auto-tuned CUDA convolutions for PyTorch.

Swap ``nn.Conv2d`` for :class:`TunedConv2d` (or call :func:`convert` on a model). On the first forward for
each input shape the layer tunes its CUDA C++ kernel's template parameters with Bayesian optimisation (Ax),
stores the winner in an on-disk cache and reuses it, in this and every later process.

>>> import torch, bagf_torch
>>> model = bagf_torch.convert(torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3)))
>>> model(torch.randn(1, 3, 8, 8)).shape
torch.Size([1, 8, 6, 6])
"""

__version__ = "0.1.0"

from . import models  # noqa: E402
from .epilogue import FusedSequential  # noqa: E402
from .nn import TunedConv2d, convert, freeze_weights  # noqa: E402
from .pretune import ModelReport, tune_model  # noqa: E402
from .problem import ConvProblem  # noqa: E402

__all__ = ["ConvProblem", "FusedSequential", "ModelReport", "TunedConv2d", "convert", "freeze_weights", "models",
           "tune_model", "__version__"]
