// cuBLASLt plans (LaunchGeometry.blas): a 1x1 stride-1 unpadded convolution as cuBLASLt GEMMs with the bias in the
// GEMM's epilogue. Host code of bagf_ext.cpp; no torch types here.
//
// The extension is built without cuBLAS headers or libraries: it uses the cuBLASLt that torch has loaded
// (libcublasLt.so.<CUDA major>), found with dlopen/dlsym, and declares the few types and enum values it passes,
// with cublasLt.h's values. The library checks every attribute's size, so a value of the wrong width is a
// CUBLAS_STATUS_INVALID_VALUE, not a misread.
//
// The GEMMs, column-major as cuBLASLt counts (m x n output D = op(A) op(B) + beta C, k the reduction), for a call
// with N images of C channels and HW pixels and K filters (the weight [K][C], a 1x1 filter read the same way in
// either memory format):
// - channels_last: one GEMM, m = K, n = N*HW, k = C: D = the output [N*HW][K], A = the weight transposed, B = the
//   input [N*HW][C]; the bias runs along m, where the epilogue adds it (CUBLASLT_EPILOGUE_BIAS).
// - NCHW: N GEMMs (a strided batch), m = HW, n = K, k = C: D[i] = the output image [K][HW] read as HW x K, A = the
//   input image [C][HW] read as HW x C, B = the weight read as C x K (batch stride 0). The bias runs along n, which
//   the epilogue cannot add (it adds along m; a row-major D would put K along m, but another project reports a bias
//   epilogue on one refused, CUBLAS_STATUS_NOT_SUPPORTED), so it comes in as C with beta = 1: one image's [K][HW]
//   of the bias, broadcast per call by the caller into a fresh allocation, batch stride 0 (Bias::kBroadcastC); where
//   the heuristic takes no such C (a C batch stride other than D's), the caller fills the whole output with the bias
//   first and C is D (Bias::kFilledD).
#pragma once

#include <cuda_runtime.h>
#include <dlfcn.h>
#include <library_types.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace bagf_lt {

// cublasLt.h's types and values (the subset used here)
using Status = int;  // cublasStatus_t, 0: CUBLAS_STATUS_SUCCESS
using Handle = void*;  // cublasLtHandle_t
using MatmulDesc = void*;  // cublasLtMatmulDesc_t
using Layout = void*;  // cublasLtMatrixLayout_t
using Preference = void*;  // cublasLtMatmulPreference_t
struct Algo {  // cublasLtMatmulAlgo_t
  uint64_t data[8];
};
struct HeuristicResult {  // cublasLtMatmulHeuristicResult_t
  Algo algo;
  size_t workspace_size;
  Status state;
  float waves_count;
  int reserved[4];
};
static_assert(sizeof(Algo) == 64 && sizeof(HeuristicResult) == 96, "cuBLASLt's struct sizes");

constexpr int kComputeF32 = 68;          // CUBLAS_COMPUTE_32F
constexpr int kComputeF32FastTF32 = 77;  // CUBLAS_COMPUTE_32F_FAST_TF32
constexpr int kOpN = 0, kOpT = 1;        // CUBLAS_OP_N, CUBLAS_OP_T
// cublasLtMatmulDescAttributes_t
constexpr int kDescTransA = 3, kDescTransB = 4, kDescEpilogue = 7, kDescBiasPointer = 8;
constexpr uint32_t kEpilogueDefault = 1, kEpilogueBias = 4;                              // cublasLtEpilogue_t
constexpr int kLayoutBatchCount = 5, kLayoutBatchStride = 6;  // cublasLtMatrixLayoutAttribute_t
constexpr int kPrefMaxWorkspace = 1, kPrefReductionMask = 3, kPrefAlignA = 5, kPrefAlignB = 6, kPrefAlignC = 7,
              kPrefAlignD = 8;  // cublasLtMatmulPreferenceAttributes_t
// cublasLtReductionScheme_t: split-K partial sums in the compute type (fp32) only, or any scheme
constexpr uint32_t kReduceInComputeType = 2, kReduceAny = 7;

// The entry points, from the loaded library.
struct Api {
  std::string error;  // why cuBLASLt cannot be used (empty: it can)
  Status (*create)(Handle*) = nullptr;
  Status (*desc_create)(MatmulDesc*, int, int) = nullptr;
  Status (*desc_set)(MatmulDesc, int, const void*, size_t) = nullptr;
  Status (*desc_destroy)(MatmulDesc) = nullptr;
  Status (*layout_create)(Layout*, int, uint64_t, uint64_t, int64_t) = nullptr;
  Status (*layout_set)(Layout, int, const void*, size_t) = nullptr;
  Status (*layout_destroy)(Layout) = nullptr;
  Status (*pref_create)(Preference*) = nullptr;
  Status (*pref_set)(Preference, int, const void*, size_t) = nullptr;
  Status (*pref_destroy)(Preference) = nullptr;
  Status (*heuristic)(Handle, MatmulDesc, Layout, Layout, Layout, Layout, Preference, int, HeuristicResult*,
                      int*) = nullptr;
  Status (*matmul)(Handle, MatmulDesc, const void*, const void*, Layout, const void*, Layout, const void*,
                   const void*, Layout, void*, Layout, const Algo*, void*, size_t, cudaStream_t) = nullptr;
  const char* (*status_string)(Status) = nullptr;
  std::mutex handles_mutex;
  std::array<Handle, 64> handles{};  // per device, created on first use
};

template <typename F>
bool bind(void* lib, const char* name, F& fn, std::string& error) {
  fn = reinterpret_cast<F>(dlsym(lib, name));
  if (fn == nullptr && error.empty()) error = std::string("libcublasLt has no ") + name;
  return fn != nullptr;
}

// The process's cuBLASLt: torch's copy, already loaded (RTLD_NOLOAD), for the CUDA runtime's major version and
// then the one this extension was built with; else the first of those the dynamic loader finds.
inline Api& api() {
  static Api* const a = [] {
    Api* a = new Api();  // (never freed: plans may be used until the process ends)
    int runtime = 0;
    cudaRuntimeGetVersion(&runtime);
    const int majors[] = {runtime / 1000, CUDART_VERSION / 1000};
    void* lib = nullptr;
    for (int flags : {RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD, RTLD_NOW | RTLD_LOCAL}) {
      for (int major : majors) {
        const std::string name = "libcublasLt.so." + std::to_string(major);
        if ((lib = dlopen(name.c_str(), flags)) != nullptr) break;
      }
      if (lib != nullptr) break;
    }
    if (lib == nullptr) {
      a->error = "libcublasLt.so." + std::to_string(majors[0]) + " is not loaded and cannot be found";
      return a;
    }
    std::string& e = a->error;
    bind(lib, "cublasLtCreate", a->create, e);
    bind(lib, "cublasLtMatmulDescCreate", a->desc_create, e);
    bind(lib, "cublasLtMatmulDescSetAttribute", a->desc_set, e);
    bind(lib, "cublasLtMatmulDescDestroy", a->desc_destroy, e);
    bind(lib, "cublasLtMatrixLayoutCreate", a->layout_create, e);
    bind(lib, "cublasLtMatrixLayoutSetAttribute", a->layout_set, e);
    bind(lib, "cublasLtMatrixLayoutDestroy", a->layout_destroy, e);
    bind(lib, "cublasLtMatmulPreferenceCreate", a->pref_create, e);
    bind(lib, "cublasLtMatmulPreferenceSetAttribute", a->pref_set, e);
    bind(lib, "cublasLtMatmulPreferenceDestroy", a->pref_destroy, e);
    bind(lib, "cublasLtMatmulAlgoGetHeuristic", a->heuristic, e);
    bind(lib, "cublasLtMatmul", a->matmul, e);
    bind(lib, "cublasLtGetStatusString", a->status_string, e);
    return a;
  }();
  return *a;
}

inline std::string status_text(Status s) {
  const char* t = api().status_string != nullptr ? api().status_string(s) : nullptr;
  return "cuBLASLt status " + std::to_string(s) + (t != nullptr ? std::string(" (") + t + ")" : std::string());
}

// The device's handle (made on that device: a handle keeps the properties of the device current at its creation);
// nullptr with ``error`` set when it cannot be made.
inline Handle handle(int device, std::string& error) {
  Api& a = api();
  if (!a.error.empty()) {
    error = a.error;
    return nullptr;
  }
  if (device < 0 || device >= static_cast<int>(a.handles.size())) {
    error = "device index " + std::to_string(device) + " out of range for cuBLASLt handles";
    return nullptr;
  }
  std::lock_guard<std::mutex> lock(a.handles_mutex);
  if (a.handles[device] == nullptr) {
    Handle h = nullptr;
    int current = -1;
    cudaGetDevice(&current);
    if (current != device) cudaSetDevice(device);
    const Status s = a.create(&h);
    if (current != device && current >= 0) cudaSetDevice(current);
    if (s != 0) {
      error = "cublasLtCreate failed: " + status_text(s);
      return nullptr;
    }
    a.handles[device] = h;
  }
  return a.handles[device];
}

// One call's shape and alignments: what a resolved GEMM depends on.
struct Shape {
  int64_t n = 0, c = 0, hw = 0, k = 0;
  bool bias = false;
  uint32_t align_x = 0, align_w = 0, align_y = 0, align_b = 0;
  bool operator==(const Shape& o) const {
    return n == o.n && c == o.c && hw == o.hw && k == o.k && bias == o.bias && align_x == o.align_x &&
           align_w == o.align_w && align_y == o.align_y && align_b == o.align_b;
  }
};

// Bytes a pointer (or a byte stride) is aligned to, at most 256 (cuBLASLt's own default assumption).
inline uint32_t alignment(uintptr_t v) {
  if (v == 0) return 256;
  const uintptr_t low = v & (~v + 1);
  return low >= 256 ? 256u : static_cast<uint32_t>(low);
}

// How a GEMM adds the bias: none; the epilogue (channels_last); C = one image's broadcast of it, batch stride 0,
// beta = 1 (NCHW); or C = D, which the caller has filled with the bias, beta = 1 (NCHW, where the first is refused).
enum class Bias { kNone, kEpilogue, kBroadcastC, kFilledD };

// A resolved GEMM: descriptors and the chosen algorithm for one shape, or why the shape has none (``error``, kept so
// that such calls go to ATen without asking the heuristic again).
struct Gemm {
  Shape shape;
  MatmulDesc desc = nullptr;
  Layout a = nullptr, b = nullptr, c = nullptr, d = nullptr;
  bool a_is_x = false;  // A is the input (NCHW), else the weight
  Bias bias = Bias::kNone;
  Algo algo{};
  size_t workspace = 0;
  int offered = 0;  // algorithms the heuristic listed
  std::string error;
};

// The entry ``gemms`` resolved for ``shape`` earlier: nullopt when it has none; else the entry, or nullptr with
// ``error`` set when that shape failed (remembered, so the heuristic is not asked again).
template <typename G, typename S>
std::optional<G*> resolved_before(std::vector<std::unique_ptr<G>>& gemms, const S& shape, std::string& error) {
  for (auto& g : gemms)
    if (g->shape == shape) {
      if (!g->error.empty()) {
        error = g->error;
        return nullptr;
      }
      return g.get();
    }
  return std::nullopt;
}

inline void destroy(Gemm& g) {
  Api& a = api();
  if (g.desc) a.desc_destroy(g.desc);
  for (Layout l : {g.a, g.b, g.c, g.d})
    if (l) a.layout_destroy(l);
  g.desc = g.a = g.b = g.c = g.d = nullptr;
}

// A plan's resolved GEMMs, one per shape seen (a plan serves one problem; a few shapes at most).
struct State {
  int dtype = 0;  // 0 float32, 1 float16, 2 bfloat16
  bool nhwc = false;
  bool tf32 = false;
  int algo = 0;  // the heuristic's list index
  size_t max_workspace = 0;
  // NCHW's bias only as a filled D, never as a broadcast C: cuBLASLt refused a call with one (``demote``), or
  // BAGF_TEST_CUBLASLT_FILLED_BIAS was set when the plan was loaded (so that a GPU test runs this path)
  bool filled_bias_only = false;
  std::mutex mutex;  // over gemms and over each call's bias-pointer attribute and launch
  std::vector<std::unique_ptr<Gemm>> gemms;

  ~State() {
    for (auto& g : gemms) destroy(*g);
  }
};

inline int data_type(int dtype) { return dtype == 1 ? CUDA_R_16F : dtype == 2 ? CUDA_R_16BF : CUDA_R_32F; }

// A column-major layout of ``rows`` x ``cols`` with leading dimension ``ld``, a strided batch of ``batch`` (stride
// ``stride`` elements) when batch > 1.
inline Status make_layout(Layout* l, int type, int64_t rows, int64_t cols, int64_t ld, int64_t batch, int64_t stride) {
  Api& a = api();
  Status s = a.layout_create(l, type, static_cast<uint64_t>(rows), static_cast<uint64_t>(cols), ld);
  if (s == 0 && batch > 1) {
    const int32_t count = static_cast<int32_t>(batch);
    s = a.layout_set(*l, kLayoutBatchCount, &count, sizeof(count));
    if (s == 0) s = a.layout_set(*l, kLayoutBatchStride, &stride, sizeof(stride));
  }
  return s;
}

// The GEMM of ``st`` for ``shape``: found among those resolved, else resolved now (descriptors, the heuristic's list
// for the call's alignments, the plan's entry of it). nullptr with ``error`` set when the shape has no such entry
// (remembered). ``bias`` is the call's bias pointer (the heuristic reads its alignment). Called with st.mutex held.
inline Gemm* resolve(State& st, Handle h, const Shape& shape, const void* bias, std::string& error) {
  if (auto earlier = resolved_before(st.gemms, shape, error)) return *earlier;
  auto failed = [&](std::unique_ptr<Gemm> g, std::string why) -> Gemm* {
    destroy(*g);
    g->error = why;
    error = std::move(why);
    st.gemms.push_back(std::move(g));
    return nullptr;
  };
  Api& a = api();
  auto g = std::make_unique<Gemm>();
  g->shape = shape;
  const int type = data_type(st.dtype);
  const int compute = st.tf32 ? kComputeF32FastTF32 : kComputeF32;
  const int64_t N = shape.n, C = shape.c, HW = shape.hw, K = shape.k;
  Status s = a.desc_create(&g->desc, compute, CUDA_R_32F);
  int32_t ta = kOpN, tb = kOpN;
  if (s == 0 && st.nhwc) {  // D as K x N*HW (ld K) = (w as C x K, ld C)^T times x as C x N*HW (ld C), bias epilogue
    ta = kOpT;
    s = make_layout(&g->a, type, C, K, C, 1, 0);
    if (s == 0) s = make_layout(&g->b, type, C, N * HW, C, 1, 0);
    if (s == 0) s = make_layout(&g->d, type, K, N * HW, K, 1, 0);
  } else if (s == 0) {  // D[i] as HW x K (ld HW) = x[i] as HW x C (ld HW) times w as C x K (ld C) [+ the bias as C]
    g->a_is_x = true;
    s = make_layout(&g->a, type, HW, C, HW, N, C * HW);
    if (s == 0) s = make_layout(&g->b, type, C, K, C, N, 0);
    if (s == 0) s = make_layout(&g->d, type, HW, K, HW, N, K * HW);
    if (s == 0 && shape.bias && !st.filled_bias_only) s = make_layout(&g->c, type, HW, K, HW, N, 0);
  }
  g->bias = !shape.bias ? Bias::kNone : st.nhwc ? Bias::kEpilogue : st.filled_bias_only ? Bias::kFilledD
                                                                                          : Bias::kBroadcastC;
  if (s == 0) s = a.desc_set(g->desc, kDescTransA, &ta, sizeof(ta));
  if (s == 0) s = a.desc_set(g->desc, kDescTransB, &tb, sizeof(tb));
  const uint32_t epilogue = g->bias == Bias::kEpilogue ? kEpilogueBias : kEpilogueDefault;
  if (s == 0) s = a.desc_set(g->desc, kDescEpilogue, &epilogue, sizeof(epilogue));
  if (s == 0 && g->bias == Bias::kEpilogue) s = a.desc_set(g->desc, kDescBiasPointer, &bias, sizeof(bias));
  if (s != 0) return failed(std::move(g), "cuBLASLt descriptors for this shape: " + status_text(s));
  std::array<HeuristicResult, 8> results{};
  int returned = 0;
  // the heuristic's list with C as ``c`` (aligned to ``align_c`` bytes)
  auto query = [&](Layout c, uint32_t align_c) {
    Preference pref = nullptr;
    Status q = a.pref_create(&pref);
    const uint64_t ws = st.max_workspace;
    const uint32_t reduce = st.dtype == 0 ? kReduceAny : kReduceInComputeType;  // (16 bits: no 16-bit partial sums)
    const uint32_t align_a = g->a_is_x ? shape.align_x : shape.align_w;
    const uint32_t align_b = g->a_is_x ? shape.align_w : shape.align_x;
    if (q == 0) q = a.pref_set(pref, kPrefMaxWorkspace, &ws, sizeof(ws));
    if (q == 0) q = a.pref_set(pref, kPrefReductionMask, &reduce, sizeof(reduce));
    if (q == 0) q = a.pref_set(pref, kPrefAlignA, &align_a, sizeof(align_a));
    if (q == 0) q = a.pref_set(pref, kPrefAlignB, &align_b, sizeof(align_b));
    if (q == 0) q = a.pref_set(pref, kPrefAlignC, &align_c, sizeof(align_c));
    if (q == 0) q = a.pref_set(pref, kPrefAlignD, &shape.align_y, sizeof(shape.align_y));
    returned = 0;
    if (q == 0) q = a.heuristic(h, g->desc, g->a, g->b, c, g->d, pref, static_cast<int>(results.size()),
                                results.data(), &returned);
    if (pref != nullptr) a.pref_destroy(pref);
    return q;
  };
  // (the bias's broadcast is a fresh allocation: 256-byte aligned)
  s = g->bias == Bias::kBroadcastC ? query(g->c, 256u) : query(g->d, shape.align_y);
  if (g->bias == Bias::kBroadcastC && (s != 0 || returned <= st.algo)) {  // no batch-stride-0 C (or too few
                                                                           // algorithms with one): C = D, filled first
    a.layout_destroy(g->c);
    g->c = nullptr;
    g->bias = Bias::kFilledD;
    s = query(g->d, shape.align_y);
  }
  if (s != 0 || returned <= st.algo || results[st.algo].state != 0)
    return failed(std::move(g), s != 0 ? "cuBLASLt's heuristic failed for this shape: " + status_text(s)
                                       : "cuBLASLt's heuristic offers " + std::to_string(returned) +
                                             " algorithms for this shape; the plan takes entry " +
                                             std::to_string(st.algo));
  g->algo = results[st.algo].algo;
  g->workspace = results[st.algo].workspace_size;
  g->offered = returned;
  st.gemms.push_back(std::move(g));
  return st.gemms.back().get();
}

// ``g`` (Bias::kBroadcastC) failed in cublasLtMatmul: forget it and every broadcast-C GEMM of ``st`` (resolved again,
// as Bias::kFilledD, at their next call). Called with st.mutex held; ``g`` is invalid afterwards.
inline void demote(State& st) {
  st.filled_bias_only = true;
  for (auto it = st.gemms.begin(); it != st.gemms.end();) {
    if ((*it)->bias == Bias::kBroadcastC) {
      destroy(**it);
      it = st.gemms.erase(it);
    } else {
      ++it;
    }
  }
}

// Run ``g`` on the stream (st.mutex held: the bias pointer is an attribute of the shared descriptor). ``bias`` is the
// bias vector for the epilogue, or for Bias::kBroadcastC one image's [K][HW] broadcast of it; for Bias::kFilledD the
// caller has filled ``y`` with the bias.
inline Status run(Handle h, Gemm& g, const void* x, const void* w, const void* bias, void* y, void* workspace,
                  cudaStream_t stream) {
  Api& a = api();
  if (g.bias == Bias::kEpilogue) {
    const Status s = a.desc_set(g.desc, kDescBiasPointer, &bias, sizeof(bias));
    if (s != 0) return s;
  }
  const float one = 1.0f, zero = 0.0f;
  const bool broadcast = g.bias == Bias::kBroadcastC, filled = g.bias == Bias::kFilledD;
  return a.matmul(h, g.desc, &one, g.a_is_x ? x : w, g.a, g.a_is_x ? w : x, g.b, broadcast || filled ? &one : &zero,
                  broadcast ? bias : y, broadcast ? g.c : g.d, y, g.d, &g.algo, workspace, g.workspace, stream);
}

// ---- a strided batch of row-major fp32 GEMMs in strict fp32 (a non-fused Winograd plan's products) -------------
//
// D[i] (m x n) = op(A[i]) (m x k) op(B[i]) (k x n) for i < batch, every matrix a dense row-major block at a stride of
// its size: A stored m x k, or k x m when ``ta`` (op(A) = A^T); B stored k x n, or n x k when ``tb``; D m x n. fp32
// products and sums (CUBLAS_COMPUTE_32F), whatever torch's TF32 flags say: at::bmm_out follows them, and a plan
// tuned and checked with fp32 products must not turn TF32 where a program sets torch.set_float32_matmul_precision.
// Column-major as cuBLASLt counts, the row-major D is D^T (n x m, ld n) = op(B)^T op(A)^T: its A is B's storage
// (n x k, ld n, as is; or k x n, ld k, transposed when ``tb``) and its B is A's storage (k x m, ld k; or m x k, ld m,
// transposed when ``ta``).
struct SgemmShape {
  int64_t batch = 0, m = 0, n = 0, k = 0;
  bool ta = false, tb = false;
  uint32_t align = 0;  // bytes every matrix of the three is aligned to (its base and its batch stride)
  bool operator==(const SgemmShape& o) const {
    return batch == o.batch && m == o.m && n == o.n && k == o.k && ta == o.ta && tb == o.tb && align == o.align;
  }
};

struct Sgemm {
  SgemmShape shape;
  MatmulDesc desc = nullptr;
  Layout a = nullptr, b = nullptr, d = nullptr;
  Algo algo{};
  size_t workspace = 0;
  std::string error;
};

inline void destroy(Sgemm& g) {
  Api& a = api();
  if (g.desc) a.desc_destroy(g.desc);
  for (Layout l : {g.a, g.b, g.d})
    if (l) a.layout_destroy(l);
  g.desc = g.a = g.b = g.d = nullptr;
}

// A plan's resolved batched GEMMs, one per shape seen.
struct SgemmCache {
  std::mutex mutex;
  std::vector<std::unique_ptr<Sgemm>> gemms;
  ~SgemmCache() {
    for (auto& g : gemms) destroy(*g);
  }
};

constexpr size_t kSgemmWorkspace = size_t{32} << 20;  // the heuristic's limit (split-K algorithms need one)

// The GEMM of ``shape`` in ``cache`` (resolved now, the heuristic's first entry, if it was not), or nullptr with
// ``error`` set (remembered). Called with cache.mutex held.
inline Sgemm* resolve_sgemm(SgemmCache& cache, Handle h, const SgemmShape& shape, std::string& error) {
  if (auto earlier = resolved_before(cache.gemms, shape, error)) return *earlier;
  Api& a = api();
  auto g = std::make_unique<Sgemm>();
  g->shape = shape;
  const int64_t m = shape.m, n = shape.n, k = shape.k, batch = shape.batch;
  // column-major: D^T (n x m) = opA(B's storage) (n x k) opB(A's storage) (k x m)
  const int32_t op_a = shape.tb ? kOpT : kOpN, op_b = shape.ta ? kOpT : kOpN;
  Status s = a.desc_create(&g->desc, kComputeF32, CUDA_R_32F);
  if (s == 0) s = a.desc_set(g->desc, kDescTransA, &op_a, sizeof(op_a));
  if (s == 0) s = a.desc_set(g->desc, kDescTransB, &op_b, sizeof(op_b));
  if (s == 0) s = shape.tb ? make_layout(&g->a, CUDA_R_32F, k, n, k, batch, n * k)
                           : make_layout(&g->a, CUDA_R_32F, n, k, n, batch, k * n);
  if (s == 0) s = shape.ta ? make_layout(&g->b, CUDA_R_32F, m, k, m, batch, m * k)
                           : make_layout(&g->b, CUDA_R_32F, k, m, k, batch, m * k);
  if (s == 0) s = make_layout(&g->d, CUDA_R_32F, n, m, n, batch, m * n);
  std::array<HeuristicResult, 1> results{};
  int returned = 0;
  if (s == 0) {
    Preference pref = nullptr;
    s = a.pref_create(&pref);
    const uint64_t ws = kSgemmWorkspace;
    const uint32_t reduce = kReduceInComputeType;  // split-K partial sums in fp32
    if (s == 0) s = a.pref_set(pref, kPrefMaxWorkspace, &ws, sizeof(ws));
    if (s == 0) s = a.pref_set(pref, kPrefReductionMask, &reduce, sizeof(reduce));
    for (int attr : {kPrefAlignA, kPrefAlignB, kPrefAlignC, kPrefAlignD})
      if (s == 0) s = a.pref_set(pref, attr, &shape.align, sizeof(shape.align));
    if (s == 0) s = a.heuristic(h, g->desc, g->a, g->b, g->d, g->d, pref, 1, results.data(), &returned);
    if (pref != nullptr) a.pref_destroy(pref);
  }
  if (s != 0 || returned < 1 || results[0].state != 0) {
    g->error = s != 0 ? "cuBLASLt for the Winograd products: " + status_text(s)
                      : std::string("cuBLASLt offers no fp32 algorithm for the Winograd products of this shape");
    error = g->error;
    destroy(*g);
    cache.gemms.push_back(std::move(g));
    return nullptr;
  }
  g->algo = results[0].algo;
  g->workspace = results[0].workspace_size;
  cache.gemms.push_back(std::move(g));
  return cache.gemms.back().get();
}

// Run ``g``: D = op(A) op(B) per batch (row-major, as resolve_sgemm describes), on ``stream``.
inline Status run_sgemm(Handle h, const Sgemm& g, const float* A, const float* B, float* D, void* workspace,
                        cudaStream_t stream) {
  const float one = 1.0f, zero = 0.0f;
  return api().matmul(h, g.desc, &one, B, g.a, A, g.b, &zero, D, g.d, D, g.d, &g.algo, workspace, g.workspace,
                      stream);
}

}  // namespace bagf_lt
