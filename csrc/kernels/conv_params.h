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

// The s_h x s_w polyphase form of a strided convolution (polyphase_gather and polyphase_weight in
// implicit_gemm_tma_h16.cuh, a polyphase TMA plan's first two launches): output pixel (p, q) of a dilation-1 conv at
// stride (s_h, s_w) reads input rows s_h p + r - pad_h = s_h (p + r') + ph - pad_h for r = s_h r' + ph, so it is a
// stride-1 unpadded conv with Rp = ceil(R / s_h) x Sp = ceil(S / s_w) taps over a Hp x Wp image of Cp channels:
// channel (ph s_w + pw) C + c of form pixel (u, v) holds the padded input's x[c][s_h u + ph][s_w v + pw] (zero outside
// the image), form channels s_h s_w C .. Cp - 1 are zeros (Cp = s_h s_w C rounded up to 8: the TMA maps' 16-byte
// strides), and the form's weight (KRSC, K x Rp x Sp x Cp) holds w[k][c][s_h r' + ph][s_w s' + pw] (zero past R, S).
// A form pixel's channels of one phase row ph are s_w C values of s_w neighbouring channels_last input pixels, in
// their order. Hp = P + Rp - 1 and Wp = Q + Sp - 1: the rows and columns the P x Q outputs read.
struct PolyphaseParams {
  int N, C, H, W;        // the input (NCHW or channels_last: the gather's template parameter)
  int sh, sw;            // the stride: phases per row and per column
  int pad_h, pad_w;
  int Hp, Wp, Cp;        // the form's extents
  int K, R, S, Rp, Sp;   // the weight and the form's taps
  int wk, wc, wr, ws;    // the weight's strides in elements (KCRS or KRSC: any dense format)
};

BAGF_HOST_DEVICE inline int polyphase_channels(int C, int sh, int sw) { return (sh * sw * C + 7) / 8 * 8; }

// The form of problem ``p`` (dilation 1; strides as given: a stride of 1 is one phase) with the weight's strides;
// the host has checked that its extents fit int32.
BAGF_HOST_DEVICE inline PolyphaseParams polyphase_form(const Conv2dParams& p, int wk, int wc, int wr, int ws) {
  PolyphaseParams q;
  q.N = p.N, q.C = p.C, q.H = p.H, q.W = p.W;
  q.sh = p.stride_h, q.sw = p.stride_w, q.pad_h = p.pad_h, q.pad_w = p.pad_w;
  q.K = p.K, q.R = p.R, q.S = p.S;
  q.Rp = (p.R + p.stride_h - 1) / p.stride_h;
  q.Sp = (p.S + p.stride_w - 1) / p.stride_w;
  q.Hp = p.P + q.Rp - 1;
  q.Wp = p.Q + q.Sp - 1;
  q.Cp = polyphase_channels(p.C, p.stride_h, p.stride_w);
  q.wk = wk, q.wc = wc, q.wr = wr, q.ws = ws;
  return q;
}

// The stride-1 problem the plan's kernel runs on the form: Cp channels, Hp x Wp pixels, Rp x Sp taps, no padding,
// the same outputs, bias and epilogue.
BAGF_HOST_DEVICE inline Conv2dParams polyphase_inner(const Conv2dParams& p, const PolyphaseParams& q) {
  Conv2dParams i = p;
  i.C = q.Cp, i.H = q.Hp, i.W = q.Wp, i.R = q.Rp, i.S = q.Sp;
  i.stride_h = i.stride_w = 1;
  i.pad_h = i.pad_w = 0;
  i.dil_h = i.dil_w = 1;
  return i;
}

// polyphase_gather's threads per block (two form values each) and polyphase_weight's; the most form channels
// polyphase_gather's table holds (the host sends a call with more to ATen: C < 64 and strides of at most 8 give at
// most 4032).
constexpr int kPolyphaseThreads = 128;
constexpr int kPolyphaseWeightThreads = 256;
constexpr int kPolyphaseMaxChannels = 4096;

// nchw_to_nhwc's tile (implicit_gemm_tma_h16.cuh): channels and pixels per block, each way; the host sizes the copy's
// grid with it.
constexpr int kNchwCopyTile = 64;

}  // namespace bagf
