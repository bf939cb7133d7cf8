"""Building: the host extension (torch.utils.cpp_extension + ninja) and NVRTC compilation of kernel variants."""

from .extension import BuildError, csrc_dir, kernels_dir, load, source_hash

__all__ = ["BuildError", "csrc_dir", "kernels_dir", "load", "source_hash"]
