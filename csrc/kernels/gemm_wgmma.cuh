// Batched fp32 GEMM with fp32 accuracy ("3xTF32") on Hopper's warpgroup tensor-core instruction (wgmma), for the
// non-fused Winograd plans' products; the interface and arithmetic of gemm_tf32x3.cuh, with A's small parts
// prepared by the caller:
//
//   C[z] = A[z] B[z]     A: M x K row-major (ld K), B: K x N row-major (ld N), C: M x N row-major (ld N),
//                        z = blockIdx.z, batch strides in elements; A's E = gridDim.z batches are followed in
//                        memory by E batches of its small parts, A - trunc_tf32(A) (winograd_gemm's stage 0
//                        writes them after U when US = 1)
//
// Why: mma.sync's TF32 rate on the H200 is 312 TFLOP/s (benchmarks/results/mma_rate_h200.json), so gemm_tf32x3's
// three products per fp32 product have a ~104 TFLOP/s ceiling, of which it reaches about half (two warps per
// scheduler, no eligible warp most cycles). wgmma's dense TF32 rate on sm_90 is ~495 TFLOP/s (~165 for three
// products), and one instruction, issued once by a warpgroup, keeps the SM's tensor cores busy for 32-64 cycles.
// Measured on AlexNet's conv3-5 products (benchmarks/results/gemm_wgmma_probe_h200.md): 1.26-1.48x
// gemm_tf32x3's best tile at N = 128 (69-82 TFLOP/s), 1.02-1.23x at N = 32.
//
// The product as wgmma sees it: D (64 x BM per warpgroup) = B^T A^T. wgmma's M is our N (Winograd tiles, 64 per
// warpgroup), its N is our M (output channels), k is our K. For TF32 both wgmma operands must be K-major: A^T's
// element (k, m) = A[m][k] is, so our A is wgmma's shared-memory operand; our B is its register operand, loaded
// from shared memory into the fragment layout by the threads (as gemm_tf32x3 loads its B) and split there.
//
// Precision: D += Bb Ab + Bs Ab + Bb As in fp32 (small*small dropped). B is split in registers
// (tc::split_tf32, rounded). A's big part is A itself: the tensor cores read an fp32 operand's top 19 bits
// (truncation to TF32); A's small part A - trunc(A) is exact in fp32 and truncated in turn (~2^-20 relative).
// Measured error against float64: 1.6-3.0e-6 relative on those products (gemm_tf32x3: 1.4-2.8e-6).
//
// The design choices, each measured with benchmarks/probes/gemm_wgmma_probe.py on AlexNet's 18 products:
//  * A's small parts from memory, not split in the kernel: splitting A on its way to shared memory (registers
//    one tile ahead, two planes stored by the threads) ran at 33-62 TFLOP/s, this at 47-82 (N = 128: 53-62
//    against 69-82).
//  * One wgmma group in flight (wait_group 1) while the next tile's fragments are loaded and split, with the
//    loop unrolled by two so that the fragment registers alternate; copies issued after the group and a
//    fixed per-thread copy plan (the loop with per-chunk index arithmetic cost 10-15%).
//  * 128-byte swizzle or none for A's planes, the copies before or after the wgmmas, the proxy fence, and a
//    launch order that keeps the m blocks of one n block together: each within noise.
//
// Shared memory per stage (STAGES-deep cp.async pipeline, dynamic, 1024-byte aligned):
//  * A's big and small planes, BM x 32 floats each, 128-byte swizzled K-major: row m's 128 bytes of k are the
//    (m % 8)th row of the 1024-byte atom m / 8, 16-byte column q stored at column q ^ (m % 8). The descriptor:
//    swizzle mode 1, stride offset 1024 (next 8 rows), leading offset unused; the k step s starts 32 s bytes
//    into the row (the hardware applies the XOR to the address).
//  * B's tile, 32 x (BN + 8) floats (pitch = 8 mod 32: the fragment loads are conflict-free). Its n index inside
//    a warp's 16 rows is permuted: fragment row g <-> n = 2g, row g + 8 <-> n = 2g + 1, so that a thread's two
//    rows are adjacent floats (one 8-byte load per k) and its two outputs per channel adjacent floats of C.
//
// Template parameters: WN = wgmma's N (64, 128, 192 or 256) and NB instructions side by side (BM = WN NB output
// channels per block), WG warpgroups (BN = 64 WG tiles per block, 128 WG threads), STAGES >= 3. Shared memory:
// STAGES (2 BM 32 + 32 (BN + 8)) floats. Bounds: every row, column and k is checked; M, N, K any positive sizes
// with M*K, K*N, M*N < 2^31 per batch entry (batch offsets are 64-bit). Compiled for anything but sm_90a the
// kernel fails to compile (a static_assert), so a tuner records a compile failure, never a launch.
#pragma once
#include "implicit_gemm_tc.cuh"

namespace bagf {
namespace wg {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// D (64 x N fp32, the accumulator fragment) += A (64 x 8 TF32, registers) * B (8 x N TF32, shared memory, desc).
__device__ __forceinline__ void wgmma_m64n64k8(float (&d)[32], const unsigned (&a)[4], unsigned long long desc) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
      "}, {%32, %33, %34, %35}, %36, 1, 1, 1;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}

__device__ __forceinline__ void wgmma_m64n128k8(float (&d)[64], const unsigned (&a)[4], unsigned long long desc) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, {%64, %65, %66, %67}, %68, 1, 1, 1;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}

__device__ __forceinline__ void wgmma_m64n192k8(float (&d)[96], const unsigned (&a)[4], unsigned long long desc) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n192k8.f32.tf32.tf32 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63,"
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79,"
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
      "}, {%96, %97, %98, %99}, %100, 1, 1, 1;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}

__device__ __forceinline__ void wgmma_m64n256k8(float (&d)[128], const unsigned (&a)[4], unsigned long long desc) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n256k8.f32.tf32.tf32 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63,"
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79,"
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95,"
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111,"
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
      "}, {%128, %129, %130, %131}, %132, 1, 1, 1;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
#endif

// Shared-memory matrix descriptor: start address, leading byte offset (along k), stride byte offset (along m/n),
// each in 16-byte units in 14-bit fields; the layout type in bits 62-63 (1: 128-byte swizzle).
__device__ __forceinline__ unsigned long long smem_desc(const float* p, unsigned lead_bytes, unsigned stride_bytes,
                                                        unsigned swizzle) {
  const unsigned long long a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  return ((a >> 4) & 0x3fffull) | (static_cast<unsigned long long>((lead_bytes >> 4) & 0x3fff) << 16) |
         (static_cast<unsigned long long>((stride_bytes >> 4) & 0x3fff) << 32) |
         (static_cast<unsigned long long>(swizzle) << 62);
}

__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// Generic-proxy writes to shared memory (cp.async) made visible to wgmma's reads (the async proxy).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Tells the compiler the register may change here: keeps reads of the accumulators after the last wait.
__device__ __forceinline__ void keep(float& r) { asm volatile("" : "+f"(r)::"memory"); }

template <int WN>
__device__ __forceinline__ void mma(float (&d)[WN / 2], const unsigned (&a)[4], unsigned long long desc) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  if constexpr (WN == 64) wgmma_m64n64k8(d, a, desc);
  else if constexpr (WN == 128) wgmma_m64n128k8(d, a, desc);
  else if constexpr (WN == 192) wgmma_m64n192k8(d, a, desc);
  else wgmma_m64n256k8(d, a, desc);
#endif
}

}  // namespace wg

template <int WN, int NB, int WG, int STAGES>
__global__ void __launch_bounds__(128 * WG, 1)
    gemm_wgmma(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ c, int M, int N,
               int K, long long stride_a, long long stride_b, long long stride_c) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int BK = 32;
  constexpr int T = 128 * WG;
  constexpr int BM = WN * NB;
  constexpr int BN = 64 * WG;
  constexpr int LDB = BN + 8;
  constexpr int A_PLANE = BM * BK;  // floats
  constexpr int STAGE = 2 * A_PLANE + BK * LDB;
  constexpr int AV = BM * 8;        // 16-byte chunks per plane's tile
  constexpr int BVC = BK * BN / 4;
  static_assert(WN == 64 || WN == 128 || WN == 192 || WN == 256, "wgmma's N");
  static_assert(STAGES >= 3, "one group in flight needs a stage besides the two being read");

  extern __shared__ __align__(1024) float smem[];  // [STAGES][big plane, small plane, B tile]

  const long long z = blockIdx.z;
  const float* a_small = a + gridDim.z * stride_a + z * stride_a;
  a += z * stride_a;
  b += z * stride_b;
  c += z * stride_c;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int gid = lane >> 2;
  const int tig = lane & 3;
  const int m0 = blockIdx.y * BM;
  const int n0 = blockIdx.x * BN;
  const bool vec = (K % 4) == 0 && (N % 4) == 0 &&
                   ((reinterpret_cast<unsigned long long>(a) | reinterpret_cast<unsigned long long>(a_small) |
                     reinterpret_cast<unsigned long long>(b) | reinterpret_cast<unsigned long long>(c)) & 15ull) == 0;
  const int num_k = (K + BK - 1) / BK;

  // Copy plan (vector path), fixed per thread: A's chunk e = tid + i T of a plane's tile is 16-byte column
  // q = e % 8 (= tid % 8) of row m = e / 8 (eight threads read one row's 128 bytes), stored at chunk
  // (m / 8) * 64 + (m % 8) * 8 + (q ^ m % 8) of the plane (the 128-byte swizzle); B's chunk e is column
  // 4 (e % (BN/4)) (fixed per thread) of row e / (BN/4). Per tile only k0 and the k bounds change.
  static_assert(AV % T == 0 && BVC % T == 0 && T % (BN / 4) == 0, "whole copy rounds");
  constexpr int CA = AV / T, CB = BVC / T;
  const int aq = tid & 7;
  const int bq = (tid % (BN / 4)) * 4;
  const int br = tid / (BN / 4);
  int a_src[CA], a_dst[CA];
  unsigned a_ok = 0;
#pragma unroll
  for (int i = 0; i < CA; ++i) {
    const int m = (tid >> 3) + i * (T / 8);
    a_src[i] = (m0 + m) * K + 4 * aq;
    a_dst[i] = 4 * ((m >> 3) * 64 + (m & 7) * 8 + (aq ^ (m & 7)));
    if (m0 + m < M) a_ok |= 1u << i;
  }
  const bool b_ok = n0 + bq < N;
  const int b_src = br * N + n0 + bq;

  auto load_tile = [&](int kt, int st) {
    const int k0 = kt * BK;
    float* as = smem + st * STAGE;
    float* bs = as + 2 * A_PLANE;
    if (vec) {
      const bool ak = k0 + 4 * aq < K;
#pragma unroll
      for (int i = 0; i < CA; ++i) {
        const bool ok = ak && ((a_ok >> i) & 1u);
        tc::cp_async16(as + a_dst[i], ok ? a + a_src[i] + k0 : a, ok ? 16 : 0);
        tc::cp_async16(as + A_PLANE + a_dst[i], ok ? a_small + a_src[i] + k0 : a, ok ? 16 : 0);
      }
      const long long kn = static_cast<long long>(k0) * N;
#pragma unroll
      for (int i = 0; i < CB; ++i) {
        const int r = br + i * (T / (BN / 4));
        const bool ok = b_ok && k0 + r < K;
        tc::cp_async16(bs + r * LDB + bq, ok ? b + kn + b_src + static_cast<long long>(i * (T / (BN / 4))) * N : b,
                       ok ? 16 : 0);
      }
    } else {
      for (int e = tid; e < 2 * BM * BK; e += T) {
        const int plane = e >= BM * BK;
        const int f = e - plane * BM * BK;
        const int m = f / BK, k = f - m * BK, q = k >> 2;
        const int dst = ((m >> 3) * 64 + (m & 7) * 8 + (q ^ (m & 7))) * 4 + (k & 3);
        const bool ok = m0 + m < M && k0 + k < K;
        const float* src = (plane ? a_small : a) + static_cast<long long>(m0 + m) * K + k0 + k;
        tc::cp_async4(as + plane * A_PLANE + dst, ok ? src : a, ok ? 4 : 0);
      }
      for (int e = tid; e < BK * BN; e += T) {
        const int r = e / BN;
        const int q = e - r * BN;
        const bool ok = k0 + r < K && n0 + q < N;
        tc::cp_async4(bs + r * LDB + q, ok ? b + static_cast<long long>(k0 + r) * N + n0 + q : b, ok ? 4 : 0);
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
    if (st < num_k) load_tile(st, st);
    tc::cp_async_commit();
  }

  const int frag_col = (warp >> 2) * 64 + (warp & 3) * 16 + 2 * gid;
  // One k tile: tile kt's copies landed and visible to both proxies; the tile STAGES - 2 ahead goes to the stage
  // that group kt - 2 read (every warpgroup waited for it before this barrier); group kt is issued from the
  // fragment set f and left in flight, group kt - 1 waited for.
  auto step = [&](int kt, unsigned (&fb)[BK / 8][4], unsigned (&fs)[BK / 8][4]) {
    tc::cp_async_wait<STAGES - 3>();
    wg::fence_proxy_async();  // this thread's cp.async writes (generic proxy) before wgmma's reads (async proxy)
    __syncthreads();
    const int next = kt + STAGES - 2;
    const float* big = smem + (kt % STAGES) * STAGE;
    const float* small = big + A_PLANE;
    const float* bs = big + 2 * A_PLANE + tig * LDB + frag_col;
#pragma unroll
    for (int s = 0; s < BK / 8; ++s) {
      const float2 lo = *reinterpret_cast<const float2*>(bs + (8 * s) * LDB);
      const float2 hi = *reinterpret_cast<const float2*>(bs + (8 * s + 4) * LDB);
      tc::split_tf32(lo.x, fb[s][0], fs[s][0]);
      tc::split_tf32(lo.y, fb[s][1], fs[s][1]);
      tc::split_tf32(hi.x, fb[s][2], fs[s][2]);
      tc::split_tf32(hi.y, fb[s][3], fs[s][3]);
    }
    wg::fence();
#pragma unroll
    for (int s = 0; s < BK / 8; ++s)
#pragma unroll
      for (int j = 0; j < NB; ++j) {
        const int off = j * (WN / 8) * 256 + 8 * s;
        const unsigned long long db = wg::smem_desc(big + off, 16, 1024, 1);
        const unsigned long long ds = wg::smem_desc(small + off, 16, 1024, 1);
        wg::mma<WN>(acc[j], fb[s], db);
        wg::mma<WN>(acc[j], fs[s], db);
        wg::mma<WN>(acc[j], fb[s], ds);
      }
    wg::commit();
    // the next copy goes out while the tensor cores work on this group; its stage was read by group kt - 2
    if (next < num_k) load_tile(next, next % STAGES);
    tc::cp_async_commit();
    wg::wait<1>();
  };
  unsigned fb0[BK / 8][4], fs0[BK / 8][4], fb1[BK / 8][4], fs1[BK / 8][4];
  for (int kt = 0; kt < num_k; kt += 2) {
    step(kt, fb0, fs0);
    if (kt + 1 < num_k) step(kt + 1, fb1, fs1);
  }
  wg::wait<0>();
  tc::cp_async_wait<0>();
#pragma unroll
  for (int j = 0; j < NB; ++j)
#pragma unroll
    for (int v = 0; v < WN / 2; ++v) wg::keep(acc[j][v]);

  const int col = n0 + frag_col;
#pragma unroll
  for (int j = 0; j < NB; ++j)
#pragma unroll
    for (int i = 0; i < WN / 8; ++i)
#pragma unroll
      for (int p = 0; p < 2; ++p) {
        const int row = m0 + j * WN + 8 * i + 2 * tig + p;
        if (row >= M) continue;
        float* dst = c + static_cast<long long>(row) * N + col;
        const float v0 = acc[j][4 * i + p], v1 = acc[j][4 * i + 2 + p];
        if (vec && col + 1 < N) {
          *reinterpret_cast<float2*>(dst) = make_float2(v0, v1);
        } else {
          if (col < N) dst[0] = v0;
          if (col + 1 < N) dst[1] = v1;
        }
      }
#elif defined(__CUDA_ARCH__)
  static_assert(WN < 0, "gemm_wgmma needs sm_90a (wgmma): compile with --gpu-architecture=sm_90a");
#endif
}

}  // namespace bagf
