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

// The input rows a staged non-fused Winograd block needs (winograd_gemm.cuh, ST=1): block x of stage 1 takes
// tiles [x*tb, min(T, (x+1)*tb)) of one channel. Tiles run image by image, tile rows, tile columns fastest; the
// block loads, for its channel, every input row from the first one its first tile reads to the last one its last
// tile reads, counted over images back to back (row index n*H + h), whole rows of W floats. first: that row
// index; rows: how many (0 when the tiles read only padding rows).
struct StagedRows {
  long long first;
  int rows;
};

BAGF_HOST_DEVICE inline StagedRows staged_rows(int block, int tb, int mt, const Conv2dParams& p) {
  const int tiles_q = (p.Q + mt - 1) / mt;
  const int tiles_img = ((p.P + mt - 1) / mt) * tiles_q;
  const long long total = static_cast<long long>(p.N) * tiles_img;
  const long long t0 = static_cast<long long>(block) * tb;
  const long long t1 = (t0 + tb < total ? t0 + tb : total) - 1;
  const long long n0 = t0 / tiles_img, n1 = t1 / tiles_img;
  const int tp0 = static_cast<int>(t0 - n0 * tiles_img) / tiles_q;
  const int tp1 = static_cast<int>(t1 - n1 * tiles_img) / tiles_q;
  int lo = tp0 * mt - p.pad_h;
  int hi = tp1 * mt - p.pad_h + mt + 1;  // the last tile's patch is mt + 2 rows
  // clip to the image; a tile row entirely in the padding reads nothing, and every row between two images' tiles
  // belongs to one of them (rows of image n0 below lo and of image n1 above hi are not loaded)
  lo = lo < 0 ? 0 : (lo > p.H ? p.H : lo);
  hi = hi > p.H - 1 ? p.H - 1 : (hi < -1 ? -1 : hi);
  StagedRows r;
  r.first = n0 * p.H + lo;
  const long long last = n1 * p.H + hi;
  r.rows = last >= r.first ? static_cast<int>(last - r.first + 1) : 0;
  return r;
}

// An upper bound of staged_rows(...).rows over every block, which the host sizes shared memory with: tb tiles
// span at most g = ceil((tb-1)/tiles_q) + 1 tile rows, each step to the next tile row moves the first row read by
// at most mt + 2 (mt inside an image; across an image boundary H - (tile rows - 1)*mt <= mt + 2 - 2*pad), and the
// last tile row reads mt + 2 rows: rows <= g*(mt+2); also at most every row of the images the tiles touch.
BAGF_HOST_DEVICE inline int staged_rows_bound(int tb, int mt, const Conv2dParams& p) {
  const int tiles_q = (p.Q + mt - 1) / mt;
  const int tiles_img = ((p.P + mt - 1) / mt) * tiles_q;
  const long long by_rows = static_cast<long long>((tb - 1 + tiles_q - 1) / tiles_q + 1) * (mt + 2);
  const long long by_images = static_cast<long long>((tb - 1 + tiles_img - 1) / tiles_img + 1) * p.H;
  const long long b = by_rows < by_images ? by_rows : by_images;
  return b > 0x7fffffff ? 0x7fffffff : static_cast<int>(b);
}

}  // namespace bagf
