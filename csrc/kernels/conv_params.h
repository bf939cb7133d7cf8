// Shape arguments shared by the host launcher (g++) and the kernels (NVRTC / nvcc).
// Plain C: no torch, no CUDA headers, so both compilers see the same layout.
#pragma once

#if defined(__CUDACC__)
#define BAGF_HOST_DEVICE __host__ __device__
#else
#define BAGF_HOST_DEVICE
#endif

namespace bagf {

// All extents are int32: the host refuses (ATen fallback) any tensor with more than 2^31-1 elements,
// so every offset computed below fits.
struct Conv2dParams {
  int N, C, H, W;       // input  NCHW
  int K, R, S;          // weight KCRS
  int P, Q;             // output spatial extent
  int stride_h, stride_w;
  int pad_h, pad_w;
  int dil_h, dil_w;
  int has_bias;
  // The ReLU after the conv in its epilogue (TMA plans, implicit_gemm_tma_h16.cuh; the host sets it only for them):
  // 0 none; 1 torch's ReLU of the output as rounded to its dtype, -0.0 made +0.0; 2 the same keeping -0.0, where
  // torch's ReLU keeps it on the device. NaN stays NaN, as torch's ReLU leaves it.
  int relu;
};

// The input patch a TH x TW output tile reads (halo included): rows x cols, stored in shared memory with an
// odd row pitch (rows read at a stride then start in different banks). One formula for both compilers: the
// host sizes a direct plan's dynamic shared memory with it, the kernel lays its buffers out with it.
struct HaloPatch {
  int rows, cols, pitch;
};

BAGF_HOST_DEVICE inline HaloPatch halo_patch(int th, int tw, const Conv2dParams& p) {
  HaloPatch h;
  h.rows = (th - 1) * p.stride_h + (p.R - 1) * p.dil_h + 1;
  h.cols = (tw - 1) * p.stride_w + (p.S - 1) * p.dil_w + 1;
  h.pitch = h.cols | 1;
  return h;
}

// Sizes and strides of the pooling epilogue (pool_epilogue.cuh). The host refuses tensors of 2^31 or more elements,
// so extents fit int32; offsets are computed in 64 bits once multiplied by a stride.
struct PoolParams {
  int N, C, H, W;  // input
  int P, Q;        // output spatial extent
  int kh, kw, sh, sw, ph, pw, dh, dw;
  int relu_keeps_negative_zero;  // 1: relu(-0.0) = -0.0, as torch's ReLU gives it on this device; 0: +0.0
  long long xs[4];  // input strides (elements) of n, c, h, w
  long long ys[4];  // output strides of n, c, p, q
};

// nchw_to_nhwc's tile (implicit_gemm_tma_h16.cuh): channels and pixels per block, each way; the host sizes the copy's
// grid with it.
constexpr int kNchwCopyTile = 64;

}  // namespace bagf
