// fp32 Winograd F(MT x MT, 3 x 3) convolution, fused in one kernel: NCHW input, KCRS weights, NKPQ output.
// Stride 1, dilation 1, 3x3 filters, any padding (the host refuses other problems: ATen answers them).
//
//   Y = A^T [ sum_c (G g_kc G^T) . (B^T d_c B) ] A      per MT x MT output tile, A = MT + 2
//
// Dataflow (the transformed tiles stay on chip): a block owns BT output tiles (over N x tile rows x
// tile columns) and BK output channels, and streams input channels through shared memory BC at a time. For
// each chunk it gathers the BT input tiles (A x A, halo included; the padding reads zeros), transforms them
// to V = B^T d B and the BK x BC filters to U = G g G^T, both into shared memory; then the E = A*A Winograd
// points are E independent BK x BT x BC products accumulated in registers. No transformed tensor ever goes
// through global memory: the input is read once per block column (plus the tile overlap, (A/MT)^2), the
// weights once per block row. After the last chunk the accumulators go through shared memory (in ROUNDS
// passes over the tiles when all E x BK x BT would not fit in the loop's buffers), each (k, tile) is
// inverse-transformed, the bias added and the MT x MT outputs written (bounds-checked at the P, Q edges).
//
// Template parameters are the tuning knobs (bagf_torch/kernels/winograd.py holds their validity rules):
//   MT  output tile (2: F(2x2,3x3), 16 products per 4 outputs; 4: F(4x4,3x3), 36 per 16)
//   BK  output channels per block            TK  per thread, within one Winograd point's product (2, 4, 8)
//   BT  output tiles per block               TT  per thread (2, 4, 8): larger register tiles need fewer
//                                                shared-memory loads per FMA (TK=TT=4: 2 LDS.128 per 16 FMA)
//   BC  input channels per chunk             EG  thread groups over the E points (each thread: E/EG points)
//   DB  1: the next chunk's raw patches and weights are prefetched into registers during this chunk's products
//   SPLIT  input-channel slices (grid.z); > 1: slices add atomically into the output the host zeroed
//
// The transforms skip the matrices' zero coefficients at compile time (no fast-math: 0*x is not folded).
// They are host-callable too: tests/test_nvcc.py checks them (and out_rounds) against Python on a CPU.
// The kernel includes nothing from torch; NVRTC compiles it at run time and plain nvcc in the tests.
#pragma once
#include "conv_params.h"

namespace bagf {
namespace wino {

// Lavin and Gray's matrices (the same as bagf_torch/winograd_math.py): B^T (A x A), G (A x 3), A^T (MT x A).
template <int MT>
struct Mat;

template <>
struct Mat<2> {
  __host__ __device__ static constexpr float bt(int i, int j) {
    constexpr float m[4][4] = {{1, 0, -1, 0}, {0, 1, 1, 0}, {0, -1, 1, 0}, {0, 1, 0, -1}};
    return m[i][j];
  }
  __host__ __device__ static constexpr float g(int i, int j) {
    constexpr float m[4][3] = {{1, 0, 0}, {0.5f, 0.5f, 0.5f}, {0.5f, -0.5f, 0.5f}, {0, 0, 1}};
    return m[i][j];
  }
  __host__ __device__ static constexpr float at(int i, int j) {
    constexpr float m[2][4] = {{1, 1, 1, 0}, {0, 1, -1, -1}};
    return m[i][j];
  }
};

template <>
struct Mat<4> {
  __host__ __device__ static constexpr float bt(int i, int j) {
    constexpr float m[6][6] = {{4, 0, -5, 0, 1, 0},  {0, -4, -4, 1, 1, 0}, {0, 4, -4, -1, 1, 0},
                               {0, -2, -1, 2, 1, 0}, {0, 2, -1, -2, 1, 0}, {0, 4, 0, -5, 0, 1}};
    return m[i][j];
  }
  __host__ __device__ static constexpr float g(int i, int j) {
    constexpr float m[6][3] = {{1.f / 4, 0, 0},
                               {-1.f / 6, -1.f / 6, -1.f / 6},
                               {-1.f / 6, 1.f / 6, -1.f / 6},
                               {1.f / 24, 1.f / 12, 1.f / 6},
                               {1.f / 24, -1.f / 12, 1.f / 6},
                               {0, 0, 1}};
    return m[i][j];
  }
  __host__ __device__ static constexpr float at(int i, int j) {
    constexpr float m[4][6] = {{1, 1, 1, 1, 1, 0}, {0, 1, -1, 2, -2, 0}, {0, 1, 1, 4, 4, 0}, {0, 1, -1, 8, -8, 1}};
    return m[i][j];
  }
};

// Toom-Cook F(5, 3) and F(6, 3) (bagf_torch/winograd_math.py's toom_cook on POINTS; the non-fused family uses them).
template <>
struct Mat<5> {
  __host__ __device__ static constexpr float bt(int i, int j) {
    constexpr float m[7][7] = {{-2, 4, 5.f / 2, -5, -1.f / 2, 1, 0}, {0, 2, -2, -9.f / 2, 1.f / 2, 1, 0},
                               {0, -2, 6, -7.f / 2, -3.f / 2, 1, 0}, {0, 1, -3.f / 2, -2, 3.f / 2, 1, 0},
                               {0, -1, 5.f / 2, 0, -5.f / 2, 1, 0},  {0, 4, 0, -5, 0, 1, 0},
                               {0, -2, 4, 5.f / 2, -5, -1.f / 2, 1}};
    return m[i][j];
  }
  __host__ __device__ static constexpr float g(int i, int j) {
    constexpr float m[7][3] = {{-1.f / 2, 0, 0},           {-1.f / 3, -1.f / 3, -1.f / 3}, {1.f / 9, -1.f / 9, 1.f / 9},
                               {1.f / 36, 1.f / 18, 1.f / 9}, {-1.f / 60, 1.f / 30, -1.f / 15},
                               {32.f / 45, 16.f / 45, 8.f / 45}, {0, 0, 1}};
    return m[i][j];
  }
  __host__ __device__ static constexpr float at(int i, int j) {
    constexpr float m[5][7] = {{1, 1, 1, 1, 1, 1, 0},
                               {0, 1, -1, 2, -2, 1.f / 2, 0},
                               {0, 1, 1, 4, 4, 1.f / 4, 0},
                               {0, 1, -1, 8, -8, 1.f / 8, 0},
                               {0, 1, 1, 16, 16, 1.f / 16, 1}};
    return m[i][j];
  }
};

template <>
struct Mat<6> {
  __host__ __device__ static constexpr float bt(int i, int j) {
    constexpr float m[8][8] = {{-1, 0, 21.f / 4, 0, -21.f / 4, 0, 1, 0},
                               {0, 1, 1, -17.f / 4, -17.f / 4, 1, 1, 0},
                               {0, -1, 1, 17.f / 4, -17.f / 4, -1, 1, 0},
                               {0, 1.f / 2, 1.f / 4, -5.f / 2, -5.f / 4, 2, 1, 0},
                               {0, -1.f / 2, 1.f / 4, 5.f / 2, -5.f / 4, -2, 1, 0},
                               {0, 2, 4, -5.f / 2, -5, 1.f / 2, 1, 0},
                               {0, -2, 4, 5.f / 2, -5, -1.f / 2, 1, 0},
                               {0, -1, 0, 21.f / 4, 0, -21.f / 4, 0, 1}};
    return m[i][j];
  }
  __host__ __device__ static constexpr float g(int i, int j) {
    constexpr float m[8][3] = {{-1, 0, 0},
                               {-2.f / 9, -2.f / 9, -2.f / 9},
                               {-2.f / 9, 2.f / 9, -2.f / 9},
                               {1.f / 90, 1.f / 45, 2.f / 45},
                               {1.f / 90, -1.f / 45, 2.f / 45},
                               {32.f / 45, 16.f / 45, 8.f / 45},
                               {32.f / 45, -16.f / 45, 8.f / 45},
                               {0, 0, 1}};
    return m[i][j];
  }
  __host__ __device__ static constexpr float at(int i, int j) {
    constexpr float m[6][8] = {{1, 1, 1, 1, 1, 1, 1, 0},
                               {0, 1, -1, 2, -2, 1.f / 2, -1.f / 2, 0},
                               {0, 1, 1, 4, 4, 1.f / 4, 1.f / 4, 0},
                               {0, 1, -1, 8, -8, 1.f / 8, -1.f / 8, 0},
                               {0, 1, 1, 16, 16, 1.f / 16, 1.f / 16, 0},
                               {0, 1, -1, 32, -32, 1.f / 32, -1.f / 32, 1}};
    return m[i][j];
  }
};

// out[i][j] = sum_l L(i, l) * in[l][j] over the nonzero coefficients (L is one of the tables above).
template <int ROWS, int INNER, int COLS, typename Coef>
__host__ __device__ __forceinline__ void left(Coef coef, const float (&in)[INNER][COLS], float (&out)[ROWS][COLS]) {
#pragma unroll
  for (int i = 0; i < ROWS; ++i) {
#pragma unroll
    for (int j = 0; j < COLS; ++j) {
      float s = 0.f;
      bool first = true;
#pragma unroll
      for (int l = 0; l < INNER; ++l) {
        const float c = coef(i, l);
        if (c == 0.f) continue;
        const float term = c == 1.f ? in[l][j] : (c == -1.f ? -in[l][j] : c * in[l][j]);
        s = first ? term : s + term;
        first = false;
      }
      out[i][j] = s;
    }
  }
}

// out[i][j] = sum_l in[i][l] * R(j, l)  (i.e. in times R^T).
template <int ROWS, int INNER, int COLS, typename Coef>
__host__ __device__ __forceinline__ void right(Coef coef, const float (&in)[ROWS][INNER], float (&out)[ROWS][COLS]) {
#pragma unroll
  for (int i = 0; i < ROWS; ++i) {
#pragma unroll
    for (int j = 0; j < COLS; ++j) {
      float s = 0.f;
      bool first = true;
#pragma unroll
      for (int l = 0; l < INNER; ++l) {
        const float c = coef(j, l);
        if (c == 0.f) continue;
        const float term = c == 1.f ? in[i][l] : (c == -1.f ? -in[i][l] : c * in[i][l]);
        s = first ? term : s + term;
        first = false;
      }
      out[i][j] = s;
    }
  }
}

// The tables as function objects (the transforms take the coefficient as a callable, so one template serves
// every tile size).
template <int MT>
struct BtOf { __host__ __device__ constexpr float operator()(int i, int j) const { return Mat<MT>::bt(i, j); } };
template <int MT>
struct GOf { __host__ __device__ constexpr float operator()(int i, int j) const { return Mat<MT>::g(i, j); } };
template <int MT>
struct AtOf { __host__ __device__ constexpr float operator()(int i, int j) const { return Mat<MT>::at(i, j); } };

template <int MT>
struct Coefs {
  using Bt = BtOf<MT>;
  using G = GOf<MT>;
  using At = AtOf<MT>;
};

// N consecutive floats from shared memory in the widest vector loads their alignment allows (the callers'
// offsets are multiples of N, and N, ULD, VLD multiples of 4 when N >= 4).
template <int N>
__device__ __forceinline__ void load_row(const float* p, float (&r)[N]) {
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

// Shared-memory rounds of the output stage: the fewest passes over the tiles (a power of two dividing the
// threads' tile columns TTN) whose E x BK x (BT/ROUNDS + 1) accumulator buffer fits in the loop's buffers.
__host__ __device__ constexpr int out_rounds(int e, int bk, int bt, int ttn, int loop_floats) {
  int r = 1;
  while (r < ttn && ttn % (2 * r) == 0 && e * bk * (bt / r + 1) > loop_floats) r *= 2;
  return r;
}

}  // namespace wino

namespace wino {

// The channel loop both Winograd kernels share: for each chunk of BC input channels in this block's slice,
// gather the BT input patches and the BK x BC filters, transform them into Us [E][BC][ULD] and Vs [E][BC][VLD]
// (shared memory), then call products() (between two barriers). DB = 1 prefetches the next chunk's raw
// patches and weights into registers before this chunk's products, so their global-memory latency overlaps
// the arithmetic. Returns nothing: the products accumulate in the caller's registers.
template <int MT, int BK, int BT, int BC, int ULD, int VLD, int T, int DB, typename Products>
__device__ __forceinline__ void channel_loop(const float* __restrict__ x, const float* __restrict__ w,
                                             const Conv2dParams& p, float* Us, float* Vs, int t0, int k0,
                                             int cb, int ce, Products&& products) {
  constexpr int A = MT + 2;
  using Co = Coefs<MT>;
  const int tid = threadIdx.x;
  const int TQ = (p.Q + MT - 1) / MT;
  const int TPQ = ((p.P + MT - 1) / MT) * TQ;
  const int NT = p.N * TPQ;
  const int HW = p.H * p.W;

  // One (channel, tile) item of a chunk: gather its A x A input patch (the padding reads zeros) ...
  auto gather_input = [&](int c0, int it, float (&d)[A][A]) {
    const int t = it % BT;
    const int g = t0 + t;
    const int gc = c0 + it / BT;
    if (g < NT && gc < p.C) {
      const int n = g / TPQ;
      const int r = g - n * TPQ;
      const int tp = r / TQ;
      const int h0 = tp * MT - p.pad_h;
      const int w0 = (r - tp * TQ) * MT - p.pad_w;
      const float* xc = x + (n * p.C + gc) * HW;
#pragma unroll
      for (int a = 0; a < A; ++a) {
        const int ih = h0 + a;
        const bool row_ok = ih >= 0 && ih < p.H;
#pragma unroll
        for (int b = 0; b < A; ++b) {
          const int iw = w0 + b;
          d[a][b] = (row_ok && iw >= 0 && iw < p.W) ? __ldg(xc + ih * p.W + iw) : 0.f;
        }
      }
    } else {
#pragma unroll
      for (int a = 0; a < A; ++a)
#pragma unroll
        for (int b = 0; b < A; ++b) d[a][b] = 0.f;
    }
  };
  // ... and store V = B^T d B.
  auto store_input = [&](int it, const float (&d)[A][A]) {
    float tmp[A][A], v[A][A];
    left<A, A, A>(typename Co::Bt(), d, tmp);
    right<A, A, A>(typename Co::Bt(), tmp, v);
    const int t = it % BT;
    const int c = it / BT;
#pragma unroll
    for (int a = 0; a < A; ++a)
#pragma unroll
      for (int b = 0; b < A; ++b) Vs[((a * A + b) * BC + c) * VLD + t] = v[a][b];
  };
  // One (output channel, channel) filter of a chunk: gather its 9 weights, then store U = G g G^T.
  auto gather_filter = [&](int c0, int it, float (&gf)[3][3]) {
    const int gk = k0 + it / BC;
    const int gc = c0 + it % BC;
    if (gk < p.K && gc < p.C) {
      const float* wp = w + (gk * p.C + gc) * 9;
#pragma unroll
      for (int a = 0; a < 3; ++a)
#pragma unroll
        for (int b = 0; b < 3; ++b) gf[a][b] = __ldg(wp + a * 3 + b);
    } else {
#pragma unroll
      for (int a = 0; a < 3; ++a)
#pragma unroll
        for (int b = 0; b < 3; ++b) gf[a][b] = 0.f;
    }
  };
  auto store_filter = [&](int it, const float (&gf)[3][3]) {
    float tmp[A][3], u[A][A];
    left<A, 3, 3>(typename Co::G(), gf, tmp);
    right<A, 3, A>(typename Co::G(), tmp, u);
    const int c = it % BC;
    const int k = it / BC;
#pragma unroll
    for (int a = 0; a < A; ++a)
#pragma unroll
      for (int b = 0; b < A; ++b) Us[((a * A + b) * BC + c) * ULD + k] = u[a][b];
  };

  if constexpr (DB) {
    constexpr int IN_ITEMS = (BC * BT + T - 1) / T;
    constexpr int F_ITEMS = (BK * BC + T - 1) / T;
    float dreg[IN_ITEMS][A][A];
    float greg[F_ITEMS][3][3];
    auto gather = [&](int c0) {
#pragma unroll
      for (int i = 0; i < IN_ITEMS; ++i)
        if (tid + i * T < BC * BT) gather_input(c0, tid + i * T, dreg[i]);
#pragma unroll
      for (int i = 0; i < F_ITEMS; ++i)
        if (tid + i * T < BK * BC) gather_filter(c0, tid + i * T, greg[i]);
    };
    if (cb < ce) gather(cb * BC);
    for (int ch = cb; ch < ce; ++ch) {
#pragma unroll
      for (int i = 0; i < IN_ITEMS; ++i)
        if (tid + i * T < BC * BT) store_input(tid + i * T, dreg[i]);
#pragma unroll
      for (int i = 0; i < F_ITEMS; ++i)
        if (tid + i * T < BK * BC) store_filter(tid + i * T, greg[i]);
      __syncthreads();
      if (ch + 1 < ce) gather((ch + 1) * BC);
      products();
      __syncthreads();
    }
  } else {
    for (int ch = cb; ch < ce; ++ch) {
      const int c0 = ch * BC;
      for (int it = tid; it < BC * BT; it += T) {
        float d[A][A];
        gather_input(c0, it, d);
        store_input(it, d);
      }
      for (int it = tid; it < BK * BC; it += T) {
        float gf[3][3];
        gather_filter(c0, it, gf);
        store_filter(it, gf);
      }
      __syncthreads();
      products();
      __syncthreads();
    }
  }
}

// The output stage both kernels share, one round of it: the accumulators of tiles [round*BTR, (round+1)*BTR)
// are in Ms [E][BK][BTR+1]; each (k, tile) item is inverse-transformed (Y = A^T M A), the bias added and its
// in-bounds MT x MT outputs stored, or added atomically when the channels are split (SPLIT > 1).
template <int MT, int BK, int BTR, int T, int SPLIT>
__device__ __forceinline__ void output_round(const float* __restrict__ bias, float* __restrict__ y,
                                             const Conv2dParams& p, const float* Ms, int t0, int k0, int round,
                                             bool add_bias) {
  constexpr int A = MT + 2;
  constexpr int OLD = BTR + 1;
  using Co = Coefs<MT>;
  const int TQ = (p.Q + MT - 1) / MT;
  const int TPQ = ((p.P + MT - 1) / MT) * TQ;
  const int NT = p.N * TPQ;
  for (int it = threadIdx.x; it < BK * BTR; it += T) {
    const int t = it % BTR;
    const int k = it / BTR;
    const int g = t0 + round * BTR + t;
    const int gk = k0 + k;
    if (g < NT && gk < p.K) {
      float m[A][A], tmp[MT][A], o[MT][MT];
#pragma unroll
      for (int a = 0; a < A; ++a)
#pragma unroll
        for (int b = 0; b < A; ++b) m[a][b] = Ms[((a * A + b) * BK + k) * OLD + t];
      left<MT, A, A>(typename Co::At(), m, tmp);
      right<MT, A, MT>(typename Co::At(), tmp, o);
      const float bv = add_bias ? __ldg(bias + gk) : 0.f;
      const int n = g / TPQ;
      const int r = g - n * TPQ;
      const int tp = r / TQ;
      const int oh0 = tp * MT;
      const int ow0 = (r - tp * TQ) * MT;
      float* yk = y + (n * p.K + gk) * p.P * p.Q;
#pragma unroll
      for (int a = 0; a < MT; ++a) {
#pragma unroll
        for (int b = 0; b < MT; ++b) {
          if (oh0 + a < p.P && ow0 + b < p.Q) {
            float* dst = yk + (oh0 + a) * p.Q + ow0 + b;
            if constexpr (SPLIT > 1) {
              atomicAdd(dst, o[a][b] + bv);
            } else {
              *dst = o[a][b] + bv;
            }
          }
        }
      }
    }
  }
}

// This block's slice [cb, ce) of the input-channel chunks (SPLIT slices over grid.z).
template <int BC, int SPLIT>
__device__ __forceinline__ void slice(const Conv2dParams& p, int& cb, int& ce) {
  const int chunks = (p.C + BC - 1) / BC;
  const int per = (chunks + SPLIT - 1) / SPLIT;
  cb = blockIdx.z * per;
  ce = min(chunks, cb + per);
}

}  // namespace wino

template <int MT, int BK, int BT, int BC, int TK, int TT, int EG, int DB, int SPLIT>
__global__ void __launch_bounds__(EG * (BK / TK) * (BT / TT))
winograd_conv2d(const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ bias,
                float* __restrict__ y, const Conv2dParams p) {
  constexpr int A = MT + 2;
  constexpr int E = A * A;
  constexpr int KT = BK / TK;    // threads along output channels
  constexpr int TTN = BT / TT;   // threads along tiles
  constexpr int T = EG * KT * TTN;
  constexpr int EPT = E / EG;    // Winograd points per thread
  constexpr int ULD = BK + 4;    // padded rows: the transposing stores spread over the banks
  constexpr int VLD = BT + 4;
  constexpr int LOOP_FLOATS = E * BC * (ULD + VLD);
  constexpr int ROUNDS = wino::out_rounds(E, BK, BT, TTN, LOOP_FLOATS);
  constexpr int BTR = BT / ROUNDS;
  constexpr int OLD = BTR + 1;
  static_assert(MT == 2 || MT == 4, "F(2x2,3x3) and F(4x4,3x3) only");
  static_assert(E % EG == 0 && BK % TK == 0 && BT % TT == 0, "tiles must divide");
  static_assert(TTN % ROUNDS == 0, "output rounds must split the thread columns evenly");

  extern __shared__ __align__(16) float smem[];
  float* Us = smem;                   // [E][BC][ULD]  transformed filters
  float* Vs = smem + E * BC * ULD;    // [E][BC][VLD]  transformed input tiles
  float* Ms = smem;                   // [E][BK][OLD]  accumulators, output stage (reuses the loop's buffers)

  const int tid = threadIdx.x;
  const int tk = tid % KT;
  const int tt = (tid / KT) % TTN;
  const int eg = tid / (KT * TTN);
  const int t0 = blockIdx.x * BT;
  const int k0 = blockIdx.y * BK;
  int cb, ce;
  wino::slice<BC, SPLIT>(p, cb, ce);

  float acc[EPT][TK][TT];
#pragma unroll
  for (int j = 0; j < EPT; ++j)
#pragma unroll
    for (int i = 0; i < TK; ++i)
#pragma unroll
      for (int l = 0; l < TT; ++l) acc[j][i][l] = 0.f;

  // E independent products: acc[e][k][t] += U[e][c][k] * V[e][c][t]
  wino::channel_loop<MT, BK, BT, BC, ULD, VLD, T, DB>(x, w, p, Us, Vs, t0, k0, cb, ce, [&]() {
#pragma unroll 2
    for (int c = 0; c < BC; ++c) {
#pragma unroll
      for (int j = 0; j < EPT; ++j) {
        const int e = eg * EPT + j;
        const float* us = Us + (e * BC + c) * ULD + tk * TK;
        const float* vs = Vs + (e * BC + c) * VLD + tt * TT;
        float uk[TK], vt[TT];
        wino::load_row<TK>(us, uk);
        wino::load_row<TT>(vs, vt);
#pragma unroll
        for (int i = 0; i < TK; ++i)
#pragma unroll
          for (int l = 0; l < TT; ++l) acc[j][i][l] = fmaf(uk[i], vt[l], acc[j][i][l]);
      }
    }
  });

  // output stage: accumulators -> shared memory -> Y = A^T M A + bias
  const bool add_bias = p.has_bias && blockIdx.z == 0;
#pragma unroll 1
  for (int round = 0; round < ROUNDS; ++round) {
    if (tt / (TTN / ROUNDS) == round) {
#pragma unroll
      for (int j = 0; j < EPT; ++j)
#pragma unroll
        for (int i = 0; i < TK; ++i)
#pragma unroll
          for (int l = 0; l < TT; ++l)
            Ms[((eg * EPT + j) * BK + tk * TK + i) * OLD + tt * TT + l - round * BTR] = acc[j][i][l];
    }
    __syncthreads();
    wino::output_round<MT, BK, BTR, T, SPLIT>(bias, y, p, Ms, t0, k0, round, add_bias);
    __syncthreads();
  }
}

}  // namespace bagf
