"""Whole models: AlexNet shipped with the package, and any torchvision classification model by name.

AlexNet is here because torchvision may be absent: ``alexnet()`` has torchvision's architecture with the same
module names, so ``torchvision.models.alexnet(weights=...).state_dict()`` loads into it (and back).
``build("torchvision:resnet18")`` works when torchvision is installed.

>>> import torch
>>> from bagf_torch import models
>>> net = models.alexnet()                     # every nn.Conv2d is already a TunedConv2d
>>> type(net.features[0]).__name__, net(torch.randn(1, 3, 224, 224)).shape
('TunedConv2d', torch.Size([1, 1000]))
"""

from __future__ import annotations

import torch
from torch import nn

from .nn import convert

__all__ = ["AlexNet", "ModelError", "alexnet", "build", "check", "input_size"]

TORCHVISION_PREFIX = "torchvision:"


class ModelError(ValueError):
    """A model name that cannot be built here; the message says what to use instead."""


class AlexNet(nn.Module):
    """AlexNet as torchvision defines it (five convs, three linears, 224x224 input), with the same
    parameter names: ``features.{0,3,6,8,10}`` convs, ``classifier.{1,4,6}`` linears."""

    def __init__(self, num_classes: int = 1000, dropout: float = 0.5):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 64, kernel_size=11, stride=4, padding=2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(64, 192, kernel_size=5, padding=2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(192, 384, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(384, 256, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(256, 256, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
        )
        self.avgpool = nn.AdaptiveAvgPool2d((6, 6))
        self.classifier = nn.Sequential(
            nn.Dropout(p=dropout),
            nn.Linear(256 * 6 * 6, 4096),
            nn.ReLU(inplace=True),
            nn.Dropout(p=dropout),
            nn.Linear(4096, 4096),
            nn.ReLU(inplace=True),
            nn.Linear(4096, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.classifier(x)


def alexnet(num_classes: int = 1000, dropout: float = 0.5, tuned: bool = True) -> AlexNet:
    """AlexNet with torchvision's layers and parameter names; ``tuned=True`` makes its convs TunedConv2d.

    Weights are PyTorch's default initialisation; load trained ones with ``load_state_dict`` (a
    torchvision AlexNet state dict fits as is).
    """
    model = AlexNet(num_classes=num_classes, dropout=dropout)
    return convert(model) if tuned else model


def _torchvision_models():
    try:
        import torchvision
    except ImportError as e:
        raise ModelError("torchvision is not installed, so torchvision:<name> models are not available; "
                         "pip install torchvision, or use --model alexnet") from e
    return torchvision.models


def torchvision_names() -> list[str]:
    """Names of torchvision's classification models (raises ModelError without torchvision)."""
    tvm = _torchvision_models()
    return sorted(tvm.list_models(module=tvm))


def check(name: str) -> str | None:
    """Whether ``build(name)`` can build the model, without building it: None for AlexNet, the torchvision name
    for ``"torchvision:<name>"``. Raises ``ModelError`` with a one-line message for an unknown name or a missing
    torchvision."""
    name = name.strip()
    if name.lower() == "alexnet":
        return None
    if name.startswith(TORCHVISION_PREFIX):
        short = name[len(TORCHVISION_PREFIX):]
        known = torchvision_names()
        if short not in known:
            close = [k for k in known if short.lower()[:3] in k][:6] or known[:6]
            raise ModelError(f"torchvision has no classification model {short!r}; try one of "
                             f"{', '.join(close)} (all: torchvision.models.list_models())")
        return short
    raise ModelError(f"unknown model {name!r}; use alexnet or torchvision:<name> (e.g. torchvision:resnet18), "
                     "or call bagf_torch.tune_model on your own model from Python")


def build(name: str, tuned: bool = True) -> nn.Module:
    """The model called ``name``: ``"alexnet"`` (shipped here) or ``"torchvision:<name>"`` (any torchvision
    classification model, untrained weights). ``tuned=True`` converts its convs to TunedConv2d. Built on the
    current default device (``torch.set_default_device``, ``with torch.device(...)``).

    Raises ``ModelError`` with a one-line message for an unknown name or a missing torchvision.
    """
    short = check(name)
    if short is None:
        return alexnet(tuned=tuned)
    model = _torchvision_models().get_model(short, weights=None)
    return convert(model) if tuned else model


def input_size(name: str) -> int:
    """The square input resolution a model expects (Inception v3 was trained at 299, the others at 224)."""
    return 299 if name.endswith("inception_v3") else 224
