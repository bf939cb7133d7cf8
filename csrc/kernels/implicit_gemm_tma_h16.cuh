// fp16 / bf16 convolution (DT 0 / 1), and fp32 with one TF32 product per multiply (DT 2), as an implicit GEMM on
// Hopper's wgmma (sm_90a) with both operand tiles brought into shared memory by the Tensor Memory Accelerator (TMA):
// the input's im2col tile by one im2col-mode copy of a channels_last input, the weight's tile by one tiled copy of a
// KRSC weight, each stage's arrival counted by an mbarrier. The output is channels_last (NHWC = 1) or NCHW (NHWC = 0:
// the host hands an NCHW call's input over as a channels_last copy, made by nchw_to_nhwc below, the plan's second
// kernel, and the epilogue writes NCHW).
//
// Why: implicit_gemm_wgmma_h16.cuh gathers its input tile per thread, one 16-byte cp.async per 8 channels of a
// pixel with its own address and bounds test, then waits and meets at a block barrier before every wgmma group;
// on AlexNet's conv4-5 at N = 128 it runs at 0.72-0.87x of cuDNN. Here one thread issues two copies per stage and
// the TMA unit computes the addresses, the padding (zero fill outside the image) and the walk over output pixels
// across rows and images; the warps only wait on the stage's mbarrier and issue wgmma. The products, their order
// and the split-K hand-over are implicit_gemm_wgmma_h16's (wgh::mma, wgh::split_hand_over), and so is the epilogue
// (wgh::store) but for NCHW tiles without stream-K, which are staged through shared memory (wgt::store_nchw_staged).
//
// GEMM view as there: D[npq][k] = sum_kk X[npq][kk] W[k][kk] (+ bias[k]), but the reduction runs tap by tap and
// BK channels at a time (one 128-byte row: 64 16-bit or 32 fp32 values): k tile t is tap (r, s) = t / CB and
// channels BK (t % CB) .. + BK - 1, CB = ceil(C / BK) (channels past C are zeros in both tiles: the maps'
// out-of-bounds fill), so any C whose channels make whole 16 bytes works (C % 8 == 0 in 16 bits, C % 4 == 0 in
// fp32: the maps' strides).
//  - The input map (host: cuTensorMapEncodeIm2col) views x as (C, W, H, N) with the bounding box of the output
//    pixels' windows' corners: lower corner (-pad_w, -pad_h), upper corner ((Q - 1) stride_w + 1 - W - pad_w, same
//    for H), traversal strides (stride_w, stride_h); one copy loads BN consecutive output pixels (walking W, then
//    H, then the image) x BK channels, starting at the block's first pixel's window corner, shifted by the tap's
//    offsets (s dil_w, r dil_h); a pixel past the last image reads zeros.
//  - The weight map (cuTensorMapEncodeTiled) views a KRSC weight as (C, R*S, K); one copy loads WN output channels
//    x BK channels of one tap.
// Both land as 128-byte rows at the 128-byte swizzle wgmma's descriptors read (wgh::desc128), in STAGES-deep rings.
//
// Schedule: the first thread of the producer warpgroup (the block's last 128 threads) fills the ring, then, each
// time every consumer warp has released a stage (its wgmma group on it done: an arrival on that stage's "empty"
// mbarrier), issues the copies of the tile STAGES ahead into it. Every warp waits on the stage's "full" mbarrier (the copies' bytes arrived), issues its wgmma group, waits
// for the one before, and releases that one's stage. No block barrier in the loop.
//
// TF32 (DT 2): a 128-byte row holds 32 fp32 channels (BK = 32) and a stage's four 32-byte k steps are
// m64nNk8.tf32 instead of k16. The host maps fp32 tensors as CU_TENSOR_MAP_DATA_TYPE_TFLOAT32, and the TMA unit rounds
// each value to TF32 to nearest as it copies: measured on the H200, these plans' error against float64 equals cuDNN's
// TF32 error to three digits, as it did with each stage rounded again in shared memory (cvt.rna); operands the
// tensor cores read as plain fp32 would be truncated to TF32 (2.6x that error, emulated on the CPU).
//
// Template parameters (bagf_torch/kernels/implicit_gemm_tma_{h16,tf32}.py have the validity rules): DT (0 fp16, 1 bf16,
// 2 fp32 with TF32 products), WN = wgmma's N = output channels per block (64, 128, 192 or 256), MI m64 row blocks per
// warpgroup and WG warpgroups (BN = 64 MI WG output pixels per block, at most 256: one im2col copy), STAGES >= 2, NHWC
// the output's format, SK 1 for stream-K (a one-dimensional grid: see wgt::sk_begin), 2 for persistent blocks (a
// one-dimensional grid of the blocks the device holds at once, each taking whole tiles blockIdx.x, + gridDim.x, ...:
// its producer fills the ring with the next tile's k tiles while its consumers store the last one, where a new block
// would start from an empty ring; no hand-over, the products and their order are SK = 0's, so the same bits). Split-K
// is the launch's grid.z, implicit_gemm_wgmma_h16's protocol through a workspace, or, when the host launches the slices
// of a tile as one thread block cluster, a hand-over in distributed shared memory (wgt::cluster_reduce).
//
// Safety: the copies cannot leave the tensors (the TMA unit bounds every element by the map's extents); the host
// encodes the maps per call from the tensors themselves and refuses (to ATen) what the maps cannot describe:
// pointers off 16-byte alignment, strides or corners out of the hardware's ranges. The epilogue's stores are
// bounds-checked against the run-time shape (32-bit indices, as implicit_gemm_wgmma_h16). Compiled for anything but
// sm_90a the kernel fails to compile (a static_assert). Includes nothing from torch or the CUDA headers.
#pragma once
#include "implicit_gemm_wgmma_h16.cuh"

namespace bagf {

// A CUtensorMap's 128 opaque bytes, 64-byte aligned as the driver writes them (cuda.h is not included here).
struct alignas(64) TmaMap {
  unsigned long long v[16];
};

namespace wgt {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// the barriers' initialisation made visible to the TMA unit (the async proxy) before any copy signals one
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// an arrival where `pred` is nonzero, predicated in the instruction (no branch: a branch between a wgmma group's
// issue and its wait made ptxas serialize the groups)
__device__ __forceinline__ void mbar_arrive_if(unsigned bar, unsigned pred) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.u32 p, %1, 0;\n"
      "@p mbarrier.arrive.shared::cta.b64 _, [%0];\n"
      "}\n" ::"r"(bar),
      "r"(pred)
      : "memory");
}
// this thread's arrival, and `bytes` more transaction bytes the phase waits for (the copies signal them)
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// spin until the phase of parity `parity` has completed (acquire); a C++ loop around try_wait (a branch inside
// the asm made ptxas serialize the wgmma groups around it)
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
  unsigned done = 0;
  do {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n"
        "}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}
// im2col-mode copy of a 4-d map (C, W, H, N): coordinates (c, w, h, n) of the first pixel's window corner, the
// tap's offsets (ow, oh), completion counted on `bar`
__device__ __forceinline__ void tma_im2col(unsigned dst, const TmaMap* map, int c, int w, int h, int n,
                                           unsigned short ow, unsigned short oh, unsigned bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.im2col.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6], {%7, %8};\n" ::"r"(dst),
      "l"(reinterpret_cast<unsigned long long>(map)), "r"(c), "r"(w), "r"(h), "r"(n), "r"(bar), "h"(ow), "h"(oh)
      : "memory");
}
// tiled copy of a 3-d map's box at coordinates (a, b, c), completion counted on `bar`
__device__ __forceinline__ void tma_tile3(unsigned dst, const TmaMap* map, int a, int b, int c, unsigned bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
      "l"(reinterpret_cast<unsigned long long>(map)), "r"(a), "r"(b), "r"(c), "r"(bar)
      : "memory");
}
#endif

// Stream-K (SK = 1): the grid's G blocks share the T x I k iterations of all T output tiles (I k tiles each)
// evenly, block c taking iterations [sk_begin(c), sk_begin(c + 1)) = [floor(c W / G), floor((c + 1) W / G)),
// W = T I (h16::slice_begin's even split over the whole grid's work). tests/test_nvcc.py runs both on the host
// against the Python rule.
__host__ __device__ __forceinline__ long long sk_begin(long long c, long long work, long long blocks) {
  return c * work / blocks;
}
// the block whose share holds iteration x (0 <= x < W): the largest c with sk_begin(c) <= x
__host__ __device__ __forceinline__ long long sk_owner(long long x, long long work, long long blocks) {
  return ((x + 1) * blocks - 1) / work;
}

// Split-K in a cluster (wgt::cluster_reduce): rank `rank` of `ranks` reduces and stores channel groups [*jb, *je) of
// 8 of a tile whose `channels` output channels (below K) lie in its first groups, in units of `unit` groups (1 for a
// channels_last store, 4 for an NCHW tile staged 32 channels a pass) of the tile's `groups` (WN / 8): the units that
// hold channels split evenly over the ranks (h16::slice_begin's rule), so every such group is one rank's, and a
// rank's share may be empty. tests/test_nvcc.py runs it on the host against the Python rule.
__host__ __device__ __forceinline__ void cluster_share(int rank, int ranks, int groups, int unit, int channels, int* jb,
                                                       int* je) {
  const int held = (channels + 8 * unit - 1) / (8 * unit);
  const int units = held < groups / unit ? held : groups / unit;
  *jb = unit * (rank * units / ranks);
  *je = unit * ((rank + 1) * units / ranks);
}

}  // namespace wgt

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
namespace wgt {

// The producer's share of one output tile's k iterations [kb, ke): the copies of each k tile into the ring, each
// after the consumers released that stage's previous use; `issued` counts the block's copies so far (the ring's slot
// and phase follow from it), across the tiles of a stream-K block.
template <int DT, int BN, int BM, int STAGES>
__device__ __forceinline__ void produce(const TmaMap* xmap, const TmaMap* wmap, const Conv2dParams& p, int n0,
                                        int m0, int kb, int ke, int cb_n, unsigned smem0, unsigned full0,
                                        unsigned empty0, int& slot, unsigned& phase, int& issued) {
  constexpr int BK = DT == 2 ? 32 : 64;
  constexpr int A_BYTES = BN * 128;
  constexpr int STAGE = A_BYTES + BM * 128;
  // the tile's first output pixel's window corner (the map's traversal walks on from there)
  const int img = n0 / (p.P * p.Q);
  const int pq = n0 - img * (p.P * p.Q);
  const int oh = pq / p.Q;
  const int ow = pq - oh * p.Q;
  const int base_h = oh * p.stride_h - p.pad_h;
  const int base_w = ow * p.stride_w - p.pad_w;
  int tap = kb / cb_n;
  int cb = kb - tap * cb_n;
  int r = tap / p.S;
  int s = tap - r * p.S;
  for (int t = kb; t < ke; ++t) {
    if (issued++ >= STAGES) mbar_wait(empty0 + 8 * slot, phase ^ 1u);  // the copy STAGES before was released
    const unsigned st = smem0 + slot * STAGE;
    const unsigned bar = full0 + 8 * slot;
    mbar_arrive_expect_tx(bar, STAGE);
    tma_im2col(st, xmap, cb * BK, base_w, base_h, img, static_cast<unsigned short>(s * p.dil_w),
               static_cast<unsigned short>(r * p.dil_h), bar);
    tma_tile3(st + A_BYTES, wmap, cb * BK, tap, m0, bar);
    if (++cb == cb_n) {
      cb = 0;
      ++tap;
      if (++s == p.S) {
        s = 0;
        ++r;
      }
    }
    if (++slot == STAGES) {
      slot = 0;
      phase ^= 1u;
    }
  }
}

// The accumulators of a tile zeroed, each kept as a register value (not a constant ptxas may re-create inside the
// loop, between the wgmma groups).
template <int WN, int MI>
__device__ __forceinline__ void zero(float (&acc)[MI][WN / 2]) {
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int v = 0; v < WN / 2; ++v) {
      acc[mi][v] = 0.f;
      wg::keep(acc[mi][v]);
    }
}

// A consumer warpgroup's share of `count` k tiles from the ring: wait for each stage's copies, issue its wgmma group,
// wait for the group before and release that one's stage; at the end wait for the last group and release its stage.
template <int DT, int WN, int MI, int BN, int BM, int STAGES>
__device__ __forceinline__ void consume(float (&acc)[MI][WN / 2], int count, unsigned smem0, unsigned full0,
                                        unsigned empty0, unsigned a_rows, int lane, int& slot, unsigned& phase) {
  constexpr int A_BYTES = BN * 128;
  constexpr int STAGE = A_BYTES + BM * 128;
  int prev = slot;
  for (int i = 0; i < count; ++i) {
    mbar_wait(full0 + 8 * slot, phase);
    const unsigned sa = smem0 + slot * STAGE;
    wg::fence();
#pragma unroll
    for (int s = 0; s < 4; ++s)  // four k steps of 32 bytes per 128-byte row
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
        wgh::mma<DT, WN>(acc[mi], wgh::desc128(sa + a_rows + mi * (64 * 128) + 32 * s),
                         wgh::desc128(sa + A_BYTES + 32 * s));
    wg::commit();
    wg::wait<1>();  // this warpgroup's group of tile i - 1 is done: its stage may be refilled
    mbar_arrive_if(empty0 + 8 * prev, i > 0 && lane == 0);
    prev = slot;
    if (++slot == STAGES) {
      slot = 0;
      phase ^= 1u;
    }
  }
  wg::wait<0>();
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int v = 0; v < WN / 2; ++v) wg::keep(acc[mi][v]);
  mbar_arrive_if(empty0 + 8 * prev, count > 0 && lane == 0);
}

// Stream-K's hand-over of a tile that several blocks share: this block stores its part of the sums in its own slot
// of the workspace (two per block: 0 for the first tile of its share, 1 for the last; the tiles between are whole),
// counts itself on the tile's counter, and the block that arrives last adds every part in k order (the owners of
// the tile's iterations, first to last) into acc: the same order whichever block finishes. Returns whether this
// block finishes the tile. Workspace: 2 G slots of BM x BN floats, then T zeroed counters.
template <int WN, int MI, int WG>
__device__ __forceinline__ bool sk_hand_over(float (&acc)[MI][WN / 2], float* __restrict__ ws, int tile, int iters,
                                             int work, int blocks, int my_slot) {
  constexpr int T = 128 * WG;
  constexpr int TILE = WN * 64 * MI * WG;  // BM x BN
  const int tid = threadIdx.x;
  auto sync = [] { asm volatile("bar.sync 1, %0;\n" ::"n"(T) : "memory"); };
  float* mine = ws + (2 * static_cast<long long>(blockIdx.x) + my_slot) * TILE + tid;
  unsigned* counter = reinterpret_cast<unsigned*>(ws + 2ll * blocks * TILE) + tile;
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int v = 0; v < WN / 2; ++v) __stcg(mine + (mi * (WN / 2) + v) * T, acc[mi][v]);
  const int first = tile * iters;
  const int c_lo = static_cast<int>(sk_owner(first, work, blocks));
  const int c_hi = static_cast<int>(sk_owner(first + iters - 1, work, blocks));
  __threadfence();
  sync();
  __shared__ unsigned arrived;
  if (tid == 0) arrived = atomicAdd(counter, 1u);
  sync();
  if (arrived != static_cast<unsigned>(c_hi - c_lo)) return false;  // (uniform across the block) another finishes
  __threadfence();
  // the first owner's part (its last tile, unless its share starts at this tile: then its first), then each later
  // owner's (its first tile) added in turn
  const float* part = ws + (2ll * c_lo + (sk_begin(c_lo, work, blocks) < first ? 1 : 0)) * TILE + tid;
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int v = 0; v < WN / 2; ++v) acc[mi][v] = __ldcg(part + (mi * (WN / 2) + v) * T);
  for (int c = c_lo + 1; c <= c_hi; ++c) {
    part = ws + 2ll * c * TILE + tid;
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int v = 0; v < WN / 2; ++v) acc[mi][v] += __ldcg(part + (mi * (WN / 2) + v) * T);
  }
  return true;
}

// Split-K inside a thread block cluster: the host launches a split-K cluster plan's grid (gx, gy, split) in clusters of
// (1, 1, split) blocks, the slices of one tile (cluster rank = blockIdx.z = the slice), and the slices hand their sums
// over through distributed shared memory instead of the workspace: no workspace, no counters for the host to zero
// before the launch (a memset, one more node in a CUDA graph), no round trip through L2 behind a fence and an atomic,
// and the tile's reduction and stores shared by its blocks instead of left to the last one. Each rank puts its fp32
// sums into its own idle ring (element v of thread tid at v T + tid: a warp's stores are one row) and arrives at the
// cluster barrier; after it, rank r adds up its share of the tile's channels -- channel groups [jb, je) of 8 (units of
// U groups: 1 for a channels_last store, 4 for an NCHW tile staged 32 channels a pass), the units that hold channels
// below K split evenly over the ranks -- from every rank's ring in rank order (split_hand_over's order, so the same
// bits as the workspace plan), arrives at the barrier again (it has read what it needs) and stores that share. A rank
// waits at that second barrier before it leaves or overwrites its ring (the staged NCHW store), since the others read
// it until then (cluster_wait). The producer warpgroups may have exited: an exited thread does not hold up a cluster
// barrier (PTX ISA, `exit`).
__device__ __forceinline__ unsigned cluster_size() {
  unsigned n;
  asm volatile("mov.u32 %0, %%cluster_nctarank;\n" : "=r"(n));
  return n;
}
__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
// this thread's arrival at the cluster barrier (its earlier writes released to the cluster), and the wait for all
// of the cluster's threads that have not exited (acquire)
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release;\n" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire;\n" ::: "memory"); }

template <int WN, int MI, int WG, int U>
__device__ __forceinline__ void cluster_reduce(float (&acc)[MI][WN / 2], unsigned ring, int channels, int& jb,
                                               int& je) {
  constexpr int T = 128 * WG;
  static_assert((WN / 8) % U == 0, "whole units of channel groups");
  const unsigned rank = cluster_rank();
  const unsigned n = cluster_size();
  const unsigned mine = ring + 4u * threadIdx.x;
  asm volatile("bar.sync 1, %0;\n" ::"n"(T) : "memory");  // every consumer warpgroup's wgmma has read the ring
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int v = 0; v < WN / 2; ++v)
      asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(mine + 4u * ((mi * (WN / 2) + v) * T)), "f"(acc[mi][v])
                   : "memory");
  cluster_arrive();
  cluster_wait();  // every rank's sums are in its ring
  cluster_share(static_cast<int>(rank), static_cast<int>(n), WN / 8, U, channels, &jb, &je);
  for (unsigned r = 0; r < n; ++r) {
    unsigned src;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(src) : "r"(mine), "r"(r));
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int j = 0; j < WN / 8; ++j) {
        if (j < jb || j >= je) continue;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int v = 4 * j + e;
          float part;
          asm volatile("ld.shared::cluster.f32 %0, [%1];\n"
                       : "=f"(part)
                       : "r"(src + 4u * ((mi * (WN / 2) + v) * T))
                       : "memory");
          acc[mi][v] = r == 0 ? part : acc[mi][v] + part;
        }
      }
  }
  cluster_arrive();  // this rank has read its share of every ring
}

// One pass of store_nchw_staged's stores: this thread's pixel (`stage` at its column, `yout` at its channel 0) in
// channels ch0 + c, c = c0, c0 + RPT, ... < 32, each rounded once to the output dtype, then the ReLU where RELU
// (wgh::out). A function, not a lambda: NVRTC compiles a generic lambda's call operator as host code.
template <int DT, int LD, int RPT, bool RELU>
__device__ __forceinline__ void put_staged_pass(const float* stage, typename wgh::Elem<DT>::T* __restrict__ yout,
                                                int c0, int ch0, int PQ, const Conv2dParams& p) {
#pragma unroll
  for (int c = c0; c < 32; c += RPT) {
    const int ch = ch0 + c;
    if (ch < p.K) yout[ch * PQ] = wgh::out<DT, RELU>(stage[c * LD], p.relu);
  }
}

// An NCHW tile's stores staged through shared memory (SK = 0: the ring, idle once every k tile has been consumed;
// SK = 2: a buffer of its own after the ring, which the producer is already filling with the next tile; stream-K
// stores from the registers). From the registers,
// a warp's NCHW stores cover 8 runs of 8 pixels of one channel (wgh::store); staged, each thread owns one pixel of the
// tile and a warp writes 32 consecutive pixels of a channel plane. 32 channels per pass: the consumers put their
// accumulators, bias added in fp32, into [channel][BN + 4] floats at `stage` (the row pad puts a warp's 32 values in 32
// banks), meet, and each thread stores its pixel's channels c0, c0 + T / BN, ... of the pass, rounded once to the
// output dtype (then p.relu's ReLU: wgh::out). Runs after the split-K hand-over, on its block only; the 128 WG
// consumer threads meet at named barrier 1. Passes [pass_begin, pass_end) only: split-K in a cluster stores each rank's share.
template <int DT, int WN, int MI, int WG>
__device__ __forceinline__ void store_nchw_staged(const float (&acc)[MI][WN / 2], const Conv2dParams& p,
                                                  const typename wgh::Elem<DT>::T* __restrict__ bias,
                                                  typename wgh::Elem<DT>::T* __restrict__ y, int n0, int m0,
                                                  float* stage, int pass_begin = 0, int pass_end = WN / 32) {
  using E = typename wgh::Elem<DT>::T;
  constexpr int T = 128 * WG;
  constexpr int BN = 64 * MI * WG;
  constexpr int LD = BN + 4;
  constexpr int RPT = T / BN;  // channel rows stored at once: 2 (MI 1) or 1 (MI 2)
  static_assert(T % BN == 0, "each thread stores one pixel of the tile");
  auto sync = [] { asm volatile("bar.sync 1, %0;\n" ::"n"(T) : "memory"); };
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int tig = lane & 3;
  const int PQ = p.P * p.Q;
  // the pixel this thread stores, and its channel 0's address in the NCHW output
  const int i = tid % BN;
  const int c0 = tid / BN;
  const int npq = n0 + i;
  const bool in = npq < p.N * PQ;
  const int img = npq / PQ;
  E* const yout = y + img * p.K * PQ + (npq - img * PQ);
#pragma unroll
  for (int pass = 0; pass < WN / 32; ++pass) {
    if (pass < pass_begin || pass >= pass_end) continue;  // (another rank's share: uniform across the block)
    sync();  // every warpgroup's wgmma has read the ring (first pass; SK = 2: the last tile's last pass was stored
             // from the buffer) or the last pass's values were stored
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      const int j = 4 * pass + jj;
      const int cl = 8 * jj + 2 * tig;  // the pass's channel of accumulator e = 0
      const int ch = m0 + 8 * j + 2 * tig;
      const float b0 = p.has_bias && ch < p.K ? wgh::Elem<DT>::widen(__ldg(bias + ch)) : 0.f;
      const float b1 = p.has_bias && ch + 1 < p.K ? wgh::Elem<DT>::widen(__ldg(bias + ch + 1)) : 0.f;
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int px = (warp >> 2) * (MI * 64) + mi * 64 + (warp & 3) * 16 + (lane >> 2) + 8 * h;
          stage[cl * LD + px] = acc[mi][4 * j + 2 * h] + b0;
          stage[(cl + 1) * LD + px] = acc[mi][4 * j + 2 * h + 1] + b1;
        }
    }
    sync();
    if (in) {  // (the ReLU decided once per pass, not per value: wgh::out)
      if (p.relu != 0)
        put_staged_pass<DT, LD, RPT, true>(stage + i, yout, c0, m0 + 32 * pass, PQ, p);
      else
        put_staged_pass<DT, LD, RPT, false>(stage + i, yout, c0, m0 + 32 * pass, PQ, p);
    }
  }
}

}  // namespace wgt
#endif

// An NCHW plan's first launch: the input copied to channels_last (its maps view channels innermost), TILE channels x
// TILE pixels per block (kNchwCopyTile, 64) through shared memory, so that both the reads (a channel's pixels) and the
// writes (a pixel's channels) are whole rows; images N over grid.z and a stride of gridDim.z. 16-bit values go two
// at a time in 4-byte words where H*W and C are even and both tensors 4-byte aligned (a warp reads 64 pixels of a
// channel and writes 64 channels of a pixel: whole 128-byte lines, 32 bytes in flight per thread), else one at a time
// (64-byte accesses, two per row); fp32 values one at a time (128-byte accesses). At most 40 registers: six blocks per
// SM. Any compute capability.
template <int DT>
__global__ void __launch_bounds__(256, 6) nchw_to_nhwc(const typename wgh::Elem<DT>::T* __restrict__ x,
                                                    typename wgh::Elem<DT>::T* __restrict__ y, int C, int HW, int N) {
  using E = wgh::Elem<DT>;
  using T = typename E::T;
  constexpr int TILE = kNchwCopyTile;
  constexpr int ROWS = TILE / 8;  // rows per warp (8 warps)
  constexpr bool H16 = sizeof(T) == 2;
  // (rows of 66 16-bit values: 4-byte aligned for the paired stores, word (33 row + lane) in bank row + lane; the
  // paired column reads of rows 2 lane and 2 lane + 1 meet in pairs of lanes (2-way), which the copy's bandwidth
  // bound hides; fp32 rows of 65: the column reads of the second phase fall in 32 different banks)
  __shared__ __align__(4) T tile[TILE][TILE + (H16 ? 2 : 1)];
  const int p0 = blockIdx.x * TILE;
  const int c0 = blockIdx.y * TILE;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const bool pairs = H16 && !(HW & 1) && !(C & 1) && !(reinterpret_cast<unsigned long long>(x) & 3ull) &&
                     !(reinterpret_cast<unsigned long long>(y) & 3ull);
  for (int n = blockIdx.z; n < N; n += gridDim.z) {
    const T* xn = x + static_cast<long long>(n) * C * HW;
    T* yn = y + static_cast<long long>(n) * C * HW;
    if (H16 && pairs) {
      // (every load of the tile issued before the first shared store: 8 x 4 bytes in flight per thread)
      unsigned v[ROWS];
      const int p = p0 + 2 * lane;  // (even, and HW even: p + 1 < HW whenever p < HW)
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        const int c = c0 + warp + 8 * r;
        v[r] = (c < C && p < HW) ? __ldg(reinterpret_cast<const unsigned*>(xn + c * HW + p)) : 0u;
      }
#pragma unroll
      for (int r = 0; r < ROWS; ++r) *reinterpret_cast<unsigned*>(&tile[warp + 8 * r][2 * lane]) = v[r];
      __syncthreads();
      const int c = c0 + 2 * lane;  // (even, and C even: c + 1 < C whenever c < C)
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        const int i = warp + 8 * r;
        if (p0 + i < HW && c < C) E::store_pair(yn + (p0 + i) * C + c, tile[2 * lane][i], tile[2 * lane + 1][i]);
      }
    } else {
#pragma unroll
      for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int j = lane; j < TILE; j += 32) {
          const int i = warp + 8 * r;
          if (c0 + i < C && p0 + j < HW) tile[i][j] = xn[(c0 + i) * HW + p0 + j];
        }
      __syncthreads();
#pragma unroll
      for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int j = lane; j < TILE; j += 32) {
          const int i = warp + 8 * r;
          if (p0 + i < HW && c0 + j < C) yn[(p0 + i) * C + c0 + j] = tile[j][i];
        }
    }
    __syncthreads();
  }
}

// A polyphase plan's first launch (conv_params.h PolyphaseParams): the input, NCHW or channels_last (IN_NHWC), as
// its polyphase form, channels_last. Each thread writes two neighbouring values of a form row (Wp Cp values of image
// n, form row u), so that a warp's stores are 128 contiguous bytes; grid.x covers a row's pairs, grid.y the Hp rows,
// grid.z the images (a stride of gridDim.z past 65535). A form channel's phase row, phase column and input channel
// come from a table the block builds first (Cp entries, at most kPolyphaseMaxChannels: C < 64 and strides <= 8), so
// each pair costs one division (its pixel). A channels_last input's values of a phase row are s_w C contiguous values
// (neighbouring lanes read neighbouring values); an NCHW input's are read a plane apart. Any compute capability.
template <int DT, int IN_NHWC>
__global__ void __launch_bounds__(kPolyphaseThreads) polyphase_gather(const typename wgh::Elem<DT>::T* __restrict__ x,
                                                                      typename wgh::Elem<DT>::T* __restrict__ xp,
                                                                      const PolyphaseParams q) {
  using E = wgh::Elem<DT>;
  using T = typename E::T;
  __shared__ int table[kPolyphaseMaxChannels];  // form channel -> ph | pw << 8 | c << 16, or -1: a zero channel
  const int phases = q.sh * q.sw * q.C;
  for (int cc = threadIdx.x; cc < q.Cp; cc += kPolyphaseThreads) {
    const int phase = cc / q.C;
    const int ph = phase / q.sw;
    table[cc] = cc < phases ? ph | (phase - ph * q.sw) << 8 | (cc - phase * q.C) << 16 : -1;
  }
  __syncthreads();
  const int e = 2 * (blockIdx.x * kPolyphaseThreads + threadIdx.x);  // (Cp is even: a pair is in one form pixel)
  if (e >= q.Wp * q.Cp) return;
  const int v = e / q.Cp;
  const int cc = e - v * q.Cp;
  const int u = blockIdx.y;
  const int t0 = table[cc], t1 = table[cc + 1];
  const long long plane = static_cast<long long>(q.H) * q.W;
  for (int n = blockIdx.z; n < q.N; n += gridDim.z) {
    T val[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int t = j ? t1 : t0;
      const int ih = q.sh * u + (t & 255) - q.pad_h;
      const int iw = q.sw * v + ((t >> 8) & 255) - q.pad_w;
      const int c = t >> 16;
      val[j] = E::zero();
      if (t >= 0 && ih >= 0 && ih < q.H && iw >= 0 && iw < q.W)
        val[j] = __ldg(IN_NHWC == 1 ? x + ((static_cast<long long>(n) * q.H + ih) * q.W + iw) * q.C + c
                                    : x + (static_cast<long long>(n) * q.C + c) * plane +
                                          static_cast<long long>(ih) * q.W + iw);
    }
    E::store_pair(xp + (static_cast<long long>(n) * q.Hp + u) * q.Wp * q.Cp + e, val[0], val[1]);
  }
}

// A polyphase plan's second launch: the weight (any dense format: its strides in q) as the form's KRSC weight, K x
// Rp x Sp x Cp, one value per thread in a grid-stride loop (zeros for taps past R, S and channels past s_h s_w C).
// Any compute capability.
template <int DT>
__global__ void __launch_bounds__(kPolyphaseWeightThreads) polyphase_weight(
    const typename wgh::Elem<DT>::T* __restrict__ w, typename wgh::Elem<DT>::T* __restrict__ wq,
    const PolyphaseParams q) {
  using E = wgh::Elem<DT>;
  const int total = q.K * q.Rp * q.Sp * q.Cp;
  for (int i = blockIdx.x * kPolyphaseWeightThreads + threadIdx.x; i < total;
       i += gridDim.x * kPolyphaseWeightThreads) {
    const int cc = i % q.Cp;
    int rest = i / q.Cp;
    const int sp = rest % q.Sp;
    rest /= q.Sp;
    const int rp = rest % q.Rp;
    const int k = rest / q.Rp;
    const int phase = cc / q.C;
    const int c = cc - phase * q.C;
    const int ph = phase / q.sw;
    const int pw = phase - ph * q.sw;
    const int r = q.sh * rp + ph, s = q.sw * sp + pw;
    wq[i] = phase < q.sh * q.sw && r < q.R && s < q.S
                ? __ldg(w + static_cast<long long>(k) * q.wk + static_cast<long long>(c) * q.wc +
                        static_cast<long long>(r) * q.wr + static_cast<long long>(s) * q.ws)
                : E::zero();
  }
}

template <int DT, int WN, int MI, int WG, int STAGES, int NHWC, int SK>
__global__ void __launch_bounds__(128 * (WG + 1), 1)
    implicit_gemm_tma_h16_conv2d(const __grid_constant__ TmaMap xmap, const __grid_constant__ TmaMap wmap,
                                 const typename wgh::Elem<DT>::T* __restrict__ bias,
                                 typename wgh::Elem<DT>::T* __restrict__ y, const Conv2dParams p,
                                 float* __restrict__ ws) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int BK = DT == 2 ? 32 : 64;  // channels per k tile: one 128-byte row per pixel and per output channel
  constexpr int TC = 128 * WG;       // consumer threads; the producer warpgroup follows them
  constexpr int BM = WN;             // output channels per tile (SK = 0: grid.y)
  constexpr int BN = 64 * MI * WG;   // output pixels per tile (SK = 0: grid.x): one im2col copy
  constexpr int NACC = MI * WN / 2;
  constexpr bool SHIFT_REGS = WG == 2;  // 384 threads get 168 registers each at launch
  static_assert(WN == 64 || WN == 128 || WN == 192 || WN == 256, "wgmma's N");
  static_assert(BN <= 256, "one im2col copy loads at most 256 pixels here");
  static_assert(STAGES >= 2, "a stage being read and one being filled");
  static_assert(NACC <= 128, "accumulators fit the register file");
  static_assert(SK == 0 || SK == 1 || SK == 2, "one tile per block, stream-K or persistent blocks");

  extern __shared__ unsigned char smem_raw[];
  __shared__ __align__(8) unsigned long long bars[2 * STAGES];  // full[STAGES], then empty[STAGES]
  const unsigned smem_base = static_cast<unsigned>(__cvta_generic_to_shared(smem_raw));
  const unsigned smem0 = (smem_base + 1023u) & ~1023u;
  const unsigned full0 = static_cast<unsigned>(__cvta_generic_to_shared(bars));
  const unsigned empty0 = full0 + 8 * STAGES;

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int cb_n = (p.C + BK - 1) / BK;  // BK-channel blocks per tap
  const int num_k = p.R * p.S * cb_n;
  // SK = 0: the block's tile is (blockIdx.x, blockIdx.y), its k tiles slice blockIdx.z of split-K's even split.
  // SK = 1: a one-dimensional grid; the block walks its share of the iterations tile by tile, the tiles numbered
  // with the output-channel blocks innermost (tile = pixel block * gy + channel block: the blocks that read the same
  // input pixels run together). SK = 2: a one-dimensional grid; the block takes tiles blockIdx.x, + gridDim.x, ...
  // whole, numbered as for SK = 1.
  const int split = static_cast<int>(gridDim.z);
  const int t_begin = h16::slice_begin(blockIdx.z, num_k, split);
  const int tiles = h16::slice_begin(static_cast<long long>(blockIdx.z) + 1, num_k, split) - t_begin;
  const int gy = (p.K + BM - 1) / BM;
  // (the problem rule keeps stream-K's work, all tiles' k tiles, below 2^31)
  const int work = SK == 1 ? (p.N * p.P * p.Q + BN - 1) / BN * gy * num_k : 0;
  const int sk_start = SK == 1 ? static_cast<int>(wgt::sk_begin(blockIdx.x, work, gridDim.x)) : 0;
  const int sk_end = SK == 1 ? static_cast<int>(wgt::sk_begin(blockIdx.x + 1ll, work, gridDim.x)) : 0;
  const int ntiles = SK == 2 ? (p.N * p.P * p.Q + BN - 1) / BN * gy : 0;  // (the epilogue's rule keeps it in 32 bits)

  if (tid == TC) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      wgt::mbar_init(full0 + 8 * s, 1);        // the producer's arrival (with the copies' bytes)
      wgt::mbar_init(empty0 + 8 * s, 4 * WG);  // one arrival per consumer warp
    }
    wgt::fence_barrier_init();
  }
  __syncthreads();

  int slot = 0;
  unsigned phase = 0;
  if (tid >= TC) {
    // The producer warpgroup: one thread issues every copy; the others give their registers to the consumers.
    if constexpr (SHIFT_REGS) asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    if (tid == TC) {
      int issued = 0;
      if constexpr (SK == 2) {
        for (int tile = blockIdx.x; tile < ntiles; tile += gridDim.x)
          wgt::produce<DT, BN, BM, STAGES>(&xmap, &wmap, p, tile / gy * BN, tile % gy * BM, 0, num_k, cb_n, smem0,
                                           full0, empty0, slot, phase, issued);
      } else if constexpr (SK == 1) {
        for (int x = sk_start; x < sk_end;) {
          const int tile = x / num_k;
          const int kb = x - tile * num_k;
          const int ke = min(num_k, sk_end - tile * num_k);
          wgt::produce<DT, BN, BM, STAGES>(&xmap, &wmap, p, tile / gy * BN, tile % gy * BM, kb, ke, cb_n, smem0,
                                           full0, empty0, slot, phase, issued);
          x = tile * num_k + ke;
        }
      } else {
        wgt::produce<DT, BN, BM, STAGES>(&xmap, &wmap, p, blockIdx.x * BN, blockIdx.y * BM, t_begin,
                                         t_begin + tiles, cb_n, smem0, full0, empty0, slot, phase, issued);
      }
    }
    return;  // (the consumers' hand-overs meet at a named barrier of their own)
  }
  if constexpr (SHIFT_REGS) asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");

  float acc[MI][WN / 2];
  const unsigned a_rows = (warp >> 2) * (MI * 64 * 128);  // this warpgroup's MI blocks of 64 pixel rows
  if constexpr (SK == 2) {
    for (int tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
      wgt::zero<WN, MI>(acc);
      wgt::consume<DT, WN, MI, BN, BM, STAGES>(acc, num_k, smem0, full0, empty0, a_rows, tid & 31, slot, phase);
      if constexpr (NHWC == 1) {
        wgh::store<DT, WN, MI, WG, true>(acc, p, bias, y, tile / gy * BN, tile % gy * BM);
      } else {  // staged through the buffer after the ring (the ring already holds the next tile's k tiles)
        wgt::store_nchw_staged<DT, WN, MI, WG>(
            acc, p, bias, y, tile / gy * BN, tile % gy * BM,
            reinterpret_cast<float*>(smem_raw + (smem0 - smem_base) + STAGES * (BN + BM) * 128));
      }
    }
  } else if constexpr (SK == 1) {
    for (int x = sk_start; x < sk_end;) {
      const int tile = x / num_k;
      const int kb = x - tile * num_k;
      const int ke = min(num_k, sk_end - tile * num_k);
      wgt::zero<WN, MI>(acc);
      wgt::consume<DT, WN, MI, BN, BM, STAGES>(acc, ke - kb, smem0, full0, empty0, a_rows, tid & 31, slot, phase);
      if ((kb == 0 && ke == num_k) ||
          wgt::sk_hand_over<WN, MI, WG>(acc, ws, tile, num_k, work, gridDim.x, x == sk_start ? 0 : 1))
        wgh::store<DT, WN, MI, WG, NHWC == 1>(acc, p, bias, y, tile / gy * BN, tile % gy * BM);
      x = tile * num_k + ke;
    }
  } else {
    wgt::zero<WN, MI>(acc);
    wgt::consume<DT, WN, MI, BN, BM, STAGES>(acc, tiles, smem0, full0, empty0, a_rows, tid & 31, slot, phase);
    static_assert(32 * (BN + 4) * 4 <= STAGES * (BN + BM) * 128, "the staged NCHW tile fits the ring");
    float* const stage = reinterpret_cast<float*>(smem_raw + (smem0 - smem_base));
    if (split > 1 && wgt::cluster_size() > 1) {
      // split-K in a cluster (the host launched the slices as one; only for a tile whose fp32 sums fit the ring, as
      // the host checks at load): each rank reduces and stores its share of the tile's channels
      if constexpr (4 * BM * BN <= STAGES * (BN + BM) * 128) {
        int jb, je;
        wgt::cluster_reduce<WN, MI, WG, NHWC == 1 ? 1 : 4>(acc, smem0, p.K - static_cast<int>(blockIdx.y) * BM, jb,
                                                          je);
        if constexpr (NHWC == 1) {
          wgh::store<DT, WN, MI, WG, true>(acc, p, bias, y, blockIdx.x * BN, blockIdx.y * BM, jb, je);
          wgt::cluster_wait();  // the other ranks have read this block's ring
        } else {
          wgt::cluster_wait();  // (before the staged store overwrites the ring the other ranks read)
          wgt::store_nchw_staged<DT, WN, MI, WG>(acc, p, bias, y, blockIdx.x * BN, blockIdx.y * BM, stage, jb / 4,
                                                 je / 4);
        }
      }
      return;
    }
    if (!wgh::split_hand_over<WN, MI, WG, false>(acc, ws)) return;
    if constexpr (NHWC == 1) {
      wgh::store<DT, WN, MI, WG, true>(acc, p, bias, y, blockIdx.x * BN, blockIdx.y * BM);
    } else {
      wgt::store_nchw_staged<DT, WN, MI, WG>(acc, p, bias, y, blockIdx.x * BN, blockIdx.y * BM, stage);
    }
  }
#elif defined(__CUDA_ARCH__)
  static_assert(WN < 0, "implicit_gemm_tma_h16_conv2d needs sm_90a (wgmma, TMA): compile with --gpu-architecture=sm_90a");
#endif
}

}  // namespace bagf
