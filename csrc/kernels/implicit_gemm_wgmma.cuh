// fp32 convolution in TF32 mode as an implicit GEMM on Hopper's warpgroup tensor-core instruction (wgmma, sm_90a):
// one TF32 product per multiply, both operands rounded to TF32 (to nearest, ties away from zero, as
// cvt.rna.tf32.f32), fp32 accumulation: the arithmetic of cuDNN's TF32 convolutions and of
// implicit_gemm_tf32_conv2d, at wgmma's rate.
//
// Why: mma.sync's TF32 rate on the H200 is 312 TFLOP/s (benchmarks/results/mma_rate_h200.json); wgmma's dense TF32
// rate is ~495 TFLOP/s, and cuDNN's TF32 kernels reach ~190 TFLOP/s on AlexNet's conv3 at N = 128.
//
// GEMM view (implicit_gemm.cuh's): Y[k][npq] = sum_{crs} W[k][crs] X[crs][npq] (+ bias[k]), the im2col matrix X
// gathered tile by tile from the NCHW input, never materialised. As wgmma sees it (gemm_wgmma.cuh's mapping):
// D (64 output pixels x WN output channels per warpgroup and instruction) = X^T W^T. For TF32 both wgmma operands
// must be K-major: W's rows are (k, crs) with crs contiguous, so W is wgmma's shared-memory operand as it lies in
// memory; X is its register operand, gathered into shared memory as X[crs][npq] tiles (cp.async, zero-filled
// where the window leaves the image) and loaded into the fragment layout by the threads.
//
// Rounding: the tensor cores read an fp32 shared-memory operand's top 19 bits (truncation). So each thread rounds
// the weights it copied in place once they land (before the proxy fence that makes them visible to wgmma);
// the input fragments are rounded in registers on their way to the instruction (tc::round_tf32).
//
// Shared memory per stage (STAGES-deep cp.async pipeline, dynamic, 1024-byte aligned): W's tile, BM x 32
// floats, 128-byte swizzled K-major (gemm_wgmma.cuh's layout and descriptor), then X's tile, 32 x (BN + 8)
// floats (pitch = 8 mod 32: conflict-free fragment loads), with gemm_wgmma's permutation of a warp's 16 rows
// (fragment row g <-> pixel 2g, row g + 8 <-> pixel 2g + 1: a thread's two pixels are adjacent floats).
//
// Template parameters (bagf_torch/kernels/implicit_gemm_wgmma.py has the validity rules): WN = wgmma's N (64,
// 128, 192 or 256) and NB instructions side by side (BM = WN NB output channels per block), WG warpgroups (BN =
// 64 WG output pixels per block, 128 WG threads), STAGES >= 3, SPLIT split-K slices (gridDim.z) summed with
// atomicAdd into an output the host zeroes first. Shapes are run-time arguments; every global access is
// bounds-checked; 16-byte weight copies only when C*R*S % 4 == 0 and the weights are 16-byte aligned. Compiled
// for anything but sm_90a the kernel fails to compile (a static_assert), so a tuner records a compile failure,
// never a launch. Includes nothing from torch.
#pragma once
#include "conv_params.h"
#include "gemm_wgmma.cuh"

namespace bagf {

template <int WN, int NB, int WG, int STAGES, int SPLIT>
__global__ void __launch_bounds__(128 * WG, 1)
    implicit_gemm_wgmma_conv2d(const float* __restrict__ x, const float* __restrict__ w,
                               const float* __restrict__ bias, float* __restrict__ y, const Conv2dParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int BK = 32;
  constexpr int T = 128 * WG;
  constexpr int BM = WN * NB;
  constexpr int BN = 64 * WG;
  constexpr int LDB = BN + 8;
  constexpr int A_TILE = BM * BK;  // floats
  constexpr int STAGE = A_TILE + BK * LDB;
  constexpr int AV = BM * 8;       // 16-byte chunks of W's tile
  constexpr int ROW_STEP = T / BN;  // = 2: the input rows one thread copies are ROW_STEP apart
  constexpr int B_LOADS = BK / ROW_STEP;
  static_assert(WN == 64 || WN == 128 || WN == 192 || WN == 256, "wgmma's N");
  static_assert(STAGES >= 3, "one group in flight needs a stage besides the two being read");
  static_assert(AV % T == 0, "whole copy rounds of W's tile");
  static_assert(T % BN == 0 && BK % ROW_STEP == 0, "input loader: one pixel column per thread");

  extern __shared__ __align__(1024) float smem[];  // [STAGES][W tile, X tile]

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int gid = lane >> 2;
  const int tig = lane & 3;
  const int m0 = blockIdx.y * BM;
  const int n0 = blockIdx.x * BN;

  const int RS = p.R * p.S;
  const int CRS = p.C * RS;
  const int PQ = p.P * p.Q;
  const int NPQ = p.N * PQ;
  const int HW = p.H * p.W;
  const bool vec = (CRS % 4) == 0 && (reinterpret_cast<unsigned long long>(w) & 15ull) == 0;

  // this block's share of the reduction (split-K)
  const int num_k = (CRS + BK - 1) / BK;
  const int per_split = (num_k + SPLIT - 1) / SPLIT;
  const int t_begin = SPLIT > 1 ? blockIdx.z * per_split : 0;
  const int t_end = SPLIT > 1 ? min(num_k, t_begin + per_split) : num_k;
  const int tiles = t_end - t_begin;

  // W's copy plan (vector path), fixed per thread: chunk e = tid + i T is 16-byte column q = e % 8 (= tid % 8) of
  // row m = e / 8, stored at chunk (m / 8) * 64 + (m % 8) * 8 + (q ^ m % 8) of the tile (the 128-byte swizzle).
  constexpr int CA = AV / T;
  const int aq = tid & 7;
  int a_src[CA], a_dst[CA];
  unsigned a_ok = 0;
#pragma unroll
  for (int i = 0; i < CA; ++i) {
    const int m = (tid >> 3) + i * (T / 8);
    a_src[i] = (m0 + m) * CRS + 4 * aq;
    a_dst[i] = 4 * ((m >> 3) * 64 + (m & 7) * 8 + (aq ^ (m & 7)));
    if (m0 + m < p.K) a_ok |= 1u << i;
  }

  // Input loader: a fixed column (output pixel) per thread, decoded once, and the rows b_row0 + 2 j (j < 16) of
  // each tile. A row's tap (c, r, s) is the same for the 32 lanes of a warp (they share b_row0), so lane j (and
  // j + 16) keeps the cursor of row b_row0 + 2 j, advanced BK at a time with at most one carry per digit, and the
  // warp reads each row's offset and tap from it with shuffles: per element an add, a bounds test and the copy
  // (a cursor per thread and row, as implicit_gemm_tc.cuh keeps, cost ~35 instructions per element here).
  const int b_col = tid % BN;
  const int b_row0 = tid / BN;
  const int npq = n0 + b_col;
  int ih0 = -0x40000000, iw0 = 0, pix_base = 0;  // a column past N*P*Q: a window no tap reaches (zeros)
  const float* x_img = x;
  if (npq < NPQ) {
    const int img = npq / PQ;
    const int pq = npq - img * PQ;
    const int oh = pq / p.Q;
    const int ow = pq - oh * p.Q;
    ih0 = oh * p.stride_h - p.pad_h;
    iw0 = ow * p.stride_w - p.pad_w;
    pix_base = ih0 * p.W + iw0;  // the window's corner, relative to x_img (may be negative)
    x_img = x + img * p.C * HW;
  }
  const int my_row = b_row0 + ROW_STEP * (lane & 15);
  const int d_c = BK / RS;
  const int d_rs = BK - d_c * RS;
  const int d_r = d_rs / p.S;
  const int d_s = d_rs - d_r * p.S;
  int cur_c, cur_r, cur_s;
  {
    const int kk = t_begin * BK + my_row;
    cur_c = kk / RS;
    const int rs = kk - cur_c * RS;
    cur_r = rs / p.S;
    cur_s = rs - cur_r * p.S;
  }
  const int row_w = p.dil_h * p.W;

  // Issue the copies of K-tile t into stage st (tiles are issued in order: the cursor stands at tile t).
  auto load_tile = [&](int t, int st) {
    const int k0 = t * BK;
    float* as = smem + st * STAGE;
    float* bs = as + A_TILE;
    if (vec) {
      const bool ak = k0 + 4 * aq < CRS;
#pragma unroll
      for (int i = 0; i < CA; ++i) {
        const bool ok = ak && ((a_ok >> i) & 1u);
        tc::cp_async16(as + a_dst[i], ok ? w + a_src[i] + k0 : w, ok ? 16 : 0);
      }
    } else {
      for (int e = tid; e < BM * BK; e += T) {
        const int m = e / BK, k = e - m * BK, q = k >> 2;
        const int dst = ((m >> 3) * 64 + (m & 7) * 8 + (q ^ (m & 7))) * 4 + (k & 3);
        const bool ok = m0 + m < p.K && k0 + k < CRS;
        tc::cp_async4(as + dst, ok ? w + (m0 + m) * CRS + k0 + k : w, ok ? 4 : 0);
      }
    }
    // this lane's row of tile t: its offset from a window's corner and its tap; a row past C*R*S gets a tap no
    // window reaches (its copies are zeros; ih0 + dr stays >= INT_MIN)
    const int e_dr = k0 + my_row < CRS ? cur_r * p.dil_h : -0x40000000;
    const int e_ds = cur_s * p.dil_w;
    const int e_off = cur_c * HW + cur_r * row_w + e_ds;
    cur_s += d_s;
    cur_r += d_r;
    cur_c += d_c;
    if (cur_s >= p.S) { cur_s -= p.S; ++cur_r; }
    if (cur_r >= p.R) { cur_r -= p.R; ++cur_c; }
    float* bcol = bs + b_row0 * LDB + b_col;
#pragma unroll
    for (int j = 0; j < B_LOADS; ++j) {
      const int dr = __shfl_sync(0xffffffffu, e_dr, j);
      const int ds = __shfl_sync(0xffffffffu, e_ds, j);
      const int off = __shfl_sync(0xffffffffu, e_off, j);
      const bool ok = static_cast<unsigned>(ih0 + dr) < static_cast<unsigned>(p.H) &&
                      static_cast<unsigned>(iw0 + ds) < static_cast<unsigned>(p.W);
      tc::cp_async4(bcol + j * ROW_STEP * LDB, x_img + (ok ? pix_base + off : 0), ok ? 4 : 0);
    }
  };

  // Round the weights this thread copied into stage st to TF32, in place (after its copies landed, before the
  // proxy fence): the elements it copied, so no other thread's copies need waiting for.
  auto round_weights = [&](int st) {
    float* as = smem + st * STAGE;
    if (vec) {
#pragma unroll
      for (int i = 0; i < CA; ++i) {
        float4* v = reinterpret_cast<float4*>(as + a_dst[i]);
        float4 f = *v;
        f.x = __uint_as_float(tc::round_tf32(f.x));
        f.y = __uint_as_float(tc::round_tf32(f.y));
        f.z = __uint_as_float(tc::round_tf32(f.z));
        f.w = __uint_as_float(tc::round_tf32(f.w));
        *v = f;
      }
    } else {
      for (int e = tid; e < BM * BK; e += T) {
        const int m = e / BK, k = e - m * BK, q = k >> 2;
        float* v = as + ((m >> 3) * 64 + (m & 7) * 8 + (q ^ (m & 7))) * 4 + (k & 3);
        *v = __uint_as_float(tc::round_tf32(*v));
      }
    }
  };

  float acc[NB][WN / 2];
#pragma unroll
  for (int j = 0; j < NB; ++j)
#pragma unroll
    for (int v = 0; v < WN / 2; ++v) acc[j][v] = 0.f;

#pragma unroll
  for (int st = 0; st < STAGES - 2; ++st) {
    if (st < tiles) load_tile(t_begin + st, st);
    tc::cp_async_commit();
  }

  const int frag_col = (warp >> 2) * 64 + (warp & 3) * 16 + 2 * gid;
  // One k tile (i counts this slice's tiles): tile i's copies landed, its weights rounded, visible to both
  // proxies; tile i + STAGES - 2 goes to the stage group i - 2 read (every warpgroup waited for it before this
  // barrier); group i is issued from the fragment set f and left in flight, group i - 1 waited for.
  auto step = [&](int i, unsigned (&f)[BK / 8][4]) {
    tc::cp_async_wait<STAGES - 3>();
    round_weights(i % STAGES);
    wg::fence_proxy_async();  // this thread's generic-proxy writes (cp.async, rounding) before wgmma's reads
    __syncthreads();
    const int next = i + STAGES - 2;
    const float* as = smem + (i % STAGES) * STAGE;
    const float* bs = as + A_TILE + tig * LDB + frag_col;
#pragma unroll
    for (int s = 0; s < BK / 8; ++s) {
      const float2 lo = *reinterpret_cast<const float2*>(bs + (8 * s) * LDB);
      const float2 hi = *reinterpret_cast<const float2*>(bs + (8 * s + 4) * LDB);
      f[s][0] = tc::round_tf32(lo.x);
      f[s][1] = tc::round_tf32(lo.y);
      f[s][2] = tc::round_tf32(hi.x);
      f[s][3] = tc::round_tf32(hi.y);
    }
    wg::fence();
#pragma unroll
    for (int s = 0; s < BK / 8; ++s)
#pragma unroll
      for (int j = 0; j < NB; ++j)
        wg::mma<WN>(acc[j], f[s], wg::smem_desc(as + j * (WN / 8) * 256 + 8 * s, 16, 1024, 1));
    wg::commit();
    if (next < tiles) load_tile(t_begin + next, next % STAGES);
    tc::cp_async_commit();
    wg::wait<1>();
  };
  unsigned f0[BK / 8][4], f1[BK / 8][4];
  for (int i = 0; i < tiles; i += 2) {
    step(i, f0);
    if (i + 1 < tiles) step(i + 1, f1);
  }
  wg::wait<0>();
  tc::cp_async_wait<0>();
#pragma unroll
  for (int j = 0; j < NB; ++j)
#pragma unroll
    for (int v = 0; v < WN / 2; ++v) wg::keep(acc[j][v]);

  // Epilogue. acc[j][4i + p] is channel j WN + 8i + 2 tig + p of pixel frag_col, acc[j][4i + 2 + p] of pixel
  // frag_col + 1; the two pixels may lie in different images.
  const bool add_bias = p.has_bias && (SPLIT == 1 || blockIdx.z == 0);
  int base[2];
  bool col_ok[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int gn = n0 + frag_col + h;
    col_ok[h] = gn < NPQ;
    const int img = col_ok[h] ? gn / PQ : 0;
    base[h] = img * p.K * PQ + (gn - img * PQ);
  }
#pragma unroll
  for (int j = 0; j < NB; ++j)
#pragma unroll
    for (int i = 0; i < WN / 8; ++i)
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const int gm = m0 + j * WN + 8 * i + 2 * tig + q;
        if (gm >= p.K) continue;
        const float b = add_bias ? __ldg(bias + gm) : 0.f;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if (!col_ok[h]) continue;
          const float v = acc[j][4 * i + 2 * h + q] + b;
          if (SPLIT > 1) {
            atomicAdd(y + base[h] + gm * PQ, v);
          } else {
            y[base[h] + gm * PQ] = v;
          }
        }
      }
#elif defined(__CUDA_ARCH__)
  static_assert(WN < 0, "implicit_gemm_wgmma_conv2d needs sm_90a (wgmma): compile with --gpu-architecture=sm_90a");
#endif
}

}  // namespace bagf
