// fp32 direct convolution with a 2-D output tile per block: NCHW input, KCRS weights, NKPQ output. Any kernel
// size, stride, padding and dilation (groups 1); every global access is bounds-checked.
//
// Dataflow (the near-I/O-optimal direct schedule, docs/iobound.md and docs/architecture.md): a block keeps a
// TH x TW tile of output pixels of one image times BK output channels in registers (x*y*z accumulators) and
// streams the input channels through shared memory BC at a time. For each chunk it copies, once, the input
// patch the tile reads -- (TH-1)*stride+(R-1)*dil+1 rows by (TW-1)*stride+(S-1)*dil+1 columns per channel,
// halo included, padding zero-filled -- and the chunk's BK x BC x R x S weights; every thread then loops over
// (c, r, s) with FFMA on its own TK output channels x PX consecutive pixels of one output row. So per chunk a
// block reads about TH*TW*stride^2 + BK*R*S words per channel for TH*TW*BK*R*S multiply-adds: the tile shape
// is the balance the lower bound asks for (bagf_torch/iobound.py models the traffic).
//
// Template parameters are the tuning knobs (bagf_torch/kernels/direct.py holds their validity rules):
//   TH, TW  output tile (rows x columns of one image)   BK  output channels per block
//   BC      input channels per chunk                    TK  output channels per thread (2, 4, 8: vector reads)
//   PX      consecutive output pixels per thread (of one row; divides TW)
//   DB      1: two shared-memory stages, the next chunk's cp.async copies overlap this chunk's products
//   SPLIT   input-channel slices (grid.z); > 1: slices add atomically into the output the host zeroed
//   KS, KU  0, 0: any filter width and stride (run-time loops over s). > 0: the kernel is specialised to filters
//           KS wide at column stride KU, dilation 1 (the host refuses any other call: ATen answers). Each thread
//           then loads, once per (c, r) filter row, the (PX-1)*KU+KS input words its PX pixels read into
//           registers and runs the KS taps fully unrolled on them: per row TK*PX*KS FMAs for (PX-1)*KU+KS
//           scalar and KS*TK/4 vector shared-memory loads (AlexNet conv1, TK=PX=8: 704 FMAs per 61 loads,
//           where the run-time loop does 64 FMAs per 10 loads and recomputes addresses per tap).
//
// Shared memory depends on the problem (the patch grows with stride, kernel size and dilation), so the host
// sizes it per call from bagf::halo_patch (conv_params.h, one formula for both compilers):
//   STAGES * 4 * BC * (R*S*(BK+4) + rows*pitch) bytes, weights of both stages first (16-byte aligned rows).
// Layout: weights [stage][c*R*S + r*S + s][BK+4] (a thread's TK channels are one vector read; the +4 spreads the
// transposing stores over more banks), input [stage][c][row][pitch] with an odd pitch (stride-u reads of
// different rows start in different banks). Threads take output channels fastest: a warp reads a few pixel
// addresses (broadcast to the lanes that share them) and contiguous weight vectors.
// Needs sm_80+ (cp.async). The kernel includes nothing from torch; NVRTC compiles it at run time.
#pragma once
#include "conv_params.h"

namespace bagf {
namespace dconv {

// Asynchronous 4-byte global -> shared copy; src_bytes == 0 writes a zero and reads nothing (padding, tails).
__device__ __forceinline__ void cp_async4(float* dst, const float* src, int src_bytes) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(d), "l"(src), "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// N consecutive floats from shared memory (the offset is a multiple of N): float4 or float2 loads.
template <int N>
__device__ __forceinline__ void load_vec(const float* p, float (&r)[N]) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      const float4 q = reinterpret_cast<const float4*>(p)[i];
      r[4 * i] = q.x; r[4 * i + 1] = q.y; r[4 * i + 2] = q.z; r[4 * i + 3] = q.w;
    }
  } else if constexpr (N % 2 == 0) {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      const float2 q = reinterpret_cast<const float2*>(p)[i];
      r[2 * i] = q.x; r[2 * i + 1] = q.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) r[i] = p[i];
  }
}

}  // namespace dconv

template <int TH, int TW, int BK, int BC, int TK, int PX, int DB, int SPLIT, int KS = 0, int KU = 0>
__global__ void __launch_bounds__((BK / TK) * (TH * TW / PX))
direct_conv2d(const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ bias,
              float* __restrict__ y, const Conv2dParams p) {
  constexpr int KG = BK / TK;          // threads along output channels
  constexpr int XG = TW / PX;          // threads along an output row
  constexpr int T = KG * TH * XG;
  constexpr int NW = T / 32;
  constexpr int BKP = BK + 4;
  constexpr int STAGES = DB ? 2 : 1;
  static_assert(BK % TK == 0 && TW % PX == 0 && T % 32 == 0, "tiles must divide, whole warps");
  static_assert((KS > 0) == (KU > 0), "a specialised kernel fixes both the filter width and the stride");

  extern __shared__ __align__(16) float smem[];
  const HaloPatch hp = halo_patch(TH, TW, p);
  const int RS = p.R * p.S;
  const int wt_words = BC * RS * BKP;      // one stage of weights
  const int in_words = BC * hp.rows * hp.pitch;  // one stage of input patches
  float* const wt = smem;                       // [STAGES][BC*R*S][BKP]
  float* const in = smem + STAGES * wt_words;   // [STAGES][BC][rows][pitch]

  const int tid = threadIdx.x;
  const int kg = tid % KG;
  const int pg = tid / KG;
  const int py = pg / XG;
  const int px0 = (pg % XG) * PX;
  const int warp = tid / 32;
  const int lane = tid % 32;

  const int TQ = (p.Q + TW - 1) / TW;
  const int TPQ = ((p.P + TH - 1) / TH) * TQ;
  const int n = blockIdx.x / TPQ;
  const int rem = blockIdx.x - n * TPQ;
  const int oh0 = (rem / TQ) * TH;
  const int ow0 = (rem % TQ) * TW;
  const int h0 = oh0 * p.stride_h - p.pad_h;
  const int w0 = ow0 * p.stride_w - p.pad_w;
  const int k0 = blockIdx.y * BK;
  const int CRS = p.C * RS;
  const int chunks = (p.C + BC - 1) / BC;
  const int per = (chunks + SPLIT - 1) / SPLIT;
  const int cb = blockIdx.z * per;
  const int ce = min(chunks, cb + per);
  const float* const x_img = x + static_cast<long long>(n) * p.C * p.H * p.W;

  float acc[TK][PX];
#pragma unroll
  for (int i = 0; i < TK; ++i)
#pragma unroll
    for (int j = 0; j < PX; ++j) acc[i][j] = 0.f;

  // One chunk's patch and weights into stage st: warps take lines, lanes take consecutive columns (coalesced
  // along W for the input, along c*R*S for the weights); out-of-range words are zero-filled copies.
  auto load = [&](int ch, int st) {
    const int c0 = ch * BC;
    float* const ins = in + st * in_words;
    for (int line = warp; line < BC * hp.rows; line += NW) {
      const int c = line / hp.rows;
      const int ih = h0 + (line - c * hp.rows);
      const bool row_ok = c0 + c < p.C && ih >= 0 && ih < p.H;
      const float* const src = x_img + (static_cast<long long>(c0 + c) * p.H + ih) * p.W;
      for (int col = lane; col < hp.cols; col += 32) {
        const int iw = w0 + col;
        const bool ok = row_ok && iw >= 0 && iw < p.W;
        dconv::cp_async4(ins + line * hp.pitch + col, ok ? src + iw : x, ok ? 4 : 0);
      }
    }
    float* const wts = wt + st * wt_words;
    const int avail = min(BC * RS, CRS - c0 * RS);  // the chunk's (c, r, s) taps that exist
    for (int k = warp; k < BK; k += NW) {
      const bool k_ok = k0 + k < p.K;
      const float* const src = w + static_cast<long long>(k0 + k) * CRS + c0 * RS;
      for (int e = lane; e < BC * RS; e += 32) {
        const bool ok = k_ok && e < avail;
        dconv::cp_async4(wts + e * BKP + k, ok ? src + e : w, ok ? 4 : 0);
      }
    }
  };

  // This thread's TK channels x PX pixels over the chunk's (c, r, s).
  auto compute = [&](int ch, int st) {
    const int bc = min(BC, p.C - ch * BC);
    const float* const ins = in + st * in_words + py * p.stride_h * hp.pitch + px0 * (KU > 0 ? KU : p.stride_w);
    const float* const wts = wt + st * wt_words + kg * TK;
    if constexpr (KS > 0) {  // p.S == KS, p.stride_w == KU, p.dil_w == 1 (the host checked)
      constexpr int WIN = (PX - 1) * KU + KS;  // input words of one filter row under this thread's PX pixels
#pragma unroll 1
      for (int c = 0; c < bc; ++c) {
#pragma unroll 1
        for (int r = 0; r < p.R; ++r) {
          const float* xr = ins + (c * hp.rows + r * p.dil_h) * hp.pitch;
          const float* wr = wts + (c * RS + r * KS) * BKP;
          float a[WIN];
#pragma unroll
          for (int t = 0; t < WIN; ++t) a[t] = xr[t];
#pragma unroll
          for (int s = 0; s < KS; ++s) {
            float b[TK];
            dconv::load_vec<TK>(wr + s * BKP, b);
#pragma unroll
            for (int i = 0; i < TK; ++i)
#pragma unroll
              for (int j = 0; j < PX; ++j) acc[i][j] = fmaf(b[i], a[j * KU + s], acc[i][j]);
          }
        }
      }
    } else {
#pragma unroll 1
      for (int c = 0; c < bc; ++c) {
#pragma unroll 1
        for (int r = 0; r < p.R; ++r) {
          const float* xr = ins + (c * hp.rows + r * p.dil_h) * hp.pitch;
          const float* wr = wts + (c * RS + r * p.S) * BKP;
#pragma unroll 2
          for (int s = 0; s < p.S; ++s) {
            float a[PX], b[TK];
#pragma unroll
            for (int j = 0; j < PX; ++j) a[j] = xr[j * p.stride_w];
            dconv::load_vec<TK>(wr, b);
#pragma unroll
            for (int i = 0; i < TK; ++i)
#pragma unroll
              for (int j = 0; j < PX; ++j) acc[i][j] = fmaf(b[i], a[j], acc[i][j]);
            xr += p.dil_w;
            wr += BKP;
          }
        }
      }
    }
  };

  if constexpr (DB) {
    if (cb < ce) {
      load(cb, 0);
      dconv::cp_async_commit();
    }
    for (int ch = cb; ch < ce; ++ch) {
      const int st = (ch - cb) & 1;
      if (ch + 1 < ce) {
        load(ch + 1, st ^ 1);  // stage st^1 was last read in the previous iteration, before its barrier
        dconv::cp_async_commit();
        dconv::cp_async_wait<1>();
      } else {
        dconv::cp_async_wait<0>();
      }
      __syncthreads();
      compute(ch, st);
      __syncthreads();
    }
  } else {
    for (int ch = cb; ch < ce; ++ch) {
      load(ch, 0);
      dconv::cp_async_commit();
      dconv::cp_async_wait<0>();
      __syncthreads();
      compute(ch, 0);
      __syncthreads();
    }
  }

  // Outputs: bias in slice 0 only; stores, or atomics into the zeroed output when the channels are split.
  const bool add_bias = p.has_bias && blockIdx.z == 0;
  const int oh = oh0 + py;
#pragma unroll
  for (int i = 0; i < TK; ++i) {
    const int gk = k0 + kg * TK + i;
    if (gk >= p.K) continue;
    const float bv = add_bias ? __ldg(bias + gk) : 0.f;
    if (oh >= p.P) continue;
    float* const yr = y + (static_cast<long long>(n * p.K + gk) * p.P + oh) * p.Q + ow0 + px0;
#pragma unroll
    for (int j = 0; j < PX; ++j) {
      if (ow0 + px0 + j < p.Q) {
        if constexpr (SPLIT > 1) {
          atomicAdd(yr + j, acc[i][j] + bv);
        } else {
          yr[j] = acc[i][j] + bv;
        }
      }
    }
  }
}

}  // namespace bagf
