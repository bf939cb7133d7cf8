// fp32 Winograd F(MT x MT, 3 x 3) convolution (MT = 2, 4, 5, 6), not fused: three transform stages of this one
// kernel around a batched GEMM, either ours (3xTF32 on tensor cores, a second kernel of the same cubin:
// gemm_tf32x3.cuh with mma.sync, or gemm_wgmma.cuh with wgmma on sm_90a) or cuBLAS's SGEMM the host runs
// through at::bmm_out (fp32, TF32 off). NCHW input, KCRS weights, NKPQ output, or all channels_last (NHWC, KRSC);
// float32, or float16 / bfloat16 tensors around fp32 transforms and products (DT); dilation 1, any padding, and
// either stride 1 with 3x3 filters or stride s > 1 (both axes) with R, S <= 3s: that convolution runs as the
// stride-1 3x3 one over its s x s polyphase components, C' = C s^2 channels (AlexNet's conv1, 11x11 stride 4:
// 48 channels of 3x3). The host refuses other problems: ATen answers.
//
//   stage 0  U[e][k][c']  = (G g_kc' G^T)[e]                  one thread per (k, c')
//   stage 1  V[e][c'][t]  = (B^T d_c't B)[e] (VL=1: V[e][t][c']) one thread per (c', tile)
//   (GEMM)   M[e]        = U[e] V[e]         E batched K x C' by C' x T products (ML=1: stored as M[e][t][k])
//   stage 2  y[n][k][..] = A^T M_kt A + bias[k]                 one thread per (k, tile), MT x MT outputs
//   stage 3  stages 0 and 1 in one launch (blocks below ceil(K*C'/TB) filters, the rest input tiles): the
//            host's default, one launch less and the small filter transform overlapping the input's
//
// E = (MT+2)^2 points, T = N * ceil(P/MT) * ceil(Q/MT) tiles (tile t: image t / tiles-per-image, then tile rows,
// then tile columns fastest). Where the fused kernels (winograd.cuh, winograd_tc.cuh) keep the transformed tiles
// on chip and run the products on the SM's own units inside the same block, this dataflow writes U, V and M to
// global memory once each (transform + batched GEMM) and in exchange the products run in a full-size GEMM:
// at N >= 32 the fused kernels spend most of their time in the transforms and the output stage, not in the
// products (F(4x4) at 93-94% of the direct fp32 roof on AlexNet's conv3-5 at N = 128, i.e. about 18 TFLOP/s
// of real FFMA work).
//
// Template parameters are the tuning knobs (bagf_torch/kernels/winograd_gemm.py):
//   MT  output tile: F(MT x MT, 3x3), MT in 2, 4, 5, 6     TB  threads per block of every stage
//   VL  0: V[e][c][t], consecutive threads take consecutive tiles (coalesced stores, overlapping loads);
//       1: V[e][t][c], consecutive threads take consecutive channels (the GEMM reads V transposed)
//   ML  0: M[e][k][t], stage 2's consecutive threads take consecutive tiles; 1: M[e][t][k], consecutive k
//   SO  1: stage 2 stages a block's outputs (whole images of one channel) in shared memory and writes them out
//       contiguously (needs ML = 0 and TB*MT*MT floats <= 48 KB; the host sizes that launch's grid)
//   US  1: stage 0 also writes U's small parts, U - trunc_tf32(U), as E more batches after U (the host then
//       allocates 2 E K C words): gemm_wgmma's A operand. Not a knob: set by the GEMM (GE 6-7).
//   DT  the tensors' dtype: 0 float32, 1 float16, 2 bfloat16 (input, weight and bias read as it and widened to
//       fp32, the output rounded to it once); the transforms, the workspaces and the GEMM are fp32 in every case
//   NHWC 1: input and output channels_last, the weight KRSC (the host passes one); 0: NCHW, KCRS. SO = 1 (whole
//       NCHW planes) needs NHWC = 0.
// Offsets are 64-bit: the workspaces may exceed 2^31 elements even when every tensor the user sees does not.
// The kernel includes nothing from torch; NVRTC compiles it at run time and plain nvcc in the tests.
#pragma once
#include "conv_params.h"
#include "elem_io.cuh"
#include "winograd.cuh"
#include "gemm_tf32x3.cuh"  // the plan's own GEMM (GE 1-5), compiled into the same cubin
#include "gemm_wgmma.cuh"   // or its wgmma GEMM (GE 6-7, sm_90a), which reads U's small parts (US = 1)

namespace bagf {
namespace wg {

using elem::load;   // (elem_io.cuh)
using elem::store;

}  // namespace wg

template <int MT, int TB, int VL, int ML, int DT, int NHWC, int SO = 0, int US = 0>
__global__ void __launch_bounds__(TB)
    winograd_gemm_stage(const void* __restrict__ x, const void* __restrict__ w, const void* __restrict__ bias,
                        void* __restrict__ y, Conv2dParams p, float* __restrict__ u, float* __restrict__ v,
                        const float* __restrict__ m, int stage) {
  static_assert(DT >= 0 && DT <= 2 && (NHWC == 0 || NHWC == 1), "DT: 0 fp32, 1 fp16, 2 bf16; NHWC: 0 or 1");
  static_assert(SO == 0 || NHWC == 0, "staged outputs write whole NCHW planes");
  constexpr int A = MT + 2;
  using Co = wino::Coefs<MT>;
  const int tiles_q = (p.Q + MT - 1) / MT;
  const int tiles_img = ((p.P + MT - 1) / MT) * tiles_q;
  const long long T = static_cast<long long>(p.N) * tiles_img;
  // Phases: a stride-s convolution with R, S <= 3s is the stride-1 3x3 convolution of its s x s polyphase
  // components (channel c' = (c*s + ph)*s + pw sees x[c][s*h + ph][s*w + pw], and filter tap (i, j) of c' is
  // w[c][s*i + ph][s*j + pw], zero past R and S), so the GEMM's reduction runs over C' = C s^2 channels.
  // s = p.stride_h (the host checks stride_w == stride_h for a Winograd GEMM plan); s = 1 is the plain 3x3.
  const int st = p.stride_h;
  const long long cc = static_cast<long long>(p.C) * st * st;
  const long long kc = static_cast<long long>(p.K) * cc;
  long long block = blockIdx.x;
  if (stage == 3) {  // stages 0 and 1 in one grid: the first ceil(K*C'/TB) blocks take the filters
    const long long filter_blocks = (kc + TB - 1) / TB;
    stage = block < filter_blocks ? 0 : 1;
    if (stage == 1) block -= filter_blocks;
  }
  const long long idx = block * TB + threadIdx.x;

  if (stage == 0) {  // filters: U = G g G^T
    if (idx >= kc) return;
    float g[3][3], tmp[A][3], uu[A][A];
    if (st == 1 && !NHWC) {
      const long long src = idx * 9;
#pragma unroll
      for (int i = 0; i < 3; ++i)
#pragma unroll
        for (int j = 0; j < 3; ++j) g[i][j] = wg::load<DT>(w, src + 3 * i + j);
    } else {  // phase (ph, pw) of filter (k, c): taps s*i + ph, s*j + pw of the R x S filter, zero past it
      const long long k = idx / cc;
      const int ci = static_cast<int>(idx - k * cc);
      const int c = ci / (st * st), ph = (ci / st) % st, pw = ci % st;
#pragma unroll
      for (int i = 0; i < 3; ++i)
#pragma unroll
        for (int j = 0; j < 3; ++j) {
          const int r = st * i + ph, q = st * j + pw;
          // KCRS, or KRSC for a channels_last plan
          const long long at = NHWC ? ((k * p.R + r) * p.S + q) * p.C + c : ((k * p.C + c) * p.R + r) * p.S + q;
          g[i][j] = r < p.R && q < p.S ? wg::load<DT>(w, at) : 0.f;
        }
    }
    wino::left<A, 3, 3>(typename Co::G(), g, tmp);
    wino::right<A, 3, A>(typename Co::G(), tmp, uu);
#pragma unroll
    for (int i = 0; i < A; ++i)
#pragma unroll
      for (int j = 0; j < A; ++j) u[(i * A + j) * kc + idx] = uu[i][j];
    if (US) {  // U's small parts after its E batches: U - trunc_tf32(U), exact in fp32 (gemm_wgmma's A)
      float* us = u + static_cast<long long>(A * A) * kc;
#pragma unroll
      for (int i = 0; i < A; ++i)
#pragma unroll
        for (int j = 0; j < A; ++j)
          us[(i * A + j) * kc + idx] = uu[i][j] - __uint_as_float(__float_as_uint(uu[i][j]) & 0xffffe000u);
    }
    return;
  }

  if (stage == 1) {  // input tiles: V = B^T d B
    const long long ct = cc * T;
    if (idx >= ct) return;
    long long c, t;  // c: the GEMM's channel c' (= the input channel when s = 1)
    int ph = 0, pw = 0;
    if (VL == 0) {
      if (st == 1) {
        c = idx / T;
        t = idx - c * T;
      } else {  // phase column pw fastest, then tiles: a warp reads s adjacent columns per tile and writes
        pw = static_cast<int>(idx % st);  // runs of consecutive tiles per channel c'
        const long long q = idx / st, cph = q / T;
        t = q - cph * T;
        ph = static_cast<int>(cph % st);
        c = cph * st + pw;
      }
    } else {
      t = idx / cc;
      c = idx - t * cc;
      if (st > 1) {
        ph = static_cast<int>((c / st) % st);
        pw = static_cast<int>(c % st);
      }
    }
    const int n = static_cast<int>(t / tiles_img);
    const int r = static_cast<int>(t - static_cast<long long>(n) * tiles_img);
    const int tp = r / tiles_q;
    const int h0 = st * tp * MT + ph - p.pad_h;  // the patch's rows h0 + s*i, columns w0 + s*j
    const int w0 = st * (r - tp * tiles_q) * MT + pw - p.pad_w;
    const int c_in = static_cast<int>(c / (st * st));
    // element (h, w) of channel c_in of image n: NCHW, or NHWC (channels_last)
    const long long plane = NHWC ? static_cast<long long>(n) * p.H * p.W * p.C + c_in
                                 : (static_cast<long long>(n) * p.C + c_in) * p.H * p.W;
    const int col_step = NHWC ? p.C : 1;
    float d[A][A], tmp[A][A], vv[A][A];
#pragma unroll
    for (int i = 0; i < A; ++i) {
      const int h = h0 + st * i;
      const bool row = h >= 0 && h < p.H;
#pragma unroll
      for (int j = 0; j < A; ++j) {
        const int ww = w0 + st * j;
        d[i][j] = row && ww >= 0 && ww < p.W
                      ? wg::load<DT>(x, plane + (static_cast<long long>(h) * p.W + ww) * col_step)
                      : 0.f;
      }
    }
    wino::left<A, A, A>(typename Co::Bt(), d, tmp);
    wino::right<A, A, A>(typename Co::Bt(), tmp, vv);
    const long long off = VL == 0 ? c * T + t : t * cc + c;
#pragma unroll
    for (int i = 0; i < A; ++i)
#pragma unroll
      for (int j = 0; j < A; ++j) v[(i * A + j) * ct + off] = vv[i][j];
    return;
  }

  // stage 2, outputs: y = A^T M A + bias
  const long long kt = static_cast<long long>(p.K) * T;
  if constexpr (SO == 1 && ML == 0) {
    // Staged: a block takes G = TB / tiles-per-image whole images of one channel k (thread = tile), puts their
    // outputs into shared memory as G planes of P x Q, then writes the planes out contiguously (y[n][k] is one
    // P*Q run). Per tile the stores are MT-float pieces of different rows and images, 6-8 L2 sectors written
    // per sector of output (ncu, benchmarks/results/ncu_winograd_gemm_stages_h200.log); staged, whole
    // sectors. The host launches K * ceil(N / G) blocks for this stage; G = 0 (an image has more tiles than
    // the block threads) takes the per-tile path below with its K*T/TB blocks, as the host does.
    static_assert(TB * MT * MT * 4 <= 48 * 1024, "staged outputs: TB*MT*MT floats of static shared memory");
    const int g_imgs = TB / tiles_img;
    if (g_imgs > 0) {
      __shared__ float planes[TB * MT * MT];  // G*P*Q <= G*tiles_img*MT*MT <= TB*MT*MT
      const long long nblk = (p.N + g_imgs - 1) / g_imgs;
      const long long k = block / nblk;
      const int n0 = static_cast<int>(block - k * nblk) * g_imgs;
      const int imgs = min(g_imgs, p.N - n0);
      const int PQ = p.P * p.Q;
      const int gi = threadIdx.x / tiles_img;
      const int r = threadIdx.x - gi * tiles_img;
      if (k < p.K && gi < imgs) {
        const long long off = k * T + static_cast<long long>(n0 + gi) * tiles_img + r;
        float mm[A][A], tmp[MT][A], o[MT][MT];
#pragma unroll
        for (int i = 0; i < A; ++i)
#pragma unroll
          for (int j = 0; j < A; ++j) mm[i][j] = __ldg(m + (i * A + j) * kt + off);
        wino::left<MT, A, A>(typename Co::At(), mm, tmp);
        wino::right<MT, A, MT>(typename Co::At(), tmp, o);
        const float b = p.has_bias ? wg::load<DT>(bias, k) : 0.f;
        const int tp = r / tiles_q;
        const int p0 = tp * MT;
        const int q0 = (r - tp * tiles_q) * MT;
        float* dst = planes + gi * PQ;
#pragma unroll
        for (int i = 0; i < MT; ++i) {
          if (p0 + i >= p.P) break;
#pragma unroll
          for (int j = 0; j < MT; ++j)
            if (q0 + j < p.Q) dst[(p0 + i) * p.Q + q0 + j] = o[i][j] + b;
        }
      }
      __syncthreads();
      if (k < p.K) {
        const long long out = (static_cast<long long>(n0) * p.K + k) * PQ;
        const long long img_stride = static_cast<long long>(p.K) * PQ;
        for (int e = threadIdx.x; e < imgs * PQ; e += TB) {
          const int gi2 = e / PQ;
          wg::store<DT>(y, out + gi2 * img_stride + (e - gi2 * PQ), planes[e]);
        }
      }
      return;
    }
  }
  if (idx >= kt) return;
  long long k, t;
  if (ML == 0) {
    k = idx / T;
    t = idx - k * T;
  } else {
    t = idx / p.K;
    k = idx - t * p.K;
  }
  const long long off = ML == 0 ? k * T + t : t * p.K + k;
  float mm[A][A], tmp[MT][A], o[MT][MT];
#pragma unroll
  for (int i = 0; i < A; ++i)
#pragma unroll
    for (int j = 0; j < A; ++j) mm[i][j] = __ldg(m + (i * A + j) * kt + off);
  wino::left<MT, A, A>(typename Co::At(), mm, tmp);
  wino::right<MT, A, MT>(typename Co::At(), tmp, o);
  const float b = p.has_bias ? wg::load<DT>(bias, k) : 0.f;
  const int n = static_cast<int>(t / tiles_img);
  const int r = static_cast<int>(t - static_cast<long long>(n) * tiles_img);
  const int tp = r / tiles_q;
  const int p0 = tp * MT;
  const int q0 = (r - tp * tiles_q) * MT;
  // output (k, p, q) of image n: NCHW y[n][k][p][q], or NHWC y[n][p][q][k]
  const long long dst = NHWC ? static_cast<long long>(n) * p.P * p.Q * p.K + k
                             : (static_cast<long long>(n) * p.K + k) * p.P * p.Q;
  const int q_step = NHWC ? p.K : 1;
#pragma unroll
  for (int i = 0; i < MT; ++i) {
    if (p0 + i >= p.P) break;
#pragma unroll
    for (int j = 0; j < MT; ++j)
      if (q0 + j < p.Q)
        wg::store<DT>(y, dst + (static_cast<long long>(p0 + i) * p.Q + q0 + j) * q_step, o[i][j] + b);
  }
}

}  // namespace bagf
