// Batched fp32 GEMM on tensor cores with fp32 accuracy ("3xTF32"), for the non-fused Winograd plans' products:
//
//   C[z] = A[z] B[z]     A: M x K row-major (ld K), B: K x N row-major (ld N), C: M x N row-major (ld N),
//                        z = blockIdx.z, batch strides in elements
//
// winograd_gemm's M[e] = U[e] V[e] is this with M = output channels, K = input channels, N = tiles. cuBLAS runs
// it on the FFMA pipe (SIMT SGEMM, 35-41 TFLOP/s on AlexNet's conv3-5 shapes, benchmarks/results/
// cublas_emulation_h200.md; its BF16x9 emulation falls back to that on sm_90). mma.sync's TF32 rate on the H200
// is 312 TFLOP/s (benchmarks/results/mma_rate_h200.json), so three TF32 products per fp32 product have a ceiling
// of ~100 TFLOP/s of fp32 work.
//
// Precision: as implicit_gemm_tc.cuh -- each operand split into a TF32 big part and the remainder (small),
// a_small*b_big + a_big*b_small + a_big*b_big accumulated in fp32 (the dropped small*small is ~2^-22 relative).
//
// Measured (benchmarks/results/gemm_tf32x3_probe_h200.md): the best of twelve tiles runs 42-58 TFLOP/s,
// 1.32-1.53x cuBLAS, on those products. ncu on conv4's product at N = 128: tensor pipe 51% busy, issue slots
// 32-40%, no eligible warp 57-65% of cycles, 2 warps per scheduler (shared memory or registers); more resident
// warps (fewer stages, __launch_bounds__ minimum blocks), hoisted copy addressing and a cheaper split each moved
// it by 0-5%. What is done to keep the tensor pipe busy (the implicit-GEMM tc kernel issues ~3 non-MMA
// instructions per MMA and reaches a third of that ceiling):
//  * The mma's k slots are mapped to physical k so that a thread's A values are adjacent pairs: step s, slot t
//    <-> k = 8s + 2t, slot t+4 <-> k = 8s + 2t + 1. One 8-byte shared load gives a0/a2 (a1/a3), and A's row
//    pitch BK + 8 makes a half-warp's 8-byte loads hit 32 different banks.
//  * The n index inside a warp tile is permuted: mma tile j, column g <-> n = g * NI + j. A thread's B values
//    for its NI tiles are then NI adjacent floats (one 16-byte load for NI = 4), and its outputs for column
//    pair (2t, 2t+1) are 2 NI adjacent floats of a row of C (16-byte stores). B's pitch BN + 4 keeps a
//    quarter-warp's 16-byte loads conflict-free.
//  * Copies are cp.async 16-byte in a STAGES-deep pipeline when K and N are multiples of 4 (and the pointers
//    16-byte aligned); otherwise 4-byte copies with the same zero-fill at the edges.
//
// Template parameters: BM x BN block tile, BK K-step (multiple of 8), WM x WN warps (warp tile BM/WM x BN/WN,
// BN/WN = 16 or 32, i.e. NI = 2 or 4), STAGES >= 2, MINB blocks per SM asked of the register allocator
// (__launch_bounds__'s second argument: more resident warps to hide latency, at the risk of spills). Shared memory (dynamic): STAGES * (BM (BK+8) + BK (BN+4))
// floats. Bounds: every row, column and k is checked; M, N, K any positive sizes with M*K, K*N, M*N < 2^31 per
// batch entry (the batch offsets are 64-bit). Includes nothing from torch.
#pragma once
#include "implicit_gemm_tc.cuh"

// Order of the three products per k step (an A/B switch for benchmarks/probes/gemm_tf32x3_probe.py --define).
// 0: each tile's three back to back; 1: three passes over the tiles, so that no product waits for the one
// issued just before it.
#ifndef BAGF_GEMM_ORDER
#define BAGF_GEMM_ORDER 1
#endif

namespace bagf {
namespace gemm {

// D += A B on the tensor cores, TF32 in, fp32 accumulate. Not volatile (unlike tc::mma_16x8x8): it has no side
// effect besides its outputs, so the compiler may interleave independent products with the loads and splits.
__device__ __forceinline__ void mma(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

}  // namespace gemm

template <int BM, int BN, int BK, int WM, int WN, int STAGES, int MINB>
__global__ void __launch_bounds__(32 * WM * WN, MINB)
    gemm_tf32x3(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ c, int M, int N,
                int K, long long stride_a, long long stride_b, long long stride_c) {
  constexpr int T = 32 * WM * WN;
  constexpr int WTM = BM / WM;
  constexpr int WTN = BN / WN;
  constexpr int MI = WTM / 16;
  constexpr int NI = WTN / 8;
  constexpr int LDA = BK + 8;
  constexpr int LDB = BN + 4;
  constexpr int A_STAGE = BM * LDA;
  constexpr int B_STAGE = BK * LDB;
  static_assert(WTM % 16 == 0 && (NI == 2 || NI == 4) && BK % 8 == 0, "warp tile must be whole mma tiles");
  static_assert(BN % 4 == 0 && STAGES >= 2, "16-byte copies of B rows; the pipeline needs two stages");

  extern __shared__ __align__(16) float smem[];
  float* As = smem;                     // [STAGES][BM][LDA]
  float* Bs = smem + STAGES * A_STAGE;  // [STAGES][BK][LDB]

  const long long z = blockIdx.z;
  a += z * stride_a;
  b += z * stride_b;
  c += z * stride_c;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int wm = warp / WN;
  const int wn = warp - wm * WN;
  const int gid = lane >> 2;
  const int tig = lane & 3;
  const int m0 = blockIdx.y * BM;
  const int n0 = blockIdx.x * BN;
  const bool vec = (K % 4) == 0 && (N % 4) == 0 &&
                   ((reinterpret_cast<unsigned long long>(a) | reinterpret_cast<unsigned long long>(b) |
                     reinterpret_cast<unsigned long long>(c)) & 15ull) == 0;
  const int num_k = (K + BK - 1) / BK;

  // Copy plan, fixed per thread for the whole reduction: its chunks' offsets (32-bit: M*K and K*N < 2^31) and
  // whether their row (A) or column (B) is in range; per K-tile only the k offset and the k bound change.
  constexpr int AV = BM * BK / 4;  // 4-float chunks per tile (vector path)
  constexpr int BV = BK * BN / 4;
  constexpr int AL = (AV + T - 1) / T;
  constexpr int BL = (BV + T - 1) / T;
  int a_off[AL], a_kq[AL], b_off[BL], b_kr[BL];
  unsigned a_ok = 0, b_ok = 0;
#pragma unroll
  for (int i = 0; i < AL; ++i) {
    const int e = tid + i * T;
    const int r = e / (BK / 4);
    const int q = (e - r * (BK / 4)) * 4;
    a_off[i] = (m0 + r) * K + q;
    a_kq[i] = q;
    if ((AV % T == 0 || e < AV) && m0 + r < M) a_ok |= 1u << i;
  }
#pragma unroll
  for (int i = 0; i < BL; ++i) {
    const int e = tid + i * T;
    const int r = e / (BN / 4);
    const int q = (e - r * (BN / 4)) * 4;
    b_off[i] = r * N + n0 + q;
    b_kr[i] = r;
    if ((BV % T == 0 || e < BV) && n0 + q < N) b_ok |= 1u << i;
  }

  auto load_tile = [&](int kt, int st) {
    const int k0 = kt * BK;
    float* as = As + st * A_STAGE;
    float* bs = Bs + st * B_STAGE;
    if (vec) {  // whole 4-float chunks: K % 4 == 0 and N % 4 == 0, so a chunk is all in range or all out
#pragma unroll
      for (int i = 0; i < AL; ++i) {
        const int e = tid + i * T;
        if (AV % T == 0 || e < AV) {
          const int r = e / (BK / 4);
          const bool ok = ((a_ok >> i) & 1u) && k0 + a_kq[i] < K;
          tc::cp_async16(as + r * LDA + a_kq[i], ok ? a + a_off[i] + k0 : a, ok ? 16 : 0);
        }
      }
      const long long kn = static_cast<long long>(k0) * N;
#pragma unroll
      for (int i = 0; i < BL; ++i) {
        const int e = tid + i * T;
        if (BV % T == 0 || e < BV) {
          const int q = (e - b_kr[i] * (BN / 4)) * 4;
          const bool ok = ((b_ok >> i) & 1u) && k0 + b_kr[i] < K;
          tc::cp_async16(bs + b_kr[i] * LDB + q, ok ? b + kn + b_off[i] : b, ok ? 16 : 0);
        }
      }
    } else {
      for (int e = tid; e < BM * BK; e += T) {
        const int r = e / BK;
        const int q = e - r * BK;
        const bool ok = m0 + r < M && k0 + q < K;
        tc::cp_async4(as + r * LDA + q, ok ? a + static_cast<long long>(m0 + r) * K + k0 + q : a, ok ? 4 : 0);
      }
      for (int e = tid; e < BK * BN; e += T) {
        const int r = e / BN;
        const int q = e - r * BN;
        const bool ok = k0 + r < K && n0 + q < N;
        tc::cp_async4(bs + r * LDB + q, ok ? b + static_cast<long long>(k0 + r) * N + n0 + q : b, ok ? 4 : 0);
      }
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
    const float* as = As + st * A_STAGE + (wm * WTM + gid) * LDA + 2 * tig;
    const float* bs = Bs + st * B_STAGE + 2 * tig * LDB + wn * WTN + gid * NI;
#pragma unroll
    for (int s = 0; s < BK / 8; ++s) {
      unsigned a_big[MI][4], a_small[MI][4], b_big[NI][2], b_small[NI][2];
#pragma unroll
      for (int i = 0; i < MI; ++i) {
        const float2 lo = *reinterpret_cast<const float2*>(as + i * 16 * LDA + s * 8);
        const float2 hi = *reinterpret_cast<const float2*>(as + (i * 16 + 8) * LDA + s * 8);
        tc::split_tf32(lo.x, a_big[i][0], a_small[i][0]);
        tc::split_tf32(hi.x, a_big[i][1], a_small[i][1]);
        tc::split_tf32(lo.y, a_big[i][2], a_small[i][2]);
        tc::split_tf32(hi.y, a_big[i][3], a_small[i][3]);
      }
      float r0[NI], r1[NI];
      if constexpr (NI == 4) {
        const float4 x0 = *reinterpret_cast<const float4*>(bs + s * 8 * LDB);
        const float4 x1 = *reinterpret_cast<const float4*>(bs + (s * 8 + 1) * LDB);
        r0[0] = x0.x; r0[1] = x0.y; r0[2] = x0.z; r0[3] = x0.w;
        r1[0] = x1.x; r1[1] = x1.y; r1[2] = x1.z; r1[3] = x1.w;
      } else {
        const float2 x0 = *reinterpret_cast<const float2*>(bs + s * 8 * LDB);
        const float2 x1 = *reinterpret_cast<const float2*>(bs + (s * 8 + 1) * LDB);
        r0[0] = x0.x; r0[1] = x0.y;
        r1[0] = x1.x; r1[1] = x1.y;
      }
#pragma unroll
      for (int j = 0; j < NI; ++j) {
        tc::split_tf32(r0[j], b_big[j][0], b_small[j][0]);
        tc::split_tf32(r1[j], b_big[j][1], b_small[j][1]);
      }
      if constexpr (BAGF_GEMM_ORDER == 0) {  // each tile's three products back to back (a dependent chain)
#pragma unroll
        for (int i = 0; i < MI; ++i)
#pragma unroll
          for (int j = 0; j < NI; ++j) {
            gemm::mma(acc[i][j], a_small[i], b_big[j]);
            gemm::mma(acc[i][j], a_big[i], b_small[j]);
            gemm::mma(acc[i][j], a_big[i], b_big[j]);
          }
      } else {  // three passes over the MI x NI tiles: consecutive products go to different accumulators
#pragma unroll
        for (int i = 0; i < MI; ++i)
#pragma unroll
          for (int j = 0; j < NI; ++j) gemm::mma(acc[i][j], a_small[i], b_big[j]);
#pragma unroll
        for (int i = 0; i < MI; ++i)
#pragma unroll
          for (int j = 0; j < NI; ++j) gemm::mma(acc[i][j], a_big[i], b_small[j]);
#pragma unroll
        for (int i = 0; i < MI; ++i)
#pragma unroll
          for (int j = 0; j < NI; ++j) gemm::mma(acc[i][j], a_big[i], b_big[j]);
      }
    }
  };

#pragma unroll
  for (int st = 0; st < STAGES - 1; ++st) {
    if (st < num_k) load_tile(st, st);
    tc::cp_async_commit();
  }
  for (int kt = 0; kt < num_k; ++kt) {
    tc::cp_async_wait<STAGES - 2>();
    __syncthreads();  // tile kt is visible to all; everyone is done with the stage the next copy overwrites
    const int next = kt + STAGES - 1;
    if (next < num_k) load_tile(next, next % STAGES);
    tc::cp_async_commit();
    multiply(kt % STAGES);
  }
  tc::cp_async_wait<0>();

  // Epilogue: accumulator v of tile (i, j) is row gid (+8 for v >= 2), column pair 2*tig + (v & 1) of the
  // tile, which is n = (2*tig + (v & 1)) * NI + j of the warp tile: per row and h, NI adjacent floats.
#pragma unroll
  for (int i = 0; i < MI; ++i)
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      const int row = m0 + wm * WTM + i * 16 + gid + 8 * hi;
      if (row >= M) continue;
      float* dst = c + static_cast<long long>(row) * N;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int col = n0 + wn * WTN + (2 * tig + h) * NI;
        if (vec && col < N) {  // N % 4 == 0 and col % NI == 0: the NI floats are all in range, aligned
          if constexpr (NI == 4) {
            *reinterpret_cast<float4*>(dst + col) =
                make_float4(acc[i][0][2 * hi + h], acc[i][1][2 * hi + h], acc[i][2][2 * hi + h], acc[i][3][2 * hi + h]);
          } else {
            *reinterpret_cast<float2*>(dst + col) = make_float2(acc[i][0][2 * hi + h], acc[i][1][2 * hi + h]);
          }
        } else {
#pragma unroll
          for (int j = 0; j < NI; ++j)
            if (col + j < N) dst[col + j] = acc[i][j][2 * hi + h];
        }
      }
    }
}

}  // namespace bagf
