"""bagf_torch: auto-tuned CUDA convolutions for PyTorch (JIT-tuned on first call, cached on disk).

The host extension is not built at install time: it is built through torch.utils.cpp_extension (ninja) on
first CUDA use, for the torch and CUDA found then. The C++/CUDA sources ship inside the package as _csrc.
"""

import shutil
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPyWithSources(build_py):
    """Copy csrc/ into the built package as bagf_torch/_csrc so installed copies can JIT-build."""

    def run(self):
        super().run()
        target = Path(self.build_lib) / "bagf_torch" / "_csrc"
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(ROOT / "csrc", target)


setup(
    name="bagf_torch",
    version="0.1.0",
    description="Auto-tuned CUDA convolutions for PyTorch: Bayesian optimisation (Ax) on first call, cached on disk",
    long_description=(ROOT / "README.md").read_text() if (ROOT / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["bagf_torch", "bagf_torch.*"]),
    # tqdm: tune_model's progress bar (pre-tuning a model takes minutes; DESIGN asks for a bar)
    install_requires=["torch>=2.4", "ninja", "ax-platform>=1.0", "numpy", "tqdm"],
    extras_require={"test": ["pytest"], "plot": ["matplotlib"]},
    entry_points={"console_scripts": ["bagf-torch = bagf_torch.cli:main"]},
    cmdclass={"build_py": BuildPyWithSources},
)
