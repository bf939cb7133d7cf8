// fp16 / bf16 convolution of channels_last tensors as an implicit GEMM on Hopper's warpgroup tensor-core
// instruction (wgmma, sm_90a), both operands read by the tensor cores straight from 128-byte-swizzled shared memory,
// fp32 accumulation: the arithmetic of cuDNN's fp16/bf16 convolutions and of implicit_gemm_h16_conv2d.
//
// Why: in implicit_gemm_h16 (mma.sync) every fragment is loaded by ldmatrix into registers before its product, and
// the threads that copy the tiles also feed the tensor cores. One wgmma is issued once per warpgroup and keeps the
// SM's tensor cores busy for 32-128 cycles with no register traffic for its operands; the threads only issue the
// next tiles' copies.
//
// GEMM view: D[npq][k] = sum_{kk} X[npq][kk] W[k][kk] (+ bias[k]), kk = (r*S + s)*C + c (the channels_last order:
// a run of 8 reduction steps is 8 contiguous channels of one input pixel when C % 8 == 0). wgmma's M is our output
// pixels (64 per instruction), its N our output channels (WN per instruction), its K our reduction (16 per
// instruction); both operands are K-major, X's tile as gathered (im2col rows) and W's as it lies in memory (KRSC:
// a channels_last weight; the host passes one). The accumulators of a thread are pairs of adjacent channels of
// two pixels, so the output is written as 4-byte pairs straight into the channels_last output.
//
// Data path: each k tile is KS sub-tiles of 64 reduction steps (BK = 64 16-bit values = one 128-byte swizzle row per
// pixel and per output channel). Every thread owns one 16-byte column q = tid % 8 of the rows tid / 8 + i T / 8 of
// both operands' sub-tiles, so one cursor (c, s, r) per thread walks the reduction for both; per sub-tile a copy is
// an add, a bounds test and one 16-byte cp.async (.ca for the input, whose pixels the other taps read again; .cg for
// the weights), a copy out of the image or past C*R*S a zero-filling one. Stored at the 128-byte swizzle: row m's
// 16-byte column q at byte (m / 8) 1024 + (m % 8) 128 + 16 (q ^ m % 8) of its tile (the tiles are 1024-byte aligned:
// the hardware applies the same XOR to the address bits). STAGES-deep ring of k tiles; the copies run STAGES - 2
// tiles ahead, one wgmma group (4 KS k16 steps of every warpgroup) stays in flight while the next copies are issued
// (gemm_wgmma.cuh's schedule): a barrier per k tile, so KS = 2 halves the barriers per reduction step. Where the
// 16-byte path does not hold (C % 8 != 0, or x or w not 16-byte aligned; checked per launch) the same tiles are
// filled by 2-byte loads and shared-memory stores: slow, correct, never a misaligned copy.
//
// Template parameters (bagf_torch/kernels/implicit_gemm_wgmma_h16.py has the validity rules): DT (0 fp16, 1 bf16),
// WN = wgmma's N = output channels per block (64, 128, 192 or 256), MI m64 row blocks per warpgroup and WG
// warpgroups (BN = 64 MI WG output pixels per block, 128 WG threads), STAGES >= 3, KS sub-tiles of 64 per k tile
// (1 or 2). Split-K is the launch's grid.z (one cubin serves every split): implicit_gemm_h16.cuh's protocol, the
// slices' fp32 sums in the host's workspace and the last slice to arrive adds them in slice order (the output does
// not depend on the schedule).
//
// Safety: every access to x, w, bias and y is bounds-checked against the run-time shape; indices and offsets are
// 32-bit (the host refuses tensors past 2^31 - 1 elements and keeps stride, padding and dilation below 65536; the
// family's problem rule refuses shapes whose last block's pixel index or weight row offset would pass 2^31 - 1). Compiled
// for anything but sm_90a the kernel fails to compile (a static_assert), so a tuner records a compile failure,
// never a launch. Includes nothing from torch or the CUDA headers.
#pragma once
#include "conv_params.h"
#include "gemm_wgmma.cuh"
#include "implicit_gemm_h16.cuh"

namespace bagf {
namespace wgh {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// D (64 x N fp32 accumulators) += A (64 x k, shared memory, descriptor da) * B (k x N, shared memory, db), both
// K-major, KS the k step ("k16" of a 16-bit type TY, "bf16" or "f16"; "k8" of "tf32"), TR the transpose flags a
// 16-bit type takes (", 0, 0": none) and tf32 does not ("").
#define BAGF_WGMMA_H16_N64(KS, TY, TR)                                                         \
  asm volatile(                                                                         \
    "wgmma.mma_async.sync.aligned.m64n64" KS ".f32." TY "." TY " {" \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15," \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31" \
    "}, %32, %33, 1, 1, 1" TR ";\n"                                                     \
    : \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
    : "l"(da), "l"(db))

#define BAGF_WGMMA_H16_N128(KS, TY, TR)                                                         \
  asm volatile(                                                                         \
    "wgmma.mma_async.sync.aligned.m64n128" KS ".f32." TY "." TY " {" \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15," \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31," \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47," \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63" \
    "}, %64, %65, 1, 1, 1" TR ";\n"                                                     \
    : \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
    : "l"(da), "l"(db))

#define BAGF_WGMMA_H16_N192(KS, TY, TR)                                                         \
  asm volatile(                                                                         \
    "wgmma.mma_async.sync.aligned.m64n192" KS ".f32." TY "." TY " {" \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15," \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31," \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47," \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63," \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79," \
    "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95" \
    "}, %96, %97, 1, 1, 1" TR ";\n"                                                     \
    : \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
    "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
    "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
    "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
    "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]) \
    : "l"(da), "l"(db))

#define BAGF_WGMMA_H16_N256(KS, TY, TR)                                                         \
  asm volatile(                                                                         \
    "wgmma.mma_async.sync.aligned.m64n256" KS ".f32." TY "." TY " {" \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15," \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31," \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47," \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63," \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79," \
    "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95," \
    "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111," \
    "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127" \
    "}, %128, %129, 1, 1, 1" TR ";\n"                                                     \
    : \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
    "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
    "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
    "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
    "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
    "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
    "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
    "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
    "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127]) \
    : "l"(da), "l"(db))

// One k step of 32 bytes per operand row: k16 of a 16-bit type (DT 0 fp16, 1 bf16, no transpose), or k8 of TF32
// (DT 2: fp32 operands, rounded to TF32 by the TMA copies that brought them; tf32 takes no transpose flags).
#define BAGF_WGMMA_H16_BY_DT(N)                                                                      \
  if constexpr (DT == 2) BAGF_WGMMA_H16_N##N("k8", "tf32", "");                                     \
  else if constexpr (DT == 1) BAGF_WGMMA_H16_N##N("k16", "bf16", ", 0, 0");                        \
  else BAGF_WGMMA_H16_N##N("k16", "f16", ", 0, 0")

template <int DT, int WN>
__device__ __forceinline__ void mma(float (&d)[WN / 2], unsigned long long da, unsigned long long db) {
  if constexpr (WN == 64) {
    BAGF_WGMMA_H16_BY_DT(64);
  } else if constexpr (WN == 128) {
    BAGF_WGMMA_H16_BY_DT(128);
  } else if constexpr (WN == 192) {
    BAGF_WGMMA_H16_BY_DT(192);
  } else {
    BAGF_WGMMA_H16_BY_DT(256);
  }
}
#endif

// Descriptor of a K-major, 128-byte-swizzled operand at shared-memory byte address `addr`: 8-row atoms of 128-byte
// rows, 1024 bytes apart (stride offset), the leading offset unused by this layout (1), swizzle mode 1 (128 bytes).
__device__ __forceinline__ unsigned long long desc128(unsigned addr) {
  return ((addr >> 4) & 0x3fffull) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}

// 16-byte asynchronous copies global -> shared; src_bytes == 0 writes zeros and reads nothing.
__device__ __forceinline__ void cp16_ca(unsigned dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp16_cg(unsigned dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void st_shared16(unsigned dst, const h16::Chunk& v) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst), "r"(v.v[0]), "r"(v.v[1]), "r"(v.v[2]),
               "r"(v.v[3]) : "memory");
}


// The output and bias element of DT: 16-bit values (DT 0 fp16, 1 bf16) as unsigned short, widened to fp32 exactly
// and narrowed by one rounding to nearest; fp32 (DT 2, the TF32 kernels) as it is.
template <int DT>
struct Elem {
  using T = unsigned short;
  static __device__ __forceinline__ float widen(T v) { return h16::to_f32<DT>(v); }
  static __device__ __forceinline__ T narrow(float f) { return h16::from_f32<DT>(f); }
  static __device__ __forceinline__ bool negative_zero(T v) { return v == 0x8000u; }
  static __device__ __forceinline__ T zero() { return 0; }
  // two neighbouring channels in one 4-byte store (dst 4-byte aligned)
  static __device__ __forceinline__ void store_pair(T* dst, T a, T b) {
    *reinterpret_cast<unsigned*>(dst) = static_cast<unsigned>(a) | (static_cast<unsigned>(b) << 16);
  }
};
template <>
struct Elem<2> {
  using T = float;
  static __device__ __forceinline__ float widen(float v) { return v; }
  static __device__ __forceinline__ float narrow(float f) { return f; }
  static __device__ __forceinline__ bool negative_zero(float v) { return __float_as_uint(v) == 0x80000000u; }
  static __device__ __forceinline__ float zero() { return 0.f; }
  static __device__ __forceinline__ void store_pair(float* dst, float a, float b) {
    *reinterpret_cast<float2*>(dst) = make_float2(a, b);
  }
};

// The output value of an fp32 sum: rounded once to the output dtype, then, where RELU, torch's ReLU of that as
// p.relu asks for it (conv_params.h): below zero gives +0.0, -0.0 gives +0.0 (1) or stays (2), NaN stays. Rounding
// first keeps a tiny negative sum that rounds to -0.0 what torch's ReLU makes of the unfused conv's -0.0. RELU is the
// launch's p.relu != 0, branched on once per store call (store, wgt::store_nchw_staged), not per value: a launch
// without a ReLU runs the same stores as a kernel without the epilogue's ReLU.
template <int DT, bool RELU>
__device__ __forceinline__ typename Elem<DT>::T out(float v, int relu) {
  const typename Elem<DT>::T o = Elem<DT>::narrow(v);
  if (RELU && v <= 0.f && !(relu == 2 && Elem<DT>::negative_zero(o))) return Elem<DT>::zero();
  return o;
}

// The end of a block of either kernel, in two steps: split_hand_over, then store (finish runs both, the gathering
// kernel's: its stores without a ReLU).
//
// split_hand_over: split-K's hand-over when the launch is split (implicit_gemm_h16.cuh's protocol: each slice's sums
// in its own BM*BN floats of the workspace, element v of thread tid at v*T + tid; the last slice of the tile to
// arrive adds them all in slice order, so the output does not depend on the schedule). Returns whether this block
// holds the tile's whole sums in acc and stores it (uniform across the block; always true unsplit). Accumulator
// 4 j + 2 h + e of row block mi: pixel (warp / 4) MI 64 + mi 64 + (warp % 4) 16 + lane / 4 + 8 h, channel
// 8 j + 2 (lane % 4) + e. The block's threads 0 .. 128 WG - 1 hold the accumulators and run this; with ALL false
// the block has other threads (a producer warpgroup after them) that do not, and the hand-over meets at a named
// barrier of the 128 WG instead of the block's.
template <int WN, int MI, int WG, bool ALL>
__device__ __forceinline__ bool split_hand_over(float (&acc)[MI][WN / 2], float* __restrict__ ws) {
  constexpr int T = 128 * WG;
  constexpr int BM = WN;
  constexpr int BN = 64 * MI * WG;
  constexpr int NACC = MI * WN / 2;
  const int tid = threadIdx.x;
  auto sync = [] {
    if constexpr (ALL) __syncthreads(); else asm volatile("bar.sync 1, %0;\n" ::"n"(T) : "memory");
  };
  const int split = static_cast<int>(gridDim.z);
  if (split == 1) return true;
  static_assert(T * NACC == BM * BN, "a thread's accumulators are BM * BN / T floats");
  const long long ntiles = static_cast<long long>(gridDim.x) * gridDim.y;
  const long long tile = static_cast<long long>(blockIdx.y) * gridDim.x + blockIdx.x;
  float* mine = ws + (static_cast<long long>(blockIdx.z) * ntiles + tile) * (BM * BN) + tid;
  unsigned* counter = reinterpret_cast<unsigned*>(ws + split * ntiles * (BM * BN)) + tile;
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int v = 0; v < WN / 2; ++v) __stcg(mine + (mi * (WN / 2) + v) * T, acc[mi][v]);
  __threadfence();
  sync();
  __shared__ unsigned arrived;
  if (tid == 0) arrived = atomicAdd(counter, 1u);
  sync();
  if (arrived != static_cast<unsigned>(split - 1)) return false;  // (uniform across the block) another slice finishes
  __threadfence();
  // slice 0's sums straight into the accumulators, then each later slice's added (a temporary per element: all
  // of a slice's loads in flight beside the accumulators would pass the register file at 128 of them)
  const float* part = ws + tile * (BM * BN) + tid;
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int v = 0; v < WN / 2; ++v) acc[mi][v] = __ldcg(part + (mi * (WN / 2) + v) * T);
  for (int z = 1; z < split; ++z) {
    part += ntiles * (BM * BN);
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int v = 0; v < WN / 2; ++v) acc[mi][v] += __ldcg(part + (mi * (WN / 2) + v) * T);
  }
  return true;
}

// store: bias in fp32 and the one rounding to the output dtype (then p.relu's ReLU: out), stored from the registers
// into the channels_last output (NHWC true: two channels per store) or the NCHW one (NHWC false: each of a warp's
// stores then covers 8 runs of 8 pixels of one channel; the TMA family stages NCHW tiles through shared memory
// instead, wgt::store_nchw_staged). Channel groups [j_begin, j_end) of 8 only: split-K in a cluster stores each
// rank's share. store_values does it with the ReLU decided at compile time; store branches on p.relu once.
template <int DT, int WN, int MI, int WG, bool NHWC, bool RELU>
__device__ __forceinline__ void store_values(const float (&acc)[MI][WN / 2], const Conv2dParams& p,
                                             const typename Elem<DT>::T* __restrict__ bias,
                                             typename Elem<DT>::T* __restrict__ y, int n0, int m0, int j_begin,
                                             int j_end) {
  using E = typename Elem<DT>::T;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int NPQ = p.N * p.P * p.Q;
  const bool pairs = (p.K & 1) == 0 && (reinterpret_cast<unsigned long long>(y) & (2 * sizeof(E) - 1)) == 0;
  const int tig = lane & 3;
  const int PQ = p.P * p.Q;
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int npq = n0 + (warp >> 2) * (MI * 64) + mi * 64 + (warp & 3) * 16 + (lane >> 2) + 8 * h;
      if (npq >= NPQ) continue;
      const int img = npq / PQ;
      // channel ch of this pixel at yout[ch * cstride]: channels_last rows of K, or NCHW planes of P*Q
      E* yout = NHWC ? y + npq * p.K : y + img * p.K * PQ + (npq - img * PQ);
      const int cstride = NHWC ? 1 : PQ;
#pragma unroll
      for (int j = 0; j < WN / 8; ++j) {
        const int ch = m0 + 8 * j + 2 * tig;
        if (ch >= p.K || j < j_begin || j >= j_end) continue;
        float v0 = acc[mi][4 * j + 2 * h];
        float v1 = acc[mi][4 * j + 2 * h + 1];
        const bool two = ch + 1 < p.K;
        if (p.has_bias) {
          v0 += Elem<DT>::widen(__ldg(bias + ch));
          if (two) v1 += Elem<DT>::widen(__ldg(bias + ch + 1));
        }
        const E o0 = out<DT, RELU>(v0, p.relu);
        if (NHWC && pairs && two) {
          Elem<DT>::store_pair(yout + ch, o0, out<DT, RELU>(v1, p.relu));
        } else {
          yout[ch * cstride] = o0;
          if (two) yout[(ch + 1) * cstride] = out<DT, RELU>(v1, p.relu);
        }
      }
    }
}

template <int DT, int WN, int MI, int WG, bool NHWC = true>
__device__ __forceinline__ void store(const float (&acc)[MI][WN / 2], const Conv2dParams& p,
                                      const typename Elem<DT>::T* __restrict__ bias,
                                      typename Elem<DT>::T* __restrict__ y, int n0, int m0, int j_begin = 0,
                                      int j_end = WN / 8) {
  if (p.relu != 0)
    store_values<DT, WN, MI, WG, NHWC, true>(acc, p, bias, y, n0, m0, j_begin, j_end);
  else
    store_values<DT, WN, MI, WG, NHWC, false>(acc, p, bias, y, n0, m0, j_begin, j_end);
}

template <int DT, int WN, int MI, int WG, bool ALL, bool NHWC = true>
__device__ __forceinline__ void finish(float (&acc)[MI][WN / 2], const Conv2dParams& p,
                                       const typename Elem<DT>::T* __restrict__ bias,
                                       typename Elem<DT>::T* __restrict__ y, float* __restrict__ ws, int n0, int m0) {
  // (the gathering kernel's end: never a ReLU, which the host sends TMA plans only, as launch_plan checks)
  if (split_hand_over<WN, MI, WG, ALL>(acc, ws))
    store_values<DT, WN, MI, WG, NHWC, false>(acc, p, bias, y, n0, m0, 0, WN / 8);
}
}  // namespace wgh

template <int DT, int WN, int MI, int WG, int STAGES, int KS>
__global__ void __launch_bounds__(128 * WG, 1)
    implicit_gemm_wgmma_h16_conv2d(const unsigned short* __restrict__ x, const unsigned short* __restrict__ w,
                                   const unsigned short* __restrict__ bias, unsigned short* __restrict__ y,
                                   const Conv2dParams p, float* __restrict__ ws) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int BK = 64;             // reduction steps per sub-tile: one 128-byte row per pixel and per channel
  constexpr int T = 128 * WG;
  constexpr int BM = WN;             // output channels per block (grid.y)
  constexpr int BN = 64 * MI * WG;   // output pixels per block (grid.x)
  constexpr int A_BYTES = BN * 128;  // an input sub-tile, BN rows
  constexpr int B_BYTES = BM * 128;  // a weight sub-tile, BM rows
  constexpr int STAGE = KS * (A_BYTES + B_BYTES);  // a stage: KS input sub-tiles, then KS weight sub-tiles
  constexpr int ROWS = T / 8;        // rows one copy round covers (eight threads per 128-byte row)
  constexpr int CA = BN / ROWS;      // input rows per thread (= 4 MI)
  constexpr int CB = BM / ROWS;      // weight rows per thread
  constexpr int NACC = MI * WN / 2;  // accumulators per thread
  static_assert(WN == 64 || WN == 128 || WN == 192 || WN == 256, "wgmma's N");
  static_assert(STAGES >= 3, "one group in flight needs a stage besides the two being read");
  static_assert(KS == 1 || KS == 2, "one or two 64-step sub-tiles per stage");
  static_assert(BN % ROWS == 0 && BM % ROWS == 0 && ROWS % 8 == 0, "whole copy rounds; a thread's rows share m % 8");
  static_assert(NACC <= 128, "accumulators fit the register file");

  extern __shared__ unsigned char smem_raw[];
  // the ring's base, 1024-byte aligned (the swizzle's atom; the host asks for 1024 bytes more than the stages)
  const unsigned smem0 = (static_cast<unsigned>(__cvta_generic_to_shared(smem_raw)) + 1023u) & ~1023u;

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int n0 = blockIdx.x * BN;  // first output pixel (index into N*P*Q)
  const int m0 = blockIdx.y * BM;  // first output channel
  const int RS = p.R * p.S;
  const int CRS = p.C * RS;
  const int PQ = p.P * p.Q;
  const int NPQ = p.N * PQ;
  const bool vec = (p.C & 7) == 0 &&
                   ((reinterpret_cast<unsigned long long>(x) | reinterpret_cast<unsigned long long>(w)) & 15ull) == 0;

  // this block's share of the k tiles (split-K over gridDim.z slices: implicit_gemm_h16's even split)
  const int num_k = (CRS + BK * KS - 1) / (BK * KS);  // k tiles (stages' worth) of the reduction
  const int split = static_cast<int>(gridDim.z);
  const int t_begin = h16::slice_begin(blockIdx.z, num_k, split);
  const int tiles = h16::slice_begin(static_cast<long long>(blockIdx.z) + 1, num_k, split) - t_begin;

  // Copy plan, fixed per thread: column q of rows row0 + i ROWS of both tiles, stored at the swizzled column.
  const int q = tid & 7;
  const int row0 = tid >> 3;
  const unsigned dst0 = row0 * 128 + ((q ^ (row0 & 7)) << 4);
  int a_ih[CA], a_iw[CA], a_base[CA];
#pragma unroll
  for (int i = 0; i < CA; ++i) {
    const int npq = n0 + row0 + i * ROWS;
    a_ih[i] = -0x40000000;  // a pixel past N*P*Q: a window no tap reaches (zeros)
    a_iw[i] = 0;
    a_base[i] = 0;
    if (npq < NPQ) {
      const int img = npq / PQ;
      const int pq = npq - img * PQ;
      const int oh = pq / p.Q;
      const int ow = pq - oh * p.Q;
      a_ih[i] = oh * p.stride_h - p.pad_h;
      a_iw[i] = ow * p.stride_w - p.pad_w;
      a_base[i] = ((img * p.H + a_ih[i]) * p.W + a_iw[i]) * p.C;  // the window's corner (may lie outside)
    }
  }
  // weight row m0 + row0 + i ROWS starts at b_src0 + i b_step (valid where bit i of b_ok is set)
  const int b_src0 = (m0 + row0) * CRS;
  const int b_step = ROWS * CRS;
  unsigned b_ok = 0;
#pragma unroll
  for (int i = 0; i < CB; ++i)
    if (m0 + row0 + i * ROWS < p.K) b_ok |= 1u << i;
  // the cursor: this thread's reduction index kk = t BK KS + 8 q of the next sub-tile to copy, as (r, s, c) digits
  int cur_kk = t_begin * BK * KS + 8 * q;
  int cur_c, cur_s, cur_r;
  {
    const int tap = cur_kk / p.C;
    cur_c = cur_kk - tap * p.C;
    cur_r = tap / p.S;
    cur_s = tap - cur_r * p.S;
  }
  const int d_tap = BK / p.C;
  const int d_c = BK - d_tap * p.C;
  const int d_r = d_tap / p.S;
  const int d_s = d_tap - d_r * p.S;

  // Copy the next sub-tile (in order: the cursor stands at it): the input rows to byte address `sa`, the weight
  // rows to `sb`.
  auto load_sub = [&](unsigned sa, unsigned sb) {
    if (vec) {
      const bool kok = cur_kk < CRS;
      const int dr = cur_r * p.dil_h;
      const int ds = cur_s * p.dil_w;
      const int off = (dr * p.W + ds) * p.C + cur_c;
#pragma unroll
      for (int i = 0; i < CA; ++i) {
        const bool ok = kok && static_cast<unsigned>(a_ih[i] + dr) < static_cast<unsigned>(p.H) &&
                        static_cast<unsigned>(a_iw[i] + ds) < static_cast<unsigned>(p.W);
        wgh::cp16_ca(sa + dst0 + i * ROWS * 128, ok ? x + a_base[i] + off : x, ok ? 16 : 0);
      }
#pragma unroll
      for (int i = 0; i < CB; ++i) {
        const bool ok = kok && ((b_ok >> i) & 1u);
        wgh::cp16_cg(sb + dst0 + i * ROWS * 128, ok ? w + b_src0 + i * b_step + cur_kk : w, ok ? 16 : 0);
      }
    } else {
      // 2-byte loads, each element's tap decoded on its own (any C, any alignment), one row at a time
#pragma unroll
      for (int i = 0; i < CA; ++i) {
        h16::Chunk v{{0u, 0u, 0u, 0u}};
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const int kk = cur_kk + e;
          const int tap = kk / p.C;
          const int c = kk - tap * p.C;
          const int r = tap / p.S;
          const int dr = r * p.dil_h;
          const int ds = (tap - r * p.S) * p.dil_w;
          if (kk < CRS && static_cast<unsigned>(a_ih[i] + dr) < static_cast<unsigned>(p.H) &&
              static_cast<unsigned>(a_iw[i] + ds) < static_cast<unsigned>(p.W))
            h16::set_half(v, e, x[a_base[i] + (dr * p.W + ds) * p.C + c]);
        }
        wgh::st_shared16(sa + dst0 + i * ROWS * 128, v);
      }
#pragma unroll
      for (int i = 0; i < CB; ++i) {
        h16::Chunk v{{0u, 0u, 0u, 0u}};
#pragma unroll
        for (int e = 0; e < 8; ++e)
          if (cur_kk + e < CRS && ((b_ok >> i) & 1u)) h16::set_half(v, e, w[b_src0 + i * b_step + cur_kk + e]);
        wgh::st_shared16(sb + dst0 + i * ROWS * 128, v);
      }
    }
    cur_kk += BK;
    cur_c += d_c;
    cur_s += d_s;
    cur_r += d_r;
    if (cur_c >= p.C) { cur_c -= p.C; ++cur_s; }
    if (cur_s >= p.S) { cur_s -= p.S; ++cur_r; }
  };

  // Copy the next k tile into the stage at byte address `st`.
  auto load_tile = [&](unsigned st) {
#pragma unroll
    for (int h = 0; h < KS; ++h) load_sub(st + h * A_BYTES, st + KS * A_BYTES + h * B_BYTES);
  };

  float acc[MI][WN / 2];
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int v = 0; v < WN / 2; ++v) acc[mi][v] = 0.f;

#pragma unroll
  for (int st = 0; st < STAGES - 2; ++st) {
    if (st < tiles) load_tile(smem0 + st * STAGE);
    h16::cp_async_commit();
  }

  // this warpgroup's MI blocks of 64 pixel rows in the input tile
  const unsigned a_rows = (warp >> 2) * (MI * 64 * 128);
  int rd = 0;               // the stage tile i is in
  int wr = STAGES - 2;      // the stage tile i + STAGES - 2 goes to
  for (int i = 0; i < tiles; ++i) {
    // tile i landed (this thread's copies), visible to the async proxy, and everyone's copies landed
    h16::cp_async_wait<STAGES - 3>();
    wg::fence_proxy_async();
    __syncthreads();
    const unsigned sa = smem0 + rd * STAGE;
    wg::fence();
#pragma unroll
    for (int h = 0; h < KS; ++h)
#pragma unroll
      for (int s = 0; s < BK / 16; ++s)
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
          wgh::mma<DT, WN>(acc[mi], wgh::desc128(sa + h * A_BYTES + a_rows + mi * (64 * 128) + 32 * s),
                           wgh::desc128(sa + KS * A_BYTES + h * B_BYTES + 32 * s));
    wg::commit();
    // the stage tile i - 2 was read from: every warpgroup waited for that group before this step's barrier
    if (i + STAGES - 2 < tiles) load_tile(smem0 + wr * STAGE);
    h16::cp_async_commit();
    wg::wait<1>();
    rd = rd == STAGES - 1 ? 0 : rd + 1;
    wr = wr == STAGES - 1 ? 0 : wr + 1;
  }
  wg::wait<0>();
  h16::cp_async_wait<0>();
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int v = 0; v < WN / 2; ++v) wg::keep(acc[mi][v]);

  wgh::finish<DT, WN, MI, WG, true>(acc, p, bias, y, ws, n0, m0);
#elif defined(__CUDA_ARCH__)
  static_assert(WN < 0, "implicit_gemm_wgmma_h16_conv2d needs sm_90a (wgmma): compile with --gpu-architecture=sm_90a");
#endif
}

}  // namespace bagf
