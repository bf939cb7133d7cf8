// fp32 Winograd F(MT x MT, 3 x 3) convolution, fused in one kernel, with the Winograd-domain products on tensor
// cores at fp32 accuracy ("3xTF32", as implicit_gemm_tc.cuh explains). NCHW input, KCRS weights, NKPQ output;
// stride 1, dilation 1, 3x3 filters, any padding (the host refuses other problems: ATen answers them).
//
// Same dataflow as winograd.cuh (and the same channel loop and output stage, wino::channel_loop and
// wino::output_round): a block owns BT output tiles and BK output channels and streams the input channels
// through shared memory BC at a time, transforming input patches and filters there; only the E = (MT+2)^2
// independent BK x BT x BC products differ. Here each warp owns E/WE of the points and a (BK/WK) x (BT/WT) tile
// of each, and computes it with mma.sync m16n8k8 (rows: output channels, columns: tiles, reduction: channels),
// three TF32 products per fragment pair (big*small, small*big, big*big) accumulated in fp32.
//
// Template parameters are the tuning knobs (bagf_torch/kernels/winograd_tc.py holds their validity rules):
//   MT  output tile (2 or 4)       BK  output channels per block   BT  output tiles per block
//   BC  input channels per chunk (a multiple of the mma's 8)
//   WK, WT  warps along output channels and tiles (warp tile (BK/WK) x (BT/WT), whole 16 x 8 mma tiles)
//   WE  warp groups over the E points (each warp: E/WE points)
//   DB  1: prefetch the next chunk's raw patches and weights into registers (wino::channel_loop)
//   SPLIT  input-channel slices (grid.z), added atomically into the output the host zeroed
// winograd_tf32_conv2d is the same kernel with one TF32 product per fragment pair, for TF32 mode (F(2x2) only).
//
// Shared memory rows are padded to BK+8 and BT+8 words (= 8 or 24 mod 32) so that a fragment load (lanes:
// 8 rows x 4 reduction steps) touches 32 different banks.
#pragma once
#include "implicit_gemm_tc.cuh"
#include "winograd.cuh"

namespace bagf {

namespace wtc {

// The kernel body, for both precisions (implicit_gemm_tc.cuh's PREC): 3, three TF32 products per fragment pair
// (fp32 accuracy, winograd_tc_conv2d); 1, one, each Winograd-domain operand rounded to TF32 (to nearest, ties away
// from zero, as cvt.rna.tf32.f32) and fp32 sums, for fp32 convolutions in TF32 mode (winograd_tf32_conv2d, F(2x2)
// only: bagf_torch/kernels/winograd_tf32.py says why).
template <int MT, int BK, int BT, int BC, int WK, int WT, int WE, int DB, int SPLIT, int PREC>
__device__ __forceinline__ void body(const float* __restrict__ x, const float* __restrict__ w,
                                     const float* __restrict__ bias, float* __restrict__ y, const Conv2dParams& p) {
  static_assert(PREC == 1 || PREC == 3, "one TF32 product (TF32 mode) or three (fp32 accuracy)");
  constexpr int A = MT + 2;
  constexpr int E = A * A;
  constexpr int T = 32 * WK * WT * WE;
  constexpr int WTK = BK / WK;  // warp tile: output channels x tiles
  constexpr int WTT = BT / WT;
  constexpr int MI = WTK / 16;
  constexpr int NI = WTT / 8;
  constexpr int EPW = E / WE;   // Winograd points per warp
  constexpr int ULD = BK + 8;
  constexpr int VLD = BT + 8;
  constexpr int LOOP_FLOATS = E * BC * (ULD + VLD);
  constexpr int ROUNDS = wino::out_rounds(E, BK, BT, WT, LOOP_FLOATS);
  constexpr int BTR = BT / ROUNDS;
  constexpr int OLD = BTR + 1;
  static_assert(MT == 2 || MT == 4, "F(2x2,3x3) and F(4x4,3x3) only");
  static_assert(WTK % 16 == 0 && WTT % 8 == 0 && BC % 8 == 0, "warp tiles must be whole m16n8k8 tiles");
  static_assert(E % WE == 0, "warp groups must divide the Winograd points");
  static_assert(WT % ROUNDS == 0, "output rounds must split the warp columns evenly");

  extern __shared__ __align__(16) float smem[];
  float* Us = smem;                   // [E][BC][ULD]  transformed filters
  float* Vs = smem + E * BC * ULD;    // [E][BC][VLD]  transformed input tiles
  float* Ms = smem;                   // [E][BK][OLD]  accumulators, output stage (reuses the loop's buffers)

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int wk = warp % WK;
  const int wt = (warp / WK) % WT;
  const int we = warp / (WK * WT);
  const int gid = lane >> 2;
  const int tig = lane & 3;
  const int t0 = blockIdx.x * BT;
  const int k0 = blockIdx.y * BK;
  int cb, ce;
  wino::slice<BC, SPLIT>(p, cb, ce);

  float acc[EPW][MI][NI][4];
#pragma unroll
  for (int j = 0; j < EPW; ++j)
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
      for (int l = 0; l < NI; ++l)
#pragma unroll
        for (int v = 0; v < 4; ++v) acc[j][i][l][v] = 0.f;

  // acc[e][k][t] += sum_c U[e][c][k] * V[e][c][t]: A = U^T (rows k), B = V (columns t), reduction over c.
  wino::channel_loop<MT, BK, BT, BC, ULD, VLD, T, DB>(x, w, p, Us, Vs, t0, k0, cb, ce, [&]() {
#pragma unroll
    for (int j = 0; j < EPW; ++j) {
      const int e = we * EPW + j;
#pragma unroll
      for (int kk = 0; kk < BC; kk += 8) {
        const float* ua = Us + (e * BC + kk + tig) * ULD + wk * WTK + gid;
        const float* vb = Vs + (e * BC + kk + tig) * VLD + wt * WTT + gid;
        if constexpr (PREC == 1) {
          unsigned a_t[MI][4], b_t[NI][2];
#pragma unroll
          for (int i = 0; i < MI; ++i) {
            a_t[i][0] = tc::round_tf32(ua[i * 16]);
            a_t[i][1] = tc::round_tf32(ua[i * 16 + 8]);
            a_t[i][2] = tc::round_tf32(ua[4 * ULD + i * 16]);
            a_t[i][3] = tc::round_tf32(ua[4 * ULD + i * 16 + 8]);
          }
#pragma unroll
          for (int l = 0; l < NI; ++l) {
            b_t[l][0] = tc::round_tf32(vb[l * 8]);
            b_t[l][1] = tc::round_tf32(vb[4 * VLD + l * 8]);
          }
#pragma unroll
          for (int i = 0; i < MI; ++i)
#pragma unroll
            for (int l = 0; l < NI; ++l) tc::mma_16x8x8(acc[j][i][l], a_t[i], b_t[l]);
        } else {
          unsigned a_big[MI][4], a_small[MI][4], b_big[NI][2], b_small[NI][2];
#pragma unroll
          for (int i = 0; i < MI; ++i) {
            tc::split_tf32(ua[i * 16], a_big[i][0], a_small[i][0]);
            tc::split_tf32(ua[i * 16 + 8], a_big[i][1], a_small[i][1]);
            tc::split_tf32(ua[4 * ULD + i * 16], a_big[i][2], a_small[i][2]);
            tc::split_tf32(ua[4 * ULD + i * 16 + 8], a_big[i][3], a_small[i][3]);
          }
#pragma unroll
          for (int l = 0; l < NI; ++l) {
            tc::split_tf32(vb[l * 8], b_big[l][0], b_small[l][0]);
            tc::split_tf32(vb[4 * VLD + l * 8], b_big[l][1], b_small[l][1]);
          }
#pragma unroll
          for (int i = 0; i < MI; ++i)
#pragma unroll
            for (int l = 0; l < NI; ++l) {
              tc::mma_16x8x8(acc[j][i][l], a_small[i], b_big[l]);
              tc::mma_16x8x8(acc[j][i][l], a_big[i], b_small[l]);
              tc::mma_16x8x8(acc[j][i][l], a_big[i], b_big[l]);
            }
        }
      }
    }
  });

  // output stage: accumulators -> shared memory -> Y = A^T M A + bias. Accumulator v of mma tile (i, l):
  // output channel row gid (+8 for v >= 2), tile column 2*tig + (v & 1).
  const bool add_bias = p.has_bias && blockIdx.z == 0;
#pragma unroll 1
  for (int round = 0; round < ROUNDS; ++round) {
    if (wt / (WT / ROUNDS) == round) {
#pragma unroll
      for (int j = 0; j < EPW; ++j)
#pragma unroll
        for (int i = 0; i < MI; ++i)
#pragma unroll
          for (int l = 0; l < NI; ++l)
#pragma unroll
            for (int v = 0; v < 4; ++v) {
              const int k = wk * WTK + i * 16 + gid + 8 * (v >> 1);
              const int t = wt * WTT + l * 8 + 2 * tig + (v & 1) - round * BTR;
              Ms[((we * EPW + j) * BK + k) * OLD + t] = acc[j][i][l][v];
            }
    }
    __syncthreads();
    wino::output_round<MT, BK, BTR, T, SPLIT>(bias, y, p, Ms, t0, k0, round, add_bias);
    __syncthreads();
  }
}

}  // namespace wtc

template <int MT, int BK, int BT, int BC, int WK, int WT, int WE, int DB, int SPLIT>
__global__ void __launch_bounds__(32 * WK * WT * WE)
winograd_tc_conv2d(const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ bias,
                   float* __restrict__ y, const Conv2dParams p) {
  wtc::body<MT, BK, BT, BC, WK, WT, WE, DB, SPLIT, 3>(x, w, bias, y, p);
}

template <int MT, int BK, int BT, int BC, int WK, int WT, int WE, int DB, int SPLIT>
__global__ void __launch_bounds__(32 * WK * WT * WE)
winograd_tf32_conv2d(const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ bias,
                     float* __restrict__ y, const Conv2dParams p) {
  static_assert(MT == 2, "TF32 products keep F(2x2,3x3) within twice a TF32 convolution's error, not F(4x4)");
  wtc::body<MT, BK, BT, BC, WK, WT, WE, DB, SPLIT, 1>(x, w, bias, y, p);
}

}  // namespace bagf
