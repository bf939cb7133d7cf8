// fp32 convolution as an implicit GEMM on tensor cores: fp32 accuracy from three TF32 products
// (implicit_gemm_tc_conv2d), or one TF32 product per multiply for TF32 mode (implicit_gemm_tf32_conv2d).
//
// Same GEMM view as implicit_gemm.cuh: Y[k][npq] = sum_{crs} W[k][crs] * X[crs][npq] (+ bias[k]), the im2col
// matrix X gathered tile by tile from the NCHW input, never materialised.
//
// Precision ("3xTF32"): each fp32 operand is split into a TF32 "big" part (round to nearest, 10-bit
// mantissa) and a TF32 "small" part (the rounding remainder, again rounded to TF32), and the product is
// a_big*b_big + a_big*b_small + a_small*b_big, accumulated in fp32 by mma.sync m16n8k8. The dropped term
// a_small*b_small is ~2^-22 relative, so results match an fp32 FFMA kernel (measured against float64 in the
// tests; the tuner's correctness check enforces the same tolerance as for every other kernel). Plain TF32
// is 2^-11 relative per product and fails that check by design: it is the second kernel here,
// implicit_gemm_tf32_conv2d, for TF32 mode only, where the check's tolerance follows cuDNN's own TF32 error.
//
// Template parameters are the tuning knobs (bagf_torch/kernels/implicit_gemm_tc.py has the validity rules):
//   BM  block tile over output channels (M)     WM  warps along M (warp tile BM/WM, a multiple of 16)
//   BN  block tile over output pixels (N*P*Q)   WN  warps along N (warp tile BN/WN, a multiple of 8)
//   BK  K-step over C*R*S (multiple of 8)       STAGES  cp.async pipeline depth (tiles in flight + 1)
//   SPLIT  split-K: gridDim.z slices of the C*R*S reduction, summed with atomicAdd into an output the host
//          zeroes first (for small N*P*Q, e.g. batch 1, where BM x BN tiles alone cannot fill 132 SMs)
//
// Shared memory: weights as As[m][k] (row length BK+4) and the input tile as Bs[k][n] (row length BN+8), so
// that the fragment loads of a warp (8 groups x 4 threads) hit 32 different banks.
//
// Safety: every global access is bounds-checked against the run-time shape; float4 weight loads are taken
// only when C*R*S % 4 == 0 and the weight pointer is 16-byte aligned. Includes nothing from torch.
#pragma once
#include "conv_params.h"

// Order of the three TF32 products per K-step (an A/B switch for benchmarks/probes/profile_tc.py; the tuner always
// compiles the default). 0: each tile's three products back to back on its accumulator (a dependent chain
// of three mma.sync). 1: three passes over the MI x NI tiles, so consecutive products go to different
// accumulators.
#ifndef BAGF_TC_MMA_PASSES
#define BAGF_TC_MMA_PASSES 0
#endif

namespace bagf {
namespace tc {

__device__ __forceinline__ unsigned to_tf32(float x) {
  unsigned r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}

// How x is split into big + small (an A/B switch for benchmarks/probes/profile_tc.py; the tuner compiles the
// default, 1). 0: both parts rounded with cvt.rna.tf32.f32. 1: integer ops only: big rounds the magnitude
// half up at mantissa bit 13 (add 0x1000, clear the low 13 bits; exact TF32), small = x - big (exact in
// fp32) truncated to TF32 by a mask. |small| <= 2^-11 |x| and the mask loses < 2^-10 |small|, so a product's
// error stays ~2^-21 relative. (Inputs within 2^-11 of FLT_MAX round big to inf; conv data never gets there.)
// 2: as 1 without the mask: small's low 13 bits go to the tensor core as they are.
// Measured on the H200 (benchmarks/results/profile_tc_split_h200.md): 1 is 1.08-1.18x faster than 0 on
// AlexNet conv1/conv3 at N=32/128 (the conversions, not the tensor cores, limited the products); 2 = 1.
#ifndef BAGF_TC_SPLIT
#define BAGF_TC_SPLIT 1
#endif

__device__ __forceinline__ void split_tf32(float x, unsigned& big, unsigned& small) {
#if BAGF_TC_SPLIT == 0
  big = to_tf32(x);
  small = to_tf32(x - __uint_as_float(big));
#else
  big = (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
  small = __float_as_uint(x - __uint_as_float(big));
#if BAGF_TC_SPLIT == 1
  small &= 0xffffe000u;
#endif
#endif
}

// x rounded to TF32 (to nearest, ties away from zero, as cvt.rna.tf32.f32 rounds; with integer ops as
// split_tf32's big part), as the tensor core's operand bits. A NaN passes as it is: the carry of the rounding
// would turn one with high mantissa bits into a zero or an infinity (0x7fffffff, GPU arithmetic's NaN, into -0).
__device__ __forceinline__ unsigned round_tf32(float x) {
  const unsigned u = __float_as_uint(x);
  return x != x ? u : (u + 0x1000u) & 0xffffe000u;
}

// D += A(16x8, row) * B(8x8, col), TF32 inputs, fp32 accumulators.
__device__ __forceinline__ void mma_16x8x8(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Asynchronous global -> shared copies (sm_80+). src_bytes == 0 writes zeros and reads nothing: that is how
// out-of-range elements (padding, tails) become zeros without a branch around the copy.
__device__ __forceinline__ void cp_async4(float* dst, const float* src, int src_bytes) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(d), "l"(src), "r"(src_bytes));
}

__device__ __forceinline__ void cp_async16(float* dst, const float* src, int src_bytes) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }


// The kernel body, for both precisions. PREC = 3: three TF32 products per fp32 product (fp32 accuracy,
// implicit_gemm_tc_conv2d). PREC = 1: one, each operand rounded to TF32 (to nearest, ties away from zero, as
// cvt.rna.tf32.f32) and fp32 accumulation: the arithmetic of cuDNN's TF32 convolutions, for callers that run
// fp32 convolutions in TF32 mode (implicit_gemm_tf32_conv2d).
template <int BM, int BN, int BK, int WM, int WN, int STAGES, int SPLIT, int PREC>
__device__ __forceinline__ void implicit_gemm_body(const float* __restrict__ x, const float* __restrict__ w,
                                                   const float* __restrict__ bias, float* __restrict__ y,
                                                   const Conv2dParams& p) {
  static_assert(PREC == 1 || PREC == 3, "one TF32 product (TF32 mode) or three (fp32 accuracy)");
  constexpr int T = 32 * WM * WN;
  constexpr int WTM = BM / WM;  // warp tile
  constexpr int WTN = BN / WN;
  constexpr int MI = WTM / 16;  // mma tiles per warp
  constexpr int NI = WTN / 8;
  constexpr int LDA = BK + 4;
  constexpr int LDB = BN + 8;
  constexpr int A_STAGE = BM * LDA;
  constexpr int B_STAGE = BK * LDB;
  constexpr int A_VECS = BM * BK / 4;
  constexpr int A_LOADS = (A_VECS + T - 1) / T;
  constexpr int B_ROW_STEP = T / BN;  // validity rule: T % BN == 0
  constexpr int B_LOADS = (BK + B_ROW_STEP - 1) / B_ROW_STEP;
  static_assert(WTM % 16 == 0 && WTN % 8 == 0 && BK % 8 == 0, "warp tile must be whole mma tiles");
  static_assert(T % BN == 0, "threads must be a multiple of BN");
  static_assert(STAGES >= 2, "the cp.async pipeline needs at least two stages");

  extern __shared__ __align__(16) float smem[];
  float* As = smem;                    // [STAGES][BM][LDA]
  float* Bs = smem + STAGES * A_STAGE; // [STAGES][BK][LDB]

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int wm = warp / WN;
  const int wn = warp - wm * WN;
  const int gid = lane >> 2;  // mma "group"
  const int tig = lane & 3;   // thread in group
  const int m0 = blockIdx.y * BM;
  const int n0 = blockIdx.x * BN;

  const int RS = p.R * p.S;
  const int CRS = p.C * RS;
  const int PQ = p.P * p.Q;
  const int NPQ = p.N * PQ;
  const int HW = p.H * p.W;
  const bool vec_ok = (CRS % 4) == 0 && ((reinterpret_cast<unsigned long long>(w) & 15ull) == 0);

  // this block's share of the reduction (split-K)
  const int num_k = (CRS + BK - 1) / BK;
  const int per_split = (num_k + SPLIT - 1) / SPLIT;
  const int t_begin = SPLIT > 1 ? blockIdx.z * per_split : 0;
  const int t_end = SPLIT > 1 ? min(num_k, t_begin + per_split) : num_k;

  // Input-tile loader: a fixed column (output pixel) per thread, decoded once; its rows' (c, r, s) are
  // decoded once too and then advanced by BK per tile with at most one carry per digit (no divisions).
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
  const int d_c = BK / RS;
  const int d_rs = BK - d_c * RS;
  const int d_r = d_rs / p.S;
  const int d_s = d_rs - d_r * p.S;
  int cur_c[B_LOADS], cur_r[B_LOADS], cur_s[B_LOADS];
#pragma unroll
  for (int i = 0; i < B_LOADS; ++i) {
    const int kk = t_begin * BK + b_row0 + i * B_ROW_STEP;
    cur_c[i] = kk / RS;
    const int rs = kk - cur_c[i] * RS;
    cur_r[i] = rs / p.S;
    cur_s[i] = rs - cur_r[i] * p.S;
  }

  // Issue the copies of K-tile t into pipeline stage st (the B rows' (c, r, s) must stand at tile t).
  auto load_tile = [&](int t, int st) {
    const int k0 = t * BK;
    float* as = As + st * A_STAGE;
    float* bs = Bs + st * B_STAGE;
#pragma unroll
    for (int i = 0; i < A_LOADS; ++i) {
      const int e = tid + i * T;
      if (e < A_VECS) {
        const int am = e / (BK / 4);
        const int ak = (e % (BK / 4)) * 4;
        const int gm = m0 + am;
        const int gk = k0 + ak;
        float* dst = as + am * LDA + ak;
        if (vec_ok) {
          const bool ok = gm < p.K && gk < CRS;
          tc::cp_async16(dst, ok ? w + gm * CRS + gk : w, ok ? 16 : 0);
        } else {
#pragma unroll
          for (int v = 0; v < 4; ++v) {
            const bool ok = gm < p.K && gk + v < CRS;
            tc::cp_async4(dst + v, ok ? w + gm * CRS + gk + v : w, ok ? 4 : 0);
          }
        }
      }
    }
#pragma unroll
    for (int i = 0; i < B_LOADS; ++i) {
      const int row = b_row0 + i * B_ROW_STEP;
      if (row < BK) {
        const int ih = ih0 + cur_r[i] * p.dil_h;
        const int iw = iw0 + cur_s[i] * p.dil_w;
        const bool ok = pix_ok && k0 + row < CRS && ih >= 0 && ih < p.H && iw >= 0 && iw < p.W;
        tc::cp_async4(bs + row * LDB + b_col, ok ? x_img + cur_c[i] * HW + ih * p.W + iw : x, ok ? 4 : 0);
      }
      // advance this row by BK: s, then r, then c, each with at most one carry
      cur_s[i] += d_s;
      cur_r[i] += d_r;
      cur_c[i] += d_c;
      if (cur_s[i] >= p.S) { cur_s[i] -= p.S; ++cur_r[i]; }
      if (cur_r[i] >= p.R) { cur_r[i] -= p.R; ++cur_c[i]; }
    }
  };

  float acc[MI][NI][4];
#pragma unroll
  for (int i = 0; i < MI; ++i)
#pragma unroll
    for (int j = 0; j < NI; ++j)
#pragma unroll
      for (int v = 0; v < 4; ++v) acc[i][j][v] = 0.f;

  auto multiply = [&](int st) {
    const float* as = As + st * A_STAGE + (wm * WTM + gid) * LDA + tig;
    const float* bs = Bs + st * B_STAGE + tig * LDB + wn * WTN + gid;
#pragma unroll
    for (int kk = 0; kk < BK; kk += 8) {
      if constexpr (PREC == 1) {
        unsigned a_t[MI][4], b_t[NI][2];
#pragma unroll
        for (int i = 0; i < MI; ++i) {
          const float* a = as + i * 16 * LDA + kk;
          a_t[i][0] = tc::round_tf32(a[0]);
          a_t[i][1] = tc::round_tf32(a[8 * LDA]);
          a_t[i][2] = tc::round_tf32(a[4]);
          a_t[i][3] = tc::round_tf32(a[8 * LDA + 4]);
        }
#pragma unroll
        for (int j = 0; j < NI; ++j) {
          const float* b = bs + kk * LDB + j * 8;
          b_t[j][0] = tc::round_tf32(b[0]);
          b_t[j][1] = tc::round_tf32(b[4 * LDB]);
        }
#pragma unroll
        for (int i = 0; i < MI; ++i)
#pragma unroll
          for (int j = 0; j < NI; ++j) tc::mma_16x8x8(acc[i][j], a_t[i], b_t[j]);
      } else {
        unsigned a_big[MI][4], a_small[MI][4], b_big[NI][2], b_small[NI][2];
#pragma unroll
        for (int i = 0; i < MI; ++i) {
          const float* a = as + i * 16 * LDA + kk;
          tc::split_tf32(a[0], a_big[i][0], a_small[i][0]);
          tc::split_tf32(a[8 * LDA], a_big[i][1], a_small[i][1]);
          tc::split_tf32(a[4], a_big[i][2], a_small[i][2]);
          tc::split_tf32(a[8 * LDA + 4], a_big[i][3], a_small[i][3]);
        }
#pragma unroll
        for (int j = 0; j < NI; ++j) {
          const float* b = bs + kk * LDB + j * 8;
          tc::split_tf32(b[0], b_big[j][0], b_small[j][0]);
          tc::split_tf32(b[4 * LDB], b_big[j][1], b_small[j][1]);
        }
        if constexpr (BAGF_TC_MMA_PASSES) {
#pragma unroll
          for (int i = 0; i < MI; ++i)
#pragma unroll
            for (int j = 0; j < NI; ++j) tc::mma_16x8x8(acc[i][j], a_small[i], b_big[j]);
#pragma unroll
          for (int i = 0; i < MI; ++i)
#pragma unroll
            for (int j = 0; j < NI; ++j) tc::mma_16x8x8(acc[i][j], a_big[i], b_small[j]);
#pragma unroll
          for (int i = 0; i < MI; ++i)
#pragma unroll
            for (int j = 0; j < NI; ++j) tc::mma_16x8x8(acc[i][j], a_big[i], b_big[j]);
        } else {
#pragma unroll
          for (int i = 0; i < MI; ++i)
#pragma unroll
            for (int j = 0; j < NI; ++j) {
              tc::mma_16x8x8(acc[i][j], a_small[i], b_big[j]);
              tc::mma_16x8x8(acc[i][j], a_big[i], b_small[j]);
              tc::mma_16x8x8(acc[i][j], a_big[i], b_big[j]);
            }
        }
      }  // PREC == 3
    }
  };

  // Multistage pipeline: STAGES-1 tiles in flight while one is multiplied. One commit group per tile slot
  // (empty groups past the end keep the wait count uniform).
#pragma unroll
  for (int st = 0; st < STAGES - 1; ++st) {
    if (t_begin + st < t_end) load_tile(t_begin + st, st);
    tc::cp_async_commit();
  }
  for (int t = t_begin; t < t_end; ++t) {
    tc::cp_async_wait<STAGES - 2>();
    __syncthreads();  // tile t is visible to all; everyone is done with the stage the next copy overwrites
    const int next = t + STAGES - 1;
    if (next < t_end) load_tile(next, (next - t_begin) % STAGES);
    tc::cp_async_commit();
    multiply((t - t_begin) % STAGES);
  }
  tc::cp_async_wait<0>();

  // Epilogue. Accumulator v of tile (i, j): row gid (+8 for v >= 2), column 2*tig + (v & 1).
  const bool add_bias = p.has_bias && (SPLIT == 1 || blockIdx.z == 0);
#pragma unroll
  for (int j = 0; j < NI; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int gn = n0 + wn * WTN + j * 8 + 2 * tig + h;
      if (gn >= NPQ) continue;
      const int img = gn / PQ;
      const int base = img * p.K * PQ + (gn - img * PQ);
#pragma unroll
      for (int i = 0; i < MI; ++i) {
#pragma unroll
        for (int hi = 0; hi < 2; ++hi) {
          const int gm = m0 + wm * WTM + i * 16 + gid + 8 * hi;
          if (gm < p.K) {
            float v = acc[i][j][2 * hi + h];
            if (add_bias) v += __ldg(bias + gm);
            if (SPLIT > 1) {
              atomicAdd(y + base + gm * PQ, v);
            } else {
              y[base + gm * PQ] = v;
            }
          }
        }
      }
    }
  }
}

}  // namespace tc

template <int BM, int BN, int BK, int WM, int WN, int STAGES, int SPLIT>
__global__ void __launch_bounds__(32 * WM * WN)
implicit_gemm_tc_conv2d(const float* __restrict__ x, const float* __restrict__ w,
                        const float* __restrict__ bias, float* __restrict__ y, const Conv2dParams p) {
  tc::implicit_gemm_body<BM, BN, BK, WM, WN, STAGES, SPLIT, 3>(x, w, bias, y, p);
}

template <int BM, int BN, int BK, int WM, int WN, int STAGES, int SPLIT>
__global__ void __launch_bounds__(32 * WM * WN)
implicit_gemm_tf32_conv2d(const float* __restrict__ x, const float* __restrict__ w,
                          const float* __restrict__ bias, float* __restrict__ y, const Conv2dParams p) {
  tc::implicit_gemm_body<BM, BN, BK, WM, WN, STAGES, SPLIT, 1>(x, w, bias, y, p);
}

}  // namespace bagf
