// fp32 direct convolution as an implicit GEMM, NCHW input, KCRS weights, NKPQ output.
//
// GEMM view: Y[k][npq] = sum_{crs} W[k][crs] * X[crs][npq] (+ bias[k]), where X is the im2col matrix that
// is never materialised: each block gathers its BK x BN slice of it straight from the input tensor.
//
// Template parameters are the tuning knobs (bagf_torch/kernels/implicit_gemm.py holds their validity rules):
//   BM  block tile over output channels        TM  register tile per thread over output channels
//   BN  block tile over output pixels (N*P*Q)  TN  register tile per thread over output pixels
//   BK  K-step over C*R*S                      DB  1: double-buffered shared memory (prefetch next K-step
//   VEC 4: float4 loads of the weight tile         into registers while the current one is multiplied)
//
// Safety: every global load and store is bounds-checked against the run-time shape, and the float4 path is
// taken only when C*R*S % 4 == 0 and the weight pointer is 16-byte aligned (otherwise the same kernel loads
// scalars), so every configuration is in-bounds for every problem. The kernel includes nothing from torch;
// NVRTC compiles it at run time and plain nvcc compiles it in the tests.
#pragma once
#include "conv_params.h"

namespace bagf {

template <int BM, int BN, int BK, int TM, int TN, int DB, int VEC>
__global__ void __launch_bounds__((BM / TM) * (BN / TN))
implicit_gemm_conv2d(const float* __restrict__ x, const float* __restrict__ w,
                     const float* __restrict__ bias, float* __restrict__ y, const Conv2dParams p) {
  constexpr int TX = BN / TN;  // threads along output pixels
  constexpr int TY = BM / TM;  // threads along output channels
  constexpr int T = TX * TY;
  constexpr int STAGES = DB ? 2 : 1;
  constexpr int A_LD = BM + 1;  // +1 word: the transposing stores below hit 32 different banks
  constexpr int A_VECS = BM * BK / VEC;
  constexpr int A_LOADS = (A_VECS + T - 1) / T;
  constexpr int B_ROW_STEP = T / BN;  // validity rule: T % BN == 0
  constexpr int B_LOADS = (BK + B_ROW_STEP - 1) / B_ROW_STEP;
  static_assert(BM % TM == 0 && BN % TN == 0, "register tile must divide the block tile");
  static_assert(T % BN == 0, "threads must be a multiple of BN");
  static_assert(BK % VEC == 0, "BK must be a multiple of VEC");

  extern __shared__ float smem[];
  float* As = smem;                           // [STAGES][BK][A_LD]
  float* Bs = smem + STAGES * BK * A_LD;      // [STAGES][BK][BN]

  const int tid = threadIdx.x;
  const int tx = tid % TX;
  const int ty = tid / TX;
  const int m0 = blockIdx.y * BM;
  const int n0 = blockIdx.x * BN;

  const int RS = p.R * p.S;
  const int CRS = p.C * RS;
  const int PQ = p.P * p.Q;
  const int NPQ = p.N * PQ;
  const int HW = p.H * p.W;
  const bool vec_ok = (CRS % 4) == 0 && ((reinterpret_cast<unsigned long long>(w) & 15ull) == 0);

  // Input-tile loader: this thread always gathers column b_col of the BK x BN slice, so the output pixel
  // it stands for is decoded once, not once per K-step.
  const int b_col = tid % BN;
  const int b_row0 = tid / BN;
  const int npq = n0 + b_col;
  const bool pix_ok = npq < NPQ;
  int ih0 = 0, iw0 = 0;
  const float* x_img = x;
  if (pix_ok) {
    const int img = npq / PQ;
    const int pq = npq - img * PQ;
    const int oh = pq / p.Q;
    const int ow = pq - oh * p.Q;
    ih0 = oh * p.stride_h - p.pad_h;
    iw0 = ow * p.stride_w - p.pad_w;
    x_img = x + img * p.C * HW;
  }

  float a_reg[A_LOADS][VEC];
  float b_reg[B_LOADS];

  auto load_tiles = [&](int k0) {
#pragma unroll
    for (int i = 0; i < A_LOADS; ++i) {
      const int e = tid + i * T;
      const int am = e / (BK / VEC);
      const int ak = (e % (BK / VEC)) * VEC;
      const int gm = m0 + am;
      const int gk = k0 + ak;
      bool done = false;
      if constexpr (VEC == 4) {
        if (vec_ok) {
          float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
          if (e < A_VECS && gm < p.K && gk < CRS) v = __ldg(reinterpret_cast<const float4*>(w + gm * CRS + gk));
          a_reg[i][0] = v.x;
          a_reg[i][1] = v.y;
          a_reg[i][2] = v.z;
          a_reg[i][3] = v.w;
          done = true;
        }
      }
      if (!done) {
#pragma unroll
        for (int v = 0; v < VEC; ++v) {
          const bool ok = e < A_VECS && gm < p.K && gk + v < CRS;
          a_reg[i][v] = ok ? __ldg(w + gm * CRS + gk + v) : 0.f;
        }
      }
    }
#pragma unroll
    for (int i = 0; i < B_LOADS; ++i) {
      const int kk = k0 + b_row0 + i * B_ROW_STEP;
      float v = 0.f;
      if (pix_ok && kk < CRS) {
        const int c = kk / RS;
        const int rs = kk - c * RS;
        const int r = rs / p.S;
        const int s = rs - r * p.S;
        const int ih = ih0 + r * p.dil_h;
        const int iw = iw0 + s * p.dil_w;
        if (ih >= 0 && ih < p.H && iw >= 0 && iw < p.W) v = __ldg(x_img + c * HW + ih * p.W + iw);
      }
      b_reg[i] = v;
    }
  };

  auto store_tiles = [&](int stage) {
    float* as = As + stage * BK * A_LD;
    float* bs = Bs + stage * BK * BN;
#pragma unroll
    for (int i = 0; i < A_LOADS; ++i) {
      const int e = tid + i * T;
      if (e < A_VECS) {
        const int am = e / (BK / VEC);
        const int ak = (e % (BK / VEC)) * VEC;
#pragma unroll
        for (int v = 0; v < VEC; ++v) as[(ak + v) * A_LD + am] = a_reg[i][v];
      }
    }
#pragma unroll
    for (int i = 0; i < B_LOADS; ++i) {
      const int row = b_row0 + i * B_ROW_STEP;
      if (row < BK) bs[row * BN + b_col] = b_reg[i];
    }
  };

  float acc[TM][TN];
#pragma unroll
  for (int i = 0; i < TM; ++i)
#pragma unroll
    for (int j = 0; j < TN; ++j) acc[i][j] = 0.f;

  auto multiply = [&](int stage) {
    const float* as = As + stage * BK * A_LD;
    const float* bs = Bs + stage * BK * BN;
#pragma unroll
    for (int kk = 0; kk < BK; ++kk) {
      float a_frag[TM], b_frag[TN];
#pragma unroll
      for (int i = 0; i < TM; ++i) a_frag[i] = as[kk * A_LD + ty + i * TY];
#pragma unroll
      for (int j = 0; j < TN; ++j) b_frag[j] = bs[kk * BN + tx + j * TX];
#pragma unroll
      for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] = fmaf(a_frag[i], b_frag[j], acc[i][j]);
    }
  };

  const int num_k = (CRS + BK - 1) / BK;
  load_tiles(0);
  store_tiles(0);
  __syncthreads();
  for (int t = 0; t < num_k; ++t) {
    const bool has_next = t + 1 < num_k;
    if (DB) {
      const int cur = t & 1;
      if (has_next) load_tiles((t + 1) * BK);  // global loads in flight while the FMAs run
      multiply(cur);
      if (has_next) store_tiles(cur ^ 1);      // the other stage was last read before the previous barrier
      __syncthreads();
    } else {
      multiply(0);
      __syncthreads();
      if (has_next) {
        load_tiles((t + 1) * BK);
        store_tiles(0);
      }
      __syncthreads();
    }
  }

  // Epilogue: thread (ty, tx) owns channels m0 + ty + i*TY and pixels n0 + tx + j*TX, so for fixed (i, j)
  // a warp writes consecutive pixels of one channel: coalesced stores.
  int out_off[TN];
#pragma unroll
  for (int j = 0; j < TN; ++j) {
    const int gn = n0 + tx + j * TX;
    if (gn < NPQ) {
      const int img = gn / PQ;
      out_off[j] = img * p.K * PQ + (gn - img * PQ);
    } else {
      out_off[j] = -1;
    }
  }
#pragma unroll
  for (int i = 0; i < TM; ++i) {
    const int gm = m0 + ty + i * TY;
    if (gm < p.K) {
      const float bv = p.has_bias ? __ldg(bias + gm) : 0.f;
#pragma unroll
      for (int j = 0; j < TN; ++j)
        if (out_off[j] >= 0) y[out_off[j] + gm * PQ] = acc[i][j] + bv;
    }
  }
}

}  // namespace bagf
