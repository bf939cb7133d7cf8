// Shape arguments shared by the host launcher (g++) and the kernels (NVRTC / nvcc).
// Plain C: no torch, no CUDA headers, so both compilers see the same layout.
#pragma once

namespace bagf {

// All extents are int32: the host refuses (ATen fallback) any tensor with more than 2^31-1 elements,
// so every offset computed below fits.
struct Conv2dParams {
  int N, C, H, W;       // input  NCHW
  int K, R, S;          // weight KCRS
  int P, Q;             // output spatial extent
  int stride_h, stride_w;
  int pad_h, pad_w;
  int dil_h, dil_w;
  int has_bias;
};

}  // namespace bagf
