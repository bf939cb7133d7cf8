"""Build hook only; the project's metadata is in pyproject.toml.

The host extension is not built at install time: it is built through torch.utils.cpp_extension (ninja) on
first CUDA use, for the torch and CUDA found then. Its C++/CUDA sources ship inside the package as _csrc.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPyWithSources(build_py):
    """Copy csrc/ into the built package as bagf_torch/_csrc so installed copies can JIT-build."""

    def run(self):
        super().run()
        source = ROOT / "csrc"
        if not (source / "bagf_ext.cpp").is_file():
            raise RuntimeError(f"{source} is missing or incomplete: the package cannot be built without the "
                               "C++/CUDA sources (an sdist must include csrc/, see MANIFEST.in)")
        target = Path(self.build_lib) / "bagf_torch" / "_csrc"
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "*.o", "*.so"))


setup(cmdclass={"build_py": BuildPyWithSources})
