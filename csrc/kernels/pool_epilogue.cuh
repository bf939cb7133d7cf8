// The pooling epilogue of a convolution layer: y = max_pool2d(relu(x)) (or max_pool2d(x)) in one pass, what nn.ReLU
// then nn.MaxPool2d compute after a conv in a Sequential (bagf_torch/epilogue.py runs them as this one launch). It
// computes what ATen's two kernels do, to the bit (NaNs as NaN): ATen's ReLU of each element (a NaN kept; -0.0 kept
// or made +0.0 as torch's own ReLU does: versions differ, and the host asks it once per device), then the window's
// maximum by ATen's max_pool2d rule (the running maximum starts at -inf; a value replaces it when greater or NaN, so
// the first of equal values stays and a NaN wins; a window with no input, which dilation allows, stays -inf).
// 16-bit values are widened to fp32 and stored back unchanged. (A ReLU with no pool after it is left to ATen: on its
// own this launch would only replace ATen's.)
//
// One thread per output element. The input is read through its four strides; the output is written through the
// output's strides, and NHWC decides only the order threads walk the outputs in: channels fastest for a channels_last
// output (consecutive threads read and write consecutive channels), columns fastest for NCHW.
//
//   DT    0 float32, 1 float16, 2 bfloat16 (input and output)
//   NHWC  0: threads walk (n, c, p, q) with q fastest; 1: (n, p, q, c) with c fastest
//   RELU  1: the maximum of the elements' ReLU; 0: of the elements
//
// The kernel includes nothing from torch; NVRTC compiles it at run time.
#pragma once

#include "conv_params.h"  // PoolParams
#include "elem_io.cuh"

namespace bagf {

template <int DT, int NHWC, int RELU>
__global__ void __launch_bounds__(256) relu_max_pool2d(const void* __restrict__ x, void* __restrict__ y,
                                                        PoolParams p) {
  static_assert(DT >= 0 && DT <= 2 && (NHWC | 1) == 1 && (RELU | 1) == 1,
                "DT: 0 fp32, 1 fp16, 2 bf16; NHWC, RELU: 0 or 1");
  const long long total = static_cast<long long>(p.N) * p.C * p.P * p.Q;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    int n, c, op, oq;
    long long r = i;
    if constexpr (NHWC) {
      c = static_cast<int>(r % p.C);
      r /= p.C;
      oq = static_cast<int>(r % p.Q);
      r /= p.Q;
      op = static_cast<int>(r % p.P);
      n = static_cast<int>(r / p.P);
    } else {
      oq = static_cast<int>(r % p.Q);
      r /= p.Q;
      op = static_cast<int>(r % p.P);
      r /= p.P;
      c = static_cast<int>(r % p.C);
      n = static_cast<int>(r / p.C);
    }
    const long long base = n * p.xs[0] + c * p.xs[1];
    float m = -__int_as_float(0x7f800000);  // -inf (a window of dilated taps may hold no input: it stays -inf)
    const int h0 = op * p.sh - p.ph;
    const int w0 = oq * p.sw - p.pw;
    for (int a = 0; a < p.kh; ++a) {
      const int h = h0 + a * p.dh;
      if (h < 0 || h >= p.H) continue;
      for (int b = 0; b < p.kw; ++b) {
        const int w = w0 + b * p.dw;
        if (w < 0 || w >= p.W) continue;
        float v = elem::load<DT>(x, base + h * p.xs[2] + w * p.xs[3]);
        if (RELU) v = v < 0.f || (v == 0.f && !p.relu_keeps_negative_zero) ? 0.f : v;  // (a NaN passes)
        if (v > m || v != v) m = v;  // (ATen's max_pool2d: a NaN wins and stays)
      }
    }
    elem::store<DT>(y, n * p.ys[0] + c * p.ys[1] + op * p.ys[2] + oq * p.ys[3], m);
  }
}

}  // namespace bagf
