// fp16 / bf16 convolution as an implicit GEMM on tensor cores (mma.sync m16n8k16, fp32 accumulation), for
// NCHW and NHWC (channels_last) tensors.
//
// GEMM view: Y[k][npq] = sum_{kk} W[k][kk] * X[kk][npq] (+ bias[k]) over the reduction index kk of C*R*S.
// Its order follows the memory format, so that the weight row W[k][.] is contiguous in memory and, in NHWC,
// runs of 8 reduction steps are 8 contiguous channels of one input pixel:
//   NCHW (NHWC = 0): kk = (c*R + r)*S + s, the input at x[((img*C + c)*H + ih)*W + iw], the weight KCRS;
//   NHWC (NHWC = 1): kk = (r*S + s)*C + c, the input at x[((img*H + ih)*W + iw)*C + c], the weight KRSC (a
//                    channels_last weight; the host passes one).
// The output is written in the input's format and dtype: NCHW y[(img*K + k)*PQ + pq], NHWC y[npq*K + k].
//
// Products: each 16-bit operand is exact in the tensor core's multiply, the sums are fp32 (the arithmetic of
// cuDNN's fp16/bf16 convolutions); bias is added in fp32 and the result rounded to the output dtype once.
//
// Data path, ST = 2 (every format and shape): every K-step a thread gathers 8 consecutive reduction elements of
// one weight row and of one output pixel's input column into registers (one 16-byte load where they are contiguous
// and aligned: the weight when C*R*S % 8 == 0, the NHWC input when C % 8 == 0; 2-byte loads otherwise, each
// bounds-checked), and stores them into shared memory after the previous tile's products (two buffers), so the
// loads' latency overlaps one K-step's multiply.
// ST = 3 or 4 (NHWC): where both operands are on their 16-byte path (C % 8 == 0, C*R*S % 8 == 0, 16-byte aligned
// pointers; checked per launch), the same 8-element chunks go straight to shared memory by cp.async (16 bytes, .cg;
// a chunk in the padding or past K or C*R*S is a zero-filling copy of 0 source bytes) into a ring of ST stages,
// ST-1 K-steps ahead of the multiply: one commit group per K-step, then wait_group ST-2 and __syncthreads before
// step t's stage is read (step t's copies have landed everywhere, and every warp has finished reading the stage the
// next copies overwrite, step t-1's). A launch that fails the 16-byte check takes ST = 2's path in the same kernel.
// Shared memory holds both operands K-contiguous, As[stage][m][kk] and Bs[stage][n][kk], rows padded by 8
// elements, so ldmatrix reads each 8x8 fragment without bank conflicts.
//
// Template parameters (bagf_torch/kernels/implicit_gemm_h16.py has the validity rules):
//   DT    0: fp16, 1: bf16                  NHWC  0: NCHW tensors, 1: NHWC (channels_last)
//   BM    block tile over output channels    WM    warps along M (warp tile BM/WM, a multiple of 16)
//   BN    block tile over output pixels      WN    warps along N (warp tile BN/WN, a multiple of 8)
//   BK    K-step (a multiple of 16)          ST    shared-memory stages: 2 register double buffer, 3-4 cp.async
//
// Split-K, a run-time choice (gridDim.z = S slices; one cubin serves every S, so the tuner's split knob costs no
// compile): for grids too small to fill the GPU (batch 1, late layers), slice z of an output tile reduces K-steps
// [z*steps/S, (z+1)*steps/S) (an even split: the shares differ by at most one step), writes its fp32 sums into the
// workspace ``ws`` (the host's: S * tiles * BM * BN floats, then one zeroed counter per tile) and counts itself in
// with an atomic; the slice that arrives last adds the S partial sums in slice order 0, 1, ... (the same sum
// whichever slice arrives last: the output does not depend on the schedule), then bias, and rounds once to the
// output dtype. S = 1 ignores ``ws`` (the host passes null).
//
// Safety: every access to x, w, bias and y is bounds-checked against the run-time shape (the split-K workspace
// is sized by the host for the launch's grid: bagf_ext.cpp split_workspace_floats); 16-byte loads and cp.async
// copies only where the pointer and the run are aligned; output pixel indices are 64-bit (a block's n0 + BN may
// pass 2^31 - 1), and the host keeps stride, padding and dilation below 65536 so that the int32 window arithmetic
// cannot overflow. Includes nothing from torch or the CUDA headers (16-bit values travel as unsigned short;
// conversions are PTX), so NVRTC needs no include path beyond csrc/kernels.
#pragma once
#include "conv_params.h"

namespace bagf {
namespace h16 {

template <int DT>
__device__ __forceinline__ float to_f32(unsigned short v) {
  if constexpr (DT == 1) {
    return __uint_as_float(static_cast<unsigned>(v) << 16);  // bf16 is fp32's upper half: exact
  } else {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
    return f;
  }
}

template <int DT>
__device__ __forceinline__ unsigned short from_f32(float f) {
  unsigned short v;
  if constexpr (DT == 1) {
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(v) : "f"(f));
  } else {
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(v) : "f"(f));
  }
  return v;
}

// D += A(16x16, row) * B(16x8, col), 16-bit inputs, fp32 accumulators.
template <int DT>
__device__ __forceinline__ void mma_16x8x16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  if constexpr (DT == 1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const unsigned short* p) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

__device__ __forceinline__ void ldmatrix_x2(unsigned (&r)[2], const unsigned short* p) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(a));
}

// Asynchronous 16-byte global -> shared copy (sm_80+), L2 only (.cg: the tiles are read once per block).
// src_bytes == 0 reads nothing and writes 16 zero bytes: padding, tails and rows past K become zeros without a
// branch around the copy (src is then any valid address: the tensor's base).
__device__ __forceinline__ void cp_async16(unsigned short* dst, const unsigned short* src, int src_bytes) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(src_bytes) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Wait until at most N of this thread's most recent commit groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// Split-K's even split: slice z of `split` reduces K-steps [slice_begin(z), slice_begin(z + 1)), i.e.
// [floor(z*num_k/split), floor((z+1)*num_k/split)), so the shares differ by at most one step and the slices cover
// every step once, in order. The product is 64-bit (z <= 65535, the host's limit on split, times num_k < 2^31).
// (A 32-bit form, z*q + z*r/split, made ptxas give the default tile 214 registers instead of 166 on nvcc 13.0.)
// tests/test_nvcc.py runs it on the host against the Python rule.
__host__ __device__ __forceinline__ int slice_begin(long long z, int num_k, int split) {
  return static_cast<int>(z * num_k / split);
}

// Eight 16-bit values packed as one 16-byte register group.
struct Chunk {
  unsigned v[4];
};

__device__ __forceinline__ void set_half(Chunk& c, int i, unsigned short h) {
  const int word = i >> 1;
  if (i & 1) {
    c.v[word] = (c.v[word] & 0x0000ffffu) | (static_cast<unsigned>(h) << 16);
  } else {
    c.v[word] = (c.v[word] & 0xffff0000u) | h;
  }
}

}  // namespace h16

template <int DT, int NHWC, int BM, int BN, int BK, int WM, int WN, int ST>
__global__ void __launch_bounds__(32 * WM * WN)
implicit_gemm_h16_conv2d(const unsigned short* __restrict__ x, const unsigned short* __restrict__ w,
                         const unsigned short* __restrict__ bias, unsigned short* __restrict__ y,
                         const Conv2dParams p, float* __restrict__ ws) {
  constexpr int T = 32 * WM * WN;
  constexpr int WTM = BM / WM;
  constexpr int WTN = BN / WN;
  constexpr int MI = WTM / 16;
  constexpr int NI = WTN / 8;
  constexpr int LDK = BK + 8;  // row pitch in elements: 16 bytes of padding, ldmatrix without bank conflicts
  constexpr int KC = BK / 8;   // 8-element chunks per row and K-step
  constexpr int A_CHUNKS = BM * KC;
  constexpr int B_CHUNKS = BN * KC;
  constexpr int A_LOADS = (A_CHUNKS + T - 1) / T;
  constexpr int B_LOADS = (B_CHUNKS + T - 1) / T;
  static_assert(DT == 0 || DT == 1, "DT: 0 fp16, 1 bf16");
  static_assert(WTM % 16 == 0 && WTN % 8 == 0 && BK % 16 == 0, "warp tile must be whole mma tiles");
  static_assert(ST >= 2 && ST <= 4, "ST: 2 (register double buffer) or a 3-4 stage cp.async pipeline");
  static_assert(ST == 2 || NHWC == 1, "the cp.async pipeline (ST >= 3) is the NHWC input's 16-byte path");

  extern __shared__ __align__(16) unsigned short smem16[];
  unsigned short* As = smem16;                  // [ST][BM][LDK]
  unsigned short* Bs = smem16 + ST * BM * LDK;  // [ST][BN][LDK]

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int wm = warp / WN;
  const int wn = warp - wm * WN;
  const int m0 = blockIdx.y * BM;
  const int n0 = blockIdx.x * BN;

  const int RS = p.R * p.S;
  const int CRS = p.C * RS;
  const int PQ = p.P * p.Q;
  const int NPQ = p.N * PQ;
  const int HW = p.H * p.W;
  const int num_k = (CRS + BK - 1) / BK;
  // this block's share of the K-steps (split-K over gridDim.z slices): slice z takes [z*num_k/S, (z+1)*num_k/S),
  // an even split (shares differ by at most one step; a slice is empty, and adds zeros, only when num_k < S)
  const int split = static_cast<int>(gridDim.z);
  const int t_begin = h16::slice_begin(blockIdx.z, num_k, split);
  const int t_end = h16::slice_begin(static_cast<long long>(blockIdx.z) + 1, num_k, split);
  const bool w_vec = (CRS % 8) == 0 && ((reinterpret_cast<unsigned long long>(w) & 15ull) == 0);
  const bool x_vec = NHWC && (p.C % 8) == 0 && ((reinterpret_cast<unsigned long long>(x) & 15ull) == 0);
  // the cp.async pipeline copies only whole aligned 16-byte runs: both operands on their 16-byte path (checked
  // here at run time, whatever the problem rule promised; otherwise this launch takes the register path, ST = 2's)
  const bool pipelined = ST >= 3 && w_vec && x_vec;

  // B chunks: which output pixel and which 8-element run of the K-step each of this thread's chunks covers.
  // NCHW: neighbouring threads take neighbouring pixels (coalesced along a row of the image); NHWC: neighbouring
  // runs of one pixel's channels. Fixed for the whole reduction: the pixel is decoded once.
  int b_kc[B_LOADS], b_ih0[B_LOADS], b_iw0[B_LOADS], b_img[B_LOADS], b_n[B_LOADS];
  // the reduction digits of each chunk's first element at the current K-step: NCHW (c, r, s), NHWC (r, s, c)
  int d0[B_LOADS], d1[B_LOADS], d2[B_LOADS];
#pragma unroll
  for (int i = 0; i < B_LOADS; ++i) {
    const int e = tid + i * T;
    const int n = NHWC ? e / KC : e % BN;
    const int kc = NHWC ? e % KC : e / BN;
    b_kc[i] = e < B_CHUNKS ? kc : -1;
    b_n[i] = n;
    const long long npq = static_cast<long long>(n0) + n;  // (n0 + BN may pass 2^31 - 1 when N*P*Q is near it)
    b_img[i] = -1;
    b_ih0[i] = b_iw0[i] = 0;
    if (e < B_CHUNKS && npq < NPQ) {
      const int img = static_cast<int>(npq / PQ);
      const int pq = static_cast<int>(npq - static_cast<long long>(img) * PQ);
      const int oh = pq / p.Q;
      const int ow = pq - oh * p.Q;
      b_img[i] = img;
      b_ih0[i] = oh * p.stride_h - p.pad_h;
      b_iw0[i] = ow * p.stride_w - p.pad_w;
    }
    const int kk = t_begin * BK + kc * 8;  // the chunk's first reduction index at the slice's first K-step
    if (NHWC) {
      const int rs = kk / p.C;
      d2[i] = kk - rs * p.C;
      d0[i] = rs / p.S;
      d1[i] = rs - d0[i] * p.S;
    } else {
      d0[i] = kk / RS;
      const int rs = kk - d0[i] * RS;
      d1[i] = rs / p.S;
      d2[i] = rs - d1[i] * p.S;
    }
  }
  // one K-step (BK elements) in reduction digits, for the carries
  int s_hi, s_mid, s_lo;
  if (NHWC) {
    const int rs = BK / p.C;
    s_lo = BK - rs * p.C;
    s_hi = rs / p.S;
    s_mid = rs - s_hi * p.S;
  } else {
    s_hi = BK / RS;
    const int rs = BK - s_hi * RS;
    s_mid = rs / p.S;
    s_lo = rs - s_mid * p.S;
  }
  const int mid_n = NHWC ? p.S : p.R;  // radix of the middle digit
  const int lo_n = NHWC ? p.C : p.S;   // radix of the lowest

  h16::Chunk a_reg[A_LOADS], b_reg[B_LOADS];

  // Gather K-step t into registers.
  auto load_regs = [&](int t) {
    const int k0 = t * BK;
#pragma unroll
    for (int i = 0; i < A_LOADS; ++i) {
      const int e = tid + i * T;
      const int am = e / KC;
      const int gk = k0 + (e - am * KC) * 8;
      const int gm = m0 + am;
      h16::Chunk c = {{0u, 0u, 0u, 0u}};
      if (e < A_CHUNKS && gm < p.K) {
        const unsigned short* src = w + static_cast<long long>(gm) * CRS + gk;
        if (w_vec) {
          if (gk < CRS) {
            const uint4 v = __ldg(reinterpret_cast<const uint4*>(src));
            c.v[0] = v.x; c.v[1] = v.y; c.v[2] = v.z; c.v[3] = v.w;
          }
        } else {
#pragma unroll
          for (int v = 0; v < 8; ++v)
            if (gk + v < CRS) h16::set_half(c, v, __ldg(src + v));
        }
      }
      a_reg[i] = c;
    }
#pragma unroll
    for (int i = 0; i < B_LOADS; ++i) {
      h16::Chunk c = {{0u, 0u, 0u, 0u}};
      const int kk0 = k0 + b_kc[i] * 8;
      if (b_kc[i] >= 0 && b_img[i] >= 0 && kk0 < CRS) {
        if (NHWC) {
          int r = d0[i], s = d1[i], ch = d2[i];
          if (x_vec) {  // 8 channels of one pixel, contiguous (ch % 8 == 0)
            const int ih = b_ih0[i] + r * p.dil_h;
            const int iw = b_iw0[i] + s * p.dil_w;
            if (ih >= 0 && ih < p.H && iw >= 0 && iw < p.W) {
              const uint4 v = __ldg(reinterpret_cast<const uint4*>(
                  x + ((static_cast<long long>(b_img[i]) * p.H + ih) * p.W + iw) * p.C + ch));
              c.v[0] = v.x; c.v[1] = v.y; c.v[2] = v.z; c.v[3] = v.w;
            }
          } else {
#pragma unroll
            for (int v = 0; v < 8; ++v) {
              const int ih = b_ih0[i] + r * p.dil_h;
              const int iw = b_iw0[i] + s * p.dil_w;
              if (kk0 + v < CRS && ih >= 0 && ih < p.H && iw >= 0 && iw < p.W)
                h16::set_half(c, v, __ldg(x + ((static_cast<long long>(b_img[i]) * p.H + ih) * p.W + iw) * p.C + ch));
              if (++ch == p.C) { ch = 0; if (++s == p.S) { s = 0; ++r; } }
            }
          }
        } else {
          int ch = d0[i], r = d1[i], s = d2[i];
          const unsigned short* img = x + static_cast<long long>(b_img[i]) * p.C * HW;
#pragma unroll
          for (int v = 0; v < 8; ++v) {
            const int ih = b_ih0[i] + r * p.dil_h;
            const int iw = b_iw0[i] + s * p.dil_w;
            if (kk0 + v < CRS && ih >= 0 && ih < p.H && iw >= 0 && iw < p.W)
              h16::set_half(c, v, __ldg(img + static_cast<long long>(ch) * HW + ih * p.W + iw));
            if (++s == p.S) { s = 0; if (++r == p.R) { r = 0; ++ch; } }
          }
        }
      }
      b_reg[i] = c;
      // advance this chunk's digits by one K-step, each with at most one carry
      d2[i] += s_lo;
      d1[i] += s_mid;
      d0[i] += s_hi;
      if (d2[i] >= lo_n) { d2[i] -= lo_n; ++d1[i]; }
      if (d1[i] >= mid_n) { d1[i] -= mid_n; ++d0[i]; }
    }
  };

  auto store_smem = [&](int buf) {
    unsigned short* as = As + buf * BM * LDK;
    unsigned short* bs = Bs + buf * BN * LDK;
#pragma unroll
    for (int i = 0; i < A_LOADS; ++i) {
      const int e = tid + i * T;
      if (e < A_CHUNKS) {
        const int am = e / KC;
        *reinterpret_cast<uint4*>(as + am * LDK + (e - am * KC) * 8) =
            make_uint4(a_reg[i].v[0], a_reg[i].v[1], a_reg[i].v[2], a_reg[i].v[3]);
      }
    }
#pragma unroll
    for (int i = 0; i < B_LOADS; ++i) {
      if (b_kc[i] >= 0)
        *reinterpret_cast<uint4*>(bs + b_n[i] * LDK + b_kc[i] * 8) =
            make_uint4(b_reg[i].v[0], b_reg[i].v[1], b_reg[i].v[2], b_reg[i].v[3]);
    }
  };

  float acc[MI][NI][4];
#pragma unroll
  for (int i = 0; i < MI; ++i)
#pragma unroll
    for (int j = 0; j < NI; ++j)
#pragma unroll
      for (int v = 0; v < 4; ++v) acc[i][j][v] = 0.f;

  auto multiply = [&](int buf) {
    const unsigned short* as = As + buf * BM * LDK + (wm * WTM + (lane & 15)) * LDK + (lane >> 4) * 8;
    const unsigned short* bs = Bs + buf * BN * LDK + (wn * WTN + (lane & 7)) * LDK + ((lane >> 3) & 1) * 8;
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
      unsigned af[MI][4], bf[NI][2];
#pragma unroll
      for (int i = 0; i < MI; ++i) h16::ldmatrix_x4(af[i], as + i * 16 * LDK + kk);
#pragma unroll
      for (int j = 0; j < NI; ++j) h16::ldmatrix_x2(bf[j], bs + j * 8 * LDK + kk);
#pragma unroll
      for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < NI; ++j) h16::mma_16x8x16<DT>(acc[i][j], af[i], bf[j]);
    }
  };

  // ST = 2, and any launch whose operands are not both on the 16-byte path: gather step t + 1 into registers
  // while step t is multiplied, then store it into the other of two buffers.
  auto register_double_buffer = [&]() {
    if (t_begin < t_end) {
      load_regs(t_begin);
      store_smem(0);
      __syncthreads();
    }
    for (int t = t_begin; t < t_end; ++t) {
      const bool more = t + 1 < t_end;
      const int buf = (t - t_begin) & 1;
      if (more) load_regs(t + 1);
      multiply(buf);
      if (more) store_smem(buf ^ 1);
      __syncthreads();
    }
  };

  if constexpr (ST >= 3) {
    if (pipelined) {
      // Copy K-step t straight into stage `stage` of the ring: one 16-byte cp.async per chunk, zero-filled
      // (src_bytes 0) where the chunk is past K, past C*R*S, or in the padding; the input digits advance one
      // K-step per call, so steps are issued in order.
      auto load_async = [&](int t, int stage) {
        const int k0 = t * BK;
        unsigned short* as = As + stage * BM * LDK;
        unsigned short* bs = Bs + stage * BN * LDK;
#pragma unroll
        for (int i = 0; i < A_LOADS; ++i) {
          const int e = tid + i * T;
          if (e < A_CHUNKS) {  // (a thread past the tile's chunks has no slot: not a bounds check)
            const int am = e / KC;
            const int kc = e - am * KC;
            const int gm = m0 + am;
            const int gk = k0 + kc * 8;
            const bool ok = gm < p.K && gk < CRS;  // CRS % 8 == 0: a chunk is all in or all out
            h16::cp_async16(as + am * LDK + kc * 8, ok ? w + static_cast<long long>(gm) * CRS + gk : w, ok ? 16 : 0);
          }
        }
#pragma unroll
        for (int i = 0; i < B_LOADS; ++i) {
          if (b_kc[i] >= 0) {
            // (r, s, c) = (d0, d1, d2); C % 8 == 0 and c % 8 == 0: the 8 channels of one pixel, contiguous
            const int ih = b_ih0[i] + d0[i] * p.dil_h;
            const int iw = b_iw0[i] + d1[i] * p.dil_w;
            const bool ok = b_img[i] >= 0 && k0 + b_kc[i] * 8 < CRS && ih >= 0 && ih < p.H && iw >= 0 && iw < p.W;
            h16::cp_async16(bs + b_n[i] * LDK + b_kc[i] * 8,
                            ok ? x + ((static_cast<long long>(b_img[i]) * p.H + ih) * p.W + iw) * p.C + d2[i] : x,
                            ok ? 16 : 0);
          }
          d2[i] += s_lo;
          d1[i] += s_mid;
          d0[i] += s_hi;
          if (d2[i] >= lo_n) { d2[i] -= lo_n; ++d1[i]; }
          if (d1[i] >= mid_n) { d1[i] -= mid_n; ++d0[i]; }
        }
      };
      // ST-1 K-steps in flight while one is multiplied; one commit group per step slot, empty past the slice's
      // end, so that "at most ST-2 groups pending" always means "step t has landed".
#pragma unroll
      for (int s = 0; s < ST - 1; ++s) {
        if (t_begin + s < t_end) load_async(t_begin + s, s);
        h16::cp_async_commit();
      }
      int read = 0, write = ST - 1;  // the stages of step t and of step t + ST - 1 (= step t - 1's)
      for (int t = t_begin; t < t_end; ++t) {
        h16::cp_async_wait<ST - 2>();  // this thread's copies of step t have landed
        // every thread's have (step t's stage is whole), and every warp has finished its ldmatrix of step
        // t - 1, whose stage the copies issued next overwrite
        __syncthreads();
        if (t + ST - 1 < t_end) load_async(t + ST - 1, write);
        h16::cp_async_commit();
        multiply(read);
        read = read == ST - 1 ? 0 : read + 1;
        write = write == ST - 1 ? 0 : write + 1;
      }
      h16::cp_async_wait<0>();  // (only empty groups remain: nothing in flight past the loop)
    } else {
      register_double_buffer();
    }
  } else {
    register_double_buffer();
  }

  if (split > 1) {
    // Each slice's sums go to its own BM*BN floats of the workspace, element f of thread tid at f*T + tid
    // (coalesced); the last slice of the tile to arrive reads them all back in slice order.
    static_assert(T * MI * NI * 4 == BM * BN, "a thread's accumulators are BM * BN / T floats");
    const long long tiles = static_cast<long long>(gridDim.x) * gridDim.y;
    const long long tile = static_cast<long long>(blockIdx.y) * gridDim.x + blockIdx.x;
    float* mine = ws + (static_cast<long long>(blockIdx.z) * tiles + tile) * (BM * BN) + tid;
    unsigned* counter = reinterpret_cast<unsigned*>(ws + split * tiles * (BM * BN)) + tile;
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
      for (int j = 0; j < NI; ++j)
#pragma unroll
        for (int v = 0; v < 4; ++v) __stcg(mine + ((i * NI + j) * 4 + v) * T, acc[i][j][v]);
    __threadfence();  // this block's sums are visible device-wide before it is counted
    __syncthreads();
    __shared__ unsigned arrived;
    if (tid == 0) arrived = atomicAdd(counter, 1u);
    __syncthreads();
    if (arrived != static_cast<unsigned>(split - 1)) return;  // (uniform across the block) another slice finishes
    __threadfence();  // the other slices' sums, counted before us, are visible to every thread of this block
    // slice by slice (its own sums read back too), each slice's loads all issued before they are added: one
    // L2 round trip per slice rather than one per element and slice
    const float* all = ws + tile * (BM * BN) + tid;
    for (int z = 0; z < split; ++z) {
      const float* part = all + z * tiles * (BM * BN);
#pragma unroll
      for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < NI; ++j)
#pragma unroll
          for (int v = 0; v < 4; ++v) {
            const float got = __ldcg(part + ((i * NI + j) * 4 + v) * T);
            acc[i][j][v] = z == 0 ? got : acc[i][j][v] + got;
          }
    }
  }

  // Epilogue. Accumulator v of tile (i, j): row gid (+8 for v >= 2), column 2*tig + (v & 1).
  const int gid = lane >> 2;
  const int tig = lane & 3;
#pragma unroll
  for (int j = 0; j < NI; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const long long gn = static_cast<long long>(n0) + wn * WTN + j * 8 + 2 * tig + h;
      if (gn >= NPQ) continue;
      const int img = static_cast<int>(gn / PQ);
      const long long base =
          NHWC ? gn * p.K : static_cast<long long>(img) * p.K * PQ + (gn - static_cast<long long>(img) * PQ);
      const int m_step = NHWC ? 1 : PQ;
#pragma unroll
      for (int i = 0; i < MI; ++i) {
#pragma unroll
        for (int hi = 0; hi < 2; ++hi) {
          const int gm = m0 + wm * WTM + i * 16 + gid + 8 * hi;
          if (gm < p.K) {
            float v = acc[i][j][2 * hi + h];
            if (p.has_bias) v += h16::to_f32<DT>(__ldg(bias + gm));
            y[base + static_cast<long long>(gm) * m_step] = h16::from_f32<DT>(v);
          }
        }
      }
    }
  }
}

}  // namespace bagf
