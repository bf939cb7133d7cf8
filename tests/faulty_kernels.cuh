// Deliberately faulty kernels for the fault-matrix GPU tests (tests/test_faults.py), compiled through the same
// NVRTC path and launched through the same op as the real kernels (same signature as implicit_gemm_conv2d).
// MODE 0: a correct naive direct convolution (the control); 1: writes 2^36 floats past the output (illegal
// address: poisons the CUDA context that launched it); 2: correct plus one (wrong numbers); 3: spins forever.
// Any other MODE fails to compile (static_assert), for the compile-error row.
#pragma once
#include "conv_params.h"

namespace bagf_test {

template <int MODE, int BM, int BN>
__global__ void faulty_conv2d(const float* __restrict__ x, const float* __restrict__ w,
                              const float* __restrict__ bias, float* __restrict__ y, const bagf::Conv2dParams p) {
  static_assert(MODE >= 0 && MODE <= 3, "faulty_conv2d: MODE must be 0..3");
  const int t = threadIdx.x;
  const int k = blockIdx.y * BM + t / BN;
  const long long pix = static_cast<long long>(blockIdx.x) * BN + t % BN;
  const long long npq = static_cast<long long>(p.N) * p.P * p.Q;
  if (MODE == 3) {
    // Spin until the process gives up on us. The sleep is an asm volatile side effect, so the compiler cannot
    // drop the loop (a `volatile int` flag in a register was optimised away on the H200: the kernel finished
    // and the row saw a correct result instead of a hang). p.N is never negative, but the compiler cannot know.
    while (p.N >= 0) {
      asm volatile("nanosleep.u32 1000;");
    }
  }
  if (k >= p.K || pix >= npq) return;
  const int n = static_cast<int>(pix / (p.P * p.Q));
  const int pq = static_cast<int>(pix % (p.P * p.Q));
  const int op = pq / p.Q, oq = pq % p.Q;
  float acc = p.has_bias ? bias[k] : 0.f;
  for (int c = 0; c < p.C; ++c)
    for (int r = 0; r < p.R; ++r)
      for (int s = 0; s < p.S; ++s) {
        const int ih = op * p.stride_h - p.pad_h + r * p.dil_h;
        const int iw = oq * p.stride_w - p.pad_w + s * p.dil_w;
        if (ih >= 0 && ih < p.H && iw >= 0 && iw < p.W)
          acc += x[((static_cast<long long>(n) * p.C + c) * p.H + ih) * p.W + iw] *
                 w[((static_cast<long long>(k) * p.C + c) * p.R + r) * p.S + s];
      }
  const long long out = ((static_cast<long long>(n) * p.K + k) * p.P + op) * p.Q + oq;
  if (MODE == 1) {
    y[out + (1LL << 36)] = acc;
    return;
  }
  y[out] = MODE == 2 ? acc + 1.f : acc;
}

}  // namespace bagf_test
